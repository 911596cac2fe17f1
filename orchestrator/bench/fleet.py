"""`fleet`: time to a target loss on a simulated fleet — slow links, islands of mixed
speeds, and hangs, crashes, slow-downs and preemptions together.

The in-process island pool (the real engine, policies and islands, really training; time
simulated on a virtual clock and islands taking turns in this process — the only way to
run 64 islands on two cores; a Ray fleet of this size is not simulated here) with:

- a link per island to the coordinator (`--link-gbps`, `--latency-ms`) pricing every
  transfer as if the model had `--nominal-params` parameters (`simulation.nominal_params`),
  so compute and communication keep the ratio of a large model's regime while a small model
  trains; data-parallel's every step is a ring all-reduce over the same links
  (`orchestrator/engine/work/links.py`);
- speeds `--speeds` repeated over the fleet and a seeded failure schedule
  (`orchestrator/testing/chaos.py`): each island fails once per `--mttf` simulated seconds on
  average (64 islands see 4× the failures of 16), of the kinds in `--mix`; a crashed, hung
  or preempted island is replaced after `join_s`; a preemption's notice is 30–120 s;
- rows (`fleet_spec.ROWS`), each DiLoCo-family row at its best outer lr from one shared
  grid (seed 0, the smallest fleet, with failures; the shipped default 0.7 is in the grid and
  its figures are reported beside), 3 seeds each; every row gets heartbeats
  (`elastic.hang_after_steps`).

Per row: simulated time to the target loss — fixed in advance as synchronous DiLoCo's final
loss on the same tokens with no failures (same seed) —, the loss at that reference run's
finishing time (equal simulated time), goodput (island-seconds whose work reached the model
÷ island-seconds the fleet had), tokens trained, and where the lost island-seconds went.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orchestrator.bench.fleet_spec import ABLATION_OF, HEADLINE, ROWS, FleetSpec
from orchestrator.bench.hetero import time_to_reach
from orchestrator.bench.report import BenchResult, Panel, checks_table, eval_curve, md_table, targets_met
from orchestrator.bench.runner import finished, fresh
from orchestrator.config_load import load_config
from orchestrator.engine.build import PhasedRun
from orchestrator.testing.chaos import Strike, mttf_schedule
from orchestrator.testing.pool import InProcessPool, Losses
from workers.wire.links import LinkConfig, ring_allreduce_s

MODEL = [
    "task.kwargs.d_model=32",
    "task.kwargs.n_layers=1",
    "task.kwargs.n_heads=2",
    "task.kwargs.context=32",
    "task.kwargs.batch_size=8",
    "task.kwargs.eval_batches=16",
    "inner.warmup_steps=20",
    "warm_start.steps=0",
    "checkpoint.every_rounds=0",
]
DEFAULT_LR = 0.7  # the shipped outer lr (in the grid)
LOSSES = "fleet-losses.json"  # beside a run's records: the pool's breakdown (a reused run keeps it)
GOODPUT_TARGETS = {16: 0.93, 64: 0.90}
TIME_TARGETS = {"sync_dylu": 0.7, "restart_from_checkpoint": 0.5}  # quorum's time to target ≤ this × theirs


@dataclass(frozen=True)
class FleetRun:
    summary: dict[str, Any]
    curve: list[tuple[float, float]]  # (simulated s, eval loss)
    losses: dict[str, Any]  # `Losses` as saved
    slots: int  # islands the fleet pays for: the target and its hot spares

    @property
    def seconds(self) -> float:
        return float(self.summary["clock_seconds"])


def overrides(spec: FleetSpec, row: str, islands: int, seed: int, lr: float, folder: Path, faults: bool) -> list[str]:
    slowdown = ",".join(f"{1 / spec.speeds[i % len(spec.speeds)]:g}" for i in range(islands))
    limits = [
        f"round_timeout_s={2 * spec.round_s:g}",
        "step_timeout_s=0",
        f"elastic.late_grace_s={spec.round_s:g}",
        f"elastic.placement_timeout_s={100 * spec.round_s:g}",
        f"elastic.hang_after_steps={spec.hang_after_steps}",
        f"elastic.progress_every_s={spec.step_s:g}",
        f"elastic.hang_floor_s={spec.hang_after_steps * spec.step_s / min(spec.speeds):g}",
    ]
    return [
        *MODEL,
        f"islands.count={islands}",
        f"simulation.slowdown=[{slowdown}]",
        f"simulation.virtual_step_s={spec.step_s:g}",
        f"simulation.link.bandwidth_gbps={spec.link_gbps:g}",
        f"simulation.link.latency_ms={spec.latency_ms:g}",
        f"simulation.nominal_params={spec.nominal_params}",
        f"inner_steps={spec.inner_steps}",
        f"rounds={spec.rounds}",
        f"seed={seed}",
        *limits,
        *ROWS[row][1],
        *([f"elastic.restart_s={spec.restart_s:g}"] if row == "restart_from_checkpoint" else []),
        *([f"elastic.spares={spec.spares_of(islands)}"] if row == "quorum_spares" else []),
        *([] if row == "ddp" else [f"outer.lr={lr:g}"]),
        f"out_dir={folder}",
    ]


def run_one(spec: FleetSpec, row: str, islands: int, seed: int, lr: float, work: Path, faults: bool = True) -> FleetRun:
    """One row on one fleet and seed (reused when it finished before with the same config)."""
    tag = f"{row}@k{islands}@s{seed}@lr{lr:g}" + ("" if faults else "@nofaults")
    cfg = load_config(None, overrides(spec, row, islands, seed, lr, work / tag, faults))
    out = Path(cfg.out_dir)
    summary = finished(cfg)
    if summary is None or not (out / LOSSES).exists():
        fresh(cfg)
        horizon = 50 * spec.rounds * spec.round_s
        chaos = (
            mttf_schedule(
                seed=seed,
                horizon_s=horizon,
                islands=islands,
                mttf_s=spec.mttf_s,
                mix=spec.strikes(),
                notice_s=spec.notice_s,
            )
            if faults
            else []
        )
        pools: list[InProcessPool] = []

        def pool(c: Any, _rid: str) -> InProcessPool:
            pools.append(InProcessPool(c, step_s=spec.step_s, chaos=chaos, chaos_seed=seed, join_s=spec.join_s))
            return pools[-1]

        summary = PhasedRun(cfg, "bench", pool).execute()
        (out / LOSSES).write_text(json.dumps(_losses(pools)))
    losses = json.loads((out / LOSSES).read_text())
    return FleetRun(summary, eval_curve(out, summary, "clock_seconds"), losses, islands + cfg.elastic.spares)


def _losses(pools: list[InProcessPool]) -> dict[str, Any]:
    total = Losses()
    for p in pools:
        total += p.losses
    return asdict(total)


def breakdown(run: FleetRun) -> dict[str, float]:
    """Fractions of the island-seconds the fleet had (islands and hot spares × simulated
    seconds: a spare is paid for): useful work, and where the rest went. `waiting` is what
    is left: islands idle at barriers and on links, spares standing by, stragglers, results
    computed and discarded."""
    have = run.slots * run.seconds
    lost = run.losses
    parts = {
        "useful": run.summary["useful_compute_seconds"],
        **{f"lost_work_{k.value}": lost["struck"][k.value] for k in (Strike.CRASH, Strike.HANG, Strike.PREEMPT)},
        "hang_undetected": lost["undetected"],
        "replacement_start": lost["placement"],
        "restarts": lost["halted"] * run.slots,
    }
    fractions = {k: v / have for k, v in parts.items()}
    fractions["waiting"] = 1.0 - sum(fractions.values())
    return fractions


def _reach_mean(xs: list[float | None]) -> float | None:
    return None if None in xs else statistics.mean(x for x in xs if x is not None)


def _seconds(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.0f}"


@dataclass(frozen=True)
class Key:
    """One run: a row on a fleet of `islands`, a seed, an outer lr, with failures or not."""

    row: str
    islands: int
    seed: int
    lr: float
    faults: bool = True


def run_all(spec: FleetSpec, work: Path, keys: list[Key]) -> dict[Key, FleetRun]:
    """Every run of `keys`, `spec.jobs` at a time in processes of their own (each on its own
    virtual clock: how many run side by side changes no figure, only the wall time)."""
    todo = list(dict.fromkeys(keys))
    if spec.jobs <= 1:
        return {k: run_one(spec, k.row, k.islands, k.seed, k.lr, work, k.faults) for k in todo}
    with ProcessPoolExecutor(max_workers=spec.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {k: pool.submit(run_one, spec, k.row, k.islands, k.seed, k.lr, work, k.faults) for k in todo}
        return {k: f.result() for k, f in futures.items()}


def seeds_of(spec: FleetSpec, row: str) -> range:
    """The headline rows run every seed; the others `ablation_seeds` (by default seed 0
    only: the budget of two cores)."""
    return range(spec.seeds if row in HEADLINE else min(spec.seeds, spec.ablation_seeds))


def tune(spec: FleetSpec, work: Path) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Each DiLoCo-family row's outer lr from the shared grid: the lowest final loss on seed 0
    of the smallest fleet, with failures. The grid's rows (the shipped default among them).
    `sync` is tuned whether asked for or not: its tuned run, without failures, is every
    row's target (before, a report without the `sync` row measured against `sync` at the
    default lr, so its times could not be set beside the full report's)."""
    k = min(spec.islands)
    tuned = list(dict.fromkeys(["sync", *(r for r in spec.rows if r != "ddp" and r not in ABLATION_OF)]))
    runs = run_all(spec, work, [Key(r, k, 0, lr) for r in tuned for lr in spec.lr_grid])
    grid = {
        f"{key.row}@lr{key.lr:g}": {
            "final_eval_loss": run.summary["final_eval_loss"],
            "sim_seconds": run.seconds,
            "goodput": breakdown(run)["useful"],
        }
        for key, run in runs.items()
    }
    best: dict[str, float] = {}
    for r in tuned:
        finals = {lr: grid[f"{r}@lr{lr:g}"]["final_eval_loss"] for lr in spec.lr_grid}
        best[r] = min(finals, key=finals.__getitem__)
    borrowed = {r: best.get(ABLATION_OF[r], DEFAULT_LR) for r in spec.rows if r in ABLATION_OF}
    return {**best, **borrowed, **({"ddp": 0.0} if "ddp" in spec.rows else {})}, grid


def fleet(quick: bool, work: Path, spec: FleetSpec | None = None) -> BenchResult:
    spec = spec or FleetSpec()
    if quick:
        spec = spec.quick()
    best, grid = tune(spec, work)
    ref_lr = best["sync"]
    keys = [Key("sync", k, s, ref_lr, faults=False) for k in spec.islands for s in range(spec.seeds)]
    keys += [Key(r, k, s, best[r]) for k in spec.islands for r in spec.rows for s in seeds_of(spec, r)]
    runs = run_all(spec, work, keys)
    results: dict[str, dict[str, Any]] = {}
    panels: list[Panel] = []
    for k in spec.islands:
        reference = {s: runs[Key("sync", k, s, ref_lr, faults=False)] for s in range(spec.seeds)}
        curves: dict[str, list[tuple[float, float]]] = {}
        for row in spec.rows:
            mine = [runs[Key(row, k, s, best[row])] for s in seeds_of(spec, row)]
            results[f"{row}_{k}"] = _row(row, k, best[row], mine, reference)
            curves[row] = mine[0].curve
        curves["sync, no failures (target)"] = reference[0].curve
        panels.append(Panel(f"{k} islands, seed 0: eval loss against simulated seconds", curves))
    checks = _checks(spec, results)
    summary = "fleet: " + "; ".join(
        f"{k} islands: "
        + ", ".join(
            f"{r} goodput {results[f'{r}_{k}']['goodput']:.2f}"
            for r in spec.rows
            if r in HEADLINE or len(seeds_of(spec, r)) > 1
        )
        for k in spec.islands
    )
    return BenchResult(
        "fleet",
        quick,
        results,
        f"{summary}; {targets_met(checks)}",
        _markdown(spec, results, checks, best, grid),
        panels,
        extra={"checks": checks, "spec": asdict(spec), "regime": regime(spec), "lr_grid": grid, "best_lr": best},
    )


def _row(row: str, k: int, lr: float, runs: list[FleetRun], reference: dict[int, FleetRun]) -> dict[str, Any]:
    targets = [reference[s].summary["final_eval_loss"] for s in range(len(runs))]
    reach = [time_to_reach(r.curve, t) for r, t in zip(runs, targets)]
    at_equal = [_loss_at(r.curve, reference[s].seconds) for s, r in enumerate(runs)]
    parts = [breakdown(r) for r in runs]
    have = [r.slots * r.seconds for r in runs]
    return {
        "description": ROWS[row][0],
        "overrides": ROWS[row][1],
        "islands": k,
        "outer_lr": None if row == "ddp" else lr,
        "goodput": statistics.mean([p["useful"] for p in parts]),
        "goodput_seeds": [p["useful"] for p in parts],
        "sim_seconds_to_target": _reach_mean(reach),
        "sim_seconds_to_target_seeds": reach,
        "target_loss_seeds": targets,
        "loss_at_reference_end": statistics.mean(at_equal),
        "final_eval_loss": statistics.mean([r.summary["final_eval_loss"] for r in runs]),
        "sim_seconds": statistics.mean([r.seconds for r in runs]),
        "sim_seconds_seeds": [r.seconds for r in runs],
        "tokens": statistics.mean([r.summary["tokens"] for r in runs]),
        "strikes": statistics.mean([sum(r.losses["strikes"].values()) for r in runs]),
        "seeds": list(range(len(runs))),
        "lost": {key: statistics.mean([p[key] for p in parts]) for key in parts[0] if key != "useful"},
        "lost_seconds": {
            key: statistics.mean([p[key] * h for p, h in zip(parts, have)]) for key in parts[0] if key != "useful"
        },
    }


def _loss_at(curve: list[tuple[float, float]], t: float) -> float:
    """The newest eval loss at or before simulated time `t`."""
    return min((p for p in curve if p[0] <= t), key=lambda p: -p[0])[1]


def _time_or_bound(m: dict[str, Any]) -> tuple[float, bool]:
    """A row's time to target, or — not reached within its tokens — its finishing time, a
    lower bound on it (exact: True)."""
    reached = m["sim_seconds_to_target"]
    return (reached, True) if reached is not None else (m["sim_seconds"], False)


def _checks(spec: FleetSpec, results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    checks: dict[str, dict[str, Any]] = {}
    for k, floor in GOODPUT_TARGETS.items():
        if f"quorum_{k}" in results:
            g = results[f"quorum_{k}"]["goodput"]
            checks[f"quorum_goodput_ge_{floor}_at_{k}"] = {"value": g, "ok": g >= floor}
    for k in (16, 64):
        q = results.get(f"quorum_{k}")
        for other, ratio in TIME_TARGETS.items():
            m = results.get(f"{other}_{k}")
            if q is None or m is None:
                continue
            t, exact = _time_or_bound(m)
            mine = q["sim_seconds_to_target"]
            value = None if mine is None else mine / t
            # quorum not reached: failed; theirs not reached: its finish bounds its time from below
            ok = value is not None and value <= ratio
            checks[f"quorum_time_le_{ratio}x_{other}_at_{k}"] = {
                "value": value,
                "ok": ok,
                "note": None if exact else f"{other} did not reach the target: its finishing time is the bound",
            }
    return checks


def regime(spec: FleetSpec) -> dict[str, float]:
    """What a transfer costs against compute at the nominal size (fp32 pseudo-gradients)."""
    link = LinkConfig(bandwidth_gbps=spec.link_gbps, latency_ms=spec.latency_ms)
    nbytes = 4 * spec.nominal_params
    round_s = spec.inner_steps * spec.step_s
    out = {
        "exchange_s": 2 * link.seconds(nbytes),
        "round_s_at_speed_1": round_s,
        "exchange_share_of_round": 2 * link.seconds(nbytes) / round_s,
    }
    for k in spec.islands:
        out[f"ddp_allreduce_steps_at_{k}"] = ring_allreduce_s([link] * k, nbytes) / spec.step_s
    return out


def _results_table(spec: FleetSpec, r: dict[str, dict[str, Any]]) -> str:
    """One row per method and fleet size: goodput and time to the target (mean and each
    seed), losses, simulated time, tokens, failures."""
    rows = [
        [
            f"`{name.rsplit('_', 1)[0]}`",
            str(m["islands"]),
            "—" if m["outer_lr"] is None else f"{m['outer_lr']:g}",
            f"{m['goodput']:.3f} ({', '.join(f'{g:.2f}' for g in m['goodput_seeds'])})",
            f"{_seconds(m['sim_seconds_to_target'])} ({', '.join(_seconds(x) for x in m['sim_seconds_to_target_seeds'])})",
            f"{m['loss_at_reference_end']:.4f}",
            f"{m['final_eval_loss']:.4f}",
            f"{m['sim_seconds']:.0f}",
            f"{m['tokens']:,.0f}",
            f"{m['strikes']:.1f}",
        ]
        for name, m in r.items()
    ]
    header = [
        "method",
        "islands",
        "outer lr",
        f"goodput, mean of {spec.seeds} (each)",
        "simulated s to target (each)",
        "loss at the reference's end",
        "final loss",
        "simulated s",
        "tokens",
        "failures",
    ]
    return md_table(header, rows)


def _lost_table(r: dict[str, dict[str, Any]]) -> str:
    """Where each row's island-seconds went, by cause."""
    keys = list(next(iter(r.values()))["lost"])
    lost = [
        [f"`{name.rsplit('_', 1)[0]}`", str(m["islands"])] + [f"{m['lost'][x]:.3f}" for x in keys]
        for name, m in r.items()
    ]
    return md_table(["method", "islands", *keys], lost)


def _grid_table(grid: dict[str, dict[str, Any]]) -> str:
    return md_table(
        ["row@lr", "final loss", "simulated s", "goodput"],
        [
            [f"`{n}`", f"{m['final_eval_loss']:.4f}", f"{m['sim_seconds']:.0f}", f"{m['goodput']:.3f}"]
            for n, m in grid.items()
        ],
    )


def _markdown(
    spec: FleetSpec,
    r: dict[str, dict[str, Any]],
    checks: dict[str, dict[str, Any]],
    best: dict[str, float],
    grid: dict[str, dict[str, Any]],
) -> str:
    reg = regime(spec)
    ddp = ", ".join(f"{reg[f'ddp_allreduce_steps_at_{k}']:.1f} steps' worth at {k}" for k in spec.islands)
    return (
        f"Islands of speeds {list(spec.speeds)} repeated; H = {spec.inner_steps}; {spec.step_s:g} simulated s per step "
        f"at speed 1 (a synchronous round: {spec.round_s:g} s); {spec.rounds} rounds' tokens per run; each island fails "
        f"once per {spec.mttf_s:g} simulated s on average ({spec.mix}; slow-downs 4×, preemption notices "
        f"{spec.notice_s[0]:g}–{spec.notice_s[1]:g} s), "
        f"replacements start {spec.join_s:g} s after; restart_from_checkpoint stands still {spec.restart_s:g} s per "
        f"failure; heartbeats: hung after {spec.hang_after_steps} expected steps without progress. Links "
        f"{spec.link_gbps:g} Gbit/s, {spec.latency_ms:g} ms, priced at {spec.nominal_params:.3g} parameters in fp32: "
        f"a DiLoCo exchange (down and up) takes {reg['exchange_s']:.2f} s, {100 * reg['exchange_share_of_round']:.1f} % "
        f"of a {reg['round_s_at_speed_1']:g}-s round at speed 1; data-parallel's per-step ring all-reduce {ddp}. "
        "The in-process island pool on a virtual clock: real training of a small model, simulated time and links. "
        "The target: synchronous DiLoCo's final loss on the same tokens with no failures, per seed.\n\n"
        + _results_table(spec, r)
        + "\n\nWhere the island-seconds went (fractions of islands × simulated seconds, mean over seeds; `waiting` "
        "is the rest: barriers, links, stragglers, discarded results):\n\n"
        + _lost_table(r)
        + "\n\n"
        + checks_table(checks)
        + f"\n\nOuter lr grid (seed 0, {min(spec.islands)} islands, with failures; best per row: "
        + ", ".join(f"{n} {lr:g}" for n, lr in best.items() if n != "ddp")
        + "):\n\n"
        + _grid_table(grid)
    )
