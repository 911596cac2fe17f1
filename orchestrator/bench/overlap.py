"""`overlap`: synchronous DiLoCo (Nesterov) vs CO2 the paper's way — heavy-ball outer
momentum kept stable under the one-round lag by the staleness gap penalty and momentum
clipping, with and without eager updates — on a simulated link on which one exchange
(parameters down + pseudo-gradient up) takes `LINK_FRACTION` of a round of computation,
so the lag has something to hide and slack to hide it in.

Rows: `compute_only` (sync with no link: the time the computation alone takes), `sync`,
`overlap` (CO2 with momentum + penalty + clip), `overlap_eager` (the same with eager
updates); ablations at `overlap_eager`'s best lr say what each part buys (no penalty;
no momentum), and `overlap_default` is `mode=overlap` at the shipped defaults.

Fairness: `sync`, `overlap` and `overlap_eager` sweep the outer lr over the same grid
(`LRS`) on seed 0; each then runs seeds 0–2 at its best lr, and a row's wall time is the
median of those three runs (the work is the same; only the data order differs), and
again over `LONG_ROUNDS` rounds, where the unhidden first and last exchanges weigh less. Every
run continues its seed's warm start. The link is calibrated from the islands' measured
computation per round in `compute_only` (seed 0, `steady_compute_seconds`): bandwidth =
2 · fp32 parameter bytes · 8 / (fraction · those seconds).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.quality_rows import MODEL
from archipelago.orchestrator.bench.report import (
    BenchResult,
    Panel,
    checks_table,
    eval_curve,
    link_applied,
    md_table,
    targets_met,
)
from archipelago.orchestrator.bench.runner import (
    Table,
    continue_warm,
    one_ray,
    real_link,
    run_methods,
    train_warm_start,
)
from archipelago.orchestrator.engine.state.logfiles import read_lines

H = 50
K = 2  # no more islands than this machine's cores: compute is not contended, so wall time means something
WARM = 200
LRS = (0.5, 0.7, 1.0, 1.4)  # the outer-lr grid of every tuned row (as in `hetero`)
SEEDS = (0, 1, 2)
LINK_FRACTION = 0.8  # one exchange takes this fraction of a round's compute
LONG_ROUNDS = 36  # the wall is timed again over this many rounds (see `_overlap`)
MOMENTUM = 0.5  # CO2's beta: the released code's value for 17-64 workers; 0.9 diverged under the lag here
CO2 = [
    "mode=overlap",
    f"mode.momentum={MOMENTUM}",
    "mode.clip=1.0",
    "mode.penalty=adaptive",
    "mode.eager=false",
]
TUNED = {
    "sync": ("synchronous DiLoCo over the slow link (Nesterov, beta 0.9)", ["mode=diloco"]),
    "overlap": (f"CO2: momentum {MOMENTUM}, adaptive gap penalty, clip 1", CO2),
    "overlap_eager": ("CO2 as `overlap`, plus eager updates", [*CO2, "mode.eager=true"]),
}
ABLATIONS = {
    "overlap_eager_no_penalty": (
        "overlap_eager without the gap penalty (Lambda = 1)",
        [*CO2, "mode.eager=true", "mode.penalty=constant", "mode.penalty_p=1"],
    ),
    "overlap_eager_no_momentum": ("overlap_eager with beta 0", [*CO2, "mode.eager=true", "mode.momentum=0"]),
}


def _lr(name: str, lr: float) -> str:
    """The override of a row's outer lr (CO2's alpha lives in its own section)."""
    return f"mode.lr={lr:g}" if name.startswith("overlap") else f"outer.lr={lr:g}"


def _base(rounds: int, warm: Path, seed: int) -> list[str]:
    return [
        f"islands.count={K}",
        f"inner_steps={H}",
        f"rounds={rounds}",
        f"ray.num_cpus={K}",
        f"seed={seed}",
        *continue_warm(WARM, warm),
    ]


def steady_compute_seconds(run_dir: Path) -> float:
    """The islands' own computation per round once a run is under way: the median over
    rounds of the mean over islands of what each computed in that round (the first rounds
    warm up: 2.8, 2.2 s against ≈ 1.1 s after). The link is sized from this, not from a
    whole round, which also holds the coordinator's step and evaluation: sized from the
    round, one exchange took as long as the islands' computation and left the lag no
    slack to hide it in."""
    records = [json.loads(line)["island_compute_seconds"] for line in read_lines(run_dir / "metrics.jsonl")]
    per_round: list[float] = []
    before: dict[str, float] = {}
    for record in records:
        per_round.append(statistics.mean(record[i] - before.get(i, 0.0) for i in record))
        before = record
    return float(statistics.median(per_round))


def bandwidth_for(num_params: int, compute_per_round: float, fraction: float = LINK_FRACTION) -> float:
    """Gbit/s at which one exchange (fp32 parameters down, fp32 pseudo-gradient up) takes
    `fraction` of `compute_per_round` seconds."""
    return 2 * num_params * 4 * 8 / (fraction * compute_per_round * 1e9)


def grid_table(rounds: int, warm: Path, bandwidth_gbps: float) -> Table:
    """Every tuned row at every lr of the grid, seed 0, over the link."""
    return {
        f"{n}@lr{lr:g}": (d, [*_base(rounds, warm, 0), *real_link(bandwidth_gbps), *o, _lr(n, lr)])
        for n, (d, o) in TUNED.items()
        for lr in LRS
    }


def overlap(quick: bool, work: Path) -> BenchResult:
    with one_ray(K):
        return _overlap(quick, work)


def _overlap(quick: bool, work: Path) -> BenchResult:
    rounds = 4 if quick else 12
    seeds = (0,) if quick else SEEDS
    shape = [*MODEL, f"islands.count={K}", f"inner_steps={H}", f"rounds={rounds}", f"ray.num_cpus={K}"]
    warm = {s: train_warm_start(shape, s, WARM, work / f"warm@s{s}") for s in seeds}
    tables: Table = {
        f"compute_only@s{s}": ("synchronous DiLoCo (Nesterov, default lr), no link delay", _base(rounds, warm[s], s))
        for s in seeds
    }
    compute = run_methods(MODEL, tables, work)
    ref = compute["compute_only@s0"]
    compute_per_round = steady_compute_seconds(work / "compute_only@s0")
    bw = bandwidth_for(ref["num_params"], compute_per_round)
    swept = grid_table(rounds, warm[0], bw)
    tables.update(swept)
    grid = run_methods(MODEL, swept, work)

    def loss_at(n: str) -> Callable[[float], float]:
        return lambda lr: float(grid[f"{n}@lr{lr:g}"]["final_eval_loss"])

    best = {n: min(LRS, key=loss_at(n)) for n in TUNED}
    later: Table = {
        f"{n}@lr{best[n]:g}@s{s}": (d, [*_base(rounds, warm[s], s), *real_link(bw), *o, _lr(n, best[n])])
        for n, (d, o) in TUNED.items()
        for s in seeds
        if s
    }
    later.update(
        {
            n: (d, [*_base(rounds, warm[0], 0), *real_link(bw), *o, _lr(n, best["overlap_eager"])])
            for n, (d, o) in ABLATIONS.items()
        }
    )
    later["overlap_default"] = (
        "mode=overlap at the shipped defaults",
        [*_base(rounds, warm[0], 0), *real_link(bw), "mode=overlap"],
    )
    tables.update(later)
    runs = {**compute, **grid, **run_methods(MODEL, later, work)}
    long_rounds = rounds if quick else LONG_ROUNDS
    long_walls, long_loss = _long(long_rounds, seeds, warm, bw, best, work)
    seeded = {"compute_only": [f"compute_only@s{s}" for s in seeds]}
    seeded.update({n: [f"{n}@lr{best[n]:g}" + (f"@s{s}" if s else "") for s in seeds] for n in TUNED})
    singles = {n: [n] for n in [*ABLATIONS, "overlap_default"]}
    compute_only = statistics.median(runs[k]["train_seconds"] for k in seeded["compute_only"])
    results: dict[str, dict[str, Any]] = {}
    for name, keys in {**seeded, **singles}.items():
        s = [runs[k] for k in keys]
        wall = statistics.median(x["train_seconds"] for x in s)
        results[name] = {
            "description": tables[keys[0]][0],
            "overrides": tables[keys[0]][1],
            "outer_lr": best["overlap_eager"] if name in ABLATIONS else best.get(name),  # None: the default
            "wall_seconds": wall,
            "wall_seconds_runs": [x["train_seconds"] for x in s],
            "wall_vs_compute_only": wall / compute_only,
            **(
                {
                    "wall_seconds_long": long_walls[name],
                    "wall_vs_compute_only_long": long_walls[name] / long_walls["compute_only"],
                    "final_eval_loss_long": long_loss[name],
                }
                if name in long_walls
                else {}
            ),
            **_means(s),
        }
    for n in TUNED:
        results[n]["lr_grid"] = {f"{lr:g}": grid[f"{n}@lr{lr:g}"]["final_eval_loss"] for lr in LRS}
    return _report(quick, work, (rounds, long_rounds), results, runs, seeded, bw, compute_per_round)


def _long(
    rounds: int, seeds: tuple[int, ...], warm: dict[int, Path], bw: float, best: dict[str, float], work: Path
) -> tuple[dict[str, float], dict[str, float]]:
    """Each tuned row and the compute alone over `rounds` (`LONG_ROUNDS`): median wall and
    mean final loss over the seeds. The first round (synchronous by design) and the last
    upload are hidden by nothing — about 1.2 rounds' exchange on top of the compute, 10 %
    of a 12-round run — so the lag's hiding is timed again where they weigh less."""
    timed = {"compute_only": ("", []), **{n: (d, [*real_link(bw), *o, _lr(n, best[n])]) for n, (d, o) in TUNED.items()}}
    long = run_methods(
        MODEL,
        {f"{n}@long@s{s}": (d, [*_base(rounds, warm[s], s), *o]) for n, (d, o) in timed.items() for s in seeds},
        work,
    )
    walls = {n: statistics.median(long[f"{n}@long@s{s}"]["train_seconds"] for s in seeds) for n in timed}
    losses = {n: statistics.mean(long[f"{n}@long@s{s}"]["final_eval_loss"] for s in seeds) for n in timed}
    return walls, losses


def _means(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's figures over its seeds' runs."""
    return {
        "compute_seconds": statistics.mean(x["compute_seconds"] for x in runs),
        "idle_fraction": statistics.mean(x["idle_fraction"] for x in runs),
        "final_eval_loss": statistics.mean(x["final_eval_loss"] for x in runs),
        "final_eval_loss_seeds": [x["final_eval_loss"] for x in runs],
        "bytes_sent": runs[0]["bytes_sent"],
    }


def _report(
    quick: bool,
    work: Path,
    lengths: tuple[int, int],
    r: dict[str, dict[str, Any]],
    runs: dict[str, dict[str, Any]],
    seeded: dict[str, list[str]],
    bw: float,
    compute_per_round: float,
) -> BenchResult:
    exchange = LINK_FRACTION * compute_per_round
    sync = r["sync"]["final_eval_loss"]
    checks = {
        f"{n}_loss_le_1.02x_sync": {
            "value": r[n]["final_eval_loss"] / sync,
            "ok": r[n]["final_eval_loss"] <= 1.02 * sync,
        }
        for n in ("overlap", "overlap_eager")
    }
    applied, link = link_applied(r["sync"]["wall_vs_compute_only_long"], LINK_FRACTION)
    checks.update(
        {
            f"{n}_wall_le_1.05x_compute_only_over_{lengths[1]}_rounds": {
                "value": r[n]["wall_vs_compute_only_long"],
                "ok": r[n]["wall_vs_compute_only_long"] <= 1.05 and link["ok"],
            }
            for n in ("overlap", "overlap_eager")
        }
    )
    checks[applied] = link
    line = (
        f"overlap: wall over {lengths[1]} rounds vs compute-only: sync {r['sync']['wall_vs_compute_only_long']:.2f}x, "
        f"overlap {r['overlap']['wall_vs_compute_only_long']:.2f}x, overlap_eager "
        f"{r['overlap_eager']['wall_vs_compute_only_long']:.2f}x; loss sync {sync:.4f} overlap {r['overlap']['final_eval_loss']:.4f} "
        f"overlap_eager {r['overlap_eager']['final_eval_loss']:.4f}; {targets_met(checks)}"
    )
    first = {n: keys[0] for n, keys in seeded.items()}
    first.update({n: n for n in r if n not in seeded})
    plotted = ("compute_only", "sync", "overlap", "overlap_eager", "overlap_default")
    curves_wall = {n: eval_curve(work / first[n], runs[first[n]], "train_seconds") for n in plotted}
    curves_tok = {n: eval_curve(work / first[n], runs[first[n]], "tokens_total") for n in plotted}
    return BenchResult(
        "overlap",
        quick,
        r,
        line,
        _markdown(r, checks, lengths, bw, exchange, compute_per_round, len(seeded["sync"])),
        [Panel("train seconds (wall-clock)", curves_wall), Panel("tokens", curves_tok)],
        extra={
            "checks": checks,
            "link_bandwidth_gbps": bw,
            "exchange_seconds": exchange,
            "compute_seconds_per_round": compute_per_round,
            "sync_wall_vs_compute_plus_exchange": r["sync"]["wall_seconds"]
            / (r["compute_only"]["wall_seconds"] + lengths[0] * exchange),
        },
    )


def _markdown(
    r: dict[str, dict[str, Any]],
    checks: dict[str, dict[str, Any]],
    lengths: tuple[int, int],
    bw: float,
    exchange: float,
    compute: float,
    seeds: int,
) -> str:
    rows = [
        [
            f"`{name}`",
            m["description"],
            "default" if m["outer_lr"] is None else f"{m['outer_lr']:g}",
            f"{m['wall_seconds']:.1f}",
            f"{m['wall_vs_compute_only']:.2f}×",
            f"{m['wall_vs_compute_only_long']:.3f}×" if "wall_vs_compute_only_long" in m else "",
            f"{m['final_eval_loss_long']:.4f}" if "final_eval_loss_long" in m else "",
            f"{m['idle_fraction']:.2f}",
            f"{m['final_eval_loss']:.4f}",
            " / ".join(f"{x:.4f}" for x in m["final_eval_loss_seeds"]),
            f"{m['bytes_sent'] / 1e6:.2f} MB",
        ]
        for name, m in r.items()
    ]
    table = md_table(
        [
            "method",
            "what",
            "outer lr",
            "wall s",
            "vs compute-only",
            f"vs compute-only, {lengths[1]} rounds",
            f"final eval loss, {lengths[1]} rounds",
            "idle",
            "final eval loss",
            "per seed",
            "bytes sent",
        ],
        rows,
    )
    grid = md_table(
        ["method", *(f"lr {lr:g}" for lr in LRS)],
        [[f"`{n}`", *(f"{r[n]['lr_grid'][f'{lr:g}']:.4f}" for lr in LRS)] for n in TUNED],
    )
    return (
        f"{K} islands (no more than this machine's cores), H = {H}, {lengths[0]} rounds after a shared warm start "
        f"({WARM} data-parallel steps) per seed; simulated link {bw * 1000:.2f} Mbit/s, so one exchange "
        f"(params down + pseudo-gradient up, fp32) takes {exchange:.2f}s against {compute:.2f}s, the islands' "
        f"median computation per round in compute-only ({LINK_FRACTION:g}×). Tuned rows: the outer lr is the best of the grid on seed 0, then the mean "
        f"of {seeds} seeds at it; wall is the median of those runs. CO2 rows: the first round synchronous, "
        f"then a one-round lag. That first round's exchange and the last upload are hidden by nothing (≈ 1.2 "
        f"rounds' exchange on top of the compute), so the wall is timed again over {lengths[1]} rounds (the "
        "compute-only and tuned rows, same lrs, medians of the seeds): the targets read that figure.\n\n"
        + table
        + "\n\nOuter-lr grid (seed 0, final eval loss):\n\n"
        + grid
        + "\n\n"
        + checks_table(checks)
        + "\n\nPaper (Sun et al. 2024): scalability ratio 1.06 at 128 GPUs on 80 Gbps TCP/IP with tau = 48; "
        "penalty removal GPT-2 small ppl 7.39 -> 7.56."
    )
