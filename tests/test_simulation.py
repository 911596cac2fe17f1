"""The simulated fleet beside the run's config: read by `load_simulated` (its settings
from before the section still load at their place), refused by the product's loader with a
pointer, checked against the fleet; the virtual-clock Ray pool handed to the coordinator;
`archipelago simulate` registered and refusing bad input with exit 2."""

from __future__ import annotations

import logging

import pytest

from archipelago.orchestrator.bench.simulation.config import ReplacementSpeed, load_simulated
from archipelago.orchestrator.bench.simulation.ray_pool import VirtualClockPool, simulated_pool
from archipelago.orchestrator.cli import main
from archipelago.orchestrator.config_load import ConfigError, load_config
from tests.helpers import toy_quadratic


def test_settings_from_before_the_simulation_section_load_at_their_new_place(caplog):
    with caplog.at_level(logging.WARNING):
        cfg, sim = load_simulated(
            None,
            [
                "islands.count=2",
                "islands.simulated_slowdown=[1,3]",
                "islands.virtual_step_s=0.5",
                "islands.links=[{},{preset: wan-1g}]",
                "link.latency_ms=7",
            ],
        )
    assert cfg.islands.count == 2 and not hasattr(cfg, "simulation")
    assert sim.slowdown == [1.0, 3.0] and sim.virtual_step_s == 0.5 and sim.link.latency_ms == 7
    assert sim.link_of(1).preset == "wan-1g" and sim.link_of(5).latency_ms == 7  # a joiner: the run's link
    assert sim.replacement_speed == ReplacementSpeed.FULL and not sim.price_head and sim.head_gbps is None
    assert "islands.simulated_slowdown is now simulation.slowdown" in caplog.text
    with pytest.raises(ConfigError, match=r"islands.virtual_step_s moved to simulation.virtual_step_s"):
        load_simulated(None, ["islands.virtual_step_s=1", "simulation.virtual_step_s=2"])


def test_a_runs_config_has_no_simulation_and_says_where_it_went():
    with pytest.raises(
        ConfigError, match=r"simulation: a run's config has no simulation section.*archipelago simulate"
    ):
        load_config(None, ["simulation.slowdown=[1,2,3,4]"])
    assert main(["run", "--set", "simulation.slowdown=[1,2,3,4]"]) == 2


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["islands.count=4", "simulation.slowdown=[1,2]"], r"simulation.slowdown has 2 entries for 4 islands"),
        (["islands.count=2", "simulation.links=[{}]"], r"simulation.links has 1 entries for 2 islands"),
        (["simulation.slowdown=[1,1,1,0.5]"], r"simulation.slowdown: .*slowdown factors must be >= 1"),
        (["simulation.head_gbps=0"], r"simulation.head_gbps: .*greater than 0"),
        (["simulation.replacement_speed=fast"], r"simulation.replacement_speed"),
        (
            ["simulation.clock=real", "islands.count=2", "simulation.slowdown=[1,2]"],
            r"simulation: .*slowdown: a simulated pace needs clock virtual",
        ),
    ],
)
def test_a_simulation_that_does_not_fit_the_fleet_is_refused_naming_the_field(sets, message, capsys):
    with pytest.raises(ConfigError, match=message):
        load_simulated(None, sets)
    assert main(["simulate", *(a for s in sets for a in ("--set", s))]) == 2
    assert "invalid config" in capsys.readouterr().err


def test_the_coordinator_is_handed_the_virtual_clock_pool_of_the_fleet():
    _, sim = load_simulated(None, toy_quadratic(2, 0.0, "simulation.slowdown=[1,3]", "simulation.virtual_step_s=2"))
    make = simulated_pool(sim)
    assert make.func is VirtualClockPool and make.keywords == {"sim": sim}
    assert sim.virtual_seconds(1, 4) == 24.0 and sim.virtual_seconds(7, 4) == 8.0  # a joiner at speed 1


def test_on_the_real_clock_the_coordinator_is_handed_the_pool_that_waits_for_the_prices(tmp_path):
    """`simulation.clock: real` runs on Ray only: the in-process pool's islands take turns."""
    from archipelago.orchestrator.bench.simulation.ray_pool import RealTimeLinkPool
    from archipelago.orchestrator.bench.simulation.runner import run_in_process

    cfg, sim = load_simulated(None, toy_quadratic(2, 0.0, "simulation.clock=real", f"out_dir={tmp_path}"))
    assert simulated_pool(sim).func is RealTimeLinkPool
    with pytest.raises(ValueError, match="clock real runs on Ray"):
        run_in_process(cfg, sim)


def test_simulate_is_a_registered_subcommand():
    from importlib.metadata import entry_points

    from archipelago.orchestrator.cli import COMMANDS

    assert [p.value for p in entry_points(group=COMMANDS, name="simulate")] == [
        "archipelago.orchestrator.bench.simulation.command:register"
    ]


def test_the_simulation_page_lists_every_setting_as_the_models_say():
    from pathlib import Path

    from archipelago.orchestrator.bench.simulation.config import reference

    page = (Path(__file__).parent.parent / "docs" / "simulation.md").read_text()
    assert reference() in page, (
        "docs/simulation.md: regenerate its table with archipelago.orchestrator.bench.simulation.config.reference()"
    )


def test_codecs_left_auto_are_chosen_for_the_simulated_links_not_this_machines():
    """A simulated run picks `auto`'s codecs as the run's plan would on the fleet it
    simulates: over a 1-Gbit/s head card at 1 B nominal parameters int8 both ways, with no
    link at all (instant transfers) exact fp32; a config that names its codecs is kept."""
    from archipelago.orchestrator.bench.simulation.config import planned_head

    auto = ["compression.codec=auto", "compression.downlink=auto"]
    cfg, sim = load_simulated(None, [*auto, "simulation.head_gbps=1", "simulation.nominal_params=1000000000"])
    slow = planned_head(cfg, sim).compression
    assert (slow.codec, slow.downlink) == ("int8", "int8")
    cfg, sim = load_simulated(None, [*auto, "simulation.nominal_params=1000000000"])
    free = planned_head(cfg, sim).compression
    assert (free.codec, free.downlink) == ("none", "none")
    cfg, sim = load_simulated(None, ["compression.codec=int4", "simulation.head_gbps=1"])
    assert planned_head(cfg, sim) is cfg
