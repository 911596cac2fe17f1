"""`compression`: how few bytes train as well as DiLoCo. The protocol of `streaming` (every
row continues one warm start per seed; 2 islands, H = 100; each row's outer lr tuned on
the same grid on seed 0; the headline rows on 3 seeds), without a simulated link: bytes
are the measure here, not wall time.

Rows: `diloco` (fp32 both ways, Nesterov), `streaming_p4_fp4` (Streaming DiLoCo, 4
fragments, FP4 (E2M1) both ways), `sparse` (the same fragments, SparseLoCo's compression both
ways: top-k 2 % of every 512 values, 2-bit values, error feedback with decay 0.95, the
`sparseloco` outer rule), `sparse_muon` (`sparse` with the Muon inner optimizer) and
`ddp_k` (data-parallel, for its bytes); and ablations of `sparse` (seed 0), one change each,
for where its loss goes. Every row's islands load the warm start from
storage instead of downloading it (`islands.build_version0`), so `bytes_bootstrap` is 0
and `bytes_communicated` counts everything that crossed a link; the ratios at the shipped
default, where each island first downloads the model in fp32, are reported beside them.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.quality_rows import MODEL, widened
from archipelago.orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from archipelago.orchestrator.bench.runner import one_ray
from archipelago.orchestrator.bench.streaming import (
    H,
    K,
    first_downloads,
    shipped_default_ratios,
    warm_runs,
    warm_starts,
)

SEEDS = (0, 1, 2)
HEADLINE = ("diloco", "sparse")
OUTER_LRS = (0.7, 1.0, 1.3)
BASE = [*MODEL, "task.kwargs.n_layers=4", f"ray.num_cpus={K}", "islands.build_version0=true"]
SPARSE_CODEC = "topk:0.02+int2"
LOSS_TARGET = 1.01  # sparse within 1 % of diloco fp32
DDP_RATIO_TARGET = 1000.0
DILOCO_RATIO_TARGET = 50.0


def rows() -> dict[str, tuple[str, list[str]]]:
    """Each row's description and overrides (its outer lr is added by the sweep)."""
    streaming = ["mode=streaming", "mode.fragments=4"]
    sparse = [
        *streaming,
        f"compression.codec={SPARSE_CODEC}",
        f"compression.downlink={SPARSE_CODEC}",
        "compression.error_feedback=true",
        "compression.feedback_decay=0.95",
        "outer.optimizer=sparseloco",
    ]
    return {
        "diloco": ("DiLoCo, fp32 both ways, Nesterov", ["mode=diloco"]),
        "streaming_p4_fp4": (
            "Streaming DiLoCo P=4, FP4 (E2M1) both ways, Nesterov",
            [*streaming, "compression.codec=fp4", "compression.downlink=fp4"],
        ),
        "sparse": (f"P=4, {SPARSE_CODEC} both ways, error feedback 0.95, SparseLoCo outer step", sparse),
        "sparse_muon": ("`sparse` with the Muon inner optimizer", [*sparse, "inner.optimizer=muon"]),
    }


def ablations(best_sparse_lr: float) -> dict[str, tuple[str, list[str]]]:
    """What `sparse` gives up, one change each (seed 0, at `sparse`'s outer lr but for the
    Nesterov row, which takes DiLoCo's grid's usual 0.7)."""
    sparse = rows()["sparse"][1]
    lr = [f"outer.lr={best_sparse_lr}"]
    down = [o for o in sparse if not o.startswith("compression.downlink")]
    return {
        "sparse_fp32_downlink": ("ablation: `sparse` with the new parameters sent whole (fp32 downlink)", [*down, *lr]),
        "sparse_unfragmented": (
            "ablation: `sparse` without fragments (mode diloco)",
            ["mode=diloco", *(o for o in sparse if o.startswith(("compression", "outer"))), *lr],
        ),
        "sparse_topk10": (
            "ablation: `sparse` keeping 10 % instead of 2 %",
            [*(o.replace("topk:0.02", "topk:0.1") for o in sparse), *lr],
        ),
        "sparse_dense_int2": (
            "ablation: `sparse` keeping every value (top-k 100 %: 2-bit values and error feedback only)",
            [*(o.replace("topk:0.02", "topk:1.0") for o in sparse), *lr],
        ),
        "sparse_int8_values": (
            "ablation: `sparse` with its kept values in 8 bits instead of 2",
            [*(o.replace("+int2", "+int8") for o in sparse), *lr],
        ),
        "sparse_no_decay": (
            "ablation: `sparse` with plain error feedback (decay 1)",
            [*(o.replace("feedback_decay=0.95", "feedback_decay=1.0") for o in sparse), *lr],
        ),
        "sparse_h20_40_rounds": (
            "ablation: `sparse` with H = 20 over 40 rounds (the same tokens, 5x the exchanges)",
            [*sparse, *lr, "inner_steps=20", "rounds=40"],
        ),
        "diloco_no_momentum": (
            "ablation: `diloco` (fp32, no compression) stepped as `sparse` is: a plain outer step at its lr",
            ["mode=diloco", "outer.optimizer=sgd", "outer.momentum=0.0", *lr],
        ),
        "sparse_nesterov": (
            "ablation: `sparse`'s codecs with plain error feedback and Nesterov (outer lr 0.7)",
            [
                *(o for o in sparse if not o.startswith(("outer.optimizer", "compression.feedback_decay"))),
                "outer.lr=0.7",
            ],
        ),
    }


def _runs(
    name: str, overrides: list[str], rounds: int, warm: dict[int, Path], seeds: tuple[int, ...], work: Path
) -> list[dict[str, Any]]:
    return warm_runs(BASE, name, name, overrides, rounds, warm, seeds, work)


def _sweep(
    key: str, overrides: list[str], rounds: int, warm: dict[int, Path], work: Path
) -> dict[float, dict[str, Any]]:
    """Seed 0 of `key` at every outer lr of the grid, widened past an edge while the edge is
    the best (+0.3 past the top, halved past the bottom): lr -> its run's summary."""
    at: dict[float, dict[str, Any]] = {}

    def loss_at(lr: float) -> float:
        at[lr] = _runs(f"{key}_lr{lr}", [*overrides, f"outer.lr={lr}"], rounds, warm, (0,), work)[0]
        return float(at[lr]["final_eval_loss"])

    losses = widened(OUTER_LRS, loss_at, lambda lr: round(lr + 0.3, 2), lambda lr: round(lr / 2, 3))
    return {lr: at[lr] for lr in sorted(losses)}


def compression(quick: bool, work: Path) -> BenchResult:
    with one_ray(K):
        return _compression(quick, work)


def _checks(d: dict[str, Any], s: dict[str, Any], k: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`sparse` (`s`) against DiLoCo in fp32 (`d`) and data-parallel (`k`). No check of
    `bytes_bootstrap`: the rows build version 0 on every island, so it is 0 by construction."""
    return {
        "sparse_within_1pct_of_diloco_fp32": {
            "value": s["final_eval_loss"] / d["final_eval_loss"],
            "target": LOSS_TARGET,
            "ok": s["final_eval_loss"] <= LOSS_TARGET * d["final_eval_loss"],
        },
        "sparse_1000x_fewer_bytes_than_ddp_k": {
            "value": k["bytes_communicated"] / s["bytes_communicated"],
            "target": DDP_RATIO_TARGET,
            "ok": k["bytes_communicated"] >= DDP_RATIO_TARGET * s["bytes_communicated"],
        },
        "sparse_50x_fewer_bytes_than_diloco_fp32": {
            "value": d["bytes_communicated"] / s["bytes_communicated"],
            "target": DILOCO_RATIO_TARGET,
            "ok": d["bytes_communicated"] >= DILOCO_RATIO_TARGET * s["bytes_communicated"],
        },
    }


def _compression(quick: bool, work: Path) -> BenchResult:
    rounds = 3 if quick else 8
    seeds = (0,) if quick else SEEDS
    warm = warm_starts(BASE, rounds, seeds, work)
    methods: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    for key, (desc, overrides) in rows().items():
        sweep = _sweep(key, overrides, rounds, warm, work)
        lr = min(sweep, key=lambda v: sweep[v]["final_eval_loss"])
        more = (
            _runs(f"{key}_lr{lr}", [*overrides, f"outer.lr={lr}"], rounds, warm, seeds, work)
            if key in HEADLINE
            else [sweep[lr]]
        )
        methods[key] = _row(desc, more, lr, {str(v): r["final_eval_loss"] for v, r in sweep.items()})
        best = f"{key}_lr{lr}@s{seeds[0]}" if key in HEADLINE else f"{key}_lr{lr}@s0"
        curves[key] = eval_curve(work / best, more[0], "tokens_total")
    for key, (desc, overrides) in ablations(methods["sparse"]["outer_lr"]).items():
        methods[key] = _row(desc, _runs(key, overrides, rounds, warm, (0,), work), None, {})
    ddp = _runs("ddp_k", ["mode=ddp"], rounds, warm, (0,), work)
    methods["ddp_k"] = _row("data-parallel, 2 islands = 2x batch, every step (its bytes)", ddp, None, {})
    curves["ddp_k"] = eval_curve(work / "ddp_k@s0", ddp[0], "tokens_total")
    d, s, k = methods["diloco"], methods["sparse"], methods["ddp_k"]
    checks = _checks(d, s, k)
    m = methods["sparse_muon"]
    summary = (
        f"compression: sparse {s['final_eval_loss']:.4f} vs diloco {d['final_eval_loss']:.4f} "
        f"({100 * (s['final_eval_loss'] / d['final_eval_loss'] - 1):+.2f}%), "
        f"{d['bytes_communicated'] / s['bytes_communicated']:.0f}x fewer bytes than diloco, "
        f"{k['bytes_communicated'] / s['bytes_communicated']:.0f}x fewer than ddp_k; sparse_muon {m['final_eval_loss']:.4f}; "
        f"{targets_met(checks)}"
    )
    return BenchResult(
        scenario="compression",
        quick=quick,
        methods=methods,
        summary=summary,
        markdown=_markdown(methods, checks),
        panels=[Panel(x_label="tokens", curves=curves, zoom_from=0.0)],
        extra={
            "checks": checks,
            "h": H,
            "islands": K,
            "rounds": rounds,
            "seeds": list(seeds),
            # DiLoCo's bytes ÷ each row's with the k fp32 first downloads of the shipped default added
            "bytes_vs_diloco_at_shipped_default": shipped_default_ratios(methods, first_downloads(methods)),
        },
    )


def _row(desc: str, runs: list[dict[str, Any]], lr: float | None, sweep: dict[str, float]) -> dict[str, Any]:
    losses = [r["final_eval_loss"] for r in runs]
    head = runs[0]
    return {
        "description": desc,
        "final_eval_loss": statistics.mean(losses),
        "final_eval_loss_seeds": losses,
        "bytes_communicated": head["bytes_communicated"],
        "bytes_bootstrap": head["bytes_bootstrap"],
        "peak_exchange_bytes": head.get("peak_exchange_bytes"),
        "num_params": head["num_params"],
        "outer_lr": lr,
        "outer_lr_sweep": sweep,
        "wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
    }


def _markdown(methods: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]]) -> str:
    base = methods["diloco"]["bytes_communicated"]
    download = first_downloads(methods)
    table = md_table(
        [
            "row",
            "final eval loss (mean)",
            "seeds",
            "outer lr",
            "bytes (all)",
            "bootstrap",
            "vs diloco fp32 bytes",
            "at the shipped default",
        ],
        [
            [
                f"`{name}`",
                f"{m['final_eval_loss']:.4f}",
                ", ".join(f"{v:.4f}" for v in m["final_eval_loss_seeds"]),
                "-" if m["outer_lr"] is None else f"{m['outer_lr']:g}",
                f"{m['bytes_communicated'] / 1e6:,.2f} MB",
                f"{m['bytes_bootstrap']:,}",
                _versus(base, m["bytes_communicated"]),
                _versus(base + download, m["bytes_communicated"] + download),
            ]
            for name, m in methods.items()
        ],
    )
    return (
        f"2 islands, H = {H}, continuing one warm start per seed; each row's outer lr is the best of "
        f"{list(OUTER_LRS)} on seed 0, widened (+0.3 past the top, halved past the bottom) while an edge is the best "
        "(the sweeps are in the JSON); `diloco` and `sparse` on 3 seeds. "
        "Islands load the warm start from storage and check its hash, so nothing is downloaded at the start. "
        f"At the shipped default (`islands.build_version0: false`) each island first downloads the model in fp32, "
        f"{download / 1e6:.2f} MB in all, the same in every row: the last column counts it, and its share "
        "shrinks as a run gets longer.\n\n"
        f"{table}\n\n{checks_table(checks)}"
    )


def _versus(base: int, nbytes: int) -> str:
    return f"{base / nbytes:,.1f}x fewer" if nbytes <= base else f"{nbytes / base:,.1f}x more"
