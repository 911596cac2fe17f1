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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from orchestrator.bench.runner import one_ray, run_methods, train_warm_start
from orchestrator.engine.warm_start import finished_record

log = logging.getLogger(__name__)

K = 4
WARM = 400  # data-parallel steps shared by every method (a quarter of the full run, like the paper's 24k of 88k)
SEEDS = (0, 1, 2)
H_VALUES = (25, 50, 100)
OUTER_LRS = (0.3, 0.5, 0.7, 1.0)
# data-parallel's tuning: its (inner) AdamW lr, as many settings as DiLoCo's outer lr per H,
# around the shipped 3e-3 (its 4x batch may want more)
DDP_LRS = (1.5e-3, 3e-3, 6e-3, 1.2e-2)
MODEL = [
    "task.kwargs.d_model=64",
    "task.kwargs.n_layers=2",
    "task.kwargs.n_heads=2",
    "task.kwargs.context=64",
    "task.kwargs.batch_size=16",
    "task.kwargs.eval_batches=64",
    "inner.warmup_steps=40",
    "data_shards=16",  # the same shards for 1 and 4 islands, so every method continues one warm start
    f"ray.num_cpus={K}",
]
PAPER = {  # DiLoCo paper, C4, 150M model, perplexity (lower is better)
    "single_1x": "16.23 (1 worker, 8× fewer tokens)",
    "ddp_k": "15.30 (8× batch)",
    "diloco_k4_h50": "15.02 (k=8, H=500)",
    "diloco_k4_h50_non_iid": "15.18 (k=4, non-iid)",
    "diloco_k4_h50_drop50": "≈ +2% vs no drop",
    "fedavg_k4_h50": "much worse than Nesterov",
    "diloco_k4_h50_outer_adam": "worse than Nesterov",
}


DEFAULT_LR = 0.7  # quick runs skip the sweep and use the product's default for this regime


@dataclass
class Method:
    key: str
    description: str
    overrides: list[str]
    seeds: tuple[int, ...] = (0,)
    outer_lr: float | None = None  # the DiLoCo rows' Nesterov lr
    work: Path | None = None  # where its runs are (set by `_run`)
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)  # seed -> summary


def diloco(steps: int, h: int, *extra: str) -> list[str]:
    return [f"islands.count={K}", f"inner_steps={h}", f"rounds={steps // h}", f"eval_every={max(1, 100 // h)}", *extra]


def nesterov(lr: float) -> list[str]:
    return ["outer.optimizer=nesterov", f"outer.lr={lr}", "outer.momentum=0.9"]


FEDAVG = ["outer.optimizer=sgd", "outer.lr=1.0", "outer.momentum=0.0"]


def h_row(steps: int, h: int, lr: float) -> Method:
    return Method(
        f"diloco_k4_h{h}", f"DiLoCo k=4 H={h}, Nesterov lr {lr} / 0.9", diloco(steps, h, *nesterov(lr)), SEEDS, lr
    )


def ddp_row(steps: int, lr: float | None) -> Method:
    """Data-parallel at AdamW lr `lr` (None: the shipped one)."""
    ddp = ["mode=ddp", f"islands.count={K}", "inner_steps=50", f"rounds={steps // 50}"]
    tuned = [f"inner.lr={lr}"] if lr is not None else []
    what = f"AdamW lr {lr:g} every step" if lr is not None else "AdamW every step"
    return Method("ddp_k", f"data-parallel, 4 islands = 4x batch, {what}", [*ddp, *tuned], SEEDS)


def methods(steps: int, quick: bool, h_rows: dict[int, Method], ddp: Method | None = None) -> list[Method]:
    """The rows; `h_rows` (H -> row) are the DiLoCo rows at their chosen outer lr, `ddp`
    data-parallel at its chosen lr (default: the shipped one). A full run adds the H = 50
    row at the shipped outer lr when the sweep chose another: the figure a user gets."""
    single = ["islands.count=1", "inner_steps=50", "eval_every=2", *FEDAVG]
    rows = [
        ddp or ddp_row(steps, None),
        *h_rows.values(),
        Method("fedavg_k4_h50", "outer SGD lr 1 = parameter averaging", diloco(steps, 50, *FEDAVG), SEEDS),
    ]
    if quick:
        return rows
    lr50 = h_rows[50].outer_lr
    assert lr50 is not None
    best50 = diloco(steps, 50, *nesterov(lr50))  # the H = 50 row's outer settings
    if lr50 != DEFAULT_LR:
        shipped = h_row(steps, 50, DEFAULT_LR)
        rows.append(
            Method(
                f"{shipped.key}_default",
                f"{shipped.description} (the shipped default)",
                shipped.overrides,
                SEEDS,
                DEFAULT_LR,
            )
        )
    return [
        Method("single_1x", "1 island, same inner steps (1/4 the tokens)", [*single, f"rounds={steps // 50}"]),
        Method("single_4x", "1 island, same tokens (4x the steps)", [*single, f"rounds={K * steps // 50}"]),
        *rows,
        Method(
            "diloco_k4_h50_outer_adam", "outer Adam lr 0.01", diloco(steps, 50, "outer.optimizer=adam", "outer.lr=0.01")
        ),
        Method(
            "diloco_k4_h50_non_iid",
            "non-iid islands (different packages; own warm start on that split)",
            [*best50, NON_IID],
        ),
        Method("diloco_k4_h50_drop50", "50% of pseudo-gradients dropped", [*best50, "outer.drop_prob=0.5"]),
    ]


NON_IID = "task.kwargs.split=non_iid"


def _run(m: Method, warm: dict[int, Path], work: Path, seeds: tuple[int, ...] | None = None) -> None:
    """The seeds of `m` not run yet, each continuing its seed's warm start (a non-iid row
    its own, trained on its split: a warm start is continued only by runs of its task)."""
    m.work = m.work or work
    if NON_IID in m.overrides:
        base = [*MODEL, NON_IID, f"islands.count={K}", "inner_steps=50", f"rounds={_rounds(m)}"]
        warm = {s: train_warm_start(base, s, WARM, work / f"warm_non_iid@s{s}") for s in seeds or m.seeds}
    table = {
        f"{m.key}@s{s}": (
            m.description,
            [*m.overrides, f"seed={s}", f"warm_start.steps={WARM}", f"warm_start.path={warm[s]}"],
        )
        for s in seeds or m.seeds
        if s not in m.runs
    }
    for name, summary in run_methods(MODEL, table, m.work).items():
        m.runs[int(name.rsplit("@s", 1)[1])] = summary
    m.runs = dict(sorted(m.runs.items()))


def _rounds(m: Method) -> int:
    """The rounds of a 4-island row at H = 50 (its warm start's schedule ends with them)."""
    return int(next(o for o in m.overrides if o.startswith("rounds="))[len("rounds=") :])


def _ddp_sweep(steps: int, warm: dict[int, Path], work: Path) -> tuple[dict[float, float], Method]:
    """Seed 0 of data-parallel at every lr of `DDP_LRS`; its row is the best lr's."""
    tried = {lr: ddp_row(steps, lr) for lr in DDP_LRS}
    for lr, m in tried.items():
        _run(m, warm, work / "sweep" / f"ddp_lr{lr:g}", seeds=(0,))
    losses = {lr: m.runs[0]["final_eval_loss"] for lr, m in tried.items()}
    return losses, tried[min(losses, key=losses.__getitem__)]


def _sweep(steps: int, warm: dict[int, Path], work: Path) -> tuple[dict[int, dict[float, float]], dict[int, Method]]:
    """Seed 0 of every H at every outer lr; the row of each H is its best lr's."""
    sweep: dict[int, dict[float, float]] = {}
    chosen: dict[int, Method] = {}
    for h in H_VALUES:
        tried = {lr: h_row(steps, h, lr) for lr in OUTER_LRS}
        for lr, m in tried.items():
            _run(m, warm, work / "sweep" / f"lr{lr}", seeds=(0,))
        sweep[h] = {lr: m.runs[0]["final_eval_loss"] for lr, m in tried.items()}
        chosen[h] = tried[min(sweep[h], key=sweep[h].__getitem__)]
    return sweep, chosen


def quality(quick: bool, work: Path) -> BenchResult:
    with one_ray(K):
        return _quality(quick, work)


def _quality(quick: bool, work: Path) -> BenchResult:
    steps = 600 if quick else 1200  # after the fork; divisible by every H, so all methods see the same tokens
    base = [*MODEL, f"islands.count={K}", "inner_steps=50", f"rounds={steps // 50}"]
    warm = {s: train_warm_start(base, s, WARM, work / f"warm@s{s}") for s in SEEDS}
    sweep: dict[int, dict[float, float]] = {}
    ddp_sweep: dict[float, float] = {}
    tuned_ddp: Method | None = None
    if quick:
        h_rows = {50: h_row(steps, 50, DEFAULT_LR)}
    else:
        sweep, h_rows = _sweep(steps, warm, work)
        ddp_sweep, tuned_ddp = _ddp_sweep(steps, warm, work)
    table = methods(steps, quick, h_rows, tuned_ddp)
    for m in table:
        _run(m, warm, work)
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
    curves = {"warm start (ddp)": eval_curve(warm[0], record, "tokens_total")}
    for m in table:
        assert m.work is not None
        points = eval_curve(m.work / f"{m.key}@s0", m.runs[0], "tokens_total")
        curves[m.key] = [(x + record["tokens"], y) for x, y in points]
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
        _markdown(results, checks, steps, sweep, {h: m.outer_lr for h, m in h_rows.items()}, ddp_sweep),
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
            "lr_sweep": {"ddp_k": {f"{lr:g}": v for lr, v in ddp_sweep.items()}},  # its AdamW lr, seed 0
            "best_diloco": best,
        },
    )


def _best(r: dict[str, dict[str, Any]]) -> str:
    """The best DiLoCo row (the H rows at their chosen outer lr)."""
    return min(
        (k for k in r if k.startswith("diloco_k4_h") and k[11:].isdigit()), key=lambda k: r[k]["final_eval_loss"]
    )


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
        from orchestrator.bench.peer import torchft_diloco
    except ImportError as err:
        log.warning("peer row skipped: %s (pip install -e '.[peer]')", err)
        return None
    peer = torchft_diloco(MODEL, h50.overrides, K, warm, SEEDS, WARM)
    rounds = next(o for o in h50.overrides if o.startswith("rounds="))
    timed = Method(f"{h50.key}_eval_at_end", h50.description, [*h50.overrides, f"eval_every={rounds[7:]}"])
    _run(timed, warm, work)
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


def _markdown(
    r: dict[str, dict[str, Any]],
    checks: dict[str, dict[str, Any]],
    steps: int,
    sweep: dict[int, dict[float, float]],
    best_lr: dict[int, float | None],
    ddp_sweep: dict[float, float],
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
        f"{steps} more inner steps per island ({next(iter(r.values()))['tokens']:,} tokens for the 4-island rows); "
        f"eval loss in nats per byte.\n\n" + md_table(header, rows)
    )
    if sweep:
        lrs = sorted(next(iter(sweep.values())))
        sweep_rows = [
            [f"H = {h}", *(f"**{sweep[h][lr]:.4f}**" if lr == best_lr[h] else f"{sweep[h][lr]:.4f}" for lr in lrs)]
            for h in sorted(sweep)
        ]
        text += "\n\nOuter Nesterov lr sweep (momentum 0.9, seed 0; bold: chosen):\n\n" + md_table(
            ["", *(f"lr {lr}" for lr in lrs)], sweep_rows
        )
    if ddp_sweep:
        chosen = min(ddp_sweep, key=ddp_sweep.__getitem__)
        text += "\n\nData-parallel AdamW lr sweep (seed 0; bold: chosen):\n\n" + md_table(
            [f"lr {lr:g}" for lr in ddp_sweep],
            [[f"**{v:.4f}**" if lr == chosen else f"{v:.4f}" for lr, v in ddp_sweep.items()]],
        )
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
