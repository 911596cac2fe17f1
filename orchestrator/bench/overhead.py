"""Where a round's time goes, ours beside the peer's, on the same work and the same
evaluation schedule (both evaluate once, at the end, and that evaluation is left out of
both walls: the peer's loop time excludes its own).

Ours comes from one run's `summary.json`: the islands' computing (measured on the
islands, per work order), the rest of the wall (what kept them waiting), and the
coordinator's loop by part (`coordinator_seconds`; `wait` is its idle time while the
islands compute). The peer's is its wall against its lower bound (one replica alone with no
exchange, scaled to the cores: `bench/peer.py`): what its exchange and contention add."""

from __future__ import annotations

from typing import Any

from archipelago.orchestrator.bench.report import md_table


def lower_bound(one_alone_s: float, k: int, threads: int, cores: int) -> float:
    """No schedule runs k replicas of `threads` threads, each `one_alone_s` alone, on
    `cores` cores in less than this."""
    return one_alone_s * max(1.0, k * threads / cores)


def round_breakdown(ours: dict[str, Any], peer: dict[str, Any], rounds: int) -> dict[str, dict[str, float]]:
    """Seconds per round of `ours` (a summary evaluating only at the end) and of `peer`
    (a peer row with `train_seconds` and `islands_alone_seconds`)."""
    parts = dict(ours["coordinator_seconds"])
    # its evaluations: the start's (while the first work trains: not on the islands' path) and the final one
    final_eval = parts.pop("evaluate") - (ours["startup"].get("first_eval_s") or 0.0)
    wall = ours["train_seconds"] - final_eval
    compute = ours["compute_seconds"]
    return {
        "archipelago": {
            "wall": wall / rounds,
            "islands_computing": compute / rounds,
            "islands_not_computing": (wall - compute) / rounds,
            **{f"coordinator_{part}": seconds / rounds for part, seconds in parts.items()},
        },
        "peer": {
            "wall": peer["train_seconds"] / rounds,
            "islands_computing": peer["islands_alone_seconds"] / rounds,
            "islands_not_computing": (peer["train_seconds"] - peer["islands_alone_seconds"]) / rounds,
        },
    }


LABELS = {
    "wall": "wall (the final evaluation left out)",
    "islands_computing": "islands computing (peer: the lower bound, one replica alone scaled to the cores)",
    "islands_not_computing": "islands not computing (exchange, barriers, the coordinator)",
    "coordinator_wait": "coordinator: waiting for results (idle)",
    "coordinator_step": "coordinator: decode, screen, aggregate, outer step",
    "coordinator_publish": "coordinator: publish the new version",
    "coordinator_dispatch": "coordinator: hand out work",
    "coordinator_record": "coordinator: records and checkpoints",
}


def breakdown_table(breakdown: dict[str, dict[str, float]], peer_name: str) -> str:
    ours, peer = breakdown["archipelago"], breakdown["peer"]
    rows = [
        [LABELS.get(key, key), f"{seconds:.3f}", f"{peer[key]:.3f}" if key in peer else "–"]
        for key, seconds in ours.items()
    ]
    return md_table(["seconds per round", "Archipelago", peer_name], rows)
