"""`quality`: the DiLoCo paper's comparisons, done its way.

The paper forks every method from one checkpoint trained with data-parallel (24k of 88k
steps), tunes the outer step, and compares at equal tokens. Here: per seed, one warm
start (`WARM` data-parallel steps over 4 islands, the product's `warm_start`) is trained
once and every method continues it (`warm_start.path`: its weights, data positions and
learning-rate schedule), then trains `steps` more inner steps per island. Rows:
`single_1x` (1 island, same steps), `single_4x` (1 island, same tokens), `ddp_k`
(data-parallel, 4x batch), `diloco_k4_h{25,50,100}` each at its best outer lr from a
sweep, `fedavg_k4_h50` (outer SGD lr 1 = parameter averaging), outer Adam, non-iid,
50% of pseudo-gradients dropped, and the peer `torchft_diloco_k4_h50` when torchft is
installed. Headline rows run `SEEDS` seeds (mean and spread).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.quality_rows import (
    DEFAULT_LR,
    H_VALUES,
    MODEL,
    SEEDS,
    WARM,
    K,
    Method,
    h_row,
    methods,
    run_row,
    tune_ddp,
    tune_inner,
    tune_outer,
)
from archipelago.orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from archipelago.orchestrator.bench.runner import one_ray, train_warm_start
from archipelago.orchestrator.engine.warm_start import finished_record

log = logging.getLogger(__name__)

PAPER = {  # DiLoCo paper, C4, 150M model, perplexity (lower is better)
    "single_1x": "16.23 (1 worker, 8× fewer tokens)",
    "ddp_k": "15.30 (8× batch)",
    "diloco_k4_h50": "15.02 (k=8, H=500)",
    "diloco_k4_h50_non_iid": "15.18 (k=4, non-iid)",
    "diloco_k4_h50_drop50": "≈ +2% vs no drop",
    "fedavg_k4_h50": "much worse than Nesterov",
    "diloco_k4_h50_outer_adam": "worse than Nesterov",
}


def quality(quick: bool, work: Path) -> BenchResult:
    with one_ray(K):
        return _quality(quick, work)


def _curves(table: list[Method], warm: Path, record: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Seed 0's eval loss against tokens: the shared warm start, then each row after it."""
    curves = {"warm start (ddp)": eval_curve(warm, record, "tokens_total")}
    for m in table:
        assert m.work is not None
        points = eval_curve(m.work / f"{m.key}@s0", m.runs[0], "tokens_total")
        curves[m.key] = [(x + record["tokens"], y) for x, y in points]
    return curves


def _quality(quick: bool, work: Path) -> BenchResult:
    steps = 600 if quick else 1200  # after the fork; divisible by every H, so all methods see the same tokens
    base = [*MODEL, f"islands.count={K}", "inner_steps=50", f"rounds={steps // 50}"]
    warm = {s: train_warm_start(base, s, WARM, work / f"warm@s{s}") for s in SEEDS}
    sweep: dict[int, dict[float, float]] = {}
    lr_sweep: dict[str, dict[float, float]] = {}
    tuned_ddp = tuned_inner = None
    if quick:
        h_rows = {50: h_row(steps, 50, DEFAULT_LR)}
    else:
        sweep, h_rows = tune_outer(steps, warm, work)
        lr_sweep["ddp_k"], tuned_ddp = tune_ddp(steps, warm, work)
        lr_sweep["diloco_k4_h50"], tuned_inner = tune_inner(h_rows[50], warm, work)
    table = methods(steps, quick, h_rows, tuned_ddp, tuned_inner)
    for m in table:
        run_row(m, warm, work)
    results = {m.key: _result(m) for m in table}
    peer = _peer(h_rows[50], warm, work)
    if peer is not None:
        results["torchft_diloco_k4_h50"], ours = peer
        results["diloco_k4_h50"].update(ours)
    ddp = results["ddp_k"]
    for r in results.values():
        r["byte_ratio_to_ddp"] = r["bytes_communicated"] / ddp["bytes_communicated"]
        r["loss_vs_ddp_pct"] = 100 * (r["final_eval_loss"] / ddp["final_eval_loss"] - 1)
        r["perplexity_per_byte"] = math.exp(r["final_eval_loss"])
    record = _warm_record(warm[0])
    curves = _curves(table, warm[0], record)
    checks = _checks(results, quick)
    best = _best(results)
    head = results[best]
    line = (
        f"quality: best DiLoCo {best} {head['final_eval_loss']:.4f} vs ddp {ddp['final_eval_loss']:.4f} "
        f"({head['loss_vs_ddp_pct']:+.2f}%, means of {len(head['final_eval_loss_seeds'])} seeds) with "
        f"{1 / head['byte_ratio_to_ddp']:.0f}x fewer bytes; {targets_met(checks)}"
    )
    return BenchResult(
        "quality",
        quick,
        results,
        line,
        _markdown(results, checks, steps, sweep, lr_sweep),
        [Panel("tokens (warm start included)", curves, zoom_from=record["tokens"])],
        extra={
            "checks": checks,
            "inner_steps_per_island": steps,
            "warm_start": {
                "steps": WARM,
                "mode": "ddp",
                "islands": K,
                "seeds": {s: _warm_record(warm[s]) for s in SEEDS},
            },
            "outer_lr_sweep": {f"h{h}": {str(lr): v for lr, v in sweep[h].items()} for h in sweep},
            # inner AdamW lr, seed 0: data-parallel's, and DiLoCo's at H = 50 (its chosen outer lr)
            "lr_sweep": {key: {f"{lr:g}": v for lr, v in losses.items()} for key, losses in lr_sweep.items()},
            "best_diloco": best,
        },
    )


def _best(r: dict[str, dict[str, Any]]) -> str:
    """The best DiLoCo row (the H rows at their chosen outer lr, and H = 50 at its tuned inner lr)."""
    tuned = [k for k in r if (k.startswith("diloco_k4_h") and k[11:].isdigit()) or k == "diloco_k4_h50_tuned_inner"]
    return min(tuned, key=lambda k: r[k]["final_eval_loss"])


def _warm_record(folder: Path) -> dict[str, Any]:
    record = finished_record(folder)
    if record is None:
        raise FileNotFoundError(f"no finished warm start in {folder}")
    return record


def _result(m: Method) -> dict[str, Any]:
    losses = [m.runs[s]["final_eval_loss"] for s in sorted(m.runs)]
    first = m.runs[min(m.runs)]
    return {
        "description": m.description,
        "overrides": m.overrides,
        "final_eval_loss": statistics.fmean(losses),
        "final_eval_loss_seeds": losses,
        "final_eval_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        **{k: first[k] for k in ("initial_eval_loss", "tokens", "outer_steps", "bytes_communicated", "train_seconds")},
    }


def _peer(h50: Method, warm: dict[int, Path], work: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """torchft's DiLoCo with the H = 50 row's settings, and both tools' overhead over the
    same replicas training alone: (the peer's row, what the H = 50 row adds: its time from
    one more run evaluating only at the end, as the peer does, and its overhead); None,
    logged, when torchft is not installed."""
    try:
        from archipelago.orchestrator.bench.peer import torchft_diloco
    except ImportError as err:
        log.warning("peer row skipped: %s (pip install -e 'orchestrator/bench[peer]')", err)
        return None
    peer = torchft_diloco(MODEL, h50.overrides, K, warm, SEEDS, WARM)
    rounds = next(o for o in h50.overrides if o.startswith("rounds="))
    timed = Method(f"{h50.key}_eval_at_end", h50.description, [*h50.overrides, f"eval_every={rounds[7:]}"])
    run_row(timed, warm, work)
    ours = timed.runs[0]["train_seconds"]
    return peer, {
        "train_seconds_eval_at_end": ours,
        "overhead_vs_islands_alone": ours / peer["islands_alone_seconds"] - 1,
    }


def _checks(r: dict[str, dict[str, Any]], quick: bool) -> dict[str, dict[str, Any]]:
    ddp = r["ddp_k"]
    best = _best(r)
    ratio = r[best]["final_eval_loss"] / ddp["final_eval_loss"]
    fewer = ddp["bytes_communicated"] / r[best]["bytes_communicated"]
    h50, fedavg = r["diloco_k4_h50"], r["fedavg_k4_h50"]
    checks = {
        "best_diloco_le_1.02x_ddp": {"value": ratio, "ok": ratio <= 1.02},
        "best_diloco_le_1.00x_ddp (goal)": {"value": ratio, "ok": ratio <= 1.0},
        "best_diloco_ge_40x_fewer_bytes": {"value": fewer, "ok": fewer >= 40},
        "nesterov_h50_beats_fedavg": {
            "value": fedavg["final_eval_loss"] - h50["final_eval_loss"],
            "ok": h50["final_eval_loss"] < fedavg["final_eval_loss"],
        },
    }
    if not quick:
        losses = [r[f"diloco_k4_h{h}"]["final_eval_loss"] for h in H_VALUES]
        checks["smaller_h_at_least_as_good"] = {
            "value": losses[0] - losses[-1],
            "ok": all(a <= b for a, b in itertools.pairwise(losses)),
        }
    peer = r.get("torchft_diloco_k4_h50")
    if peer is not None:
        gap = 100 * (peer["final_eval_loss"] / h50["final_eval_loss"] - 1)
        checks["torchft_within_1pct_of_ours"] = {"value": gap, "ok": abs(gap) <= 1.0}
        ours, theirs = h50.get("overhead_vs_islands_alone"), peer.get("overhead_vs_islands_alone")
        if ours is not None and theirs is not None:
            checks["our_overhead_le_torchft"] = {"value": ours - theirs, "ok": ours <= theirs}
    return checks


def _grid(rows: dict[str, dict[float, float]], column: str) -> str:
    """A sweep as a table: a row per swept thing, a column per setting any of them tried."""
    settings = sorted({x for losses in rows.values() for x in losses})
    cells = [[name, *(_cell(losses, x) for x in settings)] for name, losses in rows.items()]
    return md_table(["", *(column.format(x) for x in settings)], cells)


def _cell(losses: dict[float, float], x: float) -> str:
    if x not in losses:
        return "–"
    return f"**{losses[x]:.4f}**" if x == min(losses, key=losses.__getitem__) else f"{losses[x]:.4f}"


def _markdown(
    r: dict[str, dict[str, Any]],
    checks: dict[str, dict[str, Any]],
    steps: int,
    sweep: dict[int, dict[float, float]],
    lr_sweep: dict[str, dict[float, float]],
) -> str:
    def loss(m: dict[str, Any]) -> str:
        seeds = m["final_eval_loss_seeds"]
        return f"{m['final_eval_loss']:.4f}" + (
            f" ± {m['final_eval_loss_std']:.4f} ({len(seeds)})" if len(seeds) > 1 else ""
        )

    rows = [
        [
            f"`{name}`",
            m["description"],
            loss(m),
            f"{m['loss_vs_ddp_pct']:+.2f}%",
            f"{m['bytes_communicated'] / 1e6:,.1f} MB",
            f"{1 / m['byte_ratio_to_ddp']:,.1f}×",
            str(m["outer_steps"]),
            f"{m['train_seconds']:.0f}",
            PAPER.get(name, ""),
        ]
        for name, m in r.items()
    ]
    header = [
        "method",
        "what",
        "final eval loss (mean ± sd, seeds)",
        "vs ddp",
        "bytes exchanged",
        "ddp bytes / bytes",
        "outer steps",
        "train s",
        "paper (C4 150M, ppl)",
    ]
    text = (
        f"Default task (stdlib bytes), GPT d=64, 2 layers, context 64, batch 16 per island, 64 eval batches. "
        f"Per seed one warm start ({WARM} data-parallel steps, 4 islands) continued by every method for "
        f"{steps} more inner steps per island ({max(m['tokens'] for m in r.values()):,} tokens for the 4-island rows); "
        f"eval loss in nats per byte.\n\n" + md_table(header, rows)
    )
    if sweep:
        text += "\n\nOuter Nesterov lr sweep (momentum 0.9, seed 0; bold: chosen; a grid is widened past its top while "
        text += "the top is the best):\n\n" + _grid({f"H = {h}": sweep[h] for h in sorted(sweep)}, "lr {:g}")
    if lr_sweep:
        text += "\n\nInner AdamW lr sweep (seed 0; bold: chosen; DiLoCo at H = 50 and its chosen outer lr):\n\n"
        text += _grid({f"`{key}`": losses for key, losses in lr_sweep.items()}, "lr {:g}")
    peer = r.get("torchft_diloco_k4_h50")
    if peer is not None:
        ours = r["diloco_k4_h50"]
        text += (
            f"\n\nPeer, same run: torchft's DiLoCo with the `diloco_k4_h50` settings, warm starts and batches. "
            f"Wall-clock over the lower bound of both ({peer['islands_alone_seconds']:.1f} s: one replica alone on "
            f"the machine with no exchange, {peer['one_replica_alone_seconds']:.1f} s, times the share of the cores "
            f"{K} replicas need): torchft {100 * peer['overhead_vs_islands_alone']:+.1f}%, Archipelago "
            f"{100 * ours['overhead_vs_islands_alone']:+.1f}% ({ours['train_seconds_eval_at_end']:.1f} s, one run "
            f"evaluating only at the end). torchft's bytes are a ring all-reduce's, 2(k-1)/k of the pseudo-gradient "
            f"per replica each way; Archipelago's are measured."
        )
    return text + "\n\n" + checks_table(checks)
