"""`hetero`: islands of different speeds on a virtual clock — does asynchrony win time?

Two fleets of 4 islands: speeds 1, 1, ½, ¼ (`mild`) and 1, ½, ¼, ⅛ (`harsh`). Each island's
inner step advances simulated time by `STEP_S` / speed; the runs use the in-process island
pool (the real engine, policies and island code; the islands take turns in this process
and the clock is simulated, so the speeds are exactly the ones asked for). Every method
continues one warm start per seed and trains the same token budget:

- `sync`: synchronous DiLoCo, every round waits for the slowest island;
- `sync_dylu`: a barrier round whose H per island follows its speed (`mode.dylu`);
- `naive_async`: Nesterov stepped on every arrival, fixed H, outer lr ÷ k;
- `dn_dylu`: Delayed Nesterov (N = k) with Dynamic Local Updates (Liu et al. 2024);
- `quorum`: the quorum rule — a step once half the islands are in and the adaptive grace
  window has passed, token-weighted, stale results discounted by (1 + age)^−1;
- `streaming_quorum`: the same rule per fragment (2 fragments, one per layer).

Fairness: every method's outer lr is tuned on the same grid (`LRS`, ×1/k for naive) on
seed 0 of the mild fleet; the headline rows then run 3 seeds at their best lr and at the
shipped default (0.7). Reported: loss against simulated time and against tokens, the
simulated time to reach sync's final loss, and (`equal_time`) each method's loss when it
runs for as much simulated time as sync needed.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.quality_rows import MODEL
from archipelago.orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from archipelago.orchestrator.bench.runner import Table, continue_warm, run_methods, train_warm_start

K = 4
FLEETS = {"mild": [1, 1, 0.5, 0.25], "harsh": [1, 0.5, 0.25, 0.125]}
H = 50
STEP_S = 0.1  # simulated seconds per inner step of a speed-1 island
WARM = 200
DEFAULT_LR = 0.7
LRS = (0.5, 0.7, 1.0, 1.4)
SEEDS = (0, 1, 2)
ROWS = {
    "sync": ("synchronous DiLoCo (Nesterov, β 0.9)", ["mode=diloco"]),
    "sync_dylu": ("barrier round, H per island from its speed", ["mode=diloco", "mode.dylu=true"]),
    "naive_async": (
        "Nesterov on every arrival, fixed H, lr ÷ k",
        ["mode=async", "mode.rule=naive", "mode.dylu=false"],
    ),
    "dn_dylu": (
        "Delayed Nesterov N = k + Dynamic Local Updates",
        ["mode=async", "mode.rule=delayed_nesterov", "mode.dylu=true"],
    ),
    "quorum": (
        "quorum ⌈k/2⌉ + adaptive grace, token- and age-weighted, DyLU",
        ["mode=async", "mode.rule=quorum"],
    ),
    "streaming_quorum": (
        "the quorum rule per fragment: Streaming DiLoCo, P = 2, on the quorum (Decoupled DiLoCo's pacing)",
        ["mode=streaming", "mode.fragments=2", "mode.pacing=quorum"],
    ),
}


# ablations of the async rules, each at its row's best lr (seed 0, mild fleet): what each part buys
ABLATIONS = {
    "quorum_fixed_h": ("quorum without DyLU: fixed H, slow islands merge late", "quorum", ["mode.dylu=false"]),
    "quorum_fixed_h_no_age": (
        "quorum, fixed H, stale results at full token weight (α = 0)",
        "quorum",
        ["mode.dylu=false", "mode.age_power=0"],
    ),
    "quorum_fixed_h_sqrt_age": (
        "quorum, fixed H, α = ½",
        "quorum",
        ["mode.dylu=false", "mode.age_power=0.5"],
    ),
    "dn_dylu_equal_weights": (
        "Delayed Nesterov + DyLU, arrivals weighed equally (the paper's)",
        "dn_dylu",
        ["mode.token_weighted=false"],
    ),
}


def row(name: str, lr: float, seed: int, rounds: int, fleet: str, warm: Path | None) -> list[str]:
    """The overrides of one run of method `name` (a row or an ablation)."""
    slowdown = ",".join(f"{1 / v:g}" for v in FLEETS[fleet])
    scaled = lr / K if name == "naive_async" else lr
    extra = ROWS[name][1] if name in ROWS else [*ROWS[ABLATIONS[name][1]][1], *ABLATIONS[name][2]]
    out = [
        f"islands.count={K}",
        f"simulation.slowdown=[{slowdown}]",
        f"simulation.virtual_step_s={STEP_S}",
        f"inner_steps={H}",
        f"rounds={rounds}",
        f"seed={seed}",
        *extra,
        f"outer.lr={scaled:g}",
    ]
    return out + (continue_warm(WARM, warm) if warm is not None else [])


def methods(rounds: int, warm: Path | None = None, lr: float = DEFAULT_LR) -> Table:
    """Every method on the mild fleet at one lr and seed 0 (the table the tests check)."""
    return {name: (desc, row(name, lr, 0, rounds, "mild", warm)) for name, (desc, _) in ROWS.items()}


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
    lrs, seeds = ((DEFAULT_LR,), (0,)) if quick else (LRS, SEEDS)
    base = [*MODEL, f"islands.count={K}", f"inner_steps={H}", f"rounds={rounds}", f"simulation.virtual_step_s={STEP_S}"]
    warm = {s: train_warm_start(base, s, WARM, work / f"warm@s{s}", in_process=True) for s in seeds}

    def run(table: Table) -> dict[str, dict[str, Any]]:
        return run_methods(MODEL, table, work, in_process=True)

    # 1. the lr grid, every method, seed 0, mild fleet
    grid = run(
        {f"{n}@lr{lr:g}": (d, row(n, lr, 0, rounds, "mild", warm[0])) for n, (d, _) in ROWS.items() for lr in lrs}
    )
    best = {n: min(lrs, key=lambda lr, n=n: grid[f"{n}@lr{lr:g}"]["final_eval_loss"]) for n in ROWS}
    # 2. every method at its best lr over the seeds (at the default lr: seed 0, in the grid)
    others = {
        f"{n}@lr{best[n]:g}@s{s}": (d, row(n, best[n], s, rounds, "mild", warm[s]))
        for n, (d, _) in ROWS.items()
        for s in seeds
        if s
    }
    seeded = {**{f"{n}@lr{best[n]:g}@s0": grid[f"{n}@lr{best[n]:g}"] for n in ROWS}, **(run(others) if others else {})}
    # 3. the harsh fleet at each method's best lr, seed 0
    harsh = run({f"{n}@harsh": (d, row(n, best[n], 0, rounds, "harsh", warm[0])) for n, (d, _) in ROWS.items()})
    # 4. equal simulated time: each method given the simulated seconds sync took
    sync_s = grid[f"sync@lr{best['sync']:g}"]["clock_seconds"]
    stretch = {
        n: max(rounds, round(rounds * sync_s / grid[f"{n}@lr{best[n]:g}"]["clock_seconds"]))
        for n in ROWS
        if n != "sync"
    }
    equal = (
        {}
        if quick
        else run(
            {
                f"{n}@time": (d, row(n, best[n], 0, stretch[n], "mild", warm[0]))
                for n, (d, _) in ROWS.items()
                if n != "sync"
            }
        )
    )
    ablations = (
        {}
        if quick
        else run({n: (d, row(n, best[of], 0, rounds, "mild", warm[0])) for n, (d, of, _) in ABLATIONS.items()})
    )
    runs = Runs(
        rounds=rounds,
        seeds=seeds,
        lrs=lrs,
        grid=grid,
        best=best,
        seeded=seeded,
        harsh=harsh,
        equal=equal,
        ablations=ablations,
    )
    return _report(quick, work, runs)


def _stats(summaries: list[dict[str, Any]]) -> tuple[float, list[float]]:
    losses = [s["final_eval_loss"] for s in summaries]
    return statistics.mean(losses), losses


@dataclass(frozen=True, kw_only=True)
class Runs:
    """Every run of `bench hetero`, by phase (each a name -> summary map)."""

    rounds: int
    seeds: tuple[int, ...]
    lrs: tuple[float, ...]
    grid: dict[str, dict[str, Any]]  # `<row>@lr<lr>`: the lr grid, seed 0, mild fleet
    best: dict[str, float]  # row -> its best lr in the grid
    seeded: dict[str, dict[str, Any]]  # `<row>@lr<best>@s<seed>`: every seed at the best lr
    harsh: dict[str, dict[str, Any]]  # `<row>@harsh`: the harsh fleet, seed 0
    equal: dict[str, dict[str, Any]]  # `<row>@time`: given sync's simulated seconds (not quick)
    ablations: dict[str, dict[str, Any]]

    def of(self, n: str) -> list[dict[str, Any]]:
        """Row `n`'s runs at its best lr, one per seed."""
        return [self.seeded[f"{n}@lr{self.best[n]:g}@s{s}"] for s in self.seeds]


def _result(n: str, runs: Runs, work: Path, sync_final: float) -> dict[str, Any]:
    """Row `n`'s figures: its lr grid, its seeds' losses, when it reaches sync's final loss
    (at equal tokens per seed; at sync's simulated time when that run exists), the harsh
    fleet."""
    grid, best, equal = runs.grid, runs.best, runs.equal
    s0 = grid[f"{n}@lr{best[n]:g}"]
    mean, losses = _stats(runs.of(n))
    reach = [
        # seed 0 ran in the lr grid: its outputs are under the grid run's name
        time_to_reach(eval_curve(work / key.removesuffix("@s0"), runs.seeded[key], "clock_seconds"), sync_final)
        for key in (f"{n}@lr{best[n]:g}@s{s}" for s in runs.seeds)
    ]
    timed = equal.get(f"{n}@time")
    return {
        "description": ROWS[n][0],
        "overrides": ROWS[n][1],
        "best_outer_lr": best[n],
        "lr_grid": {f"{lr:g}": grid[f"{n}@lr{lr:g}"]["final_eval_loss"] for lr in runs.lrs},
        "final_eval_loss": mean,
        "final_eval_loss_seeds": losses,
        "final_eval_loss_default_lr_seed0": grid[f"{n}@lr{DEFAULT_LR:g}"]["final_eval_loss"]
        if DEFAULT_LR in runs.lrs
        else None,
        "sim_seconds": s0["clock_seconds"],
        # on the run given sync's simulated time (a run of sync's tokens may end before sync's loss)
        "sim_seconds_to_sync_final_loss": time_to_reach(
            eval_curve(work / f"{n}@time", timed, "clock_seconds"), sync_final
        )
        if timed is not None
        else (None if None in reach else statistics.mean(r for r in reach if r is not None)),
        "sim_seconds_to_sync_final_loss_equal_tokens_seeds": reach,
        "loss_at_sync_time": (timed["final_eval_loss"] if timed is not None else None) if n != "sync" else mean,
        "harsh_final_eval_loss": runs.harsh[f"{n}@harsh"]["final_eval_loss"],
        "harsh_sim_seconds": runs.harsh[f"{n}@harsh"]["clock_seconds"],
        "tokens": s0["tokens"],
        "outer_updates": s0["outer_steps"],
        "staleness": s0["staleness"],
    }


def _checks(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    sync, q, dn = results["sync"], results["quorum"], results["dn_dylu"]
    reach_q = q["sim_seconds_to_sync_final_loss"]
    return {
        "quorum_sim_time_to_sync_loss_le_0.5x": {
            "value": reach_q / sync["sim_seconds"] if reach_q is not None else None,
            "ok": reach_q is not None and reach_q <= 0.5 * sync["sim_seconds"],
        },
        "quorum_loss_le_1.01x_sync_at_equal_tokens": {
            "value": q["final_eval_loss"] / sync["final_eval_loss"],
            "ok": q["final_eval_loss"] <= 1.01 * sync["final_eval_loss"],
        },
        "dn_dylu_loss_le_1.01x_sync_at_equal_tokens (the paper's parity)": {
            "value": dn["final_eval_loss"] / sync["final_eval_loss"],
            "ok": dn["final_eval_loss"] <= 1.01 * sync["final_eval_loss"],
        },
    }


def _report(quick: bool, work: Path, runs: Runs) -> BenchResult:
    grid, best = runs.grid, runs.best
    name0 = {n: f"{n}@lr{best[n]:g}" for n in ROWS}
    by_clock = {n: eval_curve(work / name0[n], grid[name0[n]], "clock_seconds") for n in ROWS}
    by_tokens = {n: eval_curve(work / name0[n], grid[name0[n]], "tokens_total") for n in ROWS}
    sync_final, _ = _stats(runs.of("sync"))
    results = {n: _result(n, runs, work, sync_final) for n in ROWS}
    checks = _checks(results)
    sync, q, dn = results["sync"], results["quorum"], results["dn_dylu"]
    reach_q = q["sim_seconds_to_sync_final_loss"]
    reach_txt = "never" if reach_q is None else f"{reach_q:.0f}s"
    line = (
        f"hetero: sync {sync['final_eval_loss']:.4f} in {sync['sim_seconds']:.0f} simulated s; quorum "
        f"{q['final_eval_loss']:.4f} in {q['sim_seconds']:.0f} s (reaches sync's loss at {reach_txt}); dn_dylu "
        f"{dn['final_eval_loss']:.4f}; {targets_met(checks)}"
    )
    return BenchResult(
        "hetero",
        quick,
        results,
        line,
        _markdown(results, checks, runs.rounds, len(runs.seeds)) + _ablation_table(runs.ablations, grid, best),
        [Panel("simulated seconds (virtual clock)", by_clock), Panel("tokens", by_tokens)],
        extra={
            "ablations": {
                n: {"of": ABLATIONS[n][1], "final_eval_loss": a["final_eval_loss"], "staleness": a["staleness"]}
                for n, a in runs.ablations.items()
            },
            "checks": checks,
            "fleets": FLEETS,
            "virtual_step_s": STEP_S,
            "warm_start_steps": WARM,
            "lrs": LRS,
        },
    )


def _markdown(r: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]], rounds: int, seeds: int) -> str:
    def num(x: float | None, fmt: str = ".4f") -> str:
        return "n/a" if x is None else format(x, fmt)

    rows = [
        [
            f"`{n}`",
            m["description"],
            f"{m['best_outer_lr']:g}",
            f"{m['final_eval_loss']:.4f} ({', '.join(f'{x:.4f}' for x in m['final_eval_loss_seeds'])})",
            num(m["final_eval_loss_default_lr_seed0"]),
            f"{m['sim_seconds']:.1f}",
            "not reached"
            if m["sim_seconds_to_sync_final_loss"] is None
            else f"{m['sim_seconds_to_sync_final_loss']:.1f}",
            num(m["loss_at_sync_time"]),
            f"{m['harsh_final_eval_loss']:.4f} in {m['harsh_sim_seconds']:.0f} s",
            str(m["outer_updates"]),
            f"{m['staleness']['mean']:.2f} / {m['staleness']['max']}",
        ]
        for n, m in r.items()
    ]
    header = [
        "method",
        "what",
        "best outer lr",
        f"final eval loss, mean of {seeds} seeds (each)",
        "at lr 0.7 (default), seed 0",
        "simulated s",
        "simulated s to sync's final loss",
        "loss at sync's simulated time",
        "harsh fleet (1, ½, ¼, ⅛)",
        "outer updates",
        "staleness mean / max",
    ]
    return (
        f"{K} islands on a virtual clock ({STEP_S} simulated s per inner step at speed 1), the in-process island "
        f"pool (real engine, islands and training; simulated time); after a shared warm start ({WARM} data-parallel "
        f"steps per seed); H = {H}, budget {rounds} rounds x {K} islands x {H} inner steps for every method; outer "
        f"lr tuned per method over {list(LRS)} (naive: ÷ {K}) on seed 0, mild fleet (1, 1, ½, ¼).\n\n"
        + md_table(header, rows)
        + "\n\n"
        + checks_table(checks)
        + "\n\nPaper (Liu et al. 2024, 20M model, ppl): sync DiLoCo 41.35, naive async 44.27, DN+DyLU 41.13."
    )


def _ablation_table(
    ablations: dict[str, dict[str, Any]], grid: dict[str, dict[str, Any]], best: dict[str, float]
) -> str:
    if not ablations:
        return ""
    rows = []
    for n, a in ablations.items():
        desc, of, _ = ABLATIONS[n]
        base = grid[f"{of}@lr{best[of]:g}"]["final_eval_loss"]
        rows.append(
            [
                f"`{n}`",
                desc,
                f"{a['final_eval_loss']:.4f}",
                f"{base:.4f} (`{of}`)",
                f"{a['clock_seconds']:.1f}",
                f"{a['staleness']['mean']:.2f} / {a['staleness']['max']}",
            ]
        )
    header = [
        "ablation",
        "what",
        "final eval loss (seed 0)",
        "the row it ablates",
        "simulated s",
        "staleness mean / max",
    ]
    return "\n\nAblations (seed 0, mild fleet, each at its row's best lr):\n\n" + md_table(header, rows)
