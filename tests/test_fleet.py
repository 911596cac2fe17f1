"""`bench fleet`'s parts: the links priced at a nominal model size (data-parallel as a ring
all-reduce), failures drawn per island (an MTTF, a mix of kinds, preemptions with notice),
the pool's account of where the fleet's time went, the command line that describes a fleet,
and the scenario end to end on a small fleet."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest

from archipelago.orchestrator.bench import fleet_spec
from archipelago.orchestrator.bench.fleet import breakdown, run_one, seeds_of
from archipelago.orchestrator.bench.fleet_spec import FleetSpec
from archipelago.orchestrator.bench.simulation.chaos import Strike, TimedFault, mttf_schedule, parse_mix
from archipelago.orchestrator.bench.simulation.config import SimulationConfig
from archipelago.orchestrator.bench.simulation.links import LinkConfig, allreduce_s, ring_allreduce_s, tree_allreduce_s
from archipelago.orchestrator.bench.simulation.network import Network
from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind, InProcessPool
from archipelago.orchestrator.cli import main
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.build import build_engine
from tests.engine_scenarios import check_exactly_once, check_rounds_recorded, drive, scenario_cfg
from tests.helpers import events, in_process_engine

LINK = ("simulation.link.bandwidth_gbps=8", "simulation.link.latency_ms=10")  # 1 GB/s, 10 ms


def test_a_ring_all_reduce_moves_a_kth_of_the_bytes_over_2_k_minus_1_hops_paced_by_the_worst_link():
    fast, slow = LinkConfig(bandwidth_gbps=8, latency_ms=10), LinkConfig(bandwidth_gbps=4, latency_ms=20)
    assert ring_allreduce_s([fast] * 4, 4e9) == pytest.approx(2 * 3 * (0.010 + 1.0))
    assert ring_allreduce_s([fast, fast, slow, fast], 4e9) == pytest.approx(2 * 3 * (0.020 + 2.0))
    assert ring_allreduce_s([fast], 4e9) == 0.0 and ring_allreduce_s([LinkConfig()] * 8, 4e9) == 0.0
    assert fast.seconds(1e9) == pytest.approx(1.010)


def _network(*sets: str, numel: int = 10, **sim: object) -> Network:
    cfg = load_config(None, list(sets))
    return Network(cfg, SimulationConfig(link=FAST, nominal_params=1000, **sim), numel)


FAST = LinkConfig(bandwidth_gbps=8, latency_ms=10)  # 1 GB/s, 10 ms


def test_transfers_are_priced_at_the_nominal_size_and_data_parallel_pays_an_all_reduce_not_the_head():
    diloco = _network()
    assert diloco.scale == 100 and not diloco.ddp
    assert diloco.download(0, 40, bootstrap=False, ready=5.0) == pytest.approx(5.0 + 0.010 + 4000 * 8 / 8e9)
    up = diloco.upload_s(0, 40, islands=[0, 1, 2], sent=0.0, compute_s=1.0)
    assert up == pytest.approx(0.010 + 4000 * 8 / 8e9)
    ddp = _network("mode=ddp")
    assert ddp.download(0, 40, bootstrap=False, ready=5.0) == 5.0  # every replica applies the step itself
    assert ddp.download(0, 40, bootstrap=True, ready=5.0) == pytest.approx(5.0 + 0.010 + 4000 * 8 / 8e9)
    assert ddp.card_out.busy == 0.0  # a newcomer's copy is broadcast from a peer, never through a head
    assert ddp.upload_s(0, 40, islands=[0, 1, 2], sent=0.0, compute_s=1.0) == pytest.approx(
        ring_allreduce_s([FAST] * 3, 4000)
    )
    assert Network(load_config(None, []), SimulationConfig(link=FAST), 10).scale == 1.0


def test_the_heads_card_is_shared_so_many_islands_wait_on_each_other():
    """16 pseudo-gradients of 4 GB (nominal) sent at once through a 100 Gbit/s card: the
    card moves one at a time, 0.32 s each, so the last is in 5.12 s after they left — with
    its own link alone every one would be in at 0.32 s. The versions out wait the same way;
    the card is full duplex (in and out apart), and a quote books nothing."""
    net = Network(
        load_config(None, []),
        SimulationConfig(link=LinkConfig(bandwidth_gbps=100), head_gbps=100, nominal_params=1_000_000_000),
        1000,
    )
    assert net.upload_s(0, 4000, islands=[0], sent=0.0, compute_s=0.0, book=False) == pytest.approx(0.32)
    ups = [net.upload_s(i, 4000, islands=list(range(16)), sent=0.0, compute_s=0.0) for i in range(16)]
    assert ups == pytest.approx([0.32 * (i + 1) for i in range(16)])
    downs = [net.download(i, 4000, bootstrap=False, ready=10.0) for i in range(16)]
    assert downs == pytest.approx([10.0 + 0.32 * (i + 1) for i in range(16)])
    assert net.seconds()["card_in"] == pytest.approx(16 * 0.32) == net.seconds()["card_out"]
    sliced = Network(
        load_config(None, ["coordinator.shards=4"]),
        SimulationConfig(link=LinkConfig(bandwidth_gbps=100), head_gbps=100, nominal_params=1_000_000_000),
        1000,
    )
    assert sliced.upload_s(0, 4000, islands=[0], sent=0.0, compute_s=0.0) == pytest.approx(0.32)  # its own link
    assert sliced.upload_s(1, 4000, islands=[0], sent=0.0, compute_s=0.0) == pytest.approx(0.32)  # 4 cards: room


def test_the_heads_step_is_priced_at_the_measured_rate_one_at_a_time():
    """RDA over 8 updates of 1 B parameters at the rate measured on a CPU head (0.19 s per
    8 x 25 M values): 7.6 s; a second step handed over while the first runs starts when it
    ends; checkpoints every 5 rounds add a fifth of the state's write to a round's worth of
    results; data-parallel's replicas step themselves (free), and so does an unpriced head."""
    sim = SimulationConfig(nominal_params=1_000_000_000, price_head=True)
    cfg = load_config(None, ["mode=async", "islands.count=8", "checkpoint.every_rounds=0"])
    net = Network(cfg, sim, 1000)
    assert net.merge == "radial"
    assert net.stepped(at=10.0, merged=8, values=1000) == pytest.approx(17.6)
    assert net.stepped(at=12.0, merged=8, values=1000) == pytest.approx(25.2)  # waits for the first
    assert net.seconds()["step"] == pytest.approx(15.2)
    mean = Network(load_config(None, ["mode=diloco", "islands.count=8", "checkpoint.every_rounds=5"]), sim, 1000)
    state_s = 4 * 1e9 * 2 / (800e6 / 2.75)  # parameters and momentum, at the measured write rate
    assert mean.step_s(8, 1000) == pytest.approx(0.06 / 25e6 * 1e9 + state_s / 5)
    assert mean.step_s(4, 1000) == pytest.approx((0.06 / 25e6 * 1e9 + state_s / 5) / 2)  # half a round's results
    assert Network(load_config(None, ["mode=ddp"]), sim, 1000).stepped(at=3.0, merged=8, values=1000) == 3.0
    assert Network(cfg, SimulationConfig(nominal_params=10**9), 1000).stepped(at=3.0, merged=8, values=1000) == 3.0


def test_data_parallels_all_reduce_hides_behind_backward_by_the_better_of_ring_and_tree():
    """64 islands, 1 B fp32 gradients at 100 Gbit/s and 30 ms: the ring pays 126 latencies
    (3.78 s of its 4.41), the tree 2 x 6; bucketed, two thirds of a 1-s step hide it; the
    last bucket is never hidden."""
    link = LinkConfig(bandwidth_gbps=100, latency_ms=30)
    ring, tree = ring_allreduce_s([link] * 64, 4e9), tree_allreduce_s([link] * 64, 4e9)
    assert ring == pytest.approx(2 * 63 * (0.03 + 4e9 / 64 * 8 / 1e11))
    assert tree == pytest.approx(2 * 6 * 0.03 + 2 * 4e9 * 8 / 1e11) and tree < ring
    sim = SimulationConfig(link=link, nominal_params=1_000_000_000, ddp_overlap=True)
    net = Network(load_config(None, ["mode=ddp"]), sim, 1000)
    islands = list(range(64))
    last = allreduce_s([link] * 64, 25 * 2**20)  # the tree's 12 latencies: 0.36 s whatever the size
    assert last == pytest.approx(0.36, abs=0.01)
    assert net.upload_s(0, 4000, islands=islands, sent=0.0, compute_s=1.0) == pytest.approx(max(tree - 2 / 3, last))
    assert net.upload_s(0, 4000, islands=islands, sent=0.0, compute_s=0.1) == pytest.approx(tree - 0.2 / 3)
    assert net.upload_s(0, 4000, islands=islands, sent=0.0, compute_s=100.0) == pytest.approx(last)


def test_a_replacement_runs_at_the_speed_of_the_node_it_replaces_and_speeds_are_measured_with_noise(tmp_path):
    """Island 2 (half speed) crashes: its replacement, placed on the node it gave back,
    runs at half speed too (`replacement_speed: replaced`; `full` would upgrade it); the
    speeds the engine measures are off by the noise, the clock's are not."""
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=4")
    sim = SimulationConfig(slowdown=[1, 1, 2], replacement_speed="replaced", speed_noise=0.2)
    pool = InProcessPool(cfg, sim, step_s=1.0, faults=[Fault(FaultKind.CRASH, 2, order=2)], join_s=1.0)
    engine = build_engine(cfg, pool)
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    assert pool.factors == {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}
    measured = [engine.summary["islands"][str(i)]["steps_per_s"] for i in (0, 1)]
    assert all(0.5 < m < 2.0 for m in measured) and measured != [1.0, 1.0]
    full = InProcessPool(cfg, SimulationConfig(slowdown=[1, 1, 2]), step_s=1.0)
    full.freed.append(2.0)
    assert full._node_factor(3) == 1.0 and full._node_factor(2) == 2.0


@pytest.mark.parametrize("mode", ["diloco", "ddp"])
def test_a_runs_clock_pays_its_links_at_the_nominal_size(tmp_path, mode):
    """The same run with and without a link: the difference is every barrier's transfers at
    the nominal size — a pseudo-gradient up and the parameters down each round (DiLoCo), a
    ring all-reduce each step (data-parallel, and its first download)."""
    nominal = ("simulation.nominal_params=100000000",)
    bare = run_scenario_clock(scenario_cfg(tmp_path, mode))
    linked_cfg = scenario_cfg(tmp_path, mode, *LINK, *nominal)
    engine, _ = in_process_engine(linked_cfg, step_s=1.0)
    drive(engine)
    s = engine.summary
    check_exactly_once(linked_cfg, s)
    scale = 1e8 / s["num_params"]
    link = LinkConfig(bandwidth_gbps=8, latency_ms=10)
    islands = linked_cfg.islands.count
    exchanges = s["rounds_done"] * (linked_cfg.inner_steps if mode == "ddp" else 1)
    up = s["bytes_received"] / (exchanges * islands) * scale  # a result's bytes, at the nominal size
    if mode == "ddp":
        first = s["bytes_bootstrap"] / islands * scale
        expected = link.seconds(first) + exchanges * ring_allreduce_s([link] * islands, up)
    else:
        down = (s["bytes_sent"] - s["bytes_bootstrap"]) / ((s["rounds_done"] - 1) * islands) * scale
        expected = s["rounds_done"] * link.seconds(up) + (s["rounds_done"] - 1) * link.seconds(down)
        expected += link.seconds(s["bytes_bootstrap"] / islands * scale) if s["bytes_bootstrap"] else 0.0
    assert s["clock_seconds"] - bare == pytest.approx(expected, rel=0.02), (s["clock_seconds"], bare, expected)


def test_a_strike_during_data_parallels_all_reduce_hits_an_island_and_the_group_restarts(tmp_path):
    """On a slow link data-parallel spends most of a step in its all-reduce, where no island
    computes: a strike there passed it by (the pool struck only working islands, so DDP saw
    12 strikes where its failure rate gave about 138). With `strike_idle` (`bench fleet`'s)
    it hits an island, found dead at its next order; under stop-the-world restarts (the
    fleet's DDP rows: torchrun restarts the group) the fleet stands still for it, and every
    batch is still trained once."""
    # 1e9 parameters over 1 GB/s: each step's ring all-reduce among 3 islands takes about
    # 5.4 s against 1 s of compute; 12.0 s falls in the first one (its work delivered at 10)
    extra = (*LINK, "simulation.nominal_params=1000000000", "simulation.restart_s=30", "rounds=2")
    chaos = [TimedFault(at=12.0, kind=Strike.CRASH)]
    struck = {}
    for idle in (False, True):
        cfg = scenario_cfg(tmp_path, "ddp", *extra, f"simulation.strike_idle={str(idle).lower()}")
        engine, pool = in_process_engine(cfg, step_s=1.0, chaos=list(chaos))
        drive(engine)
        check_exactly_once(cfg, engine.summary)
        struck[idle] = (pool.losses.strikes[Strike.CRASH], pool.losses.halted, engine.summary["clock_seconds"])
    assert struck[False][:2] == (0, 0.0), struck  # passed by: nobody was computing
    assert struck[True][0] == 1 and struck[True][1] == pytest.approx(30.0), struck
    assert struck[True][2] >= struck[False][2] + 30.0, struck


def test_an_idle_islands_hang_makes_its_next_order_never_return_and_its_work_is_lost(tmp_path):
    """A hang that strikes an island between two works (waiting at synchronous DiLoCo's
    barrier) costs nothing then: its next order never answers and its count never moves
    from zero (so the engine cannot tell it from a download under way: its round's deadline
    finds it), its work is lost, and every batch is still trained once."""
    speeds = ("simulation.slowdown=[1.0, 1.0, 3.0]",)  # islands 0 and 1 wait 8 s a round for island 2
    cfg = scenario_cfg(tmp_path, "diloco", *speeds, "rounds=4", "simulation.strike_idle=true")
    # each of the 3 islands as likely: chaos seed 1 draws island 1, waiting for island 2
    engine, pool = in_process_engine(cfg, step_s=1.0, chaos=[TimedFault(at=6.0, kind=Strike.HANG)], chaos_seed=1)
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    assert pool.losses.strikes[Strike.HANG] == 1 and pool.losses.undetected > 0, pool.losses
    assert pool.losses.struck[Strike.HANG] == 0  # it held no work: nothing computed was destroyed
    lost = [e for e in events(cfg.out_dir) if e["kind"] == "lost"]
    assert [e["island"] for e in lost] == [1], lost


def run_scenario_clock(cfg) -> float:
    engine, _ = in_process_engine(cfg, step_s=1.0)
    drive(engine)
    return float(engine.summary["clock_seconds"])


def test_failures_come_once_per_mttf_per_island_in_the_mix_asked_for():
    mix = parse_mix("hang=1,crash=1,slow=2,preempt=0")
    assert mix == {Strike.HANG: 1, Strike.CRASH: 1, Strike.SLOW: 2, Strike.PREEMPT: 0}
    small = mttf_schedule(seed=0, horizon_s=100_000, islands=16, mttf_s=1000, mix=mix)
    large = mttf_schedule(seed=0, horizon_s=100_000, islands=64, mttf_s=1000, mix=mix)
    assert len(small) == pytest.approx(1600, rel=0.1) and len(large) == pytest.approx(6400, rel=0.05)
    kinds = Counter(f.kind for f in large)
    assert Strike.PREEMPT not in kinds and kinds[Strike.SLOW] == pytest.approx(len(large) / 2, rel=0.1)
    notices = [
        f.notice for f in mttf_schedule(seed=1, horizon_s=10_000, islands=8, mttf_s=100, mix=parse_mix("preempt=1"))
    ]
    assert notices and all(30 <= n <= 120 for n in notices)  # mttf_schedule's default range
    assert mttf_schedule(seed=3, horizon_s=500, islands=4, mttf_s=50, mix=mix) == mttf_schedule(
        seed=3, horizon_s=500, islands=4, mttf_s=50, mix=mix
    )


@pytest.mark.parametrize("text", ["boom=1", "hang=-1", "hang=0", "hang=x"])
def test_a_mix_that_means_nothing_is_refused(text):
    with pytest.raises(ValueError):
        parse_mix(text)


@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("mode", ["diloco", "quorum"])
def test_a_preemption_notice_drains_the_island_and_places_its_replacement_at_once(tmp_path, mode, partial):
    """Its work runs from 1 s to 5 s (four 1-s steps), notice at 2 s: its replacement is
    requested then, not after it is gone. With 2 s of notice the node is taken at 4 s: the
    work stops after the three steps that end by then and sends them, its fourth batch
    going back to the ledger (`elastic.partial_on_notice`) — or, without, all of it is lost
    at 4 s. With 6 s it finishes, and the island leaves, drained, with nothing lost. Each
    batch is trained once and every round recorded."""
    for notice in (2.0, 6.0):
        cfg = scenario_cfg(tmp_path, mode, "rounds=6", f"elastic.partial_on_notice={partial}")
        engine, pool = in_process_engine(
            cfg, step_s=1.0, chaos=[TimedFault(at=2.0, kind=Strike.PREEMPT, notice=notice)], join_s=1.0
        )
        drive(engine)
        check_exactly_once(cfg, engine.summary)
        check_rounds_recorded(cfg, engine.summary)
        log = [
            e for e in events(cfg.out_dir) if e["kind"] in ("preempting", "requested", "lost", "released", "partial")
        ]
        notice_at = next(n for n, e in enumerate(log) if e["kind"] == "preempting")
        gone = log[notice_at]["island"]
        assert log[notice_at + 1]["kind"] == "requested" and log[notice_at + 1]["island"] == 3  # at once
        assert log[notice_at]["notice_s"] == pytest.approx(notice)
        lost = [e for e in log if e["kind"] == "lost" and e["island"] == gone]
        partials = [e for e in log if e["kind"] == "partial" and e["island"] == gone]
        stopped = notice == 2.0 and partial
        assert len(lost) == (1 if notice == 2.0 and not partial else 0), log
        assert [(e["steps"], e["of"], sum(n for _, n in e["spans"].values())) for e in partials] == (
            [(3, 4, 1)] if stopped else []
        )
        island = engine.summary["islands"][str(gone)]
        assert island["state"] == "drained"
        assert island["rounds_contributed"] == (1 if notice == 6.0 or stopped else 0)  # its one work, whole or in part
        assert not [e for e in events(cfg.out_dir) if e["kind"] == "crash"]
        destroyed = pool.losses.struck[Strike.PREEMPT]
        assert pool.losses.strikes[Strike.PREEMPT] == 1 and (destroyed > 0) == (notice == 2.0 and not partial)


def test_the_pool_counts_a_hung_islands_time_until_the_engine_lets_it_go(tmp_path):
    """Without heartbeats a hang is found at the deadline (20 s) plus the grace (5 s): the
    island-seconds from the hang until then are counted as undetected."""
    cfg = scenario_cfg(tmp_path, "diloco", "elastic.late_grace_s=5")
    engine, pool = in_process_engine(cfg, step_s=1.0, chaos=[TimedFault(at=2.0, kind=Strike.HANG)])
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    assert pool.losses.struck[Strike.HANG] == pytest.approx(2.0)  # its work's two steps so far
    assert 20.0 <= pool.losses.undetected <= 26.0, pool.losses


def test_a_slowed_islands_heartbeats_slow_with_it_so_it_is_not_taken_for_hung(tmp_path):
    """Halved at 0.25 s, its steps come 2 s apart, within 3 step times: its heartbeats are
    spread over its longer work (were they not, 3.75 s of silence would end it)."""
    cfg = scenario_cfg(
        tmp_path, "quorum", "elastic.hang_after_steps=3", "elastic.progress_every_s=0.5", "elastic.hang_floor_s=1"
    )
    engine, _ = in_process_engine(cfg, step_s=1.0, chaos=[TimedFault(at=0.25, kind=Strike.SLOW, factor=2.0)])
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    assert not [e for e in events(cfg.out_dir) if e["kind"] == "crash"]


def test_the_fleet_is_described_on_the_command_line_and_a_wrong_flag_is_named(tmp_path, capsys):
    assert main(["bench", "quality", "--islands", "4", "--out", str(tmp_path)]) == 2
    assert "--islands describe the fleet of `bench fleet` only" in capsys.readouterr().err
    assert main(["bench", "fleet", "--rows", "sync,nope", "--out", str(tmp_path)]) == 2
    assert "unknown rows ['nope']" in capsys.readouterr().err
    assert main(["bench", "fleet", "--mix", "hang=x", "--out", str(tmp_path)]) == 2
    assert "--mix 'hang=x'" in capsys.readouterr().err
    assert main(["bench", "fleet", "--notice", "15,5", "--out", str(tmp_path)]) == 2
    assert "notice range LO,HI" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any run
    with pytest.raises(ValueError, match="speeds > 0"):
        FleetSpec(speeds=(1.0, 0.0))
    parser = argparse.ArgumentParser()
    fleet_spec.add_arguments(parser)
    spec = fleet_spec.spec_of(parser.parse_args(["--notice", "5,15", "--ablation-seeds", "3", "--seeds", "2"]))
    assert spec.notice_s == (5.0, 15.0) and seeds_of(spec, "quorum_no_partial") == range(2)
    assert seeds_of(FleetSpec(), "quorum_no_partial") == range(1) and seeds_of(FleetSpec(), "quorum") == range(3)
    assert seeds_of(FleetSpec(), "quorum_sliced") == range(3)  # run at every link: every seed, as a headline row


def test_a_best_lr_at_its_grids_edge_is_named():
    """A row tuned to the lowest or highest lr of its grid might do better on a wider one:
    the report names it. Rows that borrow another's lr, and grids of one value, are not tuned."""
    from archipelago.orchestrator.bench.fleet import at_grid_edge

    spec = FleetSpec()
    best = {"sync": 0.25, "quorum": 0.7, "ddp": 8.0, "quorum_sliced": 1.0, "sync_dylu": 0.5}
    assert at_grid_edge(spec, best) == ["sync", "ddp"]
    assert at_grid_edge(spec.quick(), {"sync": 0.7, "ddp": 1.0}) == []


def test_the_sliced_row_runs_the_head_its_plan_asks_for(tmp_path):
    """`quorum_sliced`: the fewest coordinator slices that bring the head's share under 0.10
    at the nominal 1 B parameters, at most one per island, with the codecs `auto` picks for
    them. At 1 Gbit/s no number fits 16 islands' H = 20 (one per island, int8 both ways,
    each slice keeping its part of the islands' copy); at 100 Gbit/s 54 of 64 do (53 would
    not); the run trains with them, and its card time splits over them."""
    from archipelago.orchestrator.bench.fleet import fleet_of, overrides
    from archipelago.orchestrator.bench.simulation.config import planned_head
    from archipelago.orchestrator.plan.head import head_load

    spec = FleetSpec()

    def planned(link: float, islands: int):
        cfg = load_config(None, overrides(spec, "quorum_sliced", islands, 0, 0.7, tmp_path / "x", True))
        assert cfg.coordinator.shards == "auto"  # the product's own choice, given one slice node per island
        return planned_head(cfg, fleet_of(spec, islands, link), slice_nodes=islands)

    slow = planned(1.0, 16)
    assert (slow.coordinator.shards, slow.compression.codec, slow.compression.downlink) == (16, "int8", "int8")
    wide = planned(100.0, 64)
    assert (wide.coordinator.shards, wide.compression.codec) == (54, "none")
    fewer = wide.model_copy(update={"coordinator": wide.coordinator.model_copy(update={"shards": 53})})
    share = [head_load(c, 10**9, link_gbps=100.0, step_s=1.0).share for c in (wide, fewer)]
    assert share[0] <= 0.10 < share[1]
    small = FleetSpec(islands=(4,), rows=("quorum", "quorum_sliced"), rounds=2, mttf_s=1e9, seeds=1, lr_grid=(0.7,))
    one, sliced = (run_one(small, row, 4, 0, 0.7, 10.0, tmp_path / "runs", faults=False) for row in small.rows)
    assert one.head == {"slices": 1, "codec": "none", "downlink": "none"}
    assert sliced.head == {"slices": 4, "codec": "int8", "downlink": "int8"}
    assert sliced.summary["tokens"] == one.summary["tokens"]
    # int8 both ways (about a quarter of fp32's bytes) over 4 cards: the head's card takes far
    # less time (out, the islands' first copies are whole fp32 either way)
    assert sliced.losses["head"]["card_in"] < one.losses["head"]["card_in"] / 8
    assert sliced.losses["head"]["card_out"] < one.losses["head"]["card_out"] / 6


def test_bench_fleet_end_to_end_on_a_small_fleet(tmp_path):
    """Two rows on 4 islands through failures: every row's time is accounted for (what the
    pool counts lost never exceeds the time the fleet had), the target is the fault-free
    sync run's loss, and the report states the regime the links price."""
    out = tmp_path / "out"
    argv = [
        "bench",
        "fleet",
        "--quick",
        "--islands",
        "4",
        "--rows",
        "sync,quorum",
        "--rounds",
        "3",
        "--mttf",
        "150",
        "--jobs",
        "2",
        "--links",
        "10,100",
        "--link-rows",
        "quorum",
    ]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "fleet.json").read_text())
    assert set(report["methods"]) == {"sync_4", "quorum_4"}  # <row>_<islands>, for checks from outside
    assert set(report["links"]) == {"10", "100"} and set(report["links"]["10"]["methods"]) == {"quorum_4"}
    assert report["links"]["100"]["methods"] == report["methods"]
    assert (
        report["pricing"]["head_shared"]
        and report["pricing"]["coordinator_priced"]
        and report["pricing"]["ddp_overlap"]
    )
    for m in [*report["methods"].values(), *report["links"]["10"]["methods"].values()]:
        keys = {"islands", "goodput", "goodput_dd", "head_seconds", "sim_seconds_to_target", "seeds", "lost_seconds"}
        assert keys <= set(m)
        assert m["islands"] == 4 and m["seeds"] == [0] and m["lost_seconds"]["replacement_start"] >= 0
        assert 0 < m["goodput_dd"] <= 1 and m["head_seconds"]["step"] > 0 and m["head_seconds"]["card_in"] > 0
    slow, fast = report["links"]["10"]["methods"]["quorum_4"], report["methods"]["quorum_4"]
    assert slow["head_seconds"]["card_in"] == pytest.approx(10 * fast["head_seconds"]["card_in"], rel=0.2)
    reference = run_one(
        FleetSpec(islands=(4,), rows=("sync",), rounds=3, mttf_s=150, seeds=1, lr_grid=(0.7,)),
        "sync",
        4,
        0,
        0.7,
        100.0,
        out / "fleet-runs",
        faults=False,
    )
    # each panel draws the target as a loss, not the reference run's curve at its own link's timing
    for panel in report["panels"]:
        assert panel["references"] == {"target: sync's final loss, no failures": reference.summary["final_eval_loss"]}
        assert set(panel["curves"]) == {"sync", "quorum"} or set(panel["curves"]) == {"quorum"}
    for name, m in report["methods"].items():
        assert 0 < m["goodput"] <= 1 and m["lost"]["waiting"] >= -1e-6, (name, m)
        assert m["target_loss_seeds"] == [reference.summary["final_eval_loss"]]
        assert m["strikes"] >= 1  # 4 islands failing every 150 s over a run of minutes
    assert report["regime"]["100"]["exchange_share_of_round"] == pytest.approx(2 * (0.03 + 4e9 * 8 / 100e9) / 20)
    assert report["machine"]["commit"] and (out / "fleet.png").exists() and (out / "fleet.md").exists()
    again = run_one(
        FleetSpec(islands=(4,), rows=("sync",), rounds=3, mttf_s=150, seeds=1, lr_grid=(0.7,)),
        "sync",
        4,
        0,
        0.7,
        100.0,
        tmp_path / "again",
    )
    # the same run computed again in a folder of its own (not read back from the report's): the account the report shows
    assert breakdown(again)["useful"] == report["methods"]["sync_4"]["goodput"]
    assert again.losses["strikes"] and sum(again.losses["strikes"].values()) == report["methods"]["sync_4"]["strikes"]


def test_a_hang_ends_for_the_account_when_a_restart_gives_its_work_up(tmp_path):
    """Under stop-the-world restarts a crash gives every island's work up, the hung one's
    too, and the hung island trains again: its undetected time ends there, not at the run's
    end."""
    cfg = scenario_cfg(tmp_path, "diloco", "simulation.restart_s=5")
    chaos = [TimedFault(at=2.0, kind=Strike.HANG), TimedFault(at=3.0, kind=Strike.CRASH)]
    engine, pool = in_process_engine(cfg, step_s=1.0, chaos=chaos, chaos_seed=1)
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    assert pool.losses.strikes[Strike.HANG] == pool.losses.strikes[Strike.CRASH] == 1
    assert not pool.hung and 0 < pool.losses.undetected <= 10, (pool.losses, engine.summary["clock_seconds"])


@pytest.mark.parametrize("mode", ["diloco", "sync_dylu", "overlap", "async", "quorum", "streaming", "streaming_quorum"])
def test_preemptions_with_notice_crashes_and_hangs_keep_every_batch_trained_once_in_every_mode(tmp_path, mode):
    chaos = [
        TimedFault(at=2.5, kind=Strike.PREEMPT, notice=3.0),
        TimedFault(at=6.5, kind=Strike.CRASH),
        TimedFault(at=9.5, kind=Strike.PREEMPT, notice=0.5),
        TimedFault(at=13.5, kind=Strike.HANG),
    ]
    cfg = scenario_cfg(tmp_path, mode, "rounds=8")
    engine, pool = in_process_engine(cfg, step_s=1.0, chaos=chaos, chaos_seed=3, join_s=1.0)
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    check_rounds_recorded(cfg, engine.summary)
    assert pool.losses.strikes[Strike.PREEMPT] == 2
    assert len([e for e in events(cfg.out_dir) if e["kind"] == "preempting"]) == 2


def test_each_row_counts_its_machines_and_the_slow_link_checks_face_the_fastest_ddp_row():
    """A row pays for its islands and its head's CPU nodes (each coordinator slice on a node
    of its own; data-parallel none), and at 1 Gbit/s quorum is held against the fastest of
    the DDP rows (fp32, bf16, int8), whose name and machines the check carries."""
    from archipelago.orchestrator.bench.fleet import POWERSGD_NOTE, _checks, machines_of

    assert machines_of(load_config(None, ["mode=ddp"]), 16) == {"islands": 16, "cpu_nodes": 0, "total": 16}
    assert machines_of(load_config(None, ["mode=async"]), 17)["cpu_nodes"] == 1
    assert machines_of(load_config(None, ["mode=async", "coordinator.shards=4"]), 16)["cpu_nodes"] == 5

    def row(seconds, machines):
        return {"sim_seconds_to_target": seconds, "sim_seconds": 5000.0, "machines": machines}

    gpu, head = {"islands": 16, "cpu_nodes": 0, "total": 16}, {"islands": 16, "cpu_nodes": 1, "total": 17}
    at_1 = {"quorum_16": row(120.0, head), "ddp_16": row(900.0, gpu), "ddp_bf16_16": row(None, gpu)}
    at_1["ddp_int8_16"] = row(300.0, gpu)
    checks = _checks(FleetSpec(islands=(16,)), {"1": {"methods": at_1}, "100": {"methods": {}}})
    check = checks["quorum_time_le_0.5x_best_ddp_at_16_at_1gbps"]
    assert check["versus"] == "ddp_int8" and check["value"] == pytest.approx(0.4) and check["ok"]
    assert check["machines"] == {"quorum": head, "ddp_int8": gpu} and check["note"] == POWERSGD_NOTE


def test_the_equal_machines_row_fits_the_data_parallel_rows_machines_and_keeps_their_tokens(tmp_path):
    """`quorum_sliced_equal`: islands, head and slices together on the 16 machines the DDP
    rows use, the island count the plan rates highest (islands over a round stretched by the
    head's planned share), and the same token budget in more rounds. Every other count the
    plan would allow is rated no higher; at 1 Gbit/s neither all 16 islands behind one head
    nor one island behind 14 slices wins."""
    from archipelago.orchestrator.bench.fleet import fleet_of, machines_of, overrides, within_machines
    from archipelago.orchestrator.bench.fleet_spec import EQUAL_ROW
    from archipelago.orchestrator.bench.simulation.config import planned_head
    from archipelago.orchestrator.plan.head import head_load

    spec = FleetSpec()

    def settings(k: int, rounds: int) -> list[str]:
        return overrides(spec, EQUAL_ROW, k, 0, 0.7, tmp_path / "x", True, rounds)

    def rate(cfg) -> float:
        return cfg.islands.count / (1 + head_load(cfg, spec.nominal_params, link_gbps=1.0, step_s=1.0).share)

    cfg, sim = within_machines(spec, 16, 1.0, settings)
    k = cfg.islands.count
    assert machines_of(cfg, k)["total"] <= 16 and 1 < k < 15 and cfg.coordinator.slices > 1
    assert k * cfg.rounds >= 16 * spec.rounds and len(sim.slowdown or []) == k
    for other in (1, 4, 12, 15):
        alt = planned_head(load_config(None, settings(other, 1)), fleet_of(spec, other, 1.0), slice_nodes=15 - other)
        assert rate(alt) <= rate(cfg)


def test_the_heads_nodes_fail_too_and_each_failure_restarts_the_coordinator_from_its_checkpoint(tmp_path):
    """Before, only islands failed in `bench fleet`: a row's head and its slices' nodes (17
    CPU nodes for `quorum_sliced` at 16 islands) never did. Each CPU node now fails once per
    MTTF as an island's machine does; the coordinator restarts from its checkpoint after the
    restart time (as on Ray: a slice lost is `SliceLost`, the actor restarts), the islands
    where they were. The run finishes with every batch trained once, its curve on one clock
    (a restarted coordinator counts from its own start: without the shift the curve folded
    back), and data-parallel, whose rendezvous lives on an island, has no head to lose."""
    from archipelago.orchestrator.bench.fleet import head_schedule

    spec = FleetSpec(islands=(4,), rows=("quorum",), rounds=6, mttf_s=150.0, seeds=1, lr_grid=(0.7,), mix="crash=1")
    failures = head_schedule(spec, 0, 1)
    run = run_one(spec, "quorum", 4, 0, 0.7, 10.0, tmp_path / "runs")
    summary, lives = run.summary, run.losses["lives"]
    assert summary["state"] == "finished" and summary["rounds_done"] == 6
    assert sum(summary["shards"]["tokens"]) == summary["tokens"]
    hit = [t for t in failures if t < run.seconds + lives[0][1]]
    assert run.losses["head_failures"] == len(hit) == len(lives) - 1 >= 1
    assert run.losses["halted"] == pytest.approx(spec.restart_s * len(hit))
    assert lives[-1][1] >= hit[-1] + spec.restart_s  # the last coordinator began after the last restart
    times = [t for t, _ in run.curve]
    assert times == sorted(times) and run.seconds > lives[-1][1] - lives[0][1]
    many = head_schedule(FleetSpec(mttf_s=1800.0), 0, 17)
    assert 14 < len(many) / (FleetSpec().chaos_horizon_s / 1800.0) < 20  # 17 nodes fail about 17 x one's count
