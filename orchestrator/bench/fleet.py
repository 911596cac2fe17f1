"""`fleet`: time to a target loss on a simulated fleet — slow links, islands of mixed
speeds, and hangs, crashes, slow-downs and preemptions together.

The in-process island pool (the real engine, policies and islands, really training; time
simulated on a virtual clock and islands taking turns in this process — the only way to
run 64 islands on two cores; a Ray fleet of this size is not simulated here) with:

- the network of `orchestrator/bench/simulation/network.py` at each link regime of `--links`
  (Gbit/s, `--latency-ms`): each island's link to the head, and the head's one card shared
  by every transfer in and out; every transfer priced as if the model had
  `--nominal-params` parameters, so compute and communication keep the ratio of a large
  model's regime while a small model trains; the coordinator's step (merge, outer optimizer,
  checkpoint) charged at the rates measured on a CPU head, one step at a time; data-parallel
  as PyTorch DDP runs it (bucketed all-reduce overlapped with backward, ring or tree,
  whichever is faster), its lr tuned on a grid of the same size as the outer lr's;
- measured speeds with a spread (`--speed-noise`): DyLU and the tail stop are not told the
  truth; a replacement runs at the speed of the node it replaces;
- speeds `--speeds` repeated over the fleet and a seeded failure schedule
  (`orchestrator/bench/simulation/chaos.py`): each island fails once per `--mttf` simulated seconds on
  average (64 islands see 4× the failures of 16), of the kinds in `--mix`; a crashed, hung
  or preempted island is replaced after `join_s`; a preemption's notice is 5–120 s (some
  shorter than a round, so partial contributions matter);
- rows (`fleet_spec.ROWS`), each DiLoCo-family row at its best outer lr from one shared
  grid (seed 0, the smallest fleet, with failures; the shipped default 0.7 is in the grid and
  its figures are reported beside), 3 seeds each; every row gets heartbeats
  (`elastic.hang_after_steps`).

Per row: simulated time to the target loss — fixed in advance as synchronous DiLoCo's final
loss on the same tokens with no failures (same seed) —, the loss at that reference run's
finishing time (equal simulated time), goodput (island-seconds whose work reached the model
÷ island-seconds the fleet had), `goodput_dd` (Decoupled DiLoCo's: useful training time over
wall time — the time the fleet's islands at their own speeds would need for the tokens that
reached the model, with no failure, wait or transfer, over the run's wall time), the head's
busy seconds (stepping, its card in and out), tokens trained, and where the lost
island-seconds went. Every row runs at `REFERENCE_LINK`; `link_rows` at every link.
"""

from __future__ import annotations

import bisect
import json
import math
import multiprocessing
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.fleet_spec import (
    ABLATION_OF,
    DDP_ROWS,
    EQUAL_ROW,
    HEADLINE,
    REFERENCE_LINK,
    RESTART_ROW,
    ROWS,
    SLICED_ROW,
    FleetSpec,
)
from archipelago.orchestrator.bench.hetero import time_to_reach
from archipelago.orchestrator.bench.report import (
    BenchResult,
    Panel,
    checks_table,
    eval_curve,
    md_table,
    seconds_or_unreached,
    targets_met,
)
from archipelago.orchestrator.bench.runner import finished, fresh, record_simulation
from archipelago.orchestrator.bench.simulation.chaos import Strike, mttf_schedule
from archipelago.orchestrator.bench.simulation.config import ReplacementSpeed, SimulationConfig, planned_head
from archipelago.orchestrator.bench.simulation.links import LinkConfig, allreduce_s, ring_allreduce_s
from archipelago.orchestrator.bench.simulation.network import Network
from archipelago.orchestrator.bench.simulation.pool import InProcessPool, Losses
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.build import PhasedRun
from archipelago.orchestrator.engine.types import RunPhase, SliceLost
from archipelago.orchestrator.engine.warm_start import first_phase
from archipelago.orchestrator.modes import mode_of

MODEL = [
    "task.kwargs.d_model=32",
    "task.kwargs.n_layers=1",
    "task.kwargs.n_heads=2",
    "task.kwargs.context=32",
    "task.kwargs.batch_size=8",
    "task.kwargs.eval_batches=16",
    "inner.warmup_steps=20",
    "warm_start.steps=0",
]
DEFAULT_LR = 0.7  # the shipped outer lr (in the grid)
HEAD_SEED = 1_000_003  # the head's failures drawn apart from the islands'
LOSSES = "fleet-losses.json"  # beside a run's records: the pool's breakdown (a reused run keeps it)
GOODPUT_TARGETS = {16: 0.93, 64: 0.90}
TIME_TARGETS = {"sync_dylu": 0.7, RESTART_ROW: 0.5}  # quorum's time to target ≤ this × theirs
DDP_TARGET = (1.0, 0.5)  # at this link (Gbit/s), quorum's time to target ≤ this × the fastest DDP row's


# what the fastest-DDP checks leave out, said beside them
POWERSGD_NOTE = (
    "PowerSGD is not simulated; on the WAN testbed it was the fastest DDP hook at the 1 Gbit/s-equivalent "
    "regime (docs/testbed.json)"
)


@dataclass(frozen=True)
class FleetRun:
    summary: dict[str, Any]
    curve: list[tuple[float, float]]  # (simulated s, eval loss)
    losses: dict[str, Any]  # `Losses` as saved, and the head's busy seconds (`head`)
    slots: int  # islands the fleet pays for: the target and its hot spares
    ideal_s: float  # the fleet's islands at their own speeds, training the tokens that reached the model
    head: dict[str, Any]  # the head it ran with: slices and codecs
    machines: dict[str, int]  # what the row pays for (`machines_of`)

    @property
    def seconds(self) -> float:
        return float(self.summary["clock_seconds"])


def fleet_of(spec: FleetSpec, islands: int, link: float) -> SimulationConfig:
    """The simulated fleet: speeds repeated, each island's link and the head's card at
    `link` Gbit/s, everything the network prices switched on."""
    return SimulationConfig(
        slowdown=[1 / spec.speeds[i % len(spec.speeds)] for i in range(islands)],
        virtual_step_s=spec.step_s,
        link=LinkConfig(bandwidth_gbps=link, latency_ms=spec.latency_ms),
        nominal_params=spec.nominal_params,
        head_gbps=link,
        price_head=True,
        ddp_overlap=True,
        speed_noise=spec.speed_noise,
        replacement_speed=ReplacementSpeed.REPLACED,
        strike_idle=True,
    )


def overrides(
    spec: FleetSpec, row: str, islands: int, seed: int, lr: float, folder: Path, faults: bool, rounds: int = 0
) -> list[str]:
    """The run's settings (`lr`: the outer lr; data-parallel's: its factor on inner.lr;
    `rounds`: the token budget's rounds where not `spec.rounds`)."""
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
        f"inner_steps={spec.inner_steps}",
        f"rounds={rounds or spec.rounds}",
        f"seed={seed}",
        *limits,
        *ROWS[row][1],
        *([f"elastic.spares={spec.spares_of(islands)}"] if row == "quorum_spares" else []),
        *([f"inner.lr={lr * RunConfig().inner.lr:g}"] if row in DDP_ROWS else [f"outer.lr={lr:g}"]),
        f"out_dir={folder}",
    ]


def run_one(
    spec: FleetSpec, row: str, islands: int, seed: int, lr: float, link: float, work: Path, faults: bool = True
) -> FleetRun:
    """One row on one fleet, link and seed (reused when it finished before with the same
    config and fleet)."""
    tag = f"{row}@k{islands}@s{seed}@lr{lr:g}@g{link:g}" + ("" if faults else "@nofaults")
    if row == EQUAL_ROW:
        cfg, sim = within_machines(
            spec, islands, link, lambda k, r: overrides(spec, row, k, seed, lr, work / tag, faults, r)
        )
    else:
        cfg = load_config(None, overrides(spec, row, islands, seed, lr, work / tag, faults))
        sim = fleet_of(spec, islands, link)
        cfg = planned_head(cfg, sim, slice_nodes=islands)  # quorum_sliced: one slice node per island at most
    islands = cfg.islands.count
    if row == RESTART_ROW or row in DDP_ROWS:  # the fleet stands still at every failure (DDP: a re-rendezvous)
        sim = sim.model_copy(update={"restart_s": spec.restart_s})
    out = Path(cfg.out_dir)
    summary = finished(cfg, sim)
    if summary is None or not (out / LOSSES).exists():
        fresh(cfg, sim)
        record_simulation(cfg, sim)
        horizon = spec.chaos_horizon_s
        chaos = (
            mttf_schedule(
                seed=seed,
                horizon_s=horizon,
                islands=islands + cfg.elastic.spares,  # a hot spare's machine fails as often as any
                mttf_s=spec.mttf_s,
                mix=spec.strikes(),
                notice_s=spec.notice_s,
            )
            if faults
            else []
        )
        cpu_nodes = machines_of(cfg, islands + cfg.elastic.spares)["cpu_nodes"]
        pool = InProcessPool(
            cfg,
            sim,
            chaos=chaos,
            chaos_seed=seed,
            join_s=spec.join_s,
            head_failures=head_schedule(spec, seed, cpu_nodes) if faults and cpu_nodes else [],
        )
        summary, lives = through_head_failures(cfg, sim, pool, spec.restart_s)
        (out / LOSSES).write_text(json.dumps({**_losses([pool]), "lives": lives}))
    losses = json.loads((out / LOSSES).read_text())
    curve, seconds = on_the_fleets_clock(out, summary, losses.get("lives", [(0, 0.0)]))
    summary = {**summary, "clock_seconds": seconds}
    per_step = cfg.task.kwargs["batch_size"] * cfg.task.kwargs["context"]
    fleet_rate = sum(1 / f for f in sim.slowdown or [1.0] * islands) / spec.step_s * per_step  # tokens a second
    ideal = summary["tokens_applied"] / fleet_rate
    head = {"slices": cfg.coordinator.slices, "codec": cfg.compression.codec, "downlink": cfg.compression.downlink}
    slots = islands + cfg.elastic.spares
    return FleetRun(summary, curve, losses, slots, ideal, head, machines_of(cfg, slots))


def through_head_failures(
    cfg: RunConfig, sim: SimulationConfig, pool: InProcessPool, restart_s: float
) -> tuple[dict[str, Any], list[tuple[int, float]]]:
    """Run `cfg` on `pool` to its end through the failures of its head's nodes: each is a
    coordinator lost (`SliceLost`, as on Ray), down `restart_s` while the islands idle, and a
    new one resumed from the checkpoint with the islands where they were. Returns the summary
    and each coordinator's life: (the rounds it resumed from, its clock's origin — when it
    began training, or when it failed if it never did)."""
    assert first_phase(cfg, "bench") is None, "the fleet's runs have no warm phase: one pool serves every life"
    lives: list[tuple[int, float]] = []
    while True:
        run = PhasedRun(cfg, "bench", lambda _cfg, _rid: pool, ablation=sim.ablation())
        resumed = run.engine.rounds_done
        try:
            return run.execute(), [*lives, (resumed, run.engine.clock0)]
        except SliceLost:
            began = run.engine.lifecycle.now != RunPhase.STARTING
            lives.append((resumed, run.engine.clock0 if began else pool.now()))
            pool.coordinator_lost()
            pool.head_down(restart_s)


def on_the_fleets_clock(
    out: Path, summary: dict[str, Any], lives: list[tuple[int, float]]
) -> tuple[list[tuple[float, float]], float]:
    """A run's eval curve and its end on one clock from its first coordinator's start: each
    coordinator life counts its records' seconds from its own start, so a later life's are
    shifted by how much later it began. A record of round r is the last life's that resumed
    from a round before r (a resumed life rewrites the records after its checkpoint's round)."""
    resumed = [r for r, _ in lives]

    def shift(rec: dict[str, Any]) -> float:
        life = bisect.bisect_left(resumed, rec["round"]) - 1
        return lives[life][1] - lives[0][1] + float(rec["clock_seconds"])

    return eval_curve(out, summary, shift), lives[-1][1] - lives[0][1] + float(summary["clock_seconds"])


def within_machines(
    spec: FleetSpec, machines: int, link: float, settings: Callable[[int, int], list[str]]
) -> tuple[RunConfig, SimulationConfig]:
    """`EQUAL_ROW`'s run on `machines` machines in all: k islands and the head the plan
    sizes for them on the machines left (`machines` − k − 1 offered slice nodes), the k
    whose planned work a second is the most — k islands over a round stretched by the
    head's planned share, k / (1 + share): neither the most islands (one head then takes
    many rounds' time a round on a slow link) nor the fewest slices in the plan's share —
    with the same token budget (more rounds of fewer islands). Chosen from the plan alone,
    before any run. `settings(k, rounds)`: the run's overrides."""
    from archipelago.orchestrator.plan.head import head_load

    best: tuple[float, RunConfig, SimulationConfig] | None = None
    for k in range(machines - 1, 0, -1):
        sim = fleet_of(spec, k, link)
        cfg = load_config(None, settings(k, math.ceil(spec.rounds * machines / k)))
        cfg = planned_head(cfg, sim, slice_nodes=machines - 1 - k)
        if machines_of(cfg, k)["total"] > machines:
            continue
        rate = k / (1 + head_load(cfg, spec.nominal_params, link_gbps=link, step_s=spec.step_s).share)
        if best is None or rate > best[0]:
            best = (rate, cfg, sim)
    assert best is not None, "one island and its head fit any fleet of two machines or more"
    return best[1], best[2]


def head_schedule(spec: FleetSpec, seed: int, cpu_nodes: int) -> list[float]:
    """When the head's `cpu_nodes` nodes (the coordinator's and each slice's) fail, each
    once per `spec.mttf_s` as an island's machine does: a CPU node is a machine too. Each
    failure costs a coordinator restart (`spec.restart_s`, the fleet idle) and the rounds
    since its last checkpoint."""
    crash = {Strike.CRASH: 1.0}
    schedule = mttf_schedule(
        seed=seed + HEAD_SEED, horizon_s=spec.chaos_horizon_s, islands=cpu_nodes, mttf_s=spec.mttf_s, mix=crash
    )
    return [f.at for f in schedule]


def machines_of(cfg: RunConfig, islands: int) -> dict[str, int]:
    """The machines a row pays for: its `islands` (hot spares counted), and the CPU nodes
    of its head — one, and each coordinator slice on a node of its own; data-parallel has
    none (its rendezvous store lives on an island)."""
    slices = cfg.coordinator.slices
    cpu = 0 if not mode_of(cfg).pseudo_gradients else 1 + (slices if slices > 1 else 0)
    return {"islands": islands, "cpu_nodes": cpu, "total": islands + cpu}


def _losses(pools: list[InProcessPool]) -> dict[str, Any]:
    total, head = Losses(), dict.fromkeys(("step", "card_in", "card_out"), 0.0)
    for p in pools:
        total += p.losses
        for k, v in (p.network.seconds() if p.network is not None else {}).items():
            head[k] += v
    return {**asdict(total), "head": head}


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


@dataclass(frozen=True)
class Key:
    """One run: a row on a fleet of `islands`, a seed, an lr, a link, with failures or not."""

    row: str
    islands: int
    seed: int
    lr: float
    link: float = REFERENCE_LINK
    faults: bool = True


def run_all(spec: FleetSpec, work: Path, keys: list[Key]) -> dict[Key, FleetRun]:
    """Every run of `keys`, `spec.jobs` at a time in processes of their own (each on its own
    virtual clock: how many run side by side changes no figure, only the wall time)."""
    todo = list(dict.fromkeys(keys))
    if spec.jobs <= 1:
        return {k: run_one(spec, k.row, k.islands, k.seed, k.lr, k.link, work, k.faults) for k in todo}
    with ProcessPoolExecutor(max_workers=spec.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {k: pool.submit(run_one, spec, k.row, k.islands, k.seed, k.lr, k.link, work, k.faults) for k in todo}
        return {k: f.result() for k, f in futures.items()}


def seeds_of(spec: FleetSpec, row: str) -> range:
    """The headline rows and those run at every link run every seed; the others
    `ablation_seeds` (by default seed 0 only: the budget of two cores)."""
    every = row in HEADLINE or row in spec.link_rows
    return range(spec.seeds if every else min(spec.seeds, spec.ablation_seeds))


def tune(spec: FleetSpec, work: Path) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Each row's lr from its grid: the lowest final loss on seed 0 of the smallest fleet,
    with failures, at `REFERENCE_LINK`. DiLoCo-family rows share the outer lr grid (the
    shipped default among them); data-parallel has a grid of its own lr of the same kind
    (factors on the shipped inner.lr: a k-times larger batch may want another lr). `sync` is
    tuned whether asked for or not: its tuned run, without failures, is every row's target."""
    k = min(spec.islands)
    rows = list(dict.fromkeys(r for link in spec.links for r in rows_at(spec, link)))
    tuned = list(dict.fromkeys(["sync", *(r for r in rows if r not in ABLATION_OF)]))
    grids = {r: spec.grid_of(r) for r in tuned}
    runs = run_all(spec, work, [Key(r, k, 0, lr) for r in tuned for lr in grids[r]])
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
        finals = {lr: grid[f"{r}@lr{lr:g}"]["final_eval_loss"] for lr in grids[r]}
        best[r] = min(finals, key=finals.__getitem__)
    borrowed = {r: best.get(ABLATION_OF[r], DEFAULT_LR) for r in rows if r in ABLATION_OF}
    return {**best, **borrowed}, grid


def at_grid_edge(spec: FleetSpec, best: dict[str, float]) -> list[str]:
    """The tuned rows whose best lr is the lowest or highest of their grid: a wider grid
    might do better still, so a comparison with them may flatter the others."""
    out = []
    for row, lr in best.items():
        grid = spec.grid_of(row)
        if row not in ABLATION_OF and len(grid) > 1 and lr in (min(grid), max(grid)):
            out.append(row)
    return out


def rows_at(spec: FleetSpec, link: float) -> list[str]:
    """The rows run at `link`: every row at the reference, those of them in `link_rows`
    elsewhere."""
    return list(spec.rows) if link == REFERENCE_LINK else [r for r in spec.rows if r in spec.link_rows]


def fleet(quick: bool, work: Path, spec: FleetSpec | None = None) -> BenchResult:
    spec = spec or FleetSpec()
    if quick:
        spec = spec.quick()
    best, grid = tune(spec, work)
    edges = at_grid_edge(spec, best)
    ref_lr = best["sync"]
    # the target is a loss, the same at every link: synchronous DiLoCo's without failures
    keys = [Key("sync", k, s, ref_lr, faults=False) for k in spec.islands for s in range(spec.seeds)]
    keys += [
        Key(r, k, s, best[r], link)
        for link in spec.links
        for k in spec.islands
        for r in rows_at(spec, link)
        for s in seeds_of(spec, r)
    ]
    runs = run_all(spec, work, keys)
    links: dict[str, dict[str, Any]] = {}
    panels: list[Panel] = []
    for link in spec.links:
        results: dict[str, dict[str, Any]] = {}
        for k in spec.islands:
            reference = {s: runs[Key("sync", k, s, ref_lr, faults=False)] for s in range(spec.seeds)}
            curves: dict[str, list[tuple[float, float]]] = {}
            for row in rows_at(spec, link):
                mine = [runs[Key(row, k, s, best[row], link)] for s in seeds_of(spec, row)]
                results[f"{row}_{k}"] = _row(row, k, best[row], mine, reference, spec.chaos_horizon_s)
                curves[row] = mine[0].curve
            # the target as the loss it is: the reference run's curve is at the reference
            # link's timing, which another link's panel would show as that link's
            target = {"target: sync's final loss, no failures": reference[0].summary["final_eval_loss"]}
            title = f"{link:g} Gbit/s, {k} islands, seed 0: eval loss against simulated seconds"
            panels.append(Panel(title, curves, references=target))
        links[f"{link:g}"] = {"methods": results, "crossover": _winners(results, spec.islands)}
    results = links[f"{REFERENCE_LINK:g}"]["methods"]
    checks = _checks(spec, links)
    summary = "fleet: " + "; ".join(
        f"{g} Gbit/s, {k} islands: "
        + ", ".join(
            f"{r} {seconds_or_unreached(m['sim_seconds_to_target'])} s"
            for r in HEADLINE
            if (m := links[g]["methods"].get(f"{r}_{k}")) is not None
        )
        for g in links
        for k in spec.islands
    )
    pricing = Network(RunConfig(), fleet_of(spec, 1, REFERENCE_LINK), 1).pricing()
    return BenchResult(
        "fleet",
        quick,
        results,
        f"{summary}; {targets_met(checks)}",
        _markdown(spec, links, checks, best, grid, edges),
        panels,
        extra={
            "checks": checks,
            "spec": asdict(spec),
            "regime": regime(spec),
            "links": links,
            "pricing": pricing,
            "lr_grid": grid,
            "best_lr": best,
            "best_lr_at_grid_edge": edges,
        },
    )


def _winners(results: dict[str, dict[str, Any]], islands: tuple[int, ...]) -> dict[str, str | None]:
    """At each fleet size, the row that reached the target first (None: none did)."""
    out: dict[str, str | None] = {}
    for k in islands:
        reached = {
            name.rsplit("_", 1)[0]: m["sim_seconds_to_target"]
            for name, m in results.items()
            if m["islands"] == k and m["sim_seconds_to_target"] is not None
        }
        out[str(k)] = min(reached, key=reached.__getitem__) if reached else None
    return out


def _row(
    row: str, k: int, lr: float, runs: list[FleetRun], reference: dict[int, FleetRun], horizon: float
) -> dict[str, Any]:
    targets = [reference[s].summary["final_eval_loss"] for s in range(len(runs))]
    reach = [time_to_reach(r.curve, t) for r, t in zip(runs, targets)]
    at_equal = [_loss_at(r.curve, reference[s].seconds) for s, r in enumerate(runs)]
    parts = [breakdown(r) for r in runs]
    have = [r.slots * r.seconds for r in runs]
    head = {key: statistics.mean(r.losses["head"][key] for r in runs) for key in runs[0].losses["head"]}
    return {
        "description": ROWS[row][0],
        "overrides": ROWS[row][1],
        "head": runs[0].head,
        "islands": k,
        "outer_lr": None if row in DDP_ROWS else lr,
        "lr_factor": lr if row in DDP_ROWS else None,
        "machines": runs[0].machines,
        "goodput": statistics.mean([p["useful"] for p in parts]),
        "goodput_seeds": [p["useful"] for p in parts],
        "goodput_dd": statistics.mean([r.ideal_s / r.seconds for r in runs]),
        "goodput_dd_seeds": [r.ideal_s / r.seconds for r in runs],
        "head_seconds": head,
        "head_share": max(head.values()) / statistics.mean([r.seconds for r in runs]),
        "sim_seconds_to_target": _reach_mean(reach),
        "sim_seconds_to_target_seeds": reach,
        "target_loss_seeds": targets,
        "loss_at_reference_end": statistics.mean(at_equal),
        "final_eval_loss": statistics.mean([r.summary["final_eval_loss"] for r in runs]),
        "sim_seconds": statistics.mean([r.seconds for r in runs]),
        "sim_seconds_seeds": [r.seconds for r in runs],
        # failures stop at the horizon: a run past it ran its rest without any (flattering it)
        "seeds_past_failure_horizon": sum(r.seconds > horizon for r in runs),
        "tokens": statistics.mean([r.summary["tokens"] for r in runs]),
        "strikes": statistics.mean([sum(r.losses["strikes"].values()) for r in runs]),
        "head_failures": statistics.mean([r.losses.get("head_failures", 0) for r in runs]),  # coordinator restarts
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


def _checks(spec: FleetSpec, links: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The targets: at the reference link, quorum's goodput and its time to target against
    sync_dylu's and restart's; at `DDP_TARGET`'s link, quorum's as shipped (one head) and
    with the head its plan asks for (`SLICED_ROW`), each against the fastest data-parallel
    row of `DDP_ROWS` (fp32 or either compression hook), and on the data-parallel rows'
    machines (`EQUAL_ROW`), each check naming both rows'
    machines (a row that never reached the target is bounded by its finishing time, and the
    check says so)."""
    checks: dict[str, dict[str, Any]] = {}
    results = links[f"{REFERENCE_LINK:g}"]["methods"]
    for k, floor in GOODPUT_TARGETS.items():
        if f"quorum_{k}" in results:
            g = results[f"quorum_{k}"]["goodput"]
            checks[f"quorum_goodput_ge_{floor}_at_{k}"] = {"value": g, "ok": g >= floor}
    ddp_link, ddp_ratio = DDP_TARGET
    compared: list[tuple[float, str, tuple[str, ...], float]] = [
        (REFERENCE_LINK, "quorum", (other,), ratio) for other, ratio in TIME_TARGETS.items()
    ]
    compared += [(ddp_link, mine, DDP_ROWS, ddp_ratio) for mine in ("quorum", SLICED_ROW, EQUAL_ROW)]
    for link, row, others, ratio in compared:
        at = links.get(f"{link:g}", {}).get("methods", {})
        for k in (16, 64):
            theirs = {o: at[f"{o}_{k}"] for o in others if f"{o}_{k}" in at}
            q = at.get(f"{row}_{k}")
            if q is None or not theirs:
                continue
            other = min(theirs, key=lambda o: _time_or_bound(theirs[o])[0])
            m = theirs[other]
            t, exact = _time_or_bound(m)
            mine = q["sim_seconds_to_target"]
            value = None if mine is None else mine / t
            # quorum not reached: failed; theirs not reached: its finish bounds its time from below
            suffix = "" if link == REFERENCE_LINK else f"_at_{link:g}gbps"
            name = other if len(others) == 1 else "best_ddp"
            checks[f"{row}_time_le_{ratio}x_{name}_at_{k}{suffix}"] = {
                "value": value,
                "ok": value is not None and value <= ratio,
                "versus": other,
                "machines": {row: q["machines"], other: m["machines"]},
                "note": "; ".join(
                    n
                    for n in (
                        None if exact else f"{other} did not reach the target: its finishing time is the bound",
                        POWERSGD_NOTE if len(others) > 1 else None,
                    )
                    if n
                )
                or None,
            }
    return checks


def regime(spec: FleetSpec) -> dict[str, Any]:
    """What a transfer costs against compute at the nominal size (fp32), per link: a DiLoCo
    exchange alone, every island's through the head's card, and data-parallel's per-step
    all-reduce (the better of ring and tree, before any overlap)."""
    nbytes = 4 * spec.nominal_params
    round_s = spec.inner_steps * spec.step_s
    out: dict[str, Any] = {"round_s_at_speed_1": round_s}
    for g in spec.links:
        link = LinkConfig(bandwidth_gbps=g, latency_ms=spec.latency_ms)
        at: dict[str, float] = {
            "exchange_s": 2 * link.seconds(nbytes),
            "exchange_share_of_round": 2 * link.seconds(nbytes) / round_s,
        }
        for k in spec.islands:
            at[f"head_card_each_way_s_at_{k}"] = k * nbytes * 8 / (g * 1e9)
            at[f"ddp_allreduce_steps_at_{k}"] = allreduce_s([link] * k, nbytes) / spec.step_s
            at[f"ddp_ring_steps_at_{k}"] = ring_allreduce_s([link] * k, nbytes) / spec.step_s
        out[f"{g:g}"] = at
    return out


def _results_table(spec: FleetSpec, r: dict[str, dict[str, Any]]) -> str:
    """One row per method and fleet size: time to the target (mean and each seed), both
    goodputs, the head's busiest share, losses, simulated time, tokens, failures."""
    rows = [
        [
            f"`{name.rsplit('_', 1)[0]}`",
            str(m["islands"]),
            f"{m['machines']['islands']} + {m['machines']['cpu_nodes']}",
            _head(m["head"]),
            f"{m['outer_lr']:g}" if m["outer_lr"] is not None else f"{m['lr_factor']:g}x inner",
            f"{seconds_or_unreached(m['sim_seconds_to_target'])} ({', '.join(seconds_or_unreached(x) for x in m['sim_seconds_to_target_seeds'])})",
            f"{m['goodput']:.3f} ({', '.join(f'{g:.2f}' for g in m['goodput_seeds'])})",
            f"{m['goodput_dd']:.3f}",
            f"{m['head_share']:.2f}",
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
        "machines: islands + CPU nodes",
        "head: slices, codecs up/down",
        "lr",
        "simulated s to target (each)",
        f"goodput, mean of {spec.seeds} (each)",
        "goodput (Decoupled DiLoCo's)",
        "head busiest share",
        "loss at the reference's end",
        "final loss",
        "simulated s",
        "tokens",
        "failures",
    ]
    return md_table(header, rows)


def _head(head: dict[str, Any]) -> str:
    return f"{head['slices']}, {head['codec']}/{head['downlink']}"


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


def _versus(checks: dict[str, dict[str, Any]]) -> list[str]:
    """Each time check's rows and their machines, and who fails among them."""
    versus = [
        f"`{name}`: against `{c['versus']}` ("
        + "; ".join(f"{r} {m['islands']} islands + {m['cpu_nodes']} CPU nodes" for r, m in c["machines"].items())
        + ")"
        + (f" — {c['note']}" if c.get("note") else "")
        for name, c in checks.items()
        if "versus" in c
    ]
    if versus:
        versus.append(
            "the head's nodes fail as often as islands' (each a coordinator restart from its checkpoint); "
            "data-parallel's rendezvous lives on an island"
        )
    return versus


def _markdown(
    spec: FleetSpec,
    links: dict[str, dict[str, Any]],
    checks: dict[str, dict[str, Any]],
    best: dict[str, float],
    grid: dict[str, dict[str, Any]],
    edges: list[str],
) -> str:
    reg = regime(spec)
    lines = [
        f"Islands of speeds {list(spec.speeds)} repeated (measured with a log-normal spread of {spec.speed_noise:g}; a "
        f"replacement runs at the speed of the node it replaces); H = {spec.inner_steps}; {spec.step_s:g} simulated s "
        f"per step at speed 1 (a synchronous round: {spec.round_s:g} s); {spec.rounds} rounds' tokens per run; each "
        f"island fails once per {spec.mttf_s:g} simulated s on average ({spec.mix}; slow-downs 4x, preemption notices "
        f"{spec.notice_s[0]:g}–{spec.notice_s[1]:g} s), replacements start {spec.join_s:g} s after; each CPU node of "
        f"a head (the coordinator's, each slice's) fails as often, each failure a coordinator restart from its last "
        f"checkpoint (every {RunConfig().checkpoint.every_rounds} rounds, as shipped) after {spec.restart_s:g} s; "
        f"restart_from_checkpoint stands still {spec.restart_s:g} s per failure; heartbeats: hung after "
        f"{spec.hang_after_steps} expected steps without progress. Failures are drawn up to "
        f"{spec.chaos_horizon_s:,.0f} simulated s: a run lasting longer runs its rest without any, which flatters it "
        "(`seeds_past_failure_horizon` says which rows did).",
        "",
        f"Priced as a real run is limited, at {spec.nominal_params:.3g} parameters in fp32 "
        "(`orchestrator/bench/simulation/network.py`): every island's link and the head's one card (the same speed) shared by "
        "every transfer in and out (a coordinator slice on a node of its own has a card of its own: `quorum_sliced` "
        "runs the slices its plan asks for); the coordinator's step (merge, outer optimizer, the checkpoint's share) "
        "at the rates "
        "measured on a CPU head, one at a time; data-parallel's all-reduce in buckets overlapped with backward, ring or "
        "tree; evaluation off the head. The in-process island pool on a virtual clock: real training of a small model, "
        "simulated time. The target: synchronous DiLoCo's final loss on the same tokens with no failures, per seed.",
        "",
    ]
    for g, at in links.items():
        r = reg[g]
        cost = ", ".join(
            f"{k} islands: the head's card {r[f'head_card_each_way_s_at_{k}']:.1f} s each way a round, data-parallel's "
            f"all-reduce {r[f'ddp_allreduce_steps_at_{k}']:.2f} steps' worth a step before overlap"
            for k in spec.islands
        )
        wins = ", ".join(f"{k} islands: {w or 'none reached the target'}" for k, w in at["crossover"].items())
        lines += [
            f"### {g} Gbit/s",
            "",
            f"One island's exchange (down and up) {r['exchange_s']:.2f} s ({100 * r['exchange_share_of_round']:.1f} % "
            f"of a round at speed 1); {cost}. First to the target: {wins}.",
            "",
            _results_table(spec, at["methods"]),
            "",
        ]
        if g == f"{REFERENCE_LINK:g}":
            lines += [
                "Where the island-seconds went (fractions of islands × simulated seconds, mean over seeds; `waiting` "
                "is the rest: barriers, links, the head, stragglers, discarded results):",
                "",
                _lost_table(at["methods"]),
                "",
            ]
    versus = _versus(checks)
    lines += [
        checks_table(checks),
        "",
        *([f"Each time check's rows and machines: {'; '.join(versus)}.", ""] if versus else []),
        f"lr grids (seed 0, {min(spec.islands)} islands, {REFERENCE_LINK:g} Gbit/s, with failures; best per row: "
        + ", ".join(f"{n} {lr:g}" for n, lr in best.items())
        + "; data-parallel's are factors on the shipped inner.lr; "
        + (
            f"at its grid's edge, so a wider grid might do better: {', '.join(edges)}"
            if edges
            else "none at its grid's edge"
        )
        + "):",
        "",
        _grid_table(grid),
    ]
    return "\n".join(lines)
