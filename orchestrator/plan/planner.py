"""`archipelago plan`: what every process of a run needs, and whether the cluster has it.

Before anything starts, the plan gives each process its peak memory — the coordinator
(parameters, outer optimizer state, the mean buffer,
the object store's published versions and arriving pseudo-gradients, its evaluation if
it evaluates), each coordinator slice, each island worker (on its accelerator and on its
host), the evaluation actor — and the bytes each island's link carries per round and per
run. The model's own part is measured by torch at the real shapes without allocating it
(`measure.py`); the rest is counted from the config. Then it checks every process against
the node it will run on (`cluster.py`) and names what does not fit, by how much.

It also refuses a layout that works on one host but not on a cluster: a data-parallel
warm start (or `mode: ddp`) sends every island's gradient through the coordinator every
step, which on a cluster whose head hosts no island is a parameter server on one CPU pod.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from archipelago.workers.wire.spec import Sharding

from ..config import RunConfig, WarmStartMode
from ..config_operations import EvalPlace
from ..engine.step.rules import rule_of
from ..modes import mode_of
from .cluster import DRAIN_ENV, Cluster, NodeKind
from .head import (
    DEFAULT_LINK_GBPS,
    DEFAULT_STEP_S,
    CodecChoice,
    HeadLoad,
    SliceChoice,
    WarmLoad,
    choose_head,
    head_load,
    warm_load,
)
from .memory import ModelMemory, downlink_bytes_per_value, uplink_bytes_per_value

GIB = 2**30
# What Ray's core worker adds to a process that holds torch and the task (measured: 0.05
# GiB on this machine's kind, an actor against a plain interpreter importing the same);
# CUDA's context adds about 0.5 GiB of host memory on a GPU node.
RAY_WORKER_BYTES = int(0.1 * GIB)
CUDA_CONTEXT_BYTES = int(0.5 * GIB)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Need:
    """One process's peak on one kind of memory, by part."""

    process: str  # "coordinator", "island worker", "coordinator slice", "evaluator"
    memory: str  # "host", "accelerator" or "object store" (Ray's, in the node's shared memory)
    node: str  # where it runs
    parts: dict[str, int]
    available: int | None  # what that node offers this process (None: unknown, not checked)
    count: int = 1
    # parts alive one at a time, never together (the coordinator's arriving pseudo-gradients
    # are freed by its step, before it evaluates)
    one_at_a_time: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        alone = [v for k, v in self.parts.items() if k in self.one_at_a_time]
        return sum(v for k, v in self.parts.items() if k not in self.one_at_a_time) + max(alone, default=0)

    @property
    def fits(self) -> bool | None:
        return None if self.available is None else self.total <= self.available

    def line(self) -> str:
        who = f"{self.process}{f' x{self.count}' if self.count > 1 else ''}"
        where = f"{self.memory} of {self.node}"
        have = f"{self.available / GIB:.2f} GiB" if self.available is not None else "unknown"
        verdict = {True: "fits", False: "DOES NOT FIT", None: "not checked"}[self.fits]
        parts = ", ".join(
            f"{k}{' (one of)' if k in self.one_at_a_time else ''} {v / GIB:.2f}" for k, v in self.parts.items() if v
        )
        return f"{who:<24} {where:<28} needs {self.total / GIB:7.2f} GiB of {have:<11} {verdict:<13} ({parts})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    up_bytes: int  # one island's pseudo-gradient per round
    down_bytes: int  # the parameters it receives per round
    seconds: float  # both ways, at the link the head is priced at
    run_bytes: int  # every island, every round


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preemption:
    """What a noticed island has to send its result in: its node's drain on a SIGTERM, less
    `elastic.notice_margin_s`; the bandwidth its pseudo-gradient then needs to leave in time."""

    drain_s: float
    margin_s: float
    up_bytes: int

    @property
    def gbps(self) -> float | None:
        """None: no time left at all (the island's work is lost with its node)."""
        left = self.drain_s - self.margin_s
        return self.up_bytes * 8 / left / 1e9 if left > 0 else None

    def line(self) -> str:
        fate = (
            "cannot leave in time: no time is left"
            if self.gbps is None
            else f"leaves in time at {self.gbps:,.2f} Gbit/s or more"
        )
        return (
            f"preemption: a SIGTERM drains an island's node for {self.drain_s:g} s ({DRAIN_ENV}); with "
            f"{self.margin_s:g} s kept back (elastic.notice_margin_s), its {self.up_bytes / 1e6:,.1f} MB result {fate}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    cluster: str
    model: ModelMemory
    needs: tuple[Need, ...]
    link: Link
    refusals: tuple[str, ...]  # layouts refused whatever the memory
    head: HeadLoad
    warm: WarmLoad | None = None  # an `average` warm start through the head
    preemption: Preemption | None = None  # where the cluster says how its nodes drain
    codecs: CodecChoice | None = None  # what `compression.*: auto` resolved to (the rest is planned with it)
    slices: SliceChoice | None = None  # what `coordinator.shards: auto` resolved to (the codecs chosen for it)

    @property
    def problems(self) -> list[str]:
        out = list(self.refusals)
        for n in self.needs:
            if n.fits is False and n.available is not None:
                out.append(
                    f"{n.process} needs {n.total / GIB:.2f} GiB of {n.memory} memory on {n.node}, which has "
                    f"{n.available / GIB:.2f} GiB ({(n.total - n.available) / GIB:.2f} GiB over)"
                )
        return out

    @property
    def fits(self) -> bool:
        return not self.problems

    def config(self, cfg: RunConfig) -> RunConfig:
        """`cfg` as planned: with the slices and codecs this plan chose where it left them `auto`."""
        for choice in (self.slices, self.codecs):
            if choice is not None:
                cfg = choice.apply(cfg)
        return cfg

    def lines(self) -> list[str]:
        m = self.model
        cached = ", cached" if m.cached else ""
        out = [
            f"model: {m.params:,} parameters; an inner step at {m.train_rows} rows per micro-batch, an evaluation "
            f"forward at {m.eval_rows} rows (measured with fake tensors in {m.measure_s:.1f} s{cached}); cluster: {self.cluster}",
            *(n.line() for n in self.needs),
            f"link per island per round: up {self.link.up_bytes / 1e6:,.1f} MB, down {self.link.down_bytes / 1e6:,.1f} "
            f"MB, {self.link.seconds:.2f} s both ways at the head's link; "
            f"the run: {self.link.run_bytes / 1e9:,.2f} GB",
            *(self.slices.lines() if self.slices is not None else []),
            *(self.codecs.lines() if self.codecs is not None else []),
            *self.head.lines(),
            *(self.warm.lines() if self.warm is not None else []),
            *([self.preemption.line()] if self.preemption is not None else []),
        ]
        out += [f"refused: {p}" for p in self.problems]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "fits": self.fits,
            "problems": self.problems,
            "model": dataclasses.asdict(self.model),
            "processes": [{**dataclasses.asdict(n), "total": n.total, "fits": n.fits} for n in self.needs],
            "link": dataclasses.asdict(self.link),
            "head": self.head.as_dict(),
            "codecs": None if self.codecs is None else self.codecs.as_dict(),
            "slices": None if self.slices is None else self.slices.as_dict(),
            "warm_start": None
            if self.warm is None
            else {"bytes": self.warm.bytes, "seconds": self.warm.seconds, "share": self.warm.share},
            "preemption": None
            if self.preemption is None
            else {**dataclasses.asdict(self.preemption), "gbps": self.preemption.gbps},
        }


def _coordinator(
    cfg: RunConfig, m: ModelMemory, up: float, cluster: Cluster, eval_batch_bytes: int, ray: int
) -> list[Need]:
    n4 = 4 * m.params
    k = cfg.islands.count
    head = cluster.head
    rule = rule_of(cfg)
    lag = mode_of(cfg).lag
    s = cfg.coordinator.slices
    parts = {
        "process": m.process + ray,
        "outer step runtime": m.outer_runtime,
        "parameters": n4,
        "published": n4 * (1 + lag) if ray else 0,  # in the object store (shared memory of the node)
        "arriving": int(k * up * m.params) if s == 1 else 0,
    }
    anchors = (1 + lag) if rule.anchored(cfg) else 0  # the versions rounds in flight started from (CO2's Λ)
    if s == 1:
        parts["outer state"] = n4 * rule.state_values(cfg)
        if anchors:
            parts["round starts"] = n4 * anchors
        parts["mean buffer"] = n4
    if cfg.tracks_copy and s == 1:  # slices keep a part each
        parts["downlink copy"] = n4
    if cfg.evaluation.where == EvalPlace.COORDINATOR:
        parts["evaluation"] = max(0, m.eval_peak - n4) + eval_batch_bytes
        parts["data"] = m.data  # the corpus its evaluation batches are read from
    if not mode_of(cfg).pseudo_gradients:  # every island's gradient (the AdamW moments are the outer state)
        parts["data-parallel step"] = k * n4
    elif cfg.warm_steps and cfg.warm_start.mode == WarmStartMode.DDP:  # the warm phase's AdamW and gradients
        parts["data-parallel step"] = 2 * n4 + k * n4
    needs = [
        Need(
            process="coordinator",
            memory="host",
            node=head.name,
            parts=parts,
            available=head.memory,
            one_at_a_time=("arriving", "evaluation"),
        )
    ]
    if s > 1:
        per = n4 // s
        slice_parts = {"process": m.process + ray, "parameters": per, "outer state": per * rule.state_values(cfg)}
        slice_parts["mean buffer"] = per
        if anchors:
            slice_parts["round starts"] = per * anchors
        slice_parts["arriving"] = int(k * up * m.params / s)
        if cfg.tracks_copy:
            slice_parts["downlink copy"] = per
        offering = cluster.offering(cfg.coordinator.slice_resource) if cfg.coordinator.slice_resource else []
        # where a slice may land: the least memory of the nodes offering its resource
        node = min(offering, key=lambda k: k.memory or 0) if offering else None
        needs.append(
            Need(
                process="coordinator slice",
                memory="host",
                node=node.name if node is not None else "any node",
                parts=slice_parts,
                available=node.memory if node is not None else None,
                count=s,
            )
        )
        if node is not None and ray:  # its part of every island's update, pulled into its node's store
            needs.append(
                Need(
                    process="coordinator slice's objects",
                    memory="object store",
                    node=node.name,
                    parts={"arriving": slice_parts["arriving"]},
                    available=node.object_store_bytes,
                    count=s,
                )
            )
    return needs


def _slice_refusals(cfg: RunConfig, cluster: Cluster) -> list[str]:
    """Slices that ask for nodes of their own (`coordinator.slice_resource`) need one node
    offering that resource per slice."""
    resource, s = cfg.coordinator.slice_resource, cfg.coordinator.slices
    if resource is None or s == 1:
        return []
    kinds = cluster.offering(resource)
    if not kinds:
        return [
            f"coordinator.slice_resource = {resource}: no node of {cluster.source} offers it (a slice node's "
            f"`ray start --resources`: the manifests' slices group); unset it to spread the slices over any nodes"
        ]
    offered = cluster.offered(resource)
    if s > offered:
        where = ", ".join(f"{k.name} ({k.count} nodes of {k.resources[resource]:g})" for k in kinds)
        return [
            f"coordinator.shards = {s} slices take one {resource} each; the cluster offers at most {offered}: "
            f"{where}: raise the slices group's maxReplicas or lower the shards"
        ]
    return []


def _island(cfg: RunConfig, m: ModelMemory, up: float, node: NodeKind, ray: int) -> list[Need]:
    n4 = 4 * m.params
    w = cfg.islands.workers
    opt = m.train_parts["optimizer_state"]
    if w > 1:  # the optimizer state (zero1), or everything (fsdp), is sharded over the workers
        opt = opt // w
    device = {
        "parameters": n4 if not (w > 1 and cfg.islands.sharding == Sharding.FSDP) else n4 // w,
        "gradients": m.train_parts["gradients"],
        "optimizer state": opt,
        "activations": m.train_parts["activations_and_temporaries"],
        "round start copy": n4,
        "pseudo-gradient": n4,
    }
    if cfg.tracks_copy:
        device["published copy"] = n4
    if cfg.compression.error_feedback:
        device["error feedback"] = n4
    host = {
        "process": m.process + ray,
        "torch runtime": m.runtime,
        "data": m.data,
        "received": n4,
        "sent": int(up * m.params),
    }
    if cfg.keeps_island_state:  # its copy, held on the host while it is written beside the next round
        host["inner state snapshot"] = opt + (n4 if cfg.compression.error_feedback else 0)
    on_gpu = cfg.islands.gpus > 0
    per_node = max(1, int(node.gpus // cfg.islands.gpus)) if on_gpu and node.gpus else 1
    host_available = node.memory // per_node if node.memory is not None else None
    if not on_gpu:
        return [
            Need(
                process="island worker",
                memory="host",
                node=node.name,
                parts={**host, **device},
                available=host_available,
                count=cfg.islands.count * w,
            )
        ]
    host["cuda context"] = CUDA_CONTEXT_BYTES
    if cfg.tracks_copy or not (w > 1 and cfg.islands.sharding == Sharding.FSDP):  # an FSDP group starts on the host
        host["pinned stage"] = n4  # the parameters' way onto the GPU (workers/runtime/staging.py)
    return [
        Need(
            process="island worker",
            memory="accelerator",
            node=node.name,
            parts=device,
            available=node.accelerator_memory,
            count=cfg.islands.count * w,
        ),
        Need(
            process="island worker",
            memory="host",
            node=node.name,
            parts=host,
            available=host_available,
            count=cfg.islands.count * w,
        ),
    ]


def _evaluator(cfg: RunConfig, m: ModelMemory, cluster: Cluster, eval_batch_bytes: int, ray: int) -> list[Need]:
    e = cfg.evaluation
    node = cluster.island_node(e.gpus) if not cluster.single_host else cluster.head
    name = node.name if node is not None else "no node"
    n4 = 4 * m.params
    host = {"process": m.process + ray, "received": n4}
    device = {"evaluation": m.eval_peak, "eval batches": eval_batch_bytes}
    if e.gpus <= 0:
        return [
            Need(
                process="evaluator",
                memory="host",
                node=name,
                parts={**host, **device},
                available=node.memory if node else None,
            )
        ]
    host["cuda context"] = CUDA_CONTEXT_BYTES
    return [
        Need(
            process="evaluator",
            memory="accelerator",
            node=name,
            parts=device,
            available=node.accelerator_memory if node else None,
        ),
        Need(process="evaluator", memory="host", node=name, parts=host, available=node.memory if node else None),
    ]


def _head_objects(cfg: RunConfig, m: ModelMemory, up: float, head: NodeKind) -> Need:
    """What the coordinator keeps in its node's Ray object store at once: the published
    versions islands fetch, and every island's pseudo-gradient pulled in before a step (on
    one coordinator; slices pull theirs to their own nodes). Past the store's size Ray spills
    to disk and every transfer through the head slows to the disk's pace."""
    n4 = 4 * m.params
    lag = mode_of(cfg).lag
    parts = {"published": n4 * (1 + lag)}
    if cfg.coordinator.slices == 1:
        parts["arriving"] = int(cfg.islands.count * up * m.params)
    return Need(
        process="coordinator's objects",
        memory="object store",
        node=head.name,
        parts=parts,
        available=head.object_store_bytes,
    )


def _on_one_host(needs: list[Need], node: NodeKind) -> list[Need]:
    """A local run: every process's host memory is the one machine's."""
    host = [n for n in needs if n.memory == "host"]
    total: dict[str, int] = {}
    for n in host:
        label = n.process if n.count == 1 else f"{n.process} x{n.count}"
        total[label] = n.total * n.count
    rest = [dataclasses.replace(n, available=None) if n.memory == "host" else n for n in needs]
    return [*rest, Need(process="all processes", memory="host", node=node.name, parts=total, available=node.memory)]


def _refusals(cfg: RunConfig, cluster: Cluster, m: ModelMemory) -> list[str]:
    out = []
    gradients = not mode_of(cfg).pseudo_gradients
    ddp = f"mode {cfg.mode.name.value}" if gradients else "warm_start.mode ddp" if cfg.warm_steps else None
    if cfg.warm_steps and cfg.warm_start.mode != WarmStartMode.DDP and not gradients:
        ddp = None
    if ddp and not cluster.single_host and not cluster.head.hosts_islands:
        gb = cfg.islands.count * 4 * m.params / 1e9
        out.append(
            f"{ddp} sends every island's full gradient through the coordinator on the head every step "
            f"({gb:.2f} GB a step in, as much out): a parameter server on one CPU pod. Use warm_start.mode "
            "average (Local SGD: bytes / warm_start.inner_steps) on a cluster; ddp is a single-host baseline"
        )
    if cfg.islands.gpus > 0 and cluster.island_node(cfg.islands.gpus) is None:
        out.append(f"islands.gpus = {cfg.islands.gpus:g}: no node of {cluster.source} offers that many GPUs")
    if cfg.evaluation.where == EvalPlace.ACTOR and cluster.island_node(cfg.evaluation.gpus) is None:
        out.append(f"evaluation.gpus = {cfg.evaluation.gpus:g}: no node of {cluster.source} can host the evaluator")
    node = cluster.island_node(cfg.islands.gpus) if cfg.islands.gpus > 0 else None
    if node is not None and node.gpus and not cluster.single_host:
        wanted = cfg.islands.count * cfg.islands.workers * cfg.islands.gpus
        if cfg.evaluation.where == EvalPlace.ACTOR:
            wanted += cfg.evaluation.gpus
        offered = node.gpus * node.count
        if wanted > offered:
            out.append(
                f"the islands (and the evaluator) ask for {wanted:g} GPUs; the {node.name} group offers at most "
                f"{offered:g} ({node.count} nodes of {node.gpus:g})"
            )
    return out


def on_cpu(cfg: RunConfig) -> RunConfig:
    """The config with its islands and evaluator on the CPU: what runs on a machine
    without CUDA (a private Ray instance is given the GPUs they ask for, and they train on
    its CPU), and what a rehearsal measures."""
    return cfg.model_copy(
        update={
            "islands": cfg.islands.model_copy(update={"gpus": 0.0, "workers": 1}),
            "evaluation": cfg.evaluation.model_copy(update={"gpus": 0.0}),
        }
    )


def make_plan(
    cfg: RunConfig,
    model: ModelMemory,
    cluster: Cluster,
    *,
    under_ray: bool = True,
    link_gbps: float | None = None,
    step_s: float = DEFAULT_STEP_S,
) -> Plan:
    """The plan of `cfg` on `cluster`, from the model's measured memory; `under_ray`: the
    processes are Ray's (the object store, the core worker), not plain interpreters (a
    rehearsal). The head's share of a round is priced at `link_gbps` between the islands
    and the head (None: the cluster's annotation, else `DEFAULT_LINK_GBPS`) and inner steps
    of `step_s`; slices and codecs left `auto` are chosen at that price first (`Plan.slices`,
    `Plan.codecs`: the slices up to the nodes the cluster offers them on), and everything
    else is planned with them."""
    gbps = link_gbps or cluster.link_gbps or DEFAULT_LINK_GBPS
    resource = cfg.coordinator.slice_resource
    offered = cluster.offered(resource) if resource is not None else 0
    slices, codecs = choose_head(cfg, model.params, link_gbps=gbps, step_s=step_s, offered=offered)
    for choice in (slices, codecs):
        if choice is not None:
            cfg = choice.apply(cfg)
    up = uplink_bytes_per_value(cfg)
    eval_batch_bytes = model.eval_set
    ray = RAY_WORKER_BYTES if under_ray else 0
    needs = _coordinator(cfg, model, up, cluster, eval_batch_bytes, ray)
    island_node = cluster.island_node(cfg.islands.gpus) or cluster.head
    needs += _island(cfg, model, up, island_node, ray)
    if cfg.evaluation.where == EvalPlace.ACTOR:
        needs += _evaluator(cfg, model, cluster, eval_batch_bytes, ray)
    if cluster.single_host:
        needs = _on_one_host(needs, cluster.head)
    elif under_ray:
        needs.append(_head_objects(cfg, model, up, cluster.head))
    down = int(downlink_bytes_per_value(cfg) * model.params)
    up_bytes = int(up * model.params)
    link = Link(
        up_bytes=up_bytes,
        down_bytes=down,
        seconds=(up_bytes + down) * 8 / (gbps * 1e9),
        run_bytes=cfg.islands.count * cfg.rounds * (up_bytes + down),
    )
    drain = island_node.drain_s
    warm = warm_load(cfg, model.params, link_gbps=gbps, step_s=step_s)
    refusals = [*_refusals(cfg, cluster, model), *_slice_refusals(cfg, cluster)]
    if warm is not None and not cluster.single_host and (why := warm.refusal()) is not None:
        refusals.append(why)
    return Plan(
        cluster=cluster.source,
        model=model,
        needs=tuple(needs),
        link=link,
        refusals=tuple(refusals),
        warm=warm,
        head=head_load(cfg, model.params, link_gbps=gbps, step_s=step_s),
        codecs=codecs,
        slices=slices,
        preemption=None
        if drain is None
        else Preemption(drain_s=drain, margin_s=cfg.elastic.notice_margin_s, up_bytes=up_bytes),
    )


def at_rows(cfg: RunConfig, rows: int) -> RunConfig:
    """`cfg` with one micro-batch of `rows` rows a step (everything else as it is)."""
    task = cfg.task.model_copy(update={"kwargs": {**cfg.task.kwargs, "batch_size": rows}})
    return cfg.model_copy(update={"task": task, "inner": cfg.inner.model_copy(update={"micro_batches": 1})})


DEVICE_FILL = (
    0.85  # of an island's share of its GPU a step may plan to hold (the allocator's slack, kernels' workspaces)
)


class NothingFits(ValueError):
    """Not even one row a step fits the island's share of its accelerator."""


def micro_batch_rows(cfg: RunConfig) -> int:
    """The rows of one of the config's micro-batches (its task's `batch_size` over
    `inner.micro_batches`); ValueError for a task without a `batch_size`."""
    rows = cfg.task.kwargs.get("batch_size")
    if not isinstance(rows, int):
        raise ValueError(f"{cfg.task.factory} takes no integer batch_size: its micro-batch cannot be scaled")
    return rows // cfg.inner.micro_batches


def island_accelerator_bytes(plan: Plan) -> int:
    """The island worker's planned peak on its accelerator (ValueError: it has none)."""
    need = next((n for n in plan.needs if n.process == "island worker" and n.memory == "accelerator"), None)
    if need is None:
        raise ValueError("the plan's island runs on no accelerator")
    return need.total


def rows_that_fill(cfg: RunConfig, cluster: Cluster, most: int = 512) -> tuple[int, int]:
    """The rows a step (one micro-batch, a power of two up to `most`) whose island's planned
    peak on its accelerator is the largest within `DEVICE_FILL` of one worker's share of the
    GPU (`islands.gpus`, at most one GPU, of its memory), and that peak in bytes: the tokens a
    step that keep a GPU busy, as the best open loops size them (llm.c trains the 124 M GPT-2
    at 64 rows of 1,024 tokens on an 80-GB card). Guessed from one fake-tensor measurement at
    the config's own micro-batch, scaling its activations and temporaries with the rows (they
    hold parts that do not scale, such as the chunked loss's logits: the guess is high above
    the measured rows and may be low below them), then measured at the guess and halved
    until the measurement fits. `NothingFits` where one row does not."""
    from .cache import model_memory

    node = cluster.island_node(cfg.islands.gpus)
    if cfg.islands.gpus <= 0:
        raise NothingFits("the island trains on its CPU (islands.gpus 0): it has no accelerator to fill")
    if node is None or node.accelerator_memory is None:
        raise NothingFits(f"{cluster.source} states no accelerator for an island of islands.gpus {cfg.islands.gpus}")
    room = DEVICE_FILL * min(cfg.islands.gpus, 1.0) * node.accelerator_memory

    def planned(rows: int) -> tuple[int, ModelMemory]:
        at = at_rows(cfg, rows)
        model = model_memory(at)
        return island_accelerator_bytes(make_plan(at, model, cluster)), model

    measured_rows = micro_batch_rows(cfg)
    peak, model = planned(measured_rows)
    activations = model.train_parts["activations_and_temporaries"]
    per_row = activations / max(1, measured_rows // cfg.islands.workers)
    guess = [r for r in (2**k for k in range(most.bit_length())) if (peak - activations) + per_row * r <= room]
    rows = guess[-1] if guess else 1
    while rows >= 1:
        peak = planned(rows)[0]
        if peak <= room:
            return rows, peak
        rows //= 2
    raise NothingFits(f"one row a step needs more than {room / GIB:.2f} GiB of the island's accelerator")


def plan_run(
    cfg: RunConfig,
    cluster: Cluster | None = None,
    *,
    cluster_path: str | Path | None = None,
    under_ray: bool = True,
    link_gbps: float | None = None,
    step_s: float = DEFAULT_STEP_S,
) -> Plan:
    """Measure `cfg`'s model (or read an earlier measurement of the same shapes) and plan it
    on `cluster`, the manifest at `cluster_path`, or this machine."""
    from .cache import model_memory
    from .cluster import from_manifest, this_machine

    if cluster is None:
        cluster = from_manifest(cluster_path) if cluster_path is not None else this_machine()
    return make_plan(cfg, model_memory(cfg), cluster, under_ray=under_ray, link_gbps=link_gbps, step_s=step_s)
