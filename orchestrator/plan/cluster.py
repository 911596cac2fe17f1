"""The cluster a plan is checked against: what each kind of node offers.

Three sources: KubeRay manifests (a `RayCluster`, or a `RayJob`'s `rayClusterSpec`): each
group's container memory limit, CPUs and GPUs, and the accelerator memory the worker
group states in the annotation `archipelago.io/accelerator-memory` (a manifest cannot
know which GPU a node has); a running Ray cluster (its nodes' resources); or this
machine, where a local run puts every process on one host and they share its memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ACCELERATOR_MEMORY = "archipelago.io/accelerator-memory"
LINK_GBPS = "archipelago.io/link-gbps"  # on the head group: its link to the islands, for the head's share
# the same annotation inside the head's pod (the manifests set it by the downward API), so a
# run's own plan prices the link its cluster states, and chooses `compression: auto` by it
LINK_ENV = "ARCHIPELAGO_LINK_GBPS"
# on the head group: the most nodes its slices group may have (its maxReplicas), so a run's
# plan counts the coordinator slices it may ask the autoscaler for while that group is
# scaled to zero (Ray's autoscaler does not tell a running cluster what it may scale to);
# inside the head's pod by the downward API as `SLICES_ENV`
SLICE_NODES = "archipelago.io/slice-nodes"
SLICES_ENV = "ARCHIPELAGO_SLICE_NODES"
_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


class ClusterError(ValueError):
    """The cluster description cannot be read (a manifest without the fields a plan needs)."""


def quantity(text: str | int | float) -> int:
    """A Kubernetes quantity in bytes ("16Gi", "512Mi", "32G", "1000000")."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kMGT]i?)?\s*", str(text))
    if not m:
        raise ClusterError(f"{text!r} is not a Kubernetes memory quantity")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeKind:
    name: str
    memory: int | None  # bytes its processes may hold (a container's limit), None: unknown
    cpus: float
    gpus: float
    accelerator_memory: int | None = None  # per GPU
    hosts_islands: bool = True  # a KubeRay head with num-cpus 0 runs no island
    count: int = 1  # how many such nodes (at most)
    # seconds a SIGTERM to its `ray start` drains the node before tearing it down (its island's
    # preemption notice): RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S on its pods; None: not known
    drain_s: float | None = None
    link_gbps: float | None = None  # its network card, Gbit/s (the annotation `LINK_GBPS`); None: not stated
    object_store: int | None = None  # its Ray object store, bytes (`object-store-memory`); None: Ray's default
    # the Ray custom resources it offers (`ray start --resources`), e.g. a slice node's archipelago_slice
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    # a head's statement of the slice nodes its cluster may bring up (the annotation `SLICE_NODES`)
    slice_nodes: int | None = None

    @property
    def object_store_bytes(self) -> int | None:
        """What its object store holds: as its `ray start` says, else Ray's default share of
        the node's memory (None: neither known)."""
        if self.object_store is not None:
            return self.object_store
        return int(RAY_OBJECT_STORE_SHARE * self.memory) if self.memory is not None else None


DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
RAY_OBJECT_STORE_SHARE = 0.3  # Ray's object store without `object-store-memory`: this share of the node's memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    source: str
    head: NodeKind
    workers: tuple[NodeKind, ...]

    @property
    def link_gbps(self) -> float | None:
        """The head's link, as its manifest states it."""
        return self.head.link_gbps

    @property
    def single_host(self) -> bool:
        """Every process on one machine: their memory adds up there."""
        return not self.workers

    def island_node(self, gpus: float) -> NodeKind | None:
        """The kind of node an island (`gpus` per worker) is placed on: a worker kind with
        the GPUs, or the head on one host; None when no node kind can host it."""
        kinds = [*self.workers, self.head] if self.workers else [self.head]
        for kind in kinds:
            if kind.hosts_islands and kind.gpus >= gpus and (gpus or kind.cpus):
                return kind
        return None

    def offering(self, resource: str) -> list[NodeKind]:
        """The kinds of worker node that offer the custom `resource` (slice nodes)."""
        return [kind for kind in self.workers if kind.resources.get(resource, 0) > 0]

    def in_groups(self, resource: str) -> int:
        """Units of the custom `resource` its worker kinds offer: a group's at its most
        nodes (a manifest), or the nodes up (a running cluster)."""
        return int(sum(kind.resources[resource] * kind.count for kind in self.offering(resource)))

    def offered(self, resource: str) -> int:
        """How many units of the custom `resource` (one a slice) the cluster may offer: its
        groups', or what the head states of its slices group when more (a group scaled to
        zero has no node up to count)."""
        return max(self.in_groups(resource), self.head.slice_nodes or 0)


_RAY_BUILT_IN = ("CPU", "GPU", "memory", "object_store_memory")


def custom_resources(text: str | dict[str, Any] | None) -> dict[str, float]:
    """`rayStartParams.resources` as KubeRay takes it: a JSON object inside a quoted string
    (`'"{\\"archipelago_slice\\": 1}"'`), or the object itself."""
    if text is None:
        return {}
    if isinstance(text, dict):
        found: Any = text
    else:
        raw = str(text).strip()
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            raw = raw[1:-1].replace('\\"', '"')
        try:
            found = json.loads(raw)
        except json.JSONDecodeError:
            raise ClusterError(f"rayStartParams.resources {text!r} is not a JSON object of resources") from None
    if not isinstance(found, dict) or not all(isinstance(v, int | float) for v in found.values()):
        raise ClusterError(f"rayStartParams.resources {text!r} is not a JSON object of resources")
    return {str(k): float(v) for k, v in found.items()}


def _container(template: dict[str, Any]) -> dict[str, Any]:
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        raise ClusterError("a group's pod template has no container")
    return containers[0]


def _kind(name: str, group: dict[str, Any], count: int) -> NodeKind:
    template = group.get("template") or {}
    resources = _container(template).get("resources") or {}
    limits = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    params = group.get("rayStartParams") or {}
    cpus = float(params.get("num-cpus", quantity_cpus(limits.get("cpu", 0))))
    gpus = float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    accel = annotations.get(ACCELERATOR_MEMORY)
    env = {e.get("name"): e.get("value") for e in _container(template).get("env") or []}
    link = annotations.get(LINK_GBPS)
    return NodeKind(
        name=name,
        memory=quantity(limits["memory"]) if "memory" in limits else None,
        cpus=cpus,
        gpus=gpus,
        accelerator_memory=quantity(accel) if accel else None,
        hosts_islands=cpus > 0 or gpus > 0,
        count=count,
        drain_s=float(env[DRAIN_ENV]) if env.get(DRAIN_ENV) is not None else None,
        link_gbps=_gbps(link, f"{name}: the annotation {LINK_GBPS}"),
        slice_nodes=_count(annotations.get(SLICE_NODES), f"{name}: the annotation {SLICE_NODES}"),
        object_store=int(params["object-store-memory"]) if params.get("object-store-memory") is not None else None,
        resources=custom_resources(params.get("resources")),
    )


def quantity_cpus(text: str | int | float) -> float:
    s = str(text)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def from_manifest(path: str | Path) -> Cluster:
    """The cluster a `RayCluster` or `RayJob` manifest describes (its first document of either kind)."""
    for doc in yaml.safe_load_all(Path(path).read_text()):
        if not isinstance(doc, dict) or doc.get("kind") not in ("RayCluster", "RayJob"):
            continue
        spec = doc.get("spec") or {}
        if doc["kind"] == "RayJob":
            spec = spec.get("rayClusterSpec") or {}
        head = spec.get("headGroupSpec")
        if not head:
            raise ClusterError(f"{path}: no headGroupSpec")
        workers = tuple(
            _kind(g.get("groupName", "workers"), g, int(g.get("maxReplicas", g.get("replicas", 1))))
            for g in spec.get("workerGroupSpecs") or []
        )
        cluster = Cluster(source=str(path), head=_kind("head", head, 1), workers=workers)
        stated = cluster.head.slice_nodes
        groups = {r: cluster.in_groups(r) for w in workers for r in w.resources}
        if stated is not None and stated not in groups.values():
            raise ClusterError(
                f"{path}: the head states {stated} slice nodes ({SLICE_NODES}), but the groups offering a custom "
                f"resource may have {groups or 'none'}: keep the annotation equal to the slices group's maxReplicas"
            )
        return cluster
    raise ClusterError(f"{path} holds no RayCluster or RayJob")


def ray_nodes(*, leave_out: str | None = None) -> list[NodeKind]:
    """The live nodes of the Ray cluster this process is connected to, each a kind of its
    own, by their Ray resources (`leave_out`: a node id not to list)."""
    import ray

    kinds = []
    for node in ray.nodes():
        if not node.get("Alive") or node.get("NodeID") == leave_out:
            continue
        r = node.get("Resources", {})
        kinds.append(
            NodeKind(
                name=node.get("NodeManagerAddress", "node"),
                memory=int(r["memory"]) if "memory" in r else None,
                cpus=float(r.get("CPU", 0)),
                gpus=float(r.get("GPU", 0)),
                hosts_islands=bool(r.get("CPU", 0) or r.get("GPU", 0)),
                resources={
                    k: float(v)
                    for k, v in r.items()
                    if k not in _RAY_BUILT_IN and not k.startswith(("node:", "accelerator_type:"))
                },
            )
        )
    return kinds


def from_ray() -> Cluster:
    """The running Ray cluster this process is connected to (`ray.init` first): the head
    node and each other node as a kind of its own."""
    kinds = ray_nodes()
    if not kinds:
        raise ClusterError("the Ray cluster has no live node")
    head, *rest = kinds
    return Cluster(source="ray", head=head, workers=tuple(rest))


def _count(value: str | None, what: str) -> int | None:
    """A stated number of nodes (None: not stated); anything but a whole number ≥ 0 is refused."""
    if value is None:
        return None
    if not str(value).strip().isdigit():
        raise ClusterError(f"{what} = {value!r} is not a number of nodes")
    return int(value)


def _gbps(value: str | None, what: str) -> float | None:
    """A link's stated Gbit/s (None: not stated); anything but a positive number is refused."""
    try:
        gbps = float(value) if value is not None else None
    except ValueError:
        raise ClusterError(f"{what} = {value!r} is not a number of Gbit/s") from None
    if gbps is not None and not (math.isfinite(gbps) and gbps > 0):
        raise ClusterError(f"{what} = {value!r} is not a positive number of Gbit/s")
    return gbps


def this_machine(accelerator_memory: int | None = None) -> Cluster:
    """This host: its physical memory (or its cgroup's limit), its cores, its GPUs, and the
    link to its islands and its cluster's slice nodes where the environment states them
    (`LINK_ENV`, `SLICES_ENV`: a head pod's)."""
    from ..engine.threads import usable_cores

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            memory = min(memory, int(limit))
    except (OSError, ValueError):
        pass
    # GPUs without importing torch (the run's preflight must not: `bench startup`): the
    # NVIDIA driver lists them; their memory is read from torch only where it is loaded
    listed = Path("/proc/driver/nvidia/gpus")
    gpus = float(len(list(listed.iterdir()))) if listed.is_dir() else 0.0
    torch = sys.modules.get("torch")
    if gpus and accelerator_memory is None and torch is not None and torch.cuda.is_available():
        accelerator_memory = torch.cuda.get_device_properties(0).total_memory
    node = NodeKind(
        name="this machine",
        memory=memory,
        cpus=float(usable_cores()),
        gpus=gpus,
        accelerator_memory=accelerator_memory,
        link_gbps=_gbps(os.environ.get(LINK_ENV) or None, f"${LINK_ENV}"),
        slice_nodes=_count(os.environ.get(SLICES_ENV) or None, f"${SLICES_ENV}"),
    )
    return Cluster(source="this machine", head=node, workers=())
