"""The `simulation:` section and what it selects: the moved settings still load, a real-
clock island stretched by its subclass (never by `Island` itself), the virtual-clock pool
chosen by the config."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from orchestrator.config_load import ConfigError, load_config
from orchestrator.engine.specs import island_spec
from orchestrator.runtime.island_pool import RayIslandPool
from orchestrator.runtime.simulated import VirtualClockPool, pool_class
from tests.helpers import toy_quadratic
from workers.runtime import simulated as sim_island
from workers.runtime.island import Island
from workers.runtime.island_group import GroupIsland
from workers.runtime.simulated import SimulatedIsland, simulated


def test_settings_from_before_the_simulation_section_load_at_their_new_place(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(
            None,
            [
                "islands.count=2",
                "islands.simulated_slowdown=[1,3]",
                "islands.virtual_step_s=0.5",
                "islands.links=[{},{preset: wan-1g}]",
                "link.latency_ms=7",
            ],
        )
    sim = cfg.simulation
    assert sim.slowdown == [1.0, 3.0] and sim.virtual_step_s == 0.5 and sim.link.latency_ms == 7
    assert sim.link_of(1).preset == "wan-1g" and sim.link_of(5).latency_ms == 7  # a joiner: the run's link
    assert "islands.simulated_slowdown is now simulation.slowdown" in caplog.text
    with pytest.raises(ConfigError, match=r"islands.virtual_step_s moved to simulation.virtual_step_s"):
        load_config(None, ["islands.virtual_step_s=1", "simulation.virtual_step_s=2"])


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["islands.count=4", "simulation.slowdown=[1,2]"], r"simulation.slowdown has 2 entries for 4 islands"),
        (["islands.count=2", "simulation.links=[{}]"], r"simulation.links has 1 entries for 2 islands"),
        (["simulation.slowdown=[1,1,1,0.5]"], r"slowdown factors must be >= 1"),
    ],
)
def test_a_simulation_that_does_not_fit_the_fleet_is_refused(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_only_a_simulated_real_clock_run_builds_simulated_islands():
    plain = load_config(None, toy_quadratic(2, 0.0))
    slow = load_config(None, toy_quadratic(2, 0.0, "simulation.slowdown=[1,3]"))
    link = load_config(None, toy_quadratic(2, 0.0, "simulation.link.latency_ms=5"))
    virtual = load_config(None, toy_quadratic(2, 0.0, "simulation.slowdown=[1,3]", "simulation.virtual_step_s=1"))
    assert [island_spec(c, 1).simulated for c in (plain, slow, link, virtual)] == [False, True, True, False]
    assert simulated(Island, island_spec(plain, 1)) is Island
    cls = simulated(GroupIsland, island_spec(slow, 1))
    assert issubclass(cls, SimulatedIsland) and issubclass(cls, GroupIsland) and cls.__mro__[1] is SimulatedIsland
    assert [pool_class(c) for c in (plain, slow, virtual)] == [RayIslandPool, RayIslandPool, VirtualClockPool]


def test_a_simulated_island_sleeps_its_slowdown_per_step_and_its_download_first(monkeypatch):
    """Each inner step is followed by (slowdown - 1) x its measured time asleep, the
    order's link delay is slept before it starts, and the probe reports the slowed speed;
    the same island class unsimulated sleeps nothing."""
    cfg = load_config(None, toy_quadratic(2, 0.0, "simulation.slowdown=[1,3]", "rounds=2", "inner_steps=4"))
    spec = island_spec(cfg, 1)
    slept: list[float] = []
    monkeypatch.setattr(sim_island.time, "sleep", slept.append)
    island = simulated(Island, spec)(spec)
    order = dataclasses.replace(island.order(0, 4), start_delay_s=30.0)
    island.run(order, np.zeros(2))
    assert len(slept) == 5 and 29.0 < slept[0] <= 30.0  # the download, then one per step
    assert all(0 <= s < 1 for s in slept[1:])
    speed = island.probe()
    assert speed == pytest.approx(island.probed_steps_per_s / 3)
    slept.clear()
    Island(spec).run(island.order(0, 4), np.zeros(2))
    assert slept == []
