"""What the coordinator keeps in memory as a run grows in rounds and islands: the per-round
history the control plane pages through is the part that grows with both (events, the
robust-aggregation history and publication times are bounded by count; see
test_engine.py for the last)."""

from __future__ import annotations

import os
import random

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.state.membership import RETAINED
from archipelago.orchestrator.engine.state.records import HISTORY, Recorder
from archipelago.orchestrator.engine.state.views import RoundRecord
from archipelago.orchestrator.engine.types import IslandState
from tests.helpers import in_process_engine

ISLANDS, ROUNDS = 64, 10_000
BOUND_MIB = 80  # docs/elasticity.md quotes this bound
# growth of the process's resident memory over the run, and after round 50 (ditto); growth,
# not the absolute figure, since the suite runs every test in one process
RUN_GROWTH_MIB, GROWTH_BOUND_MIB = 128, 96


def _record(rnd: int, rng: random.Random) -> RoundRecord:
    """A per-round record as the engine writes it at 64 islands (every per-island field)."""
    per_island = {str(i): rng.random() for i in range(ISLANDS)}
    return RoundRecord.model_validate({
        "round": rnd, "version": rnd, "mode": "diloco", "time": 1.0, "eval_loss": 2.0, "train_loss": 2.0,
        "island_train_loss": dict(per_island), "contributed": list(range(ISLANDS)), "rejected": {},
        "dropped": [], "staleness": 0, "staleness_updates": [0] * ISLANDS,
        "inner_steps": {str(i): 500 for i in range(ISLANDS)}, "tokens": 1, "tokens_total": rnd,
        "tokens_applied_total": rnd, "bytes_sent": rnd, "bytes_received": rnd, "round_seconds": 1.0,
        "wall_seconds": float(rnd), "train_seconds": float(rnd), "tokens_per_s": 1.0, "lr": 0.7,
        "islands_alive": ISLANDS, "island_idle_fraction": dict(per_island),
        "island_compute_seconds": dict(per_island), "clock_seconds": float(rnd),
    })  # fmt: skip


def test_the_history_of_64_islands_over_10000_rounds_stays_under_its_bound(tmp_path):
    """Held as dicts it took 157 MiB (tracemalloc; the issue measured 188 MiB with the older
    record); held as the JSON lines already written to metrics.jsonl, 64.8 MiB (tracemalloc
    and the objects' own sizes agree), and a page parses only what it returns."""
    import sys

    recorder = Recorder(tmp_path, load_config(None, [f"out_dir={tmp_path}"]))
    rng = random.Random(0)
    records = [_record(r, rng) for r in range(1, ROUNDS + 1)]
    for record in records:
        recorder.record(record)
    assert len(recorder.history) == min(HISTORY, ROUNDS)
    held = sys.getsizeof(recorder.history) + sum(sys.getsizeof(t) + sys.getsizeof(t[1]) for t in recorder.history)
    print(f"history of {ISLANDS} islands x {ROUNDS} rounds: {held / 2**20:.1f} MiB")
    assert held < BOUND_MIB * 2**20
    page = recorder.page(ROUNDS - 3, 500)
    assert [r["round"] for r in page] == [ROUNDS - 2, ROUNDS - 1, ROUNDS] and page[-1] == records[-1].as_dict()


RUN_ROUNDS = int(os.environ.get("ARCHIPELAGO_MEMORY_ROUNDS", "120"))  # docs/elasticity.md: 10,000
CHURN = 40  # each island that replaces a dead one dies at its 40th work order


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_64_island_run_with_churn_holds_its_coordinator_memory_bounded(tmp_path):
    """The whole engine, in process, at 64 islands with an island dying and replaced every
    ~40 rounds (tiny model, H = 1): the coordinator's state must not grow with rounds or with
    every island ever seen. CI runs 120 rounds; `ARCHIPELAGO_MEMORY_ROUNDS=10000` gives the
    figure in docs/elasticity.md (resident memory of the process, islands included)."""
    cfg = load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_quadratic",
            "task.kwargs.centers=[[1.0,0.0],[-0.5,2.0]]",
            "warm_start.steps=0",
            f"islands.count={ISLANDS}",
            f"elastic.max_islands={ISLANDS}",
            f"data_shards={ISLANDS}",
            f"rounds={RUN_ROUNDS}",
            "inner_steps=1",
            "inner.optimizer=sgd",
            "inner.warmup_steps=0",
            "eval_every=50",
            "checkpoint.every_rounds=50",
            f"out_dir={tmp_path / 'out'}",
        ],
    )
    chain = RUN_ROUNDS // CHURN + 1
    faults = [Fault(FaultKind.CRASH, i, order=CHURN) for i in (0, *range(ISLANDS, ISLANDS + chain))]
    engine, _ = in_process_engine(cfg, faults)
    rss: list[tuple[int, float]] = []
    engine.outputs.on_record = lambda *_: rss.append((engine.rounds_done, _rss_mib()))
    engine.execute()
    summary = engine.summary
    retired = summary["retired_islands"]
    gone = [s for s in summary["islands"].values() if IslandState(s["state"]).gone]
    replaced = len(gone) + retired["islands"]
    assert replaced >= RUN_ROUNDS // CHURN - 1  # the churn happened
    assert len(gone) <= RETAINED and len(summary["islands"]) <= ISLANDS + RETAINED
    assert max(int(i) for i in summary["islands"]) == ISLANDS - 1 + replaced  # no index reused
    listed = sum(s["tokens"] for s in summary["islands"].values())
    assert listed + retired["tokens"] == summary["tokens"] == sum(summary["shards"]["tokens"])
    grown = rss[-1][1] - next(m for r, m in rss if r >= min(50, RUN_ROUNDS // 2))
    marks = {r: round(m) for r, m in rss if r in (1, 50, 100, 1000, 2500, 5000, 7500, 10_000)}
    print(
        f"{ISLANDS} islands x {RUN_ROUNDS} rounds, {replaced} replaced: rss MiB by round {marks}, +{grown:.0f} after 50"
    )
    assert rss[-1][1] - rss[0][1] < RUN_GROWTH_MIB and grown < GROWTH_BOUND_MIB
