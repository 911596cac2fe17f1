"""`warmstart`: the default run's bytes, warm start and first downloads included, against
data-parallel reaching the same loss.

The default run trains a warm start on the run's islands before they fork. Trained
data-parallel it exchanges a gradient every step, which over slow links costs many times
the DiLoCo phase. Each row here is the default config (`archipelago run` with no
arguments) with one warm-start mode: `ddp`, `average` (Local SGD, an average every
`warm_start.inner_steps` steps: 10, 25 and 50) and `single` (one island, then the fork's
downloads).

The baseline is data-parallel on the same islands (4× batch), run for the default run's
steps, at each lr of a grid around the shipped one (half of it to four times), evaluated every `DDP_EVAL_EVERY` steps. Its bytes to
reach a row's final loss are read off its curve of eval loss against cumulative bytes
(bootstrap included), linearly interpolated between evaluations; the best lr (fewest
bytes) is the baseline. A baseline that never reaches a row's loss gives that row's ratio
as a lower bound (its whole run's bytes), and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.hetero import time_to_reach
from archipelago.orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from archipelago.orchestrator.bench.runner import Table, run_methods
from archipelago.orchestrator.config import WarmStartMode
from archipelago.orchestrator.config_load import load_config

TARGET_RATIO = 20.0  # the issue's: total bytes >= 20x fewer than data-parallel at equal loss
AVERAGE_H = (10, 25, 50)  # warm_start.inner_steps of mode average
DDP_LRS = (1.5e-3, 3e-3, 6e-3, 1.2e-2)
DDP_EVAL_EVERY = 20  # steps between the baseline's evaluations (its curve's resolution)
QUICK = ["rounds=2", "inner_steps=10"]  # the default model and islands, cut short


def _cumulative_bytes(run_dir: Path, summary: dict[str, Any], offset: int = 0) -> list[tuple[float, float]]:
    """(bytes moved so far, eval loss) of a run, `offset` bytes before its first round
    (the records' byte counts are cumulative)."""
    return eval_curve(
        run_dir, summary, lambda rec: float(offset + rec["bytes_sent"] + rec["bytes_received"]), start=float(offset)
    )


def fewest(reach: dict[str, float | None]) -> str | None:
    """The baseline that reached the target with the fewest bytes; None if none reached it."""
    reached = {name: x for name, x in reach.items() if x is not None}
    return min(reached, key=lambda name: reached[name]) if reached else None


def row_name(mode: WarmStartMode, h: int) -> str:
    return f"default_warm_{mode.value}" + (f"_h{h}" if mode == WarmStartMode.AVERAGE else "")


def rows() -> Table:
    """The default config once per warm-start mode, average at several H; nothing else
    changed."""
    table = {
        row_name(m, 0): (f"the default run, warm start {m.value}", [f"warm_start.mode={m.value}"])
        for m in (WarmStartMode.DDP, WarmStartMode.SINGLE)
    }
    for h in AVERAGE_H:
        table[row_name(WarmStartMode.AVERAGE, h)] = (
            f"the default run, warm start average every {h} steps",
            ["warm_start.mode=average", f"warm_start.inner_steps={h}"],
        )
    return table


def _row(s: dict[str, Any], reach: dict[str, float | None], baselines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A warm-started run's bytes (its warm start's and its own) against the fewest any
    data-parallel baseline moved to reach its loss (`reach`: bytes per baseline, None where
    it never did; then the most any moved, a lower bound on the ratio)."""
    warm = s["warm_start"]
    total = warm["bytes_communicated"] + s["bytes_communicated"]
    best = fewest(reach)
    ddp_bytes = reach[best] if best is not None else max(baselines[b]["bytes_communicated"] for b in reach)
    return {
        "final_eval_loss": s["final_eval_loss"],
        "warm_start_final_eval_loss": warm["final_eval_loss"],
        "bytes_warm_start": warm["bytes_communicated"],
        "bytes_main": s["bytes_communicated"],
        "bytes_communicated": total,
        "train_seconds": warm["train_seconds"] + s["train_seconds"],
        "ddp_bytes_to_reach": ddp_bytes,
        "ddp_bytes_to_reach_by_lr": {baselines[b]["lr"]: x for b, x in reach.items()},
        "ddp_reached": best is not None,
        "ddp_best": best,
        "bytes_ratio_vs_ddp_at_equal_loss": ddp_bytes / total,
    }


def warmstart(quick: bool, work: Path) -> BenchResult:
    base = [*(QUICK if quick else []), "api.enabled=false"]
    default = load_config(None, base)
    steps = default.warm_steps + default.total_inner_steps
    runs = rows()
    ddp_sets = ["mode=ddp", "warm_start.steps=0", f"inner_steps={DDP_EVAL_EVERY}", f"rounds={steps // DDP_EVAL_EVERY}"]
    lrs = DDP_LRS[1:2] if quick else DDP_LRS
    baselines = {f"ddp_k@lr{lr:g}": (f"data-parallel, lr {lr:g}", [*ddp_sets, f"inner.lr={lr}"]) for lr in lrs}
    summaries = run_methods(base, {**runs, **baselines}, work)

    curves = {name: _cumulative_bytes(work / name, summaries[name]) for name in baselines}
    results: dict[str, dict[str, Any]] = {}
    for name in baselines:
        s = summaries[name]
        results[name] = {
            "final_eval_loss": s["final_eval_loss"],
            "bytes_communicated": s["bytes_communicated"],
            "train_seconds": s["train_seconds"],
            "lr": float(name.split("@lr")[1]),
        }
    for name in runs:
        s = summaries[name]
        results[name] = _row(s, {b: time_to_reach(curves[b], s["final_eval_loss"]) for b in baselines}, results)
        warm = s["warm_start"]
        warm_curve = _cumulative_bytes(work / name / "warm_start", {"initial_eval_loss": warm["initial_eval_loss"]})
        curves[name] = warm_curve + _cumulative_bytes(work / name, s, offset=warm["bytes_communicated"])[1:]

    mb = {n: [(x / 1e6, y) for x, y in c] for n, c in curves.items()}
    shipped = row_name(default.warm_start.mode, default.warm_start.inner_steps)
    ratio = results[shipped]["bytes_ratio_vs_ddp_at_equal_loss"]
    checks = {
        f"default_run_bytes_ratio_vs_ddp_ge_{TARGET_RATIO:g}x (shipped warm start: {default.warm_start.mode.value})": {
            "value": ratio,
            "target": TARGET_RATIO,
            "ok": ratio >= TARGET_RATIO,
            "lower_bound": not results[shipped]["ddp_reached"],
        }
    }
    line = (
        f"warmstart: the default run (warm start {default.warm_start.mode.value}) moves {ratio:.1f}x fewer bytes "
        f"than data-parallel reaching its loss ({targets_met(checks)})"
    )
    return BenchResult(
        "warmstart",
        quick,
        results,
        line,
        _markdown(results, checks, shipped),
        [Panel("MB moved (warm start and first downloads included)", mb, y_label="eval loss", log_x=True)],
        extra={"checks": checks, "shipped_warm_start": default.warm_start.mode.value, "ddp_lrs": list(lrs)},
    )


def _markdown(results: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]], shipped: str) -> str:
    rows = []
    for name, r in results.items():
        if "bytes_ratio_vs_ddp_at_equal_loss" in r:
            bound = "" if r["ddp_reached"] else " (at least: never reached)"
            rows.append(
                [
                    name + (" (shipped)" if name == shipped else ""),
                    f"{r['warm_start_final_eval_loss']:.4f}",
                    f"{r['final_eval_loss']:.4f}",
                    f"{r['bytes_warm_start'] / 1e6:,.1f}",
                    f"{r['bytes_communicated'] / 1e6:,.1f}",
                    f"{r['ddp_bytes_to_reach'] / 1e6:,.0f}",
                    f"{r['bytes_ratio_vs_ddp_at_equal_loss']:.1f}x{bound}",
                    f"{r['train_seconds']:.0f}",
                ]
            )
    table = md_table(
        ["run", "warm-start loss", "final loss", "warm MB", "total MB", "DDP MB to reach", "ratio", "train s"], rows
    )
    ddp = md_table(
        ["baseline", "final loss", "MB", "train s"],
        [
            [n, f"{r['final_eval_loss']:.4f}", f"{r['bytes_communicated'] / 1e6:,.0f}", f"{r['train_seconds']:.0f}"]
            for n, r in results.items()
            if "lr" in r
        ],
    )
    return f"{(__doc__ or '').split(chr(10) + chr(10), 1)[1]}\n{table}\n\n{ddp}\n\n{checks_table(checks)}\n"
