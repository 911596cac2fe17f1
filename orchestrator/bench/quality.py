"""`quality`: the DiLoCo paper's comparisons at small scale, same seed and token budget.

Every method trains the same model on the same data for the same number of tokens:
4 islands × S inner steps × batch (a single island takes 4·S steps). Keys: `single`,
`ddp_k` (data-parallel, 4× batch, one optimizer), `diloco_k4_h{10,50,200}`, outer-optimizer
ablation `diloco_k4_h50_outer_sgd` (plain averaging) and `..._outer_adam`, `..._non_iid`,
and `..._drop50` (each pseudo-gradient dropped with probability 0.5).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from orchestrator.bench.runner import run_methods

K = 4
MODEL = [
    "task.kwargs.d_model=64",
    "task.kwargs.n_layers=2",
    "task.kwargs.n_heads=2",
    "task.kwargs.context=64",
    "task.kwargs.batch_size=16",
    "task.kwargs.eval_batches=16",
    "inner.warmup_steps=40",
    "seed=0",
    f"ray.num_cpus={K}",
]
HEADLINE = "diloco_k4_h50"
PAPER = {  # DiLoCo paper, C4, 150M model, perplexity (lower is better)
    "single": "16.23 (1 worker, 8× fewer tokens)",
    "ddp_k": "15.30 (8× batch)",
    "diloco_k4_h50": "15.02 (k=8, H=500)",
    "diloco_k4_h50_non_iid": "15.18 (k=4, non-iid)",
    "diloco_k4_h50_drop50": "≈ +2% vs no drop",
    "diloco_k4_h50_outer_sgd": "much worse than Nesterov",
    "diloco_k4_h50_outer_adam": "much worse than Nesterov",
}


def methods(steps: int) -> dict[str, tuple[str, list[str]]]:
    """name -> (description, overrides). `steps` = inner steps per island."""

    def diloco(h: int, *extra: str) -> list[str]:
        return [
            f"islands.count={K}",
            f"inner_steps={h}",
            f"rounds={steps // h}",
            f"eval_every={max(1, 50 // h)}",
            *extra,
        ]

    return {
        "single": (
            "1 island, same tokens (4x the steps)",
            [
                "islands.count=1",
                "inner_steps=50",
                f"rounds={K * steps // 50}",
                f"eval_every={K}",
                "outer.optimizer=sgd",
                "outer.lr=1.0",
                "outer.momentum=0.0",
            ],
        ),
        "ddp_k": (
            "data-parallel, 4 islands = 4x batch, AdamW every step",
            ["mode=ddp", f"islands.count={K}", "inner_steps=50", f"rounds={steps // 50}"],
        ),
        "diloco_k4_h10": ("DiLoCo k=4 H=10", diloco(10)),
        HEADLINE: ("DiLoCo k=4 H=50 (Nesterov 0.7/0.9)", diloco(50)),
        "diloco_k4_h200": ("DiLoCo k=4 H=200", diloco(200)),
        "diloco_k4_h50_outer_sgd": (
            "outer SGD lr 1 = plain averaging",
            diloco(50, "outer.optimizer=sgd", "outer.lr=1.0", "outer.momentum=0.0"),
        ),
        "diloco_k4_h50_outer_adam": ("outer Adam lr 0.05", diloco(50, "outer.optimizer=adam", "outer.lr=0.05")),
        "diloco_k4_h50_non_iid": ("non-iid islands (different packages)", diloco(50, "task.kwargs.split=non_iid")),
        "diloco_k4_h50_drop50": ("50% of pseudo-gradients dropped", diloco(50, "outer.drop_prob=0.5")),
    }


def quality(quick: bool, work: Path) -> BenchResult:
    steps = 200 if quick else 1600  # divisible by every H, so all methods see the same tokens
    table = methods(steps)
    summaries = run_methods(MODEL, table, work)
    results: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    for name, (desc, overrides) in table.items():
        summary = summaries[name]
        curves[name] = eval_curve(work / name, summary, "tokens_total")
        results[name] = {
            "description": desc,
            "overrides": overrides,
            **{
                k: summary[k]
                for k in (
                    "initial_eval_loss",
                    "final_eval_loss",
                    "tokens",
                    "outer_steps",
                    "bytes_communicated",
                    "wall_seconds",
                    "train_seconds",
                )
            },
        }
    ddp = results["ddp_k"]
    for r in results.values():
        r["byte_ratio_to_ddp"] = r["bytes_communicated"] / ddp["bytes_communicated"]
        r["loss_vs_ddp_pct"] = 100 * (r["final_eval_loss"] / ddp["final_eval_loss"] - 1)
        r["perplexity_per_byte"] = math.exp(r["final_eval_loss"])
    checks = _checks(results)
    head = results[HEADLINE]
    summary_line = (
        f"quality: {HEADLINE} eval loss {head['final_eval_loss']:.4f} vs ddp {ddp['final_eval_loss']:.4f} "
        f"({head['loss_vs_ddp_pct']:+.1f}%) with {1 / head['byte_ratio_to_ddp']:.0f}x fewer bytes; "
        f"{targets_met(checks)}"
    )
    return BenchResult(
        "quality",
        quick,
        results,
        summary_line,
        _markdown(results, checks, steps),
        [Panel("tokens", curves)],
        extra={"checks": checks, "inner_steps_per_island": steps},
    )


def _checks(r: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    h50, ddp = r[HEADLINE], r["ddp_k"]
    fewer = ddp["bytes_communicated"] / h50["bytes_communicated"]
    return {
        "h50_within_2pct_of_ddp": {"value": h50["loss_vs_ddp_pct"], "ok": h50["loss_vs_ddp_pct"] <= 2.0},
        "h50_at_least_40x_fewer_bytes": {"value": fewer, "ok": fewer >= 40},
        "nesterov_beats_plain_averaging": {
            "value": r["diloco_k4_h50_outer_sgd"]["final_eval_loss"] - h50["final_eval_loss"],
            "ok": h50["final_eval_loss"] < r["diloco_k4_h50_outer_sgd"]["final_eval_loss"],
        },
        "nesterov_beats_adam": {
            "value": r["diloco_k4_h50_outer_adam"]["final_eval_loss"] - h50["final_eval_loss"],
            "ok": h50["final_eval_loss"] < r["diloco_k4_h50_outer_adam"]["final_eval_loss"],
        },
        "non_iid_costs_under_5pct": {
            "value": 100 * (r["diloco_k4_h50_non_iid"]["final_eval_loss"] / h50["final_eval_loss"] - 1),
            "ok": r["diloco_k4_h50_non_iid"]["final_eval_loss"] <= 1.05 * h50["final_eval_loss"],
        },
        "drop50_costs_under_5pct": {
            "value": 100 * (r["diloco_k4_h50_drop50"]["final_eval_loss"] / h50["final_eval_loss"] - 1),
            "ok": r["diloco_k4_h50_drop50"]["final_eval_loss"] <= 1.05 * h50["final_eval_loss"],
        },
    }


def _markdown(r: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]], steps: int) -> str:
    rows = [
        [
            f"`{name}`",
            m["description"],
            f"{m['final_eval_loss']:.4f}",
            f"{m['loss_vs_ddp_pct']:+.1f}%",
            f"{m['bytes_communicated'] / 1e6:,.1f} MB",
            f"{1 / m['byte_ratio_to_ddp']:,.1f}×",
            str(m["outer_steps"]),
            f"{m['train_seconds']:.0f}",
            PAPER.get(name, ""),
        ]
        for name, m in r.items()
    ]
    table = md_table(
        [
            "method",
            "what",
            "final eval loss",
            "vs ddp",
            "bytes exchanged",
            "ddp bytes / bytes",
            "outer steps",
            "train s",
            "paper (C4 150M, ppl)",
        ],
        rows,
    )
    tokens = next(iter(r.values()))["tokens"]
    return (
        f"Default task (stdlib bytes), GPT d=64, 2 layers, context 64, batch 16 per island; "
        f"{steps} inner steps per island, {tokens:,} tokens for every method; eval loss in nats per byte.\n\n"
        + table
        + "\n\n"
        + checks_table(checks)
    )
