"""Whole runs on the in-process island pool: what the engine decides (bytes counted, updates
dropped or refused for staleness, DyLU's step counts, an island without a shard) checked on
the virtual clock, exactly and in a fraction of a second. These used to be Ray runs of ~9 s
each whose Ray part (actors, object store) the Ray tests cover once; on a loaded machine
their wall-clock speeds were also the flakiest numbers in the suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import load_scenario, run_simulated, tiny_lm_config, toy_quadratic

VIRTUAL = ["simulation.virtual_step_s=0.01"]  # the in-process pool's clock: simulated seconds per step
QUADRATIC = [*toy_quadratic(3, 0.0, "data_shards=3"), *VIRTUAL]
# three islands, the third four times slower, six steps a round (asynchronous, per arrival)
SLOW_THIRD = [
    "mode=async",
    "mode.rule=delayed_nesterov",
    "simulation.slowdown=[1,1,4]",
    "rounds=6",
    "inner_steps=6",
]


def _quadratic(tmp_path: Path, *extra: str) -> dict:
    cfg = load_scenario([*QUADRATIC, f"task.kwargs.fault_dir={tmp_path}", f"out_dir={tmp_path / 'out'}", *extra])
    return run_simulated(cfg)


def test_async_fixed_h_fast_islands_submit_more_and_staleness_is_recorded(tmp_path):
    summary = _quadratic(tmp_path, *SLOW_THIRD, "mode.dylu=false")
    isl = summary["islands"]
    assert isl["0"]["submissions"] > 2 * isl["2"]["submissions"]
    assert isl["2"]["staleness_max"] >= 2 and summary["staleness"]["max"] >= 2
    assert summary["tokens"] == 3 * 6 * 6  # the same step budget as a synchronous run
    assert summary["outer_steps"] == sum(s["submissions"] for s in isl.values())
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["round"] == 6 and records[-1]["eval_loss"] is not None
    assert all("staleness" in r for r in records)


def test_dylu_gives_the_slow_island_fewer_steps(tmp_path):
    summary = _quadratic(tmp_path, *SLOW_THIRD, "mode.dylu=true")
    isl = summary["islands"]
    mean_h = {i: s["tokens"] / s["submissions"] for i, s in isl.items()}  # one token per step here
    assert mean_h["2"] < mean_h["0"] / 2
    assert isl["2"]["steps_per_s"] == pytest.approx(isl["0"]["steps_per_s"] / 4)
    assert summary["tokens"] == 3 * 6 * 6


@pytest.mark.parametrize("policy", ["reject", "downweight"])
def test_staleness_policy_is_applied_and_counted(tmp_path, policy):
    summary = _quadratic(
        tmp_path,
        *SLOW_THIRD,
        "mode.dylu=false",
        "mode.max_staleness=1",
        f"mode.stale_policy={policy}",
    )
    slow = summary["islands"]["2"]
    assert slow["staleness_max"] >= 2
    if policy == "reject":
        assert slow["rejections"] >= 1 and slow["downweighted"] == 0
        # a rejected update's batches went back to the ledger and were trained again
        assert summary["tokens_applied"] == summary["tokens"] == sum(summary["shards"]["tokens"])
    else:
        assert slow["downweighted"] >= 1 and slow["rejections"] == 0
        assert summary["tokens_applied"] == summary["tokens"]


def test_dropped_pseudo_gradients_are_trained_but_not_applied(tmp_path):
    summary = _quadratic(tmp_path, "rounds=6", "inner_steps=2", "simulation.drop_prob=0.5", "seed=3")
    assert summary["tokens"] == 3 * 6 * 2
    assert 0 < summary["tokens_applied"] < summary["tokens"]


def test_an_island_without_a_data_shard_idles_instead_of_failing(tmp_path):
    summary = _quadratic(tmp_path, "rounds=3", "inner_steps=2", "data_shards=2")
    isl = summary["islands"]
    assert isl["2"]["state"] == "training" and isl["2"]["rounds_contributed"] == 0
    assert summary["tokens"] == 3 * 2 * 2 and sum(summary["shards"]["tokens"]) == summary["tokens"]


def test_bytes_are_counted_the_same_way_in_diloco_and_ddp(tmp_path, corpus_cache):
    sizes = {}
    for mode in ("diloco", "ddp"):
        extra = (f"mode={mode}", "islands.count=2", "rounds=2", "inner_steps=4", *VIRTUAL)
        summary = run_simulated(tiny_lm_config(tmp_path / mode, corpus_cache, *extra))
        sizes[mode] = summary
        assert summary["tokens"] == 2 * 2 * 4 * 8 * 32  # same token budget in both modes
    numel = sizes["diloco"]["num_params"]
    assert sizes["diloco"]["bytes_communicated"] == 2 * 2 * numel * 4 * 2  # rounds*islands*(send+recv)
    assert sizes["ddp"]["bytes_communicated"] == 2 * 4 * 2 * numel * 4 * 2  # every step
    assert sizes["ddp"]["outer_steps"] == 8


def test_int8_compression_quarters_the_bytes_sent(tmp_path):
    base = [*toy_quadratic(2, 0.0, "rounds=5", "inner_steps=10", "task.kwargs.dtype=float32"), *VIRTUAL]
    plain, int8 = (
        run_simulated(load_scenario([*base, f"out_dir={tmp_path / name}", *extra]))
        for name, extra in (("plain", []), ("int8", ["compression.codec=int8"]))
    )
    # 2 float32 values = 8 bytes; int8: 2 bytes + one 4-byte scale + 4-byte chunk size per result
    assert plain["bytes_sent"] == 5 * 2 * 8 and int8["bytes_sent"] == 5 * 2 * 10
    assert int8["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], rel=0.05)


@pytest.mark.parametrize("mode", ["async", "overlap"])
def test_async_and_overlap_learn_on_three_coordinator_shards(tmp_path, corpus_cache, mode):
    """The engine's sliced outer step in the lagged modes (the Ray slices' own tests, in
    diloco, are in test_sharded_ray.py)."""
    # fixed H and outer lr 0.4 in async: with DyLU, H = 5 and lr 0.7 this tiny model sometimes
    # diverges whatever S is (arrival timing decides), which is not what this test is about
    stable = ["mode.dylu=false", "outer.lr=0.4"] if mode == "async" else []
    sets = [f"mode={mode}", "islands.count=2", "rounds=4", "inner_steps=5", "compression.chunk=1024"]
    summary = run_simulated(tiny_lm_config(tmp_path, corpus_cache, *sets, "coordinator.shards=3", *stable, *VIRTUAL))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["outer_steps"] >= 4


def test_a_bench_warm_start_is_continued_by_the_runs_that_name_it(tmp_path):
    """`train_warm_start` trains a scenario's shared warm start once; every run of the
    scenario then reads its checkpoint through the run id its marker records (a warm start
    checkpointed under another id fails every run that continues it)."""
    from archipelago.orchestrator.bench.runner import train_warm_start

    base = [*QUADRATIC, f"task.kwargs.fault_dir={tmp_path}", "inner_steps=4", "rounds=2"]
    warm = train_warm_start(base, 0, 8, tmp_path / "warm", in_process=True)
    assert train_warm_start(base, 0, 8, tmp_path / "warm", in_process=True) == warm  # trained once, then reused
    cfg = load_scenario(
        [*base, "seed=0", "warm_start.steps=8", f"warm_start.path={warm}", f"out_dir={tmp_path / 'run'}"]
    )
    summary = run_simulated(cfg)
    assert summary["state"] == "finished" and summary["warm_start"]["run_id"] == "bench-s0-warm"
    assert summary["initial_eval_loss"] == pytest.approx(summary["warm_start"]["final_eval_loss"])
