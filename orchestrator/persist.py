"""What a coordinator checkpoint holds, and putting it back: global parameters, the
server's optimizer state and version, membership and island statistics, data-shard
positions, quarantine streaks and run counters. Rounds after the last checkpoint are
redone after a restart; nothing before it is lost."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.checkpoint import load_checkpoint, save_checkpoint
from orchestrator.membership import IslandStats

if TYPE_CHECKING:
    from orchestrator.coordinator import Coordinator

COUNTERS = ("tokens", "tokens_applied", "bytes_sent", "bytes_received", "initial_eval", "last_eval",
            "rounds_done", "completed_steps")


def capture(co: "Coordinator", train_elapsed: float) -> dict[str, Any]:
    co.sync_model()
    return {
        "run_id": co.run_id, "config": co.cfg.model_dump(mode="json"),
        "params": co.flat.data.detach().clone(), "server": co.server.state_dict(),
        "members": {i: dataclasses.asdict(s) for i, s in co.members.islands.items()},
        "shards": co.shards.state(), "quarantine": dict(co.quarantine.streak),
        "counters": {k: getattr(co, k) for k in COUNTERS}, "train_elapsed": train_elapsed,
        "target": co.supervisor.target,
    }


def save(co: "Coordinator", train_elapsed: float) -> Path:
    return save_checkpoint(Path(co.cfg.checkpoint_dir), capture(co, train_elapsed))


def find(cfg_checkpoint_dir: str, run_id: str) -> dict[str, Any] | None:
    """The checkpoint of run `run_id`, if one exists (another run's is ignored)."""
    state = load_checkpoint(Path(cfg_checkpoint_dir))
    return state if state is not None and state["run_id"] == run_id else None


def restore(co: "Coordinator", state: dict[str, Any]) -> None:
    co.flat.load(state["params"])
    co.server.load_state_dict(state["server"])
    for i, fields in state["members"].items():
        co.members.islands[int(i)] = IslandStats(**fields)
    co.shards.load(state["shards"])
    co.quarantine.streak = dict(state["quarantine"])
    for k, v in state["counters"].items():
        setattr(co, k, v)
    co.train_elapsed = state["train_elapsed"]
    co.supervisor.target = state["target"]
