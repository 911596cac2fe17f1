"""`bench fleet`'s parts: the links priced at a nominal model size (data-parallel as a ring
all-reduce), failures drawn per island (an MTTF, a mix of kinds, preemptions with notice),
the pool's account of where the fleet's time went, the command line that describes a fleet,
and the scenario end to end on a small fleet."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest

from orchestrator.bench import fleet_spec
from orchestrator.bench.fleet import breakdown, run_one, seeds_of
from orchestrator.bench.fleet_spec import FleetSpec
from orchestrator.cli import main
from orchestrator.config_load import load_config
from orchestrator.engine.work.links import LinkPrices
from orchestrator.testing.chaos import Strike, TimedFault, mttf_schedule, parse_mix
from tests.engine_scenarios import check_exactly_once, check_rounds_recorded, drive, scenario_cfg
from tests.helpers import events, in_process_engine
from workers.wire.links import LinkConfig, ring_allreduce_s

LINK = ("simulation.link.bandwidth_gbps=8", "simulation.link.latency_ms=10")  # 1 GB/s, 10 ms


def test_a_ring_all_reduce_moves_a_kth_of_the_bytes_over_2_k_minus_1_hops_paced_by_the_worst_link():
    fast, slow = LinkConfig(bandwidth_gbps=8, latency_ms=10), LinkConfig(bandwidth_gbps=4, latency_ms=20)
    assert ring_allreduce_s([fast] * 4, 4e9) == pytest.approx(2 * 3 * (0.010 + 1.0))
    assert ring_allreduce_s([fast, fast, slow, fast], 4e9) == pytest.approx(2 * 3 * (0.020 + 2.0))
    assert ring_allreduce_s([fast], 4e9) == 0.0 and ring_allreduce_s([LinkConfig()] * 8, 4e9) == 0.0
    assert fast.seconds(1e9) == pytest.approx(1.010)


def test_transfers_are_priced_at_the_nominal_size_and_data_parallel_pays_a_ring_not_the_coordinator():
    diloco = LinkPrices.of(load_config(None, [*LINK, "simulation.nominal_params=1000"]), numel=10)
    assert diloco.scale == 100 and not diloco.ring
    assert diloco.download_s(0, 40, bootstrap=False) == pytest.approx(0.010 + 4000 * 8 / 8e9)
    assert diloco.upload_s(0, 40, [0, 1, 2]) == pytest.approx(0.010 + 4000 * 8 / 8e9)
    ddp = LinkPrices.of(load_config(None, ["mode=ddp", *LINK, "simulation.nominal_params=1000"]), numel=10)
    assert ddp.download_s(0, 40, bootstrap=False) == 0.0  # every replica applies the step itself
    assert ddp.download_s(0, 40, bootstrap=True) == pytest.approx(0.010 + 4000 * 8 / 8e9)  # its first copy
    assert ddp.upload_s(0, 40, [0, 1, 2]) == pytest.approx(
        ring_allreduce_s([LinkConfig(bandwidth_gbps=8, latency_ms=10)] * 3, 4000)
    )
    assert LinkPrices.of(load_config(None, list(LINK)), numel=10).scale == 1.0


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
    assert notices and all(30 <= n <= 120 for n in notices)
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
    ]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "fleet.json").read_text())
    assert set(report["methods"]) == {"sync_4", "quorum_4"}  # <row>_<islands>, for checks from outside
    for m in report["methods"].values():
        assert {"islands", "goodput", "sim_seconds_to_target", "final_eval_loss", "seeds", "lost_seconds"} <= set(m)
        assert m["islands"] == 4 and m["seeds"] == [0] and m["lost_seconds"]["replacement_start"] >= 0
    reference = run_one(
        FleetSpec(islands=(4,), rows=("sync",), rounds=3, mttf_s=150, seeds=1, lr_grid=(0.7,)),
        "sync",
        4,
        0,
        0.7,
        out / "fleet-runs",
        faults=False,
    )
    for name, m in report["methods"].items():
        assert 0 < m["goodput"] <= 1 and m["lost"]["waiting"] >= -1e-6, (name, m)
        assert m["target_loss_seeds"] == [reference.summary["final_eval_loss"]]
        assert m["strikes"] >= 1  # 4 islands failing every 150 s over a run of minutes
    assert report["regime"]["exchange_share_of_round"] == pytest.approx(2 * (0.03 + 4e9 * 8 / 100e9) / 20)
    assert report["machine"]["commit"] and (out / "fleet.png").exists() and (out / "fleet.md").exists()
    again = run_one(
        FleetSpec(islands=(4,), rows=("sync",), rounds=3, mttf_s=150, seeds=1, lr_grid=(0.7,)),
        "sync",
        4,
        0,
        0.7,
        tmp_path / "again",
    )
    # the same run computed again in a folder of its own (not read back from the report's): the account the report shows
    assert breakdown(again)["useful"] == report["methods"]["sync_4"]["goodput"]
    assert again.losses["strikes"] and sum(again.losses["strikes"].values()) == report["methods"]["sync_4"]["strikes"]


def test_a_hang_ends_for_the_account_when_a_restart_gives_its_work_up(tmp_path):
    """Under stop-the-world restarts a crash gives every island's work up, the hung one's
    too, and the hung island trains again: its undetected time ends there, not at the run's
    end."""
    cfg = scenario_cfg(tmp_path, "diloco", "elastic.on_failure=restart", "elastic.restart_s=5")
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
