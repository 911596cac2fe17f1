"""Typed run configuration. Every field is validated here, before anything starts, so a
mistake is reported by field name instead of surfacing minutes later inside an actor."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, Union

from pydantic import Field, field_validator, model_validator

from archipelago.workers.wire.spec import AUTO_CODEC, InnerConfig, Sharding

from .config_operations import (
    ApiConfig,
    CheckpointConfig,
    ElasticConfig,
    EvaluationConfig,
    ExportConfig,
    RecordsConfig,
    TrackingConfig,
)
from .config_sections import CompressionConfig, OuterConfig, OuterMerge, OuterOptimizer, Strict
from .mode_settings import (
    AsyncSettings,
    DilocoSettings,
    Mode,
    ModeSettings,
    QuorumSettings,
    check_quorum,
)
from .modes import MODES, SETTINGS, mode_of, modes_where, settings_if

log = logging.getLogger(__name__)
# the package's top-level names before `archipelago` was its one import root
LEGACY_ROOTS = ("orchestrator", "workers", "api")


class WarmStartMode(str, Enum):
    """How the shared start of a run is trained before its islands fork."""

    DDP = "ddp"  # data-parallel over the run's islands (k x batch, one optimizer)
    AVERAGE = "average"  # Local SGD: every island trains `inner_steps` steps, then they average
    SINGLE = "single"  # one island trains alone


class WarmStartConfig(Strict):
    """Training shared by every island before they fork (the DiLoCo paper forks from a
    model trained 24k of 88k steps): from scratch, the first pseudo-gradients are huge and
    an outer Nesterov step amplifies them for many rounds; from a warm start the outer
    step refines instead. The islands continue its data (nothing is trained twice) and its
    learning-rate schedule (the inner warmup is over before the first outer step)."""

    steps: int | None = Field(
        None,
        ge=0,
        description="inner steps of the warm start; null (auto): for a run from scratch in a DiLoCo-family "
        "mode, a quarter of the run's rounds x inner_steps and at least inner.warmup_steps, else 0; 0 disables",
    )
    mode: WarmStartMode = Field(
        WarmStartMode.AVERAGE,
        description="ddp (data-parallel over the run's islands: a gradient exchange every step), average "
        "(Local SGD over the run's islands: parameters averaged every warm_start.inner_steps steps, bytes / H) "
        "or single (one island alone, batch x 1)",
    )
    inner_steps: int = Field(
        25,
        ge=1,
        description="mode average: steps between two averages (one round when they do not divide warm_start.steps); "
        "25 moves 24x fewer bytes than data-parallel at the default run's loss (bench warmstart)",
    )
    path: str | None = Field(
        None,
        description="reuse the finished warm start in this folder (a run's out_dir/warm_start) instead of "
        "training one: e.g. to compare methods from one warm start; same task, seed and data shards",
    )


class RobustConfig(Strict):
    """Admission checks beyond shape, weight and finiteness (`engine/step/admission.py`)."""

    norm_ratio: float | None = Field(
        10.0, gt=1, description="reject if ‖Δ‖ > ratio × median of recent norms; null disables"
    )
    weight_ratio: float | None = Field(
        4.0,
        gt=1,
        description="reject if the token weight per inner step > ratio x median of recent ones (an island "
        "reports its own weight); null disables",
    )
    history: int = Field(32, ge=4, description="accepted norms (and weights) kept for the medians")
    min_history: int = Field(4, ge=1, description="norms needed before the check applies")
    quarantine_after: int = Field(3, ge=1, description="consecutive rejections that quarantine an island")


class IslandsConfig(Strict):
    """How many islands and what each one holds (on a cluster: real GPUs)."""

    count: int = Field(4, ge=1, le=1024, description="islands at the start (the target count; elastic runs change it)")
    workers: int = Field(1, ge=1, le=64, description="data-parallel workers per island (one node, STRICT_PACK)")
    sharding: Sharding = Field(
        Sharding.ZERO1,
        description="with workers > 1: zero1 (each worker holds the model, optimizer state sliced) or fsdp "
        "(FSDP2: parameters, gradients and optimizer state sharded, for a model one accelerator cannot hold)",
    )
    build_version0: bool = Field(
        False,
        description="islands build the run's first parameters themselves (the same seed) and check them against "
        "the coordinator's SHA-256 instead of downloading them (bytes_bootstrap 0); one that differs downloads "
        "them and its join event says so. With a warm start they read its weights from version0.npy beside it (shared "
        "storage; unreadable: they download them); not with init_from",
    )
    cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per island worker")
    gpus: float = Field(0.0, ge=0, description="Ray GPUs per island worker; CUDA is used when > 0 and available")
    threads: int | None = Field(None, ge=1, description="torch threads per island (default: cpus, at least 1)")


class TaskSpec(Strict):
    """The user's model and data: an import path `module:factory` and its keyword arguments."""

    factory: str = Field(
        "archipelago.workers.tasks.lm_task:make_task",
        description="`module:function` returning a Task, importable on every node",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the factory, validated by the task before anything starts",
    )

    @field_validator("factory")
    @classmethod
    def _one_import_root(cls, factory: str) -> str:
        """A factory named by its module before the package had one import root
        (`archipelago.workers.tasks.lm_task:make_task`) still loads, as `archipelago.<module>`, with a
        warning that says what to write instead."""
        if factory.split(".", 1)[0] in LEGACY_ROOTS:
            moved = f"archipelago.{factory}"
            warnings.warn(
                f"task.factory {factory!r} names a module by its old top-level package; write {moved!r} "
                "(the old name will stop working in a later release)",
                DeprecationWarning,
                stacklevel=2,
            )
            log.warning("task.factory %r is deprecated: write %r", factory, moved)
            return moved
        return factory


class RayConfig(Strict):
    """Where the run's Ray lives."""

    address: str | None = Field(None, description="existing cluster; default: $RAY_ADDRESS, else start a local one")
    num_cpus: int | None = Field(
        None, ge=1, description="logical CPUs of a local instance (default: what islands need)"
    )


MAX_SHARDS = 256  # coordinator slices a config may ask for
AUTO_SHARDS = "auto"  # coordinator.shards: the run's plan chooses how many (plan/head.py:choose_slices)


class CoordinatorConfig(Strict):
    """The outer step over S shards: each owns 1/S of the parameters and of the outer
    optimizer state, and receives 1/S of every pseudo-gradient straight from the islands."""

    shards: Annotated[int, Field(ge=1, le=MAX_SHARDS)] | Literal["auto"] = Field(
        1,
        description="coordinator shards S (1: the coordinator steps alone); auto: the run's plan picks the fewest "
        "that bring the head's share of a round under 0.10 at the head's stated link, at most the nodes the "
        "cluster offers coordinator.slice_resource on (a manifest's slices group at its maxReplicas, or the nodes up, "
        "or what the head states: $ARCHIPELAGO_SLICE_NODES from the manifests' archipelago.io/slice-nodes), 1 where "
        "it offers none or the mode steps on one coordinator (needs slice_resource and preflight)",
    )
    slice_resource: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$",
        description="a Ray custom resource each shard takes one unit of: on a cluster whose slice nodes offer one "
        "each (the manifests' slices worker group: archipelago_slice), every shard runs on a node of its own, so "
        "the islands' bytes in and the outer state split S ways over S network cards and memories, and the plan "
        "checks each shard against that node; null: the shards are spread over whatever nodes there are",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="threads of the coordinator's outer step (default: the cores of its node that its "
        "islands there do not reserve, at least 1; all its cores for a step every island waits for, sync "
        "DiLoCo's) and of each shard's (default 1)",
    )
    eval_threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="torch threads of the coordinator's evaluations (default: the cores of its node that its "
        "islands there do not reserve, at least the outer step's)",
    )

    @property
    def sliced(self) -> bool:
        """More than one shard asked for by number (`auto` is 1 wherever slices cannot be)."""
        return self.shards not in (1, AUTO_SHARDS)

    @property
    def slices(self) -> int:
        """The shards the run steps on: `shards`, once the run's plan has chosen where it
        was left `auto` (`plan/head.py:choose_slices`)."""
        if isinstance(self.shards, str):  # AUTO_SHARDS
            raise ValueError(
                "coordinator.shards auto is chosen by the run's plan at launch (Plan.config): nothing steps on it before"
            )
        return self.shards


_FAMILY = modes_where(lambda m: m.pseudo_gradients)  # the DiLoCo family, for errors
# what only a run whose islands send pseudo-gradients for an outer optimizer of the
# coordinator's own can do: (the setting, whether a config sets it, what the other modes do)
_FAMILY_ONLY: tuple[tuple[str, Callable[[RunConfig], bool], str], ...] = (
    ("coordinator.shards > 1", lambda c: c.coordinator.sliced, "steps on one coordinator"),
    ("compression.downlink", lambda c: c.tracks_copy, "receives exact parameters"),
    (
        "outer.merge radial_directional",
        lambda c: c.merge != OuterMerge.MEAN,
        "averages gradients, which have no merge of their own",
    ),
    (
        "inner.optimizer muon",
        lambda c: c.inner.optimizer == "muon",
        "steps the islands' optimizer on the coordinator, over the flat parameter (Muon needs whole matrices)",
    ),
)
RUN_PLACEHOLDER = "{run_id}"  # in `out_dir`: the run's own folder


def _choice() -> Any:
    """The `mode` field's type: the rows' settings classes as a union discriminated by
    `name` (pydantic picks the class, so a setting another mode has is an unknown key).
    Built from the registry, so a new row's class is a member without an edit here; typed
    as the classes' base for mypy, which reads each row's class through `settings_of`."""
    return Annotated[Union[SETTINGS], Field(discriminator="name")]  # noqa: UP007 (a tuple of classes)


if TYPE_CHECKING:
    ModeChoice: TypeAlias = ModeSettings
else:
    ModeChoice = _choice()


class RunConfig(Strict):
    """One training run. `mode` holds the mode and its own settings: `diloco` is
    synchronous DiLoCo; `ddp` the data-parallel baseline (gradients averaged every step, one
    AdamW using `inner`); `async` asynchronous Local-SGD; `overlap` CO2, communication
    hidden behind the next round's computation; `streaming` Streaming DiLoCo. `mode: async`
    is short for `mode: {name: async}`, every setting of the mode at its default."""

    mode: ModeChoice = Field(
        default_factory=DilocoSettings,
        description="the mode (`mode.name`: " + ", ".join(f"{m.value}" for m in MODES) + ") and its settings: "
        "see the `mode` tables below, one per mode",
    )
    rounds: int = Field(8, ge=1, description="outer rounds (ddp: rounds x inner_steps optimizer steps)")
    inner_steps: int = Field(
        50,
        ge=1,
        description="H, inner steps per round: 50x fewer bytes than data-parallel at H = 50; the papers use "
        "100-500 on larger models and longer runs (bytes fall as 1/H, see docs/benchmarks.md)",
    )
    seed: int = Field(0, description="model init (identical on every island) and data order")
    data_shards: int | None = Field(None, ge=1, description="data shards islands own (default: 4 per initial island)")
    eval_every: int = Field(1, ge=1, description="evaluate the global model every N rounds")
    round_timeout_s: float = Field(
        300.0,
        gt=0,
        description="fixed part of a work order's deadline (start-up, download); the deadline is "
        "round_timeout_s + H x step_timeout_s, and an island past it is left out of its round (marked late)",
    )
    step_timeout_s: float = Field(
        10.0,
        ge=0,
        description="allowance per inner step in a work order's deadline, so the deadline scales with H "
        "(a PATCH of inner_steps or a large H never makes every island late)",
    )
    speed_smoothing: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="EMA factor of each island's measured steps/s (its deadline, DyLU's H, the quorum's window)",
    )
    speed_timeout_factor: float | None = Field(
        3.0,
        gt=1,
        description="once an island's speed is measured, its deadline is this many times the time its work "
        "should take, at least round_timeout_s and at most the bound above (null: the bound only)",
    )
    preflight: bool = Field(
        True,
        description="check the run's plan (`archipelago plan`: each process's memory against its node) before "
        "starting anything, and refuse what cannot fit (exit 2)",
    )
    out_dir: str = Field(
        f"runs/{RUN_PLACEHOLDER}",
        description=f"outputs: config, metrics, events, summary, final model. `{RUN_PLACEHOLDER}` is replaced by the run's "
        "id, so each run has its own folder; a folder `latest` beside it then points at the newest "
        "(`--resume runs/latest`)",
    )
    init_from: str | None = Field(
        None,
        description="start from these weights instead of the seed's initialisation: a final.pt, or a "
        "checkpoint folder (its newest valid checkpoint); recorded in summary.json",
    )
    # sections (each documented by its model's docstring in docs/configuration.md), grouped
    # by what a user sets (`config_docs.GROUPS`): the run, as the fields above
    task: TaskSpec = Field(default_factory=TaskSpec)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    # the islands: what each holds, how it trains, what it sends
    islands: IslandsConfig = Field(default_factory=IslandsConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    # the mode's outer step (with `mode`, above)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    robust: RobustConfig = Field(default_factory=RobustConfig)
    # the fleet's elasticity
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    # outputs
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    records: RecordsConfig = Field(default_factory=RecordsConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    # the control plane
    api: ApiConfig = Field(default_factory=ApiConfig)

    @field_validator("mode", mode="before")
    @classmethod
    def _by_name(cls, mode: Any) -> Any:
        """`mode: async` is `mode: {name: async}`; settings without a name are the default
        mode's (`mode.dylu: true` alone: DiLoCo with DyLU)."""
        if isinstance(mode, str):
            return {"name": mode}
        if isinstance(mode, dict) and "name" not in mode:
            return {"name": Mode.DILOCO.value, **mode}
        return mode

    @model_validator(mode="after")
    def _warm_steps(self) -> RunConfig:
        w = self.warm_start
        if self.warm_steps and not mode_of(self).pseudo_gradients and w.path is None:
            raise ValueError(
                f"warm_start.steps in mode {self.mode.name.value} needs warm_start.path (it continues a finished warm "
                "start; there is no fork to train one for)"
            )
        if w.path is not None and not Path(w.path).is_dir():
            raise ValueError(f"warm_start.path: no such folder: {w.path}")
        return self

    @field_validator("out_dir")
    @classmethod
    def _one_placeholder(cls, out_dir: str) -> str:
        rest = out_dir.replace(RUN_PLACEHOLDER, "")
        if "{" in rest or "}" in rest:
            raise ValueError(f"braces other than {RUN_PLACEHOLDER} (the run's id) in {out_dir!r}")
        return out_dir

    def for_run(self, run_id: str) -> RunConfig:
        """This config with `out_dir`'s `{run_id}` replaced by `run_id` (unchanged without one)."""
        if RUN_PLACEHOLDER not in self.out_dir:
            return self
        return self.model_copy(update={"out_dir": self.out_dir.replace(RUN_PLACEHOLDER, run_id)})

    @field_validator("init_from")
    @classmethod
    def _exists(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).exists():
            raise ValueError(f"no such file or folder: {path}")
        return path

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        row = mode_of(self)
        if not row.pseudo_gradients:
            for setting, is_set, why in _FAMILY_ONLY:
                if is_set(self):
                    raise ValueError(
                        f"{setting} needs a DiLoCo-family mode ({_FAMILY}): mode {self.mode.name.value} {why}"
                    )
        if self.tracks_copy:
            self._check_tracked_copy()
        if (q := settings_if(self, QuorumSettings)) is not None:
            check_quorum(q.quorum, self.islands.count)
        if self.inner.optimizer == "muon" and self.islands.workers > 1:
            raise ValueError("inner.optimizer muon needs whole matrices on one worker: islands.workers = 1")
        if self.outer.optimizer == OuterOptimizer.SPARSELOCO and not self.compression.error_feedback:
            raise ValueError(
                "outer.optimizer sparseloco steps without momentum: it needs compression.error_feedback = true "
                "(and a lossy compression.codec such as topk:0.02+int2)"
            )
        if self.codecs_left_to_plan and not self.preflight:
            raise ValueError(
                "compression.codec or compression.downlink auto is chosen by the run's plan at launch: it needs "
                "preflight = true (or name the codecs)"
            )
        if self.coordinator.shards == AUTO_SHARDS:
            if not self.preflight:
                raise ValueError(
                    "coordinator.shards auto is chosen by the run's plan at launch: it needs preflight = true (or "
                    "name the shards)"
                )
            if self.coordinator.slice_resource is None:
                raise ValueError(
                    "coordinator.shards auto places each slice on a node of its own, counted by the resource its "
                    "nodes offer: set coordinator.slice_resource (archipelago_slice on the manifests' slices group)"
                )
        row.check_inner_steps(self, self.inner_steps)
        if (a := settings_if(self, AsyncSettings)) is not None:
            a.check_c(self.islands.count)
        return self

    def _check_tracked_copy(self) -> None:
        what = f"mode {self.mode.name.value}" if mode_of(self).tracks_copy else "compression.downlink"
        if (needs := self.copy_needs()) is not None:
            raise ValueError(f"{what} needs {needs}")

    def copy_needs(self) -> str | None:
        """What islands need to hold the published copy and that this config lacks (None:
        they can hold it): the check of a tracked copy, and what `auto`'s downlink reads."""
        if self.coordinator.sliced and mode_of(self).fragments:
            return "coordinator.shards = 1 (fragments step on one coordinator)"
        if self.islands.workers > 1 and self.islands.sharding == Sharding.FSDP:
            return "islands.sharding = zero1 (an FSDP island holds no whole copy)"
        return None

    @property
    def tracks_copy(self) -> bool:
        """Islands hold a copy of the published parameters that changes keep up to date."""
        return mode_of(self).tracks_copy or self.compression.downlink not in ("none", AUTO_CODEC)

    @property
    def keeps_island_state(self) -> bool:
        """Islands save their inner state for the checkpoints: not without checkpoints,
        with `checkpoint.island_state` off, in ddp (its optimizer is the coordinator's), or
        for islands of several workers (each holds a shard of the optimizer: not yet kept)."""
        keeps = self.checkpoint.every_rounds and self.checkpoint.island_state and self.islands.workers == 1
        return bool(keeps) and mode_of(self).pseudo_gradients

    @property
    def codecs_left_to_plan(self) -> bool:
        """`compression.codec` or `.downlink` is `auto`: the run's plan picks it at launch
        (`plan/head.py:choose_codecs`), and the run trains with what it picked."""
        return AUTO_CODEC in (self.compression.codec, self.compression.downlink)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.path or f"{self.out_dir}/checkpoint"

    @property
    def num_shards(self) -> int:
        return self.data_shards or 4 * self.islands.count

    def deadline_s(self, steps: int, steps_per_s: float | None = None) -> float:
        """How long work of `steps` inner steps may take before its island is late: the
        configured bound, or less once the island's speed is known (at the shipped H = 500
        the bound is 88 minutes, which a hung island would hold a barrier round for)."""
        bound = self.round_timeout_s + steps * self.step_timeout_s
        if not steps_per_s or self.speed_timeout_factor is None:
            return bound
        return min(bound, max(self.round_timeout_s, self.speed_timeout_factor * steps / steps_per_s))

    @property
    def total_inner_steps(self) -> int:
        """Inner steps per island of this run's rounds (the warm start not included)."""
        return self.rounds * self.inner_steps

    @property
    def warm_steps(self) -> int:
        """Inner steps trained before the fork: `warm_start.steps`, or where it is null (auto)
        a quarter of the run's inner steps (at least the inner warmup) for a DiLoCo-family
        run trained from scratch, none otherwise. Derived here, not written back into the
        section, so a config dumped and loaded again says what its user set."""
        if self.warm_start.steps is not None:
            return self.warm_start.steps
        scratch = self.init_from is None and mode_of(self).pseudo_gradients
        return max(self.total_inner_steps // 4, self.inner.warmup_steps) if scratch else 0

    @property
    def merge(self) -> OuterMerge:
        """`outer.merge`, or where it is null what the mode's row says (RDA for mode async on
        one coordinator, the mean elsewhere)."""
        return self.outer.merge if self.outer.merge is not None else mode_of(self).merge(self)

    @property
    def schedule_steps(self) -> int:
        """Length of the inner learning-rate schedule: the warm start, then the rounds."""
        return self.inner.schedule_steps or self.warm_steps + self.total_inner_steps

    @property
    def island_threads(self) -> int:
        return self.islands.threads or max(1, int(self.islands.cpus))
