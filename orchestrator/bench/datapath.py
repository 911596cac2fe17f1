"""`datapath`: how fast the coordinator ingests pseudo-gradients, measured side by side
in one run on one Ray instance:

- `coordinator_gbps[S]`: K islands' pseudo-gradients (P fp32 values each) already in
  the islands' object stores; the time for the production servers (one coordinator, or S
  shard actors) to fetch them, screen them (finite, norm guard), average them and take
  the outer Nesterov step. Bytes = K·P·4. One torch thread per process (the default),
  plus S = 1 with `coordinator.threads: 2`. With the page faults the coordinator's process
  took per round: the store's pages it had not mapped yet.
- `coordinator_gbps_s1_mapped`: the same work for S = 1 on the same pseudo-gradients
  copied once into the coordinator's own memory, so no page is mapped on the way: how
  much of the gap to memcpy is reading fresh object-store pages.
- `round_gbps` (S = 1): the same, plus the broadcast, as a round has it: the coordinator
  publishes the new parameters (`ray.put` and their digest, as `Publisher` does) and
  every island fetches them, checks the digest (a verified hand-off) and copies them into
  its model. This is what an all-reduce's result in every process compares with.
- `gloo_allreduce_gbps`: the same K·P·4 bytes all-reduced by `torch.distributed` (gloo)
  across K processes (what a data-parallel step would spend instead; every process
  ends with the sum, so nothing is left to broadcast).
- `memcpy_gbps`: numpy copying max(K·P, 32 M) fp32 values, beyond the CPU caches
  (bytes copied per second).
- `overhead_fraction`: in real sync DiLoCo runs at the default H, the share of the
  islands' steady-state time not spent computing (no simulated link), for S = 1 and 2.

GB/s are 1e9 bytes per second. Each measurement is the median of several repetitions.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from orchestrator.bench.report import BenchResult, Panel, checks_table, md_table, targets_met
from orchestrator.bench.runner import run_methods
from orchestrator.config import RunConfig
from orchestrator.config_load import load_config
from orchestrator.engine.logfiles import read_lines
from orchestrator.engine.outer_slices import SlicedOuter
from orchestrator.engine.outer_step import LocalOuter, Outer
from orchestrator.engine.policies import build_policies, outer_rule
from orchestrator.engine.types import Contribution
from orchestrator.runtime.slices import start_slices
from workers.runtime.island_group import group_address
from workers.wire.compress import encode
from workers.wire.flat import slice_bounds
from workers.wire.handoff import params_digest
from workers.wire.messages import RoundResult, Sliced


class _Source:
    """Stands in for an island's exchange only: it publishes a pseudo-gradient exactly as
    `RayIsland` does (inline payload for one coordinator; S `ray.put` slices for shards)
    and takes the new parameters as an island's full download does."""

    def __init__(self, island: int, numel: int, shards: int, chunk: int) -> None:
        self.island, self.shards, self.chunk = island, shards, chunk
        self.delta = np.random.default_rng(island).normal(0, 1e-3, numel).astype(np.float32)
        self.model = np.zeros(numel, dtype=np.float32)  # the island's copy of the parameters

    def receive(self, published: list[ray.ObjectRef], digest: str) -> None:
        """What an island does with a full download: fetch, check the digest, load it."""
        params = ray.get(published[0])
        if params_digest(params) != digest:
            raise RuntimeError("the published parameters do not match their digest")
        np.copyto(self.model, params)

    def result(self, version: int) -> RoundResult:
        if self.shards == 1:
            payload: Any = encode(self.delta)
        else:
            bounds = slice_bounds(self.delta.size, self.shards, self.chunk)
            payload = Sliced(parts=tuple(ray.put(encode(self.delta[lo:hi], "none", self.chunk)) for lo, hi in bounds))
        return RoundResult(
            island=self.island,
            version=version,
            payload=payload,
            weight=1000,
            steps=1,
            mean_loss=0.0,
            compute_s=0.0,
            finished_at=time.time(),
            positions={},
            shard_tokens={},
        )


class _Aggregator:
    """The coordinator's side of a round, with the production outer step and admission of `cfg`."""

    def __init__(self, cfg: RunConfig, numel: int) -> None:
        torch.set_num_threads(cfg.coordinator.threads)
        flat = torch.zeros(numel)
        self.outer: Outer
        if cfg.coordinator.shards > 1:
            bounds = slice_bounds(numel, cfg.coordinator.shards, cfg.compression.chunk)
            self.outer = SlicedOuter(flat, bounds, start_slices(cfg, flat.numpy(), bounds, "datapath"))
        else:
            self.outer = LocalOuter(flat, outer_rule(cfg))
        self.admission = build_policies(cfg, numel).admission
        self.version = 0
        self.local: list[tuple[int, np.ndarray]] = []

    def aggregate(self, refs: list[ray.ObjectRef]) -> tuple[float, int]:
        """A round's aggregation of the results in the object store: (seconds, the page
        faults this process took meanwhile: the store's pages it had not mapped yet)."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        results = ray.get(refs)
        deltas = [(r.island, r.delta()) for r in results]  # arrays, or S slices' references
        seconds = self._step(deltas, t0)
        if not self.local and all(isinstance(d, np.ndarray) for _, d in deltas):
            self.local = [(i, np.array(d)) for i, d in deltas]
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    def aggregate_mapped(self) -> float:
        """The same work on the first round's pseudo-gradients copied into this process's
        own memory once (pages mapped): what reading the store's fresh pages costs is the
        difference."""
        return self._step(self.local, time.perf_counter())

    def _step(self, deltas: list[tuple[int, Any]], t0: float) -> float:
        contributions = [Contribution(island=i, version=self.version, delta=d, weight=1000) for i, d in deltas]
        key, facts = self.outer.inspect(contributions)
        verdicts = [self.admission.judge(c, f, self.version, self.version) for c, f in zip(contributions, facts)]
        assert all(v.admitted for v in verdicts), verdicts
        self.outer.apply(key, {c.island: c.weight for c in contributions})
        self.version += 1
        return time.perf_counter() - t0

    def publish(self) -> tuple[list[ray.ObjectRef], str | None]:
        """The new version as `Publisher.publish` makes it: put once, with its digest."""
        params = self.outer.params()
        return [ray.put(params)], params_digest(params)


class _Reducer:
    def __init__(self, numel: int) -> None:
        torch.set_num_threads(1)
        self.buf = torch.randn(numel)

    def address(self) -> str:
        return group_address()

    def join(self, address: str, rank: int, world: int) -> None:
        torch.distributed.init_process_group(
            "gloo", init_method=address, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )

    def allreduce(self, reps: int) -> float:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.distributed.all_reduce(self.buf)
        return (time.perf_counter() - t0) / reps


def memcpy_gbps(numel: int, reps: int) -> float:
    src = np.random.default_rng(0).normal(size=numel).astype(np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


def coordinator_gbps(
    islands: int, numel: int, shards: int, reps: int, threads: int = 1, broadcast: bool = False
) -> dict[str, float]:
    cfg = load_config(
        None,
        [
            "mode=diloco",
            f"islands.count={islands}",
            f"coordinator.shards={shards}",
            f"coordinator.threads={threads}",
            "compression.chunk=4096",
        ],
    )
    # Ray's stubs type handles of `ray.remote(cls)` loosely; these are plain actor handles
    sources: list[Any] = [
        ray.remote(_Source).options(num_cpus=0).remote(i, numel, shards, 4096) for i in range(islands)
    ]
    agg: Any = ray.remote(_Aggregator).options(num_cpus=0, max_concurrency=1).remote(cfg, numel)
    times: list[float] = []
    rounds: list[float] = []
    mapped: list[float] = []
    faults: list[int] = []
    for v in range(reps + 1):  # the first repetition warms up (allocations, shard start)
        refs = [s.result.remote(v) for s in sources]
        ray.wait(refs, num_returns=len(refs))
        t0 = time.perf_counter()
        elapsed, faulted = ray.get(agg.aggregate.remote(refs))
        if broadcast:
            published, digest = ray.get(agg.publish.remote())
            ray.get([s.receive.remote(published, digest) for s in sources])
        if v:
            times.append(elapsed)
            faults.append(faulted)
            rounds.append(time.perf_counter() - t0)
            if shards == 1:
                mapped.append(ray.get(agg.aggregate_mapped.remote()))
    for a in (*sources, agg):
        ray.kill(a)
    seconds, nbytes = statistics.median(times), islands * numel * 4
    out = {"seconds": seconds, "gbps": nbytes / seconds / 1e9, "page_faults": statistics.median(faults)}
    if mapped:
        out.update(mapped_seconds=statistics.median(mapped), mapped_gbps=nbytes / statistics.median(mapped) / 1e9)
    if broadcast:
        round_s = statistics.median(rounds)
        out.update(round_seconds=round_s, round_gbps=nbytes / round_s / 1e9)
    return out


def gloo_allreduce_gbps(processes: int, numel: int, reps: int) -> dict[str, float]:
    actors: list[Any] = [ray.remote(_Reducer).options(num_cpus=0).remote(numel) for _ in range(processes)]
    address = ray.get(actors[0].address.remote())
    ray.get([a.join.remote(address, r, processes) for r, a in enumerate(actors)])
    ray.get([a.allreduce.remote(1) for a in actors])  # warm-up
    seconds = max(ray.get([a.allreduce.remote(reps) for a in actors]))
    for a in actors:
        ray.kill(a)
    return {"seconds": seconds, "gbps": processes * numel * 4 / seconds / 1e9}


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


def datapath(quick: bool, work: Path) -> BenchResult:
    islands, numel, reps = (2, 2_000_000, 3) if quick else (4, 8_000_000, 5)
    shard_counts = [1, 2] if quick else [1, 2, 4]
    if not ray.is_initialized():
        ray.init(num_cpus=islands, include_dashboard=False, log_to_driver=False)
    try:
        memcpy = memcpy_gbps(max(islands * numel, 32_000_000), reps * 3)  # beyond the caches
        coord = {s: coordinator_gbps(islands, numel, s, reps, broadcast=s == 1) for s in shard_counts}
        threaded = coordinator_gbps(islands, numel, 1, reps, threads=2)  # S = 1 on both cores
        gloo = gloo_allreduce_gbps(islands, numel, reps)
    finally:
        ray.shutdown()
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
    overhead = {name: steady_overhead(work / name) for name in table}
    default, with_broadcast = coord[1]["gbps"], coord[1]["round_gbps"]
    checks = {
        "coordinator_ge_0.7x_memcpy (default settings: S = 1, 1 thread)": {
            "value": default / memcpy,
            "target": 0.7,
            "ok": default >= 0.7 * memcpy,
        },
        "round_with_broadcast_ge_1.5x_gloo_allreduce (default settings)": {
            "value": with_broadcast / gloo["gbps"],
            "target": 1.5,
            "ok": with_broadcast >= 1.5 * gloo["gbps"],
        },
        "overhead_lt_5pct_default_h": {"value": overhead["sync_s1"], "ok": overhead["sync_s1"] < 0.05},
    }
    methods = {
        f"coordinator_s{s}": {
            "gbps": c["gbps"],
            "seconds_per_round": c["seconds"],
            "page_faults_per_round": c["page_faults"],
        }
        for s, c in coord.items()
    }
    methods["coordinator_s1_mapped"] = {
        "gbps": coord[1]["mapped_gbps"],
        "seconds_per_round": coord[1]["mapped_seconds"],
    }
    methods["round_s1_with_broadcast"] = {"gbps": with_broadcast, "seconds_per_round": coord[1]["round_seconds"]}
    methods["coordinator_s1_2threads"] = {"gbps": threaded["gbps"], "seconds_per_round": threaded["seconds"]}
    methods["gloo_allreduce"] = {"gbps": gloo["gbps"], "seconds_per_round": gloo["seconds"]}
    methods["memcpy"] = {"gbps": memcpy}
    for name, s in summaries.items():
        methods[name] = {
            "overhead_fraction": overhead[name],
            "final_eval_loss": s["final_eval_loss"],
            "train_seconds": s["train_seconds"],
            "idle_fraction_whole_run": s["idle_fraction"],
        }
    per_s = ", ".join(f"S={s} {c['gbps']:.2f}" for s, c in coord.items()) + f", S=1 2 threads {threaded['gbps']:.2f}"
    line = (
        f"datapath: coordinator {per_s} GB/s; a round with its broadcast {with_broadcast:.2f} GB/s; "
        f"gloo all-reduce {gloo['gbps']:.2f} GB/s; memcpy {memcpy:.2f} GB/s; overhead at default H "
        f"{100 * overhead['sync_s1']:.1f}% (S=1), {100 * overhead['sync_s2']:.1f}% (S=2); {targets_met(checks)}"
    )
    scaling = {"coordinator": [(float(s), c["gbps"]) for s, c in coord.items()]}
    references = {"memcpy": memcpy, "gloo all-reduce": gloo["gbps"]}
    md = _markdown(islands, numel, coord, threaded, gloo, memcpy, overhead, checks)
    return BenchResult(
        "datapath",
        quick,
        methods,
        line,
        md,
        [Panel("coordinator shards S", scaling, y_label="GB/s (1e9 bytes/s)", references=references)],
        extra={
            "coordinator_gbps": {str(s): c["gbps"] for s, c in coord.items()},
            "coordinator_gbps_s1_2threads": threaded["gbps"],
            "coordinator_gbps_s1_mapped": coord[1]["mapped_gbps"],
            "coordinator_page_faults_per_round": {str(s): c["page_faults"] for s, c in coord.items()},
            "round_gbps_with_broadcast": with_broadcast,
            "gloo_allreduce_gbps": gloo["gbps"],
            "memcpy_gbps": memcpy,
            "overhead_fraction": overhead["sync_s1"],
            "overhead_fraction_by_shards": {"1": overhead["sync_s1"], "2": overhead["sync_s2"]},
            "islands": islands,
            "params": numel,
            "checks": checks,
        },
    )


def _markdown(
    islands: int,
    numel: int,
    coord: dict[int, dict[str, float]],
    threaded: dict[str, float],
    gloo: dict[str, float],
    memcpy: float,
    overhead: dict[str, float],
    checks: dict[str, dict[str, Any]],
) -> str:
    mb = islands * numel * 4 / 1e6
    rows = [
        [f"coordinator, S = {s}", f"{c['gbps']:.2f}", f"{1000 * c['seconds']:.0f}", f"{c['page_faults']:.0f}"]
        for s, c in coord.items()
    ]
    rows.append(
        [
            "coordinator, S = 1, `coordinator.threads: 2`",
            f"{threaded['gbps']:.2f}",
            f"{1000 * threaded['seconds']:.0f}",
            f"{threaded['page_faults']:.0f}",
        ]
    )
    rows.append(
        [
            "coordinator, S = 1, the same pseudo-gradients already in its memory (pages mapped)",
            f"{coord[1]['mapped_gbps']:.2f}",
            f"{1000 * coord[1]['mapped_seconds']:.0f}",
            "0",
        ]
    )
    first = coord[1]
    rows.append(
        [
            "a round, S = 1, with the broadcast (publish, fetch, verify, load)",
            f"{first['round_gbps']:.2f}",
            f"{1000 * first['round_seconds']:.0f}",
            "–",
        ]
    )
    rows += [
        ["gloo all-reduce", f"{gloo['gbps']:.2f}", f"{1000 * gloo['seconds']:.0f}", "–"],
        ["memcpy", f"{memcpy:.2f}", "–", "–"],
    ]
    over = md_table(["run", "steady-state overhead"], [[k, f"{100 * v:.2f}%"] for k, v in overhead.items()])
    return (
        f"{islands} islands × {numel / 1e6:.0f} M fp32 values = {mb:.0f} MB of pseudo-gradient per round, "
        "all on this machine (shard actors and islands share its cores). The coordinator reads "
        "the islands' results where Ray's object store put them: pages its process has not "
        "mapped yet, each mapped on first touch (a page fault); the row with the "
        "pseudo-gradients already in its memory is the same work without that.\n\n"
        + md_table(["path", "GB/s", "ms per round", "coordinator's page faults per round"], rows)
        + "\n\n"
        + over
        + "\n\n"
        + checks_table(checks)
    )
