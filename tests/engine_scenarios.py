"""The engine scenarios' shared parts: a small config over the recording quadratic task,
driving an engine with actions at given rounds, and the checks every scenario ends with:
each batch trained exactly once, each round recorded once, each due checkpoint taken."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.simulation.pool import Fault
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.engine.engine import RoundEngine
from tests.helpers import assert_trained_once, in_process_engine, load_scenario

CENTERS = "[[1.0,0.0],[-0.5,2.0],[0.5,0.5],[2.0,-1.0]]"
_keys = itertools.count()


# scenario modes that are a mode plus settings: async's per-arrival Delayed Nesterov and its
# quorum rule (the default), the quorum rule of streaming (per fragment), and sync + DyLU
VARIANTS = {
    "async": ["mode=async", "mode.rule=delayed_nesterov"],
    "quorum": ["mode=async", "mode.rule=quorum"],
    "streaming_quorum": ["mode=streaming", "mode.pacing=quorum"],
    "sync_dylu": ["mode=diloco", "mode.dylu=true"],
}


def scenario_cfg(tmp_path: Path, mode: str, *extra: str, heartbeats: bool = True) -> RunConfig:
    """A scenario's config, with heartbeats as shipped (`elastic.hang_after_steps`, and with
    them the tail stop): the fault suite runs what ships. A test about deadlines alone (a
    hung island found only at its deadline and grace) turns them off with `heartbeats=False`."""
    key = f"r{next(_keys)}"
    chosen = VARIANTS.get(mode, [f"mode={mode}"])
    return load_scenario(
        [
            "task.factory=tests.toy_tasks:make_recording",
            "warm_start.steps=0",
            f"task.kwargs.centers={CENTERS}",
            f"task.kwargs.record={key}",
            *chosen,
            "islands.count=3",
            "rounds=6",
            "inner_steps=4",
            "inner.optimizer=sgd",
            "inner.lr=0.1",
            "inner.warmup_steps=0",
            "inner.grad_clip=null",
            "outer.lr=0.7",
            "round_timeout_s=20",
            "step_timeout_s=0",
            "elastic.late_grace_s=100",
            "robust.weight_ratio=null",  # the recording task's batches weigh 1 to 12 tokens on purpose
            "checkpoint.every_rounds=1",
            "elastic.placement_timeout_s=100",
            *([] if heartbeats else ["elastic.hang_after_steps=null"]),
            f"out_dir={tmp_path / key}",
            # streaming: two fragments, over a point with one layer per coordinate
            *(["task.kwargs.split=true", "mode.fragments=2"] if mode.startswith("streaming") else []),
            *extra,
        ],
    )


Action = Callable[[RoundEngine], None]


def drive(engine: RoundEngine, at: dict[int, Action] | None = None, until: int | None = None) -> None:
    """Step `engine`; once it has recorded round r, run `at[r]`; stop stepping after round `until`.
    Before an action and at `until`, a checkpoint being written in the background is finished,
    so what the test then reads (or a restarted engine loads) does not depend on a thread's pace."""
    done: set[int] = set()
    engine.start()
    while engine.step():
        for r, act in (at or {}).items():
            if r not in done and engine.rounds_done >= r:
                done.add(r)
                engine.outputs.finish_writing()
                act(engine)
        if until is not None and engine.rounds_done >= until:
            engine.outputs.finish_writing()
            return


def check_exactly_once(cfg: RunConfig, summary: dict[str, Any], lost: Counter | None = None) -> None:
    """Reads − lost work = each batch below its shard's position, once; tokens agree."""
    position, tokens = summary["shards"]["position"], summary["shards"]["tokens"]
    assert_trained_once(cfg.task.kwargs["record"], position, [cfg.out_dir], lost)
    assert [p * (s + 1) for s, p in enumerate(position)] == tokens  # a batch of shard s weighs s + 1
    listed = sum(isl["tokens"] for isl in summary["islands"].values())
    assert sum(tokens) == summary["tokens"] == listed + summary["retired_islands"]["tokens"]


def check_rounds_recorded(cfg: RunConfig, summary: dict[str, Any]) -> None:
    """Every round from 1 to the last has exactly one record, and every checkpoint due
    (each `checkpoint.every_rounds`-th round) was taken, whatever a close covered."""
    out = Path(cfg.out_dir)
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == list(range(1, summary["rounds_done"] + 1)), rounds
    every = cfg.checkpoint.every_rounds
    taken = [
        e["round"]
        for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())
        if e["kind"] == "checkpoint"
    ]
    due = set(range(every, summary["rounds_done"] + 1, every))
    assert due <= set(taken), sorted(due - set(taken))


def run_scenario(
    cfg: RunConfig, faults: list[Fault] | None = None, at: dict[int, Action] | None = None, **pool: Any
) -> dict[str, Any]:
    """Drive an in-process engine through `faults` and `at`; then check the run's data was
    trained exactly once and its rounds recorded and checkpointed as due."""
    engine, _ = in_process_engine(cfg, faults, **pool)
    drive(engine, at)
    check_exactly_once(cfg, engine.summary)
    check_rounds_recorded(cfg, engine.summary)
    return engine.summary
