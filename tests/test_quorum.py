"""Quorum pacing (`mode: async`, `mode.rule: quorum`) and sync + DyLU
(`mode.dylu`): the window's arithmetic, that no straggler or hung island holds a step,
that late results merge discounted by age, and that the rule's settings change live
through the control plane (real HTTP into a real engine on the in-process pool)."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from archipelago.api.app import create_app
from archipelago.orchestrator.algorithms.aggregate import WeightedMean
from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.config_sections import OuterConfig
from archipelago.orchestrator.engine.commands import Answer, Command, Refused, SettingsUpdate, UpdateSettings
from archipelago.orchestrator.engine.engine import RoundEngine
from archipelago.orchestrator.engine.pacing.arrivals import final_shares
from archipelago.orchestrator.engine.pacing.quorum import QuorumRule, age_factor, grace_window
from archipelago.orchestrator.engine.state.flights import Close
from archipelago.orchestrator.engine.step.outer import OuterStep
from archipelago.orchestrator.engine.step.rules import optimizer_rule
from tests.engine_scenarios import check_exactly_once, drive, scenario_cfg
from tests.helpers import in_process_engine
from tests.http_server import serving

versions: dict[int, int] = {}  # id(close) -> the version it stepped from


def _watch(engine: RoundEngine) -> list[tuple[float, Close]]:
    """Every close the pacing hands the engine, with the pool's clock when it did (and,
    in `versions`, the version it steps from)."""
    closes: list[tuple[float, Close]] = []
    ask = engine.pacing.next_close

    def next_close(run: Any, in_flight: Any) -> Close | None:
        close = ask(run, in_flight)
        if close is not None:
            closes.append((engine.pool.now(), close))
            versions[id(close)] = run.version
        return close

    engine.pacing.next_close = next_close  # type: ignore[method-assign]
    return closes


def _driven(cfg: Any) -> tuple[RoundEngine, Any, list[tuple[float, Close]]]:
    """`cfg` run to its end in process, every close watched, every batch checked trained once."""
    engine, pool = in_process_engine(cfg)
    closes = _watch(engine)
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    return engine, pool, closes


def _merged_per_step(closes: list[tuple[float, Close]]) -> list[int]:
    """Results merged by each step, in time order (with fragments, a step is the fragment
    steps fired at one instant)."""
    return [sum(len(c.flights) for t, c in closes if t == at) for at in sorted({t for t, _ in closes})]


def test_the_window_is_median_plus_k_mad_capped_and_the_cap_until_enough_offsets():
    rule = QuorumRule(quorum=None, grace_cap=0.25, grace_k=3.0, age_power=1.0)
    # median 0.2, MAD 0.1: 0.2 + 3 × 0.1 = 0.5 (the 5 s outlier moves neither)
    assert grace_window([0.1, 0.2, 0.3, 0.2, 5.0], 10.0, rule) == pytest.approx(0.5)
    assert grace_window([0.1, 0.2, 0.3], 10.0, rule) == 2.5  # too few offsets: the cap
    assert grace_window([3.0, 4.0, 5.0, 4.0], 10.0, rule) == 2.5  # the cap bounds any wait
    assert [rule.needed(n) for n in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]  # half, rounded up
    assert QuorumRule(quorum=4, grace_cap=0, grace_k=0, age_power=0).needed(3) == 3  # never above the fleet


def test_age_discount_and_the_merge_reference_vector():
    """docs/algorithms.md's vector: Δ₁ = (1, 0) of 10 tokens, fresh; Δ₂ = (0, 2) of 30
    tokens, one version old, α = 1 → weights 10 and 15 → mean (0.4, 1.2); one Nesterov
    step (lr 0.7, β 0.9, first step: buffer = mean) moves θ by −0.7 × 1.9 × mean."""
    assert age_factor(0, 1.0) == 1.0 and age_factor(3, 1.0) == 0.25 and age_factor(3, 0.5) == 0.5
    assert age_factor(2, 0.0) == 1.0
    mean = WeightedMean(2, torch.float64)
    parts = [(np.array([1.0, 0.0]), 10 * age_factor(0, 1.0)), (np.array([0.0, 2.0]), 30 * age_factor(1, 1.0))]
    assert mean.fill(parts).numpy() == pytest.approx([0.4, 1.2], abs=1e-12)
    theta = torch.tensor([1.0, 1.0], dtype=torch.float64)
    cfg = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)
    step = OuterStep(theta, optimizer_rule(cfg))
    step.apply([(np.array([1.0, 0.0]), 10.0), (np.array([0.0, 2.0]), 15.0)])
    assert theta.numpy() == pytest.approx([1 - 0.7 * 1.9 * 0.4, 1 - 0.7 * 1.9 * 1.2], abs=1e-12)


def test_a_straggler_never_holds_a_step_and_merges_later_discounted(tmp_path):
    """Island 2's second work takes 10 s more than its 4: the others step without it
    (within the window's cap after their quorum), and its result, when it lands, merges
    into a later step with weight × 1 / (1 + age)."""
    cfg = scenario_cfg(tmp_path, "quorum", "rounds=8")
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.LATE, island=2, order=2, seconds=10.0)])
    closes = _watch(engine)
    seen: dict[str, set[str]] = {}  # what the dashboard's `result` column showed per island
    engine.start()
    while engine.step():
        for i, view in engine.islands_view.items():
            seen.setdefault(i, set()).add(view["merge"] or "-")
    check_exactly_once(cfg, engine.summary)
    assert {"training", "merged", "late"} <= seen["2"]  # the straggler's result merged late
    assert "waiting" in seen["0"] | seen["1"]  # the others waited in the window for it
    times = [t for t, _ in closes]
    assert max(b - a for a, b in itertools.pairwise(times)) <= 4 + 0.25 * 4 + 1e-9  # H = 4 s, cap 1 s
    late = [c for _, c in closes if c.factors and any(f < 1 for f in c.factors.values())]
    assert late, "the straggler's result merged nowhere"
    factors = late[0].factors or {}
    flight = next(f for f in late[0].flights if f.work.island == 2)
    age = versions[id(late[0])] - flight.work.version
    assert age >= 2 and factors[2] == pytest.approx(1 / (1 + age))
    assert all(factors[f.work.island] == 1.0 for f in late[0].flights if f.work.version == versions[id(late[0])])
    assert engine.summary["islands"]["2"]["staleness_max"] == age


def test_fragments_on_a_quorum_step_each_fragment_on_its_own_results_aged_by_its_own_steps(tmp_path):
    """Streaming on the quorum rule (2 fragments, fixed H, island 2 four times slower):
    islands 0 and 1 never wait for it, every step updates one fragment from that
    fragment's results only, and island 2's late fragment merges with weight × 1 / (1 + a),
    a = the steps *its fragment* took meanwhile (counted here from the steps themselves)."""
    cfg = scenario_cfg(
        tmp_path,
        "streaming_quorum",
        "rounds=8",
        "mode.dylu=false",
        "mode.quorum=2",
        "simulation.slowdown=[1.0,1.0,4.0]",
    )
    engine, pool, closes = _driven(cfg)
    assert {o.steps for o in pool.dispatched} == {2}  # segments of H / P = 4 / 2 steps
    stepped_to: dict[int, list[int]] = {0: [], 1: []}  # fragment -> versions its steps made
    aged, oldest = 0, 0
    for _, close in closes:
        assert close.fragment is not None and close.factors is not None
        assert {f.work.fragment for f in close.flights} == {close.fragment}
        for f in close.flights:
            age = sum(v > f.work.version for v in stepped_to[close.fragment])
            assert close.factors[f.work.island] == pytest.approx(1 / (1 + age))
            aged += age > 0
            oldest = max(oldest, age) if f.work.island == 2 else oldest
        # a step of late results alone moves by the youngest one's factor, else by the mean's
        fresh = any(f.work.version >= max(stepped_to[close.fragment], default=0) for f in close.flights)
        assert close.scale == (1.0 if fresh else pytest.approx(max(close.factors.values())))
        stepped_to[close.fragment].append(versions[id(close)] + 1)
    assert aged and len(stepped_to[0]) >= 8 and len(stepped_to[1]) >= 8
    assert any(c.scale < 1 for _, c in closes)  # island 2's late fragments stepped alone, discounted
    assert engine.summary["islands"]["2"]["staleness_max"] == oldest == 2  # in its fragment's steps
    assert engine.summary["islands"]["0"]["staleness_max"] == 0  # fresh, though two fragments stepped at once
    # each island sends the fragments in turn
    sent = [o.fragment for o in pool.dispatched if o.island == 0]
    assert sent[:4] == [0, 1, 0, 1]


def test_fragments_sent_early_wait_for_the_window_from_when_they_are_in_hand(tmp_path):
    """Streaming's τ: each Δ crosses its link before its island finishes. With DyLU the
    three islands finish within the window (the slow one ½ s after the others' 4 s), so
    each step merges all three — the window opens when
    the coordinator has the quorum's results, not when they crossed the link (counted
    from the crossing, it had closed before the others' results, alike, were in hand).
    And τ is time: a segment a quarter as long sends its Δ a quarter as many steps early."""
    cfg = scenario_cfg(tmp_path, "streaming_quorum", "inner_steps=8", "mode.tau=2", "simulation.slowdown=[1.0,1.0,4.5]")
    _, pool, closes = _driven(cfg)
    assert {(o.island, o.steps, o.send_after) for o in list(pool.dispatched)[:3]} == {(0, 4, 2), (1, 4, 2), (2, 1, 1)}
    assert all(len(c.flights) == 3 for _, c in closes[:-1])


def test_a_hung_island_holds_no_step_and_is_replaced(tmp_path):
    cfg = scenario_cfg(tmp_path, "quorum", "rounds=8", "elastic.late_grace_s=10")
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.HANG, island=1, order=2)])
    closes = _watch(engine)
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    times = [t for t, _ in closes]
    assert max(b - a for a, b in itertools.pairwise(times)) <= 4 + 0.25 * 4 + 1e-9
    without = [c for _, c in closes if 1 not in {f.work.island for f in c.flights}]
    assert len(without) >= 4  # steps went on while it hung (its deadline is 20 s away)
    assert engine.summary["islands"]["1"]["state"] == "dead"


def test_sync_dylu_is_a_barrier_whose_h_follows_speed(tmp_path):
    cfg = scenario_cfg(tmp_path, "sync_dylu", "simulation.slowdown=[1.0,1.0,4.0]")
    engine, pool, closes = _driven(cfg)
    assert {o.island: o.steps for o in list(pool.dispatched)[:3]} == {0: 4, 1: 4, 2: 1}
    # every step, the last one too (the budget's rest shared, not one island's remainder)
    assert all(sorted(f.work.island for f in c.flights) == [0, 1, 2] for _, c in closes)
    assert engine.summary["staleness"]["max"] == 0


def test_the_budget_s_rest_is_shared_by_the_islands_starting_together():
    assert final_shares({0: 50, 1: 50, 2: 25, 3: 12}, 500) == {0: 50, 1: 50, 2: 25, 3: 12}
    # 49 left of 137 wanted: in proportion (17, 17, 8, 4 → 46), the first take the rounding
    assert final_shares({0: 50, 1: 50, 2: 25, 3: 12}, 49) == {0: 18, 1: 18, 2: 9, 3: 4}
    assert final_shares({0: 4, 1: 4, 2: 1}, 2) == {0: 1, 1: 1, 2: 1}  # at least one each; the budget caps


class _EngineHandle:
    """The control plane's handle over an engine in this process (what the coordinator
    actor answers, minus Ray)."""

    def __init__(self, engine: RoundEngine) -> None:
        self.engine = engine

    def status(self) -> dict[str, Any]:
        return self.engine.status()

    def islands(self) -> dict[str, dict[str, Any]]:
        return self.engine.islands_view

    def events(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self.engine.events.since(since, limit)

    def history(self, since: int, limit: int) -> list[dict[str, Any]]:
        return self.engine.recorder.page(since, limit)

    def submit(self, command: Command, key: str | None = None) -> Answer:
        return self.engine.submit(command, key=key)


@pytest.mark.parametrize("mode", ["quorum", "streaming_quorum"])
def test_quorum_and_grace_change_over_rest_at_the_next_step(tmp_path, mode):
    cfg = scenario_cfg(tmp_path, mode, "rounds=12", "mode.quorum=1", "mode.grace_cap=0")
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.LATE, island=2, order=3, seconds=3.0)])
    closes = _watch(engine)
    auth = {"Authorization": "Bearer t"}
    with serving(create_app(_EngineHandle(engine), "t")) as url, httpx.Client(base_url=url, timeout=10) as client:
        for body, field in (({"quorum": 0}, "quorum"), ({"quorum": 4}, "quorum"), ({"grace_cap": -1}, "grace_cap")):
            r = client.patch("/v1/run/settings", json=body, headers=auth)
            assert r.status_code == 422 and field in r.text, (body, r.text)
        drive(engine, until=3)
        assert any(len(c.flights) < 3 for _, c in closes)  # a quorum of one, no window: steps alone
        r = client.patch("/v1/run/settings", json={"quorum": 3, "grace_cap": 100}, headers=auth)
        assert r.status_code == 202, r.text
        mark = len(closes)
        while engine.step():
            pass
        status = client.get("/v1/run", headers=auth).json()
    assert status["quorum"] == 3 and status["grace_cap"] == 100
    after = _merged_per_step(closes[mark:])[1:-1]  # from the step after the change (the last may be short)
    assert after and all(n == 3 for n in after)
    check_exactly_once(cfg, engine.summary)


def test_mode_async_alone_runs_the_quorum_rule_and_delayed_nesterov_stays_selectable():
    from archipelago.orchestrator.engine.pacing.arrivals import PerArrival
    from archipelago.orchestrator.engine.pacing.quorum import Quorum
    from archipelago.orchestrator.engine.policies import build_policies

    cfg = load_config(None, ["mode=async"])
    assert cfg.mode == type(cfg.mode)() and cfg.mode.rule.value == "quorum"
    assert isinstance(build_policies(cfg, 4).pacing, Quorum)
    dn = load_config(None, ["mode=async", "mode.rule=delayed_nesterov"])
    assert isinstance(build_policies(dn, 4).pacing, PerArrival)


def test_quorum_settings_are_refused_for_another_rule(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco")
    engine, _ = in_process_engine(cfg)
    reply = engine.submit(UpdateSettings(settings=SettingsUpdate(quorum=2)))
    assert isinstance(reply, Refused) and "mode.rule = quorum" in reply.message


def test_a_quorum_above_the_island_count_is_a_config_error_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"mode\.quorum"):
        scenario_cfg(tmp_path, "quorum", "mode.quorum=4")


def test_delayed_nesterov_accumulates_arrivals_by_their_tokens(tmp_path):
    """Token-weighted DN (`mode.token_weighted`, the default): with DyLU's H of 8, 8
    and 2 steps, each arrival's update is scaled by its H over their mean (6), so N arrivals
    fill the momentum buffer by the tokens behind them; false gives the paper's equal weights."""
    slow = "simulation.slowdown=[1.0,1.0,4.0]"
    for weighted, expected in ((True, {0: 8 / 6, 1: 8 / 6, 2: 2 / 6}), (False, {0: 1.0, 1: 1.0, 2: 1.0})):
        cfg = scenario_cfg(tmp_path, "async", "inner_steps=8", slow, f"mode.token_weighted={weighted}")
        engine, _ = in_process_engine(cfg)
        closes = _watch(engine)
        drive(engine, until=1)
        first = {c.flights[0].work.island: c.scale for _, c in closes[:3]}
        assert first == pytest.approx(expected)


@pytest.mark.parametrize(
    "extra",
    [["compression.codec=int8", "compression.downlink=int8"], ["coordinator.shards=2", "compression.chunk=16"]],
    ids=["int8-both-ways", "sliced-coordinator"],
)
def test_quorum_composes_with_compression_and_a_sliced_coordinator(tmp_path, extra):
    """The quorum's discounted late merge on compressed pseudo-gradients (and a compressed
    downlink) and on a coordinator in 2 slices: every batch once, the straggler's result
    merged at its age's weight, the model finite and better."""
    cfg = scenario_cfg(tmp_path, "quorum", "rounds=8", *extra)
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.LATE, island=2, order=2, seconds=10.0)])
    closes = _watch(engine)
    drive(engine)
    summary = engine.summary
    check_exactly_once(cfg, summary)
    late = [c for _, c in closes if c.factors and any(f < 1 for f in c.factors.values())]
    assert late and summary["islands"]["2"]["staleness_max"] >= 2
    assert np.isfinite(engine.flat.data.numpy()).all()
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_a_step_with_no_island_left_in_flight_waits_until_every_result_crossed_its_link(tmp_path):
    """Before: when every island had arrived, the quorum fired at once (`now`, the last
    island's compute end), so on a priced link no async step waited for the uploads —
    a simulated async run looked an upload per round faster than DiLoCo on the same fleet
    (calibrated on the testbed: simulated 108 s where the shaped links took 158 s). Each
    step fires once all it merges has crossed its link, and on identical islands async's
    steps fall at DiLoCo's times."""
    link = ["simulation.link.bandwidth_gbps=0.0001", "simulation.link.latency_ms=0", "simulation.virtual_step_s=1"]
    times = {}
    for mode in ("quorum", "diloco"):
        cfg = scenario_cfg(tmp_path, mode, "rounds=3", "mode.dylu=false", *link)
        *_, closes = _driven(cfg)
        assert all(t >= max(f.usable_at for f in c.flights) for t, c in closes)
        assert all(max(f.usable_at for f in c.flights) > max(f.received_at for f in c.flights) for _, c in closes)
        times[mode] = [t for t, _ in closes]
    assert times["quorum"] == pytest.approx(times["diloco"])


def test_a_step_merges_only_the_results_that_have_crossed_their_links(tmp_path):
    """The quorum's window may close while another island's result is still on its link
    (received, its upload not yet crossed on the simulated clock): before, that result was
    merged with the rest, ahead of its arrival. Each step merges only what crossed by then;
    the late one waits for the next step, and every batch is trained once."""
    link = ["simulation.link.bandwidth_gbps=0.0001", "simulation.link.latency_ms=0", "simulation.virtual_step_s=1"]
    cfg = scenario_cfg(
        tmp_path,
        "quorum",
        "rounds=4",
        "mode.quorum=1",
        "mode.grace_cap=0.0",
        "mode.dylu=false",
        "islands.count=4",
        # an upload takes 10 s: the third island's result is received while the first two's
        # cross, and lands 2.4 s after theirs; the fourth is still computing then
        "simulation.slowdown=[1.0,1.0,1.6,6.0]",
        "simulation.nominal_params=16000",
        *link,
    )
    *_, closes = _driven(cfg)
    assert closes and all(f.usable_at <= t for t, c in closes for f in c.flights)
    assert any(len(c.flights) < 3 for _, c in closes)  # a step went without the one still crossing
