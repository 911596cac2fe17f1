"""`datapath`: how fast the coordinator ingests pseudo-gradients, measured side by side
in one run on one Ray instance:

- `coordinator_gbps[S]`: K islands' pseudo-gradients (P fp32 values each) already in
  the islands' object stores; the time for the production servers (one coordinator, or S
  shard actors) to fetch them, screen them (finite, norm guard), average them and take
  the outer Nesterov step, reading the updates once (`fused_step`). Bytes = K·P·4.
  The default's torch threads (the coordinator: `step_threads`; sync DiLoCo's islands all
  wait for its step, so it takes every core of the machine; a shard: one), plus S = 1
  with `coordinator.threads: 1` (one core, as before the step took the waiting islands'
  cores). With the page faults the coordinator's process took per round: the store's
  pages it had not mapped yet.
- `coordinator_gbps_paced` (S = 1, the default's threads and 1, and its round with the broadcast):
  the same rounds `GAP_S` apart, as a run's rounds are (its islands compute between
  them). Back to back, a round's results land on store pages the coordinator has not
  touched unless Ray has freed the previous round's first (`RAY_SYSTEM_CONFIG`).
- `coordinator_gbps_s1_mapped`: the same work for S = 1 on the same pseudo-gradients
  copied once into the coordinator's own memory, so no page is mapped on the way: how
  much of the gap to memcpy is reading fresh object-store pages.
- `round_gbps` (S = 1): the same, plus the broadcast, as a round has it: the coordinator
  publishes the new parameters (`ray.put` and their digest, as `Publisher` does) and
  hands them to every island in a call of its own (as it sends its next work orders);
  each fetches them, checks the digest (a verified hand-off) and copies them into its
  model; the round ends when the last has. Timed from the driver's call with the
  results' references to its return. This is what an all-reduce's result in every
  process compares with. `round_breakdown_seconds`: where it went (the step, the put, the
  digest, the islands' calls with each island's check and load, the rest), each part
  timed in the process that ran it.
- `gloo_allreduce_gbps`: the same K·P·4 bytes all-reduced by `torch.distributed` (gloo)
  across K processes (what a data-parallel step would spend instead; every process
  ends with the sum, so nothing is left to broadcast). The checks against it take the
  median of `REPEATS` measurements of the three (round back to back, round paced, gloo)
  one after another: on 2 shared cores each moves by 10-30 % from one to the next, and a
  single measurement met or missed 1.5x by chance.
- `memcpy_gbps`: numpy copying max(K·P, 32 M) fp32 values, beyond the CPU caches
  (bytes copied per second).
- `overhead_fraction`: in real sync DiLoCo runs at the default H, the share of the
  islands' steady-state time not spent computing (no simulated link), for S = 1 and 2.

GB/s are 1e9 bytes per second. Each measurement is the median of several repetitions.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from archipelago.orchestrator.bench.datapath_probes import coordinator_gbps, gloo_allreduce_gbps, memcpy_gbps
from archipelago.orchestrator.bench.report import BenchResult, Panel, checks_table, md_table, targets_met
from archipelago.orchestrator.bench.runner import run_methods
from archipelago.orchestrator.engine.state.logfiles import read_lines
from archipelago.orchestrator.runtime.driver import RAY_SYSTEM_CONFIG

GAP_S = 1.0  # between paced rounds: less than one default round's compute on this machine
REPEATS = 5  # interleaved repetitions of (round back to back, round paced, gloo): a run's ratios move by 10-30 %


def steady_overhead(run_dir: Path) -> float:
    """1 − compute / wall between the first and the second-to-last round records (so
    start-up, the first evaluation and the final one, which nothing overlaps, are out),
    averaged over islands."""
    records = [json.loads(line) for line in read_lines(run_dir / "metrics.jsonl")]
    a, b = records[0], records[-2]
    fractions = []
    for island in a["island_compute_seconds"]:
        busy = b["island_compute_seconds"][island] - a["island_compute_seconds"][island]
        fractions.append(1 - busy / (b["train_seconds"] - a["train_seconds"]))
    return sum(fractions) / len(fractions)


@dataclass(frozen=True, kw_only=True)
class Measured:
    """The probes of one `datapath` run, side by side on one Ray instance (each a
    `coordinator_gbps` answer unless said otherwise)."""

    islands: int
    numel: int
    memcpy: float  # GB/s
    coord: dict[int, dict[str, float]]  # S -> back to back, the default's threads
    threaded: dict[str, float]  # S = 1, `coordinator.threads: 1`
    paced: dict[str, float]  # S = 1, rounds `GAP_S` apart, with the broadcast
    paced_threaded: dict[str, float]  # ... and with one thread
    gloo: dict[str, float]  # `gloo_allreduce_gbps`
    vs_gloo: list[tuple[float, float]]  # gloo's time ÷ a round's, back to back and paced, per repetition


def _measure(quick: bool) -> Measured:
    """Every probe, on a Ray instance of its own (the repetitions interleaved: on shared
    cores each measurement moves by 10-30 % from one to the next)."""
    islands, numel, reps = (2, 2_000_000, 3) if quick else (4, 8_000_000, 5)
    shard_counts = [1, 2] if quick else [1, 2, 4]
    if not ray.is_initialized():
        ray.init(num_cpus=islands, include_dashboard=False, log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG)
    try:
        memcpy = memcpy_gbps(max(islands * numel, 32_000_000), reps * 3)  # beyond the caches
        coord = {s: coordinator_gbps(islands, numel, s, reps, broadcast=s == 1) for s in shard_counts}
        threaded = coordinator_gbps(islands, numel, 1, reps, threads=1)  # S = 1 on one core
        paced = coordinator_gbps(islands, numel, 1, reps, broadcast=True, gap_s=GAP_S)
        paced_threaded = coordinator_gbps(islands, numel, 1, reps, threads=1, gap_s=GAP_S)
        gloo = gloo_allreduce_gbps(islands, numel, reps)
        vs_gloo = [(gloo["seconds"] / coord[1]["round_seconds"], gloo["seconds"] / paced["round_seconds"])]
        for _ in range(1 if quick else REPEATS - 1):  # the same three again, one after another
            again = coordinator_gbps(islands, numel, 1, reps, broadcast=True)
            again_paced = coordinator_gbps(islands, numel, 1, reps, broadcast=True, gap_s=GAP_S)
            g = gloo_allreduce_gbps(islands, numel, reps)["seconds"]
            vs_gloo.append((g / again["round_seconds"], g / again_paced["round_seconds"]))
    finally:
        ray.shutdown()
    return Measured(
        islands=islands,
        numel=numel,
        memcpy=memcpy,
        coord=coord,
        threaded=threaded,
        paced=paced,
        paced_threaded=paced_threaded,
        gloo=gloo,
        vs_gloo=vs_gloo,
    )


def _runs(quick: bool, work: Path) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """Real sync DiLoCo runs at the default H with 1 and 2 coordinator shards: their
    summaries and steady-state overheads."""
    rounds = 3 if quick else 6
    table = {
        f"sync_s{s}": (
            f"sync DiLoCo, default H, {s} coordinator shard(s)",
            [
                "islands.count=2",
                f"rounds={rounds}",
                f"coordinator.shards={s}",
                "ray.num_cpus=2",
                "compression.chunk=1024",
            ],
        )
        for s in (1, 2)
    }
    summaries = run_methods([], table, work)
    return summaries, {name: steady_overhead(work / name) for name in table}


def _checks(m: Measured, overhead: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The issue's targets against memcpy and gloo (the ratios to gloo: medians of the
    repetitions)."""
    paced_gbps = m.paced["gbps"]
    ratio, ratio_paced = (statistics.median(r[i] for r in m.vs_gloo) for i in (0, 1))
    n = len(m.vs_gloo)
    return {
        "coordinator_ge_0.7x_memcpy (default settings: S = 1)": {
            "value": m.coord[1]["gbps"] / m.memcpy,
            "target": 0.7,
            "ok": m.coord[1]["gbps"] >= 0.7 * m.memcpy,
        },
        "coordinator_ge_0.7x_memcpy (default settings, rounds paced as a run's)": {
            "value": paced_gbps / m.memcpy,
            "target": 0.7,
            "ok": paced_gbps >= 0.7 * m.memcpy,
        },
        f"round_with_broadcast_ge_1.5x_gloo_allreduce (default settings; median of {n})": {
            "value": ratio,
            "target": 1.5,
            "ok": ratio >= 1.5,
        },
        f"round_with_broadcast_ge_1.5x_gloo_allreduce (default settings, rounds paced as a run's; median of {n})": {
            "value": ratio_paced,
            "target": 1.5,
            "ok": ratio_paced >= 1.5,
        },
        "overhead_lt_5pct_default_h": {"value": overhead["sync_s1"], "ok": overhead["sync_s1"] < 0.05},
    }


def _probe_row(c: dict[str, float]) -> dict[str, float]:
    return {"gbps": c["gbps"], "seconds_per_round": c["seconds"], "page_faults_per_round": c["page_faults"]}


def _methods(
    m: Measured, summaries: dict[str, dict[str, Any]], overhead: dict[str, float]
) -> dict[str, dict[str, Any]]:
    """One row per path measured and per run."""
    methods: dict[str, dict[str, Any]] = {f"coordinator_s{s}": _probe_row(c) for s, c in m.coord.items()}
    methods["coordinator_s1_paced"] = _probe_row(m.paced)
    methods["coordinator_s1_1thread_paced"] = _probe_row(m.paced_threaded)
    methods["round_s1_with_broadcast_paced"] = {
        "gbps": m.paced["round_gbps"],
        "seconds_per_round": m.paced["round_seconds"],
    }
    first = m.coord[1]
    methods["coordinator_s1_mapped"] = {"gbps": first["mapped_gbps"], "seconds_per_round": first["mapped_seconds"]}
    methods["round_s1_with_broadcast"] = {"gbps": first["round_gbps"], "seconds_per_round": first["round_seconds"]}
    methods["coordinator_s1_1thread"] = {"gbps": m.threaded["gbps"], "seconds_per_round": m.threaded["seconds"]}
    methods["gloo_allreduce"] = {"gbps": m.gloo["gbps"], "seconds_per_round": m.gloo["seconds"]}
    methods["memcpy"] = {"gbps": m.memcpy}
    for name, s in summaries.items():
        methods[name] = {
            "overhead_fraction": overhead[name],
            "final_eval_loss": s["final_eval_loss"],
            "train_seconds": s["train_seconds"],
            "idle_fraction_whole_run": s["idle_fraction"],
        }
    return methods


def _extra(
    m: Measured, overhead: dict[str, float], breakdown: dict[str, dict[str, float]], checks: dict[str, Any]
) -> dict[str, Any]:
    """The report's figures beyond the rows, under the keys `docs/datapath.json` has."""
    coord, paced = m.coord, m.paced
    return {
        "coordinator_gbps": {str(s): c["gbps"] for s, c in coord.items()},
        "coordinator_gbps_s1_1thread": m.threaded["gbps"],
        "coordinator_gbps_s1_mapped": coord[1]["mapped_gbps"],
        "coordinator_gbps_paced": {"1": paced["gbps"], "1_thread": m.paced_threaded["gbps"]},
        "coordinator_page_faults_per_round_paced": paced["page_faults"],
        "round_gbps_with_broadcast_paced": paced["round_gbps"],
        "paced_gap_seconds": GAP_S,
        "coordinator_page_faults_per_round": {str(s): c["page_faults"] for s, c in coord.items()},
        "round_gbps_with_broadcast": coord[1]["round_gbps"],
        "round_breakdown_seconds": breakdown,
        # gloo's all-reduce time over the round's, back to back and paced: the first run
        # (the rows above), then each repetition; the checks take the medians
        "round_vs_gloo_repeats": [{"back_to_back": a, "paced": b} for a, b in m.vs_gloo],
        "gloo_allreduce_gbps": m.gloo["gbps"],
        "memcpy_gbps": m.memcpy,
        "overhead_fraction": overhead["sync_s1"],
        "overhead_fraction_by_shards": {"1": overhead["sync_s1"], "2": overhead["sync_s2"]},
        "islands": m.islands,
        "params": m.numel,
        "checks": checks,
    }


def datapath(quick: bool, work: Path) -> BenchResult:
    m = _measure(quick)
    summaries, overhead = _runs(quick, work)
    checks = _checks(m, overhead)
    coord, gloo = m.coord, m.gloo
    per_s = ", ".join(f"S={s} {c['gbps']:.2f}" for s, c in coord.items()) + f", S=1 1 thread {m.threaded['gbps']:.2f}"
    line = (
        f"datapath: coordinator {per_s} GB/s; a round with its broadcast {coord[1]['round_gbps']:.2f} GB/s; "
        f"gloo all-reduce {gloo['gbps']:.2f} GB/s; memcpy {m.memcpy:.2f} GB/s; overhead at default H "
        f"{100 * overhead['sync_s1']:.1f}% (S=1), {100 * overhead['sync_s2']:.1f}% (S=2); {targets_met(checks)}"
    )
    scaling = {"coordinator": [(float(s), c["gbps"]) for s, c in coord.items()]}
    references = {"memcpy": m.memcpy, "gloo all-reduce": gloo["gbps"]}
    breakdown = {"back_to_back": _breakdown(coord[1]), "paced": _breakdown(m.paced)}
    md = _markdown(m, overhead, checks) + "\n\n" + _breakdown_markdown(breakdown, gloo["seconds"])
    md += (
        "\n\ngloo's all-reduce time ÷ a round's with its broadcast, back to back / paced, in each of "
        f"{len(m.vs_gloo)} repetitions of the three, one after another (the checks take the medians): "
        + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in m.vs_gloo)
    )
    return BenchResult(
        "datapath",
        quick,
        _methods(m, summaries, overhead),
        line,
        md,
        [Panel("coordinator shards S", scaling, y_label="GB/s (1e9 bytes/s)", references=references)],
        extra=_extra(m, overhead, breakdown, checks),
    )


BREAKDOWN = (
    ("step", "the coordinator's step: fetch the results, screen them, mean and outer step"),
    ("put", "publish: `ray.put` of the new parameters (one copy into the object store)"),
    ("digest", "publish: their digest (XXH3-128)"),
    ("islands", "the islands' calls, from the coordinator's call to the last island's return"),
    ("island_check", "of which one island's digest check (median over islands)"),
    ("island_load", "of which one island's load into its model (median over islands)"),
    ("islands_cpu", "every island's check and load added up, in CPU time (the islands share the cores)"),
    ("rest", "the rest: the driver's call to the coordinator and its return (Ray)"),
)


def _breakdown(c: dict[str, float]) -> dict[str, float]:
    """Where a round with its broadcast went (medians over the repetitions, seconds); `rest`
    is the round less the coordinator's four parts."""
    parts = {key: c[f"round_{key}_seconds"] for key, _ in BREAKDOWN if key != "rest"}
    parts["rest"] = c["round_seconds"] - sum(parts[k] for k in ("step", "put", "digest", "islands"))
    parts["round"] = c["round_seconds"]
    return parts


def _breakdown_markdown(breakdown: dict[str, dict[str, float]], gloo_s: float) -> str:
    rows = [[what, *(f"{1000 * b[key]:.1f}" for b in breakdown.values())] for key, what in BREAKDOWN]
    rows.append(["the round", *(f"{1000 * b['round']:.1f}" for b in breakdown.values())])
    rows.append(["1.5× gloo's all-reduce would need at most", *(f"{1000 * gloo_s / 1.5:.1f}" for _ in breakdown)])
    return (
        f"Where a round with its broadcast goes (S = 1, ms, medians; {os.cpu_count()} cores for "
        "the coordinator and every island):\n\n" + md_table(["part", "back to back", f"rounds {GAP_S:g} s apart"], rows)
    )


def _threads(n: float) -> str:
    """The default's thread count (`step_threads`: sync DiLoCo's islands wait for the
    step, so every core of this machine)."""
    return f"{n:.0f} thread{'s' if n != 1 else ''} (the default here)"


def _markdown(m: Measured, overhead: dict[str, float], checks: dict[str, dict[str, Any]]) -> str:
    islands, numel, coord, first, one, two = m.islands, m.numel, m.coord, m.coord[1], m.paced, m.paced_threaded
    mb = islands * numel * 4 / 1e6

    def row(path: str, gbps: float, seconds: float | None, faults: float | None) -> list[str]:
        ms = "–" if seconds is None else f"{1000 * seconds:.0f}"
        return [path, f"{gbps:.2f}", ms, "–" if faults is None else f"{faults:.0f}"]

    rows = [
        row(
            f"coordinator, S = {s}" + (f", {_threads(c['threads'])}" if s == 1 else ""),
            c["gbps"],
            c["seconds"],
            c["page_faults"],
        )
        for s, c in coord.items()
    ]
    rows += [
        row(
            "coordinator, S = 1, `coordinator.threads: 1`",
            m.threaded["gbps"],
            m.threaded["seconds"],
            m.threaded["page_faults"],
        ),
        row(
            "coordinator, S = 1, the same pseudo-gradients already in its memory (pages mapped)",
            first["mapped_gbps"],
            first["mapped_seconds"],
            0,
        ),
        row(
            "a round, S = 1, with the broadcast (publish, fetch, verify, load)",
            first["round_gbps"],
            first["round_seconds"],
            None,
        ),
    ]
    rows += [
        row(f"coordinator, S = 1, {what}, rounds {GAP_S:g} s apart", c["gbps"], c["seconds"], c["page_faults"])
        for what, c in ((_threads(one["threads"]), one), ("`coordinator.threads: 1`", two))
    ]
    rows += [
        row(
            f"a round, S = 1, with the broadcast, rounds {GAP_S:g} s apart",
            one["round_gbps"],
            one["round_seconds"],
            None,
        ),
        row("gloo all-reduce", m.gloo["gbps"], m.gloo["seconds"], None),
        row("memcpy", m.memcpy, None, None),
    ]
    over = md_table(["run", "steady-state overhead"], [[k, f"{100 * v:.2f}%"] for k, v in overhead.items()])
    return (
        f"{islands} islands × {numel / 1e6:.0f} M fp32 values = {mb:.0f} MB of pseudo-gradient per round, "
        "all on this machine (shard actors and islands share its cores). The coordinator reads "
        "the islands' results where Ray's object store put them. A round's results land on "
        "pages the store freed earlier if Ray has freed the previous round's by then (it frees "
        f"in batches, every {RAY_SYSTEM_CONFIG['free_objects_period_milliseconds']} ms in the Ray "
        "instances Archipelago starts, once a second by Ray's default), else on pages the "
        "coordinator's process has not mapped yet, each mapped on first touch (a page fault). "
        f"The rows back to back, and the same rounds {GAP_S:g} s apart as a run's are (its "
        "islands compute between them). The row with the pseudo-gradients already in the "
        "coordinator's memory is the same work with no page to map.\n\n"
        + md_table(["path", "GB/s", "ms per round", "coordinator's page faults per round"], rows)
        + "\n\n"
        + over
        + "\n\n"
        + checks_table(checks)
    )
