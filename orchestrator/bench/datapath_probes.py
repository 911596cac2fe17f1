"""The measurements of `bench datapath` (`datapath.py` runs them and reports): the
production coordinator's aggregation fed by actors that publish pseudo-gradients as
islands do, a round with its broadcast, gloo's all-reduce of the same bytes, and memcpy.
Each returns seconds and GB/s (1e9 bytes per second), the median of `reps` repetitions."""

from __future__ import annotations

import resource
import statistics
import time
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch

from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.policies import build_policies
from archipelago.orchestrator.engine.step.outer import Commit, LocalOuter, Outer
from archipelago.orchestrator.engine.step.rules import outer_rule
from archipelago.orchestrator.engine.step.slices import SlicedOuter
from archipelago.orchestrator.engine.threads import step_threads
from archipelago.orchestrator.engine.types import Contribution
from archipelago.orchestrator.runtime.slices import start_slices
from archipelago.workers.runtime.island_group import group_address
from archipelago.workers.wire.compress import encode
from archipelago.workers.wire.flat import slice_bounds
from archipelago.workers.wire.handoff import params_digest
from archipelago.workers.wire.messages import RoundResult, Sliced


class _Source:
    """Stands in for an island's exchange only: it publishes a pseudo-gradient exactly as
    `IslandActor` does (inline payload for one coordinator; S `ray.put` slices for shards)
    and takes the new parameters as an island's full download does."""

    def __init__(self, island: int, numel: int, shards: int, chunk: int) -> None:
        self.island, self.shards, self.chunk = island, shards, chunk
        self.delta = np.random.default_rng(island).normal(0, 1e-3, numel).astype(np.float32)
        self.model = np.zeros(numel, dtype=np.float32)  # the island's copy of the parameters

    def receive(self, params: np.ndarray, digest: str) -> tuple[float, float, float]:
        """What an island does with a full download: fetch (Ray resolves the reference, a
        top-level argument as in a work order, from the object store), check the digest,
        load it. Returns the seconds of the check and of the load, and the CPU seconds of
        both (4 islands on 2 cores also wait for a core: the first two count that)."""
        c0, t0 = time.thread_time(), time.perf_counter()
        if params_digest(params) != digest:
            raise RuntimeError("the published parameters do not match their digest")
        t1 = time.perf_counter()
        np.copyto(self.model, params)
        return t1 - t0, time.perf_counter() - t1, time.thread_time() - c0

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

    def __init__(self, cfg: RunConfig, numel: int, islands: list[Any] | None = None) -> None:
        """`islands`: the sources to hand each new version to (None: no broadcast), held
        as a coordinator holds its islands' handles."""
        policies = build_policies(cfg, numel)
        # every island on this machine, whose cores the step takes if they all wait for it
        # (a barrier's), as `Outputs.step_threads` decides
        torch.set_num_threads(step_threads(cfg, 0 if policies.pacing.islands_wait else cfg.islands.count))
        flat = torch.zeros(numel)
        self.outer: Outer
        if cfg.coordinator.slices > 1:
            bounds = slice_bounds(numel, cfg.coordinator.slices, cfg.compression.chunk)
            calls = start_slices(cfg, flat.numpy(), bounds, "datapath")
            self.outer = SlicedOuter(flat, bounds, calls, outer_rule(cfg).merge)
        else:
            self.outer = LocalOuter(flat, outer_rule(cfg))
        self.admission = policies.admission
        self.islands = islands
        self.version = 0
        self.local: list[tuple[int, np.ndarray, int]] = []

    def aggregate(self, refs: list[ray.ObjectRef]) -> tuple[float, int, dict[str, float]]:
        """A round's aggregation of the results in the object store: (seconds, the page
        faults this process took meanwhile: the store's pages it had not mapped yet, and
        where a round with its broadcast spent its time). With islands, the round goes on
        as the coordinator's does: the new version published right after the step, handed
        to every island in a call of this actor's (as the coordinator sends its next
        orders) and the call returns once every island holds it."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        results = ray.get(refs)
        deltas = [(r.island, r.delta(), r.weight) for r in results]  # arrays, or S slices' references
        seconds = self._step(deltas, t0)
        if not self.local and all(isinstance(d, np.ndarray) for _, d, _ in deltas):
            self.local = [(i, np.array(d), w) for i, d, w in deltas]
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        parts: dict[str, float] = {}
        if self.islands:
            t1 = time.perf_counter()
            params = self.outer.params()
            published = ray.put(params)  # as `Publisher.publish`: put once, with its digest
            t2 = time.perf_counter()
            digest = params_digest(params)
            t3 = time.perf_counter()
            checks, loads, cpu = zip(*ray.get([s.receive.remote(published, digest) for s in self.islands]))
            parts = {
                "step": seconds,
                "put": t2 - t1,
                "digest": t3 - t2,
                "islands": time.perf_counter() - t3,
                "island_check": statistics.median(checks),
                "island_load": statistics.median(loads),
                "islands_cpu": sum(cpu),
            }
        return seconds, faulted, parts

    def aggregate_mapped(self) -> float:
        """The same work on the first round's pseudo-gradients copied into this process's
        own memory once (pages mapped): what reading the store's fresh pages costs is the
        difference."""
        return self._step(self.local, time.perf_counter())

    def _step(self, deltas: list[tuple[int, Any, int]], t0: float) -> float:
        contributions = [Contribution(island=i, version=self.version, delta=d, weight=w) for i, d, w in deltas]
        proposal = self.outer.propose(contributions)
        verdicts = [
            self.admission.judge(c, f, self.version, self.version) for c, f in zip(contributions, proposal.facts)
        ]
        assert all(v.admitted for v in verdicts), verdicts
        self.outer.commit(proposal, Commit(weights={c.island: c.weight for c in contributions}))
        self.version += 1
        return time.perf_counter() - t0

    def threads(self) -> int:
        return torch.get_num_threads()


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
    islands: int,
    numel: int,
    shards: int,
    reps: int,
    threads: int | None = None,
    broadcast: bool = False,
    gap_s: float = 0.0,
) -> dict[str, float]:
    """The production coordinator's rounds on `islands` fresh pseudo-gradients each.
    Back to back (`gap_s` 0), each round's results are created while Ray is still freeing
    the previous round's, so the store places them on pages the coordinator has not
    touched; `gap_s` apart (islands computing between rounds, as in a run), the store
    reuses the freed pages."""
    cfg = load_config(
        None,
        [
            "mode=diloco",
            f"islands.count={islands}",
            f"coordinator.shards={shards}",
            *([f"coordinator.threads={threads}"] if threads is not None else []),  # else the default's
            "compression.chunk=4096",
        ],
    )
    # Ray's stubs type handles of `ray.remote(cls)` loosely; these are plain actor handles
    sources: list[Any] = [
        ray.remote(_Source).options(num_cpus=0).remote(i, numel, shards, 4096) for i in range(islands)
    ]
    agg: Any = (
        ray.remote(_Aggregator)
        .options(num_cpus=0, max_concurrency=1)
        .remote(cfg, numel, sources if broadcast else None)
    )
    times: list[float] = []
    rounds: list[float] = []
    mapped: list[float] = []
    faults: list[int] = []
    parts: list[dict[str, float]] = []
    for v in range(reps + 1):  # the first repetition warms up (allocations, shard start)
        refs = [s.result.remote(v) for s in sources]
        ray.wait(refs, num_returns=len(refs))
        t0 = time.perf_counter()
        elapsed, faulted, split = ray.get(agg.aggregate.remote(refs))
        if v:
            times.append(elapsed)
            faults.append(faulted)
            rounds.append(time.perf_counter() - t0)
            parts.append(split)
            if shards == 1:
                mapped.append(ray.get(agg.aggregate_mapped.remote()))
        del refs  # the round's results are freed, as a coordinator's are once it has stepped
        time.sleep(gap_s)
    used = ray.get(agg.threads.remote())
    for a in (*sources, agg):
        ray.kill(a)
    seconds, nbytes = statistics.median(times), islands * numel * 4
    out = {
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "page_faults": statistics.median(faults),
        "threads": used,
    }
    if mapped:
        out.update(mapped_seconds=statistics.median(mapped), mapped_gbps=nbytes / statistics.median(mapped) / 1e9)
    if broadcast:
        round_s = statistics.median(rounds)
        out.update(round_seconds=round_s, round_gbps=nbytes / round_s / 1e9)
        out.update({f"round_{key}_seconds": statistics.median(p[key] for p in parts) for key in parts[0]})
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
