"""`hetero`: islands of speeds 1, 1, 0.5, 0.25 on a virtual clock.

Each island's inner step advances simulated time by `STEP_S` / speed (exactly the speeds
asked for, whatever else this machine runs); results are taken in the order of their
simulated finish times while the islands really train on Ray (`islands.virtual_step_s`).
Every method continues one warm start and trains the same token budget: synchronous
DiLoCo (`sync`: every round waits for the slowest island), naive async (`naive_async`:
Nesterov stepped on every arrival, fixed H, its outer lr scaled by 1/k so k arrivals
make about one synchronous step) and `dn_dylu` (Delayed Nesterov, N = k, with Dynamic
Local Updates, speeds known before the first work). Reports loss against tokens and
against simulated time, and the simulated time to reach sync's final loss.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from orchestrator.bench.quality import MODEL
from orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from orchestrator.bench.runner import one_ray, run_methods, train_warm_start

K = 4
SPEEDS = [1, 1, 0.5, 0.25]
H = 50
STEP_S = 0.1  # simulated seconds per inner step of a speed-1 island
WARM = 200
OUTER_LR = 0.7


def methods(rounds: int, warm: Path | None = None) -> dict[str, tuple[str, list[str]]]:
    slowdown = ",".join(f"{1 / v:g}" for v in SPEEDS)
    base = [
        f"islands.count={K}",
        f"islands.simulated_slowdown=[{slowdown}]",
        f"islands.virtual_step_s={STEP_S}",
        f"inner_steps={H}",
        f"rounds={rounds}",
        f"outer.lr={OUTER_LR}",
    ]
    if warm is not None:
        base += [f"warm_start.steps={WARM}", f"warm_start.path={warm}"]
    return {
        "sync": ("synchronous DiLoCo (Nesterov 0.7/0.9)", [*base, "mode=diloco"]),
        "naive_async": (
            f"async, Nesterov lr {OUTER_LR}/{K} stepped on every arrival, fixed H",
            [*base, "mode=async", "asynchronous.rule=naive", "asynchronous.dylu=false", f"outer.lr={OUTER_LR / K:g}"],
        ),
        "dn_dylu": (
            f"async, Delayed Nesterov N={K} + Dynamic Local Updates",
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
    with one_ray(K):
        return _hetero(quick, work)


def _hetero(quick: bool, work: Path) -> BenchResult:
    rounds = 6 if quick else 16
    warm = train_warm_start(
        [*MODEL, f"islands.count={K}", f"inner_steps={H}", f"rounds={rounds}"], 0, WARM, work / "warm"
    )
    table = methods(rounds, warm)
    summaries = run_methods(MODEL, table, work)
    by_clock = {n: eval_curve(work / n, s, "clock_seconds") for n, s in summaries.items()}
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
            "sim_seconds": s["clock_seconds"],
            "sim_seconds_to_sync_final_loss": time_to_reach(by_clock[name], target),
            "wall_seconds": s["train_seconds"],
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
    reach = dn["sim_seconds_to_sync_final_loss"]
    checks = {
        "dn_dylu_sim_time_to_sync_loss_le_0.5x": {
            "value": reach / sync["sim_seconds"] if reach is not None else None,
            "ok": reach is not None and reach <= 0.5 * sync["sim_seconds"],
        },
        "dn_dylu_loss_le_1.01x_sync_at_equal_tokens": {
            "value": dn["final_eval_loss"] / sync["final_eval_loss"],
            "ok": dn["final_eval_loss"] <= 1.01 * sync["final_eval_loss"],
        },
        "naive_async_worse_than_dn_dylu_but_finite": {
            "value": naive["final_eval_loss"] - dn["final_eval_loss"],
            "ok": dn["final_eval_loss"] < naive["final_eval_loss"] < 2 * naive["initial_eval_loss"],
        },
    }
    line = (
        f"hetero: sync {sync['final_eval_loss']:.4f} in {sync['sim_seconds']:.0f} simulated s; dn_dylu "
        f"{dn['final_eval_loss']:.4f} in {dn['sim_seconds']:.0f} s (reaches sync's loss at "
        f"{'never' if reach is None else f'{reach:.0f}s'}); naive {naive['final_eval_loss']:.4f}; "
        f"{targets_met(checks)}"
    )
    return BenchResult(
        "hetero",
        quick,
        results,
        line,
        _markdown(results, checks, rounds),
        [Panel("simulated seconds (virtual clock)", by_clock), Panel("tokens", by_tokens)],
        extra={"checks": checks, "speeds": SPEEDS, "virtual_step_s": STEP_S, "warm_start_steps": WARM},
    )


def _markdown(r: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]], rounds: int) -> str:
    rows = [
        [
            f"`{name}`",
            m["description"],
            f"{m['final_eval_loss']:.4f}",
            f"{m['sim_seconds']:.1f}",
            "not reached"
            if m["sim_seconds_to_sync_final_loss"] is None
            else f"{m['sim_seconds_to_sync_final_loss']:.1f}",
            str(m["outer_updates"]),
            f"{m['staleness']['mean']:.2f} / {m['staleness']['max']}",
            " / ".join(f"{v['steps_per_s']:.1f}" for v in m["islands"].values()),
        ]
        for name, m in r.items()
    ]
    table = md_table(
        [
            "method",
            "what",
            "final eval loss",
            "simulated s",
            "simulated s to sync's final loss",
            "outer updates",
            "staleness mean / max",
            "measured steps/s per island",
        ],
        rows,
    )
    return (
        f"{K} islands of speeds {SPEEDS} on a virtual clock ({STEP_S} simulated s per inner step at speed 1; "
        f"the islands really train on Ray, nothing sleeps), after a shared warm start ({WARM} data-parallel steps); "
        f"H = {H}, budget {rounds} rounds x {K} islands x {H} inner steps for every method.\n\n"
        + table
        + "\n\n"
        + checks_table(checks)
        + "\n\nPaper (Liu et al. 2024, 20M model, ppl): sync DiLoCo 41.35, naive async 44.27, DN+DyLU 41.13."
    )
