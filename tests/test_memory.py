"""What the coordinator keeps in memory as a run grows in rounds and islands: the per-round
history the control plane pages through is the part that grows with both (events, the
robust-aggregation history and publication times are bounded by count; see
test_engine.py for the last)."""

from __future__ import annotations

import random

from orchestrator.config_load import load_config
from orchestrator.engine.records import HISTORY, Recorder

ISLANDS, ROUNDS = 64, 10_000
BOUND_MIB = 80  # docs/operations.md quotes this bound


def _record(rnd: int, rng: random.Random) -> dict:
    """A per-round record as the engine writes it at 64 islands (every per-island field)."""
    per_island = {str(i): rng.random() for i in range(ISLANDS)}
    return {
        "round": rnd, "version": rnd, "mode": "diloco", "time": 1.0, "eval_loss": 2.0, "train_loss": 2.0,
        "island_train_loss": dict(per_island), "contributed": list(range(ISLANDS)), "rejected": {},
        "dropped": [], "staleness": 0, "staleness_updates": [0] * ISLANDS,
        "inner_steps": {str(i): 500 for i in range(ISLANDS)}, "tokens": 1, "tokens_total": rnd,
        "tokens_applied_total": rnd, "bytes_sent": rnd, "bytes_received": rnd, "round_seconds": 1.0,
        "wall_seconds": float(rnd), "train_seconds": float(rnd), "tokens_per_s": 1.0, "lr": 0.7,
        "islands_alive": ISLANDS, "island_idle_fraction": dict(per_island),
        "island_compute_seconds": dict(per_island), "clock_seconds": float(rnd),
    }  # fmt: skip


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
    assert [r["round"] for r in page] == [ROUNDS - 2, ROUNDS - 1, ROUNDS] and page[-1] == records[-1]
