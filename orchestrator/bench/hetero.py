"""`hetero`: islands of speeds 1, 1, 0.5, 0.25 (simulated slowdown 1, 1, 2, 4).

Same data, model, seed and token budget for three methods: synchronous DiLoCo (`sync`,
every round waits for the slowest island), naive async (`naive_async`: torch Nesterov
stepped on every arrival, fixed H) and `dn_dylu` (Delayed Nesterov, N = 4, with Dynamic
Local Updates). Reports wall-clock to reach sync's final loss, loss at equal tokens,
outer updates and staleness.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from orchestrator.bench.quality import MODEL
from orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from orchestrator.bench.runner import run_methods

SPEEDS = [1, 1, 0.5, 0.25]
H = 50


def methods(rounds: int) -> dict[str, tuple[str, list[str]]]:
    base = ["islands.count=4", "islands.simulated_slowdown=[1,1,2,4]", f"inner_steps={H}", f"rounds={rounds}"]
    return {
        "sync": ("synchronous DiLoCo (Nesterov 0.7/0.9)", [*base, "mode=diloco"]),
        "naive_async": (
            "async, Nesterov 0.7/0.9 stepped on every arrival, fixed H",
            [*base, "mode=async", "asynchronous.rule=naive", "asynchronous.dylu=false"],
        ),
        "dn_dylu": (
            "async, Delayed Nesterov N=4 + Dynamic Local Updates",
            [*base, "mode=async", "asynchronous.rule=delayed_nesterov", "asynchronous.dylu=true"],
        ),
    }


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First x at which the curve reaches `target` (linear interpolation between points)."""
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if y1 <= target:
            if y0 <= target or y0 == y1:
                return x1 if y0 > target else x0
            return x0 + (x1 - x0) * (y0 - target) / (y0 - y1)
    return None


def hetero(quick: bool, work: Path) -> BenchResult:
    rounds = 6 if quick else 16
    table = methods(rounds)
    summaries = run_methods(MODEL, table, work)
    by_wall = {n: eval_curve(work / n, s, "train_seconds") for n, s in summaries.items()}
    by_tokens = {n: eval_curve(work / n, s, "tokens_total") for n, s in summaries.items()}
    target = summaries["sync"]["final_eval_loss"]
    results: dict[str, dict[str, Any]] = {}
    for name, (desc, overrides) in table.items():
        s = summaries[name]
        results[name] = {
            "description": desc,
            "overrides": overrides,
            "final_eval_loss": s["final_eval_loss"],
            "initial_eval_loss": s["initial_eval_loss"],
            "wall_seconds": s["train_seconds"],
            "seconds_to_sync_final_loss": time_to_reach(by_wall[name], target),
            "tokens": s["tokens"],
            "outer_updates": s["outer_steps"],
            "staleness": s["staleness"],
            "islands": {
                i: {
                    k: v[k]
                    for k in ("submissions", "inner_steps", "steps_per_s", "staleness_mean", "staleness_max", "tokens")
                }
                for i, v in s["islands"].items()
            },
        }
    sync, dn, naive = results["sync"], results["dn_dylu"], results["naive_async"]
    reach = dn["seconds_to_sync_final_loss"]
    checks = {
        "dn_dylu_time_to_sync_loss_le_0.6x": {
            "value": reach / sync["wall_seconds"] if reach is not None else None,
            "ok": reach is not None and reach <= 0.6 * sync["wall_seconds"],
        },
        "dn_dylu_loss_within_1pct_of_sync": {
            "value": 100 * (dn["final_eval_loss"] / sync["final_eval_loss"] - 1),
            "ok": dn["final_eval_loss"] <= 1.01 * sync["final_eval_loss"],
        },
        "naive_async_worse_than_dn_dylu": {
            "value": naive["final_eval_loss"] - dn["final_eval_loss"],
            "ok": naive["final_eval_loss"] > dn["final_eval_loss"],
        },
    }
    line = (
        f"hetero: sync {sync['final_eval_loss']:.4f} in {sync['wall_seconds']:.0f}s; dn_dylu "
        f"{dn['final_eval_loss']:.4f} in {dn['wall_seconds']:.0f}s (reaches sync's loss at "
        f"{'never' if reach is None else f'{reach:.0f}s'}); naive {naive['final_eval_loss']:.4f}; "
        f"{targets_met(checks)}"
    )
    return BenchResult(
        "hetero",
        quick,
        results,
        line,
        _markdown(results, checks, rounds),
        [Panel("train seconds (wall-clock)", by_wall), Panel("tokens", by_tokens)],
        extra={"checks": checks, "speeds": SPEEDS},
    )


def _markdown(r: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]], rounds: int) -> str:
    rows = [
        [
            f"`{name}`",
            m["description"],
            f"{m['final_eval_loss']:.4f}",
            f"{m['wall_seconds']:.1f}",
            "not reached" if m["seconds_to_sync_final_loss"] is None else f"{m['seconds_to_sync_final_loss']:.1f}",
            str(m["outer_updates"]),
            f"{m['staleness']['mean']:.2f} / {m['staleness']['max']}",
        ]
        for name, m in r.items()
    ]
    table = md_table(
        [
            "method",
            "what",
            "final eval loss",
            "train s",
            "s to sync's final loss",
            "outer updates",
            "staleness mean / max",
        ],
        rows,
    )
    return (
        f"4 islands with simulated speeds {SPEEDS} (each inner step of island i is stretched by 1/speed), "
        f"H = {H}, budget {rounds} rounds x 4 islands x {H} inner steps for every method; same model as `quality`.\n\n"
        + table
        + "\n\n"
        + checks_table(checks)
        + "\n\nPaper (Liu et al. 2024, 20M model, ppl): sync DiLoCo 41.35, naive async 44.27, DN+DyLU 41.13."
    )
