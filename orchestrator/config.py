"""Typed run configuration. Every field is validated here, before anything starts, so a
mistake is reported by field name instead of surfacing minutes later inside an actor."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workers.wire.links import LinkConfig
from workers.wire.spec import CODEC_NAMES, InnerConfig, Sharding


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Mode(str, Enum):
    """How rounds are paced and which outer rule steps (chosen once, in `engine/policies.py`)."""

    DILOCO = "diloco"  # barrier rounds, one outer step per round
    DDP = "ddp"  # barrier per batch: the data-parallel baseline
    ASYNC = "async"  # per-arrival: every pseudo-gradient applied when it lands (Delayed Nesterov)
    OVERLAP = "overlap"  # one-round lag: CO2, the exchange of round t hidden behind round t+1
    STREAMING = "streaming"  # Streaming DiLoCo: P fragments synchronised on a staggered schedule


class WarmStartMode(str, Enum):
    """How the shared start of a run is trained before its islands fork."""

    DDP = "ddp"  # data-parallel over the run's islands (k x batch, one optimizer)
    SINGLE = "single"  # one island trains alone


class WarmStartConfig(_Strict):
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
        WarmStartMode.DDP,
        description="ddp (data-parallel over the run's islands) or single (one island alone, batch x 1)",
    )
    path: str | None = Field(
        None,
        description="reuse the finished warm start in this folder (a run's out_dir/warm_start) instead of "
        "training one: e.g. to compare methods from one warm start; same task, seed and data shards",
    )


class RobustConfig(_Strict):
    """Admission checks beyond shape, weight and finiteness (`engine/admission.py`)."""

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


class IslandsConfig(_Strict):
    """How many islands and what each one holds (on a cluster: real GPUs)."""

    count: int = Field(4, ge=1, le=1024, description="islands at the start (the target count; elastic runs change it)")
    workers: int = Field(1, ge=1, le=64, description="data-parallel workers per island (one node, STRICT_PACK)")
    sharding: Sharding = Field(
        Sharding.ZERO1,
        description="with workers > 1: zero1 (each worker holds the model, optimizer state sliced) or fsdp "
        "(FSDP2: parameters, gradients and optimizer state sharded, for a model one accelerator cannot hold)",
    )
    cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per island worker")
    gpus: float = Field(0.0, ge=0, description="Ray GPUs per island worker; CUDA is used when > 0 and available")
    threads: int | None = Field(None, ge=1, description="torch threads per island (default: cpus, at least 1)")
    links: list[LinkConfig] | None = Field(
        None,
        description="SIMULATION: one link per initial island; joiners and replacements use the run's `link`",
    )
    simulated_slowdown: list[float] | None = Field(
        None,
        description="SIMULATION: one factor >= 1 per initial island stretching every inner step (2 = half speed); "
        "joiners and replacements run at 1",
    )

    virtual_step_s: float | None = Field(
        None,
        gt=0,
        description="SIMULATION: a virtual clock. Island i's inner step takes virtual_step_s x its "
        "simulated_slowdown simulated seconds and nothing sleeps; results are taken in the order of their "
        "simulated finish times and the run's clock (deadlines, links, clock_seconds) is simulated, while "
        "the islands really train; so measured speeds are exact on a contended machine",
    )

    @model_validator(mode="after")
    def _check(self) -> IslandsConfig:
        s = self.simulated_slowdown
        if s is not None:
            if len(s) != self.count:
                raise ValueError(f"simulated_slowdown has {len(s)} entries for {self.count} islands")
            if any(f < 1 for f in s):
                raise ValueError("simulated_slowdown factors must be >= 1")
        if self.links is not None and len(self.links) != self.count:
            raise ValueError(f"links has {len(self.links)} entries for {self.count} islands")
        return self

    def slowdown(self, index: int) -> float:
        """Island `index`'s factor; islands past the list (joiners, replacements) run at full speed."""
        s = self.simulated_slowdown
        return s[index] if s and index < len(s) else 1.0

    def virtual_seconds(self, index: int, steps: int) -> float:
        """Simulated seconds of `steps` inner steps of island `index` under the virtual clock."""
        return steps * (self.virtual_step_s or 0.0) * self.slowdown(index)


class OuterConfig(_Strict):
    """Outer optimizer stepped on the token-weighted mean pseudo-gradient (docs/algorithms.md)."""

    optimizer: Literal["nesterov", "sgd", "adam"] = Field(
        "nesterov",
        description="nesterov (torch SGD's Nesterov update, in place); sgd with lr 1 and momentum 0 is plain "
        "parameter averaging (FedAvg); adam",
    )
    lr: float = Field(0.7, gt=0, description="outer learning rate (DiLoCo paper: 0.7)")
    momentum: float = Field(0.9, ge=0, lt=1, description="nesterov/sgd momentum")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam betas")
    drop_prob: float = Field(0.0, ge=0, lt=1, description="drop each pseudo-gradient with this probability (ablation)")


class AsyncRule(str, Enum):
    QUORUM = "quorum"  # a step per quorum + adaptive grace window, token-weighted and age-aware
    DELAYED_NESTEROV = "delayed_nesterov"  # Liu et al. 2024: a step per arrival, momentum every N
    NAIVE = "naive"  # the `outer` optimizer stepped on every arrival (over-accelerates)


class AsyncConfig(_Strict):
    """`mode: async` settings (section `asynchronous`)."""

    rule: AsyncRule = Field(
        AsyncRule.DELAYED_NESTEROV,
        description="quorum (the `outer` optimizer stepped on what a quorum and its grace window bring, "
        "token-weighted, stale results discounted by age), delayed_nesterov (Liu et al. 2024, per arrival), or "
        "naive (the `outer` optimizer stepped on every arrival: the paper's baseline that over-accelerates)",
    )
    quorum: int | None = Field(
        None, ge=1, description="rule quorum: results that open a step (null: half the live islands, rounded up)"
    )
    grace_cap: float = Field(
        0.25, ge=0, description="rule quorum: the grace window is at most this fraction of a round's duration"
    )
    grace_k: float = Field(
        3.0, ge=0, description="rule quorum: grace window = median + k x MAD of recent arrival offsets (capped)"
    )
    age_power: float = Field(
        1.0, ge=0, description="rule quorum: a result a versions old merges with weight tokens x (1 + a)^-age_power"
    )
    delay: int | None = Field(None, ge=1, description="DN's N (default: the number of islands)")
    token_weighted: bool = Field(
        True,
        description="delayed_nesterov / naive: scale each arrival by its inner steps over the islands' mean H, so "
        "DyLU's short and long updates weigh by their tokens (false: equally, as in the paper)",
    )
    c: float = Field(0.0, ge=0, le=1, description="DN momentum fraction between updates, in [0, 1/N]")
    dylu: bool = Field(True, description="Dynamic Local Updates: H per island from its measured speed")
    speed_smoothing: float = Field(0.5, ge=0, lt=1, description="EMA factor of measured steps/s")
    max_staleness: int | None = Field(None, ge=0, description="beyond this, apply stale_policy")
    stale_policy: Literal["reject", "downweight"] = Field(
        "reject",
        description="past max_staleness: reject, or scale by 1/(1 + staleness - max_staleness)",
    )

    @model_validator(mode="after")
    def _check(self) -> AsyncConfig:
        if self.delay is not None and self.c > 1.0 / self.delay:
            raise ValueError(f"c must be at most 1/delay = {1 / self.delay:g}")
        return self


class DilocoConfig(_Strict):
    """`mode: diloco` settings (section `diloco`)."""

    dylu: bool = Field(
        False,
        description="Dynamic Local Updates in a barrier round: each island's H follows its measured speed, so "
        "the islands of a round finish together and none waits for the slowest (sync_dylu)",
    )


class OverlapConfig(_Strict):
    """`mode: overlap` (CO2) outer step; defaults are the authors' code defaults for <= 16 workers."""

    lr: float = Field(
        0.7,
        gt=0,
        description="alpha, outer learning rate (the authors' code uses 1; under the one-round lag 1 is marginally "
        "stable: 0.7 was best of 0.5, 0.7 and 1 in `bench overlap`, see docs/benchmarks.md)",
    )
    momentum: float = Field(0.0, ge=0, lt=1, description="beta, heavy-ball outer momentum")
    clip: float | None = Field(1.0, gt=0, description="phi, element-wise outer momentum clip; null disables")
    penalty: Literal["constant", "adaptive"] = Field(
        "constant",
        description="staleness gap penalty Lambda: constant = 1/p (the released code), "
        "adaptive = 1/(1 + lambda ||x_n - x_s|| / (||delta|| + eps))",
    )
    penalty_p: float = Field(1.0, ge=1, description="constant penalty: Lambda = 1/p (1 = none)")
    penalty_lambda: float = Field(1.0, ge=0, description="adaptive penalty strength")
    eager: bool = Field(
        False,
        description="eager updates (Kale et al. 2025): an island starting round t+1 from the version before its "
        "round t landed starts from that version moved by its own round-t pseudo-gradient, standing in for the "
        "average still in flight (lr x Lambda, clipped like the momentum), instead of from the lagged version",
    )


class StreamingConfig(_Strict):
    """`mode: streaming` (Streaming DiLoCo, Douillard et al. 2025): the model is cut into P
    fragments by layer; a round of H inner steps is P segments of H/P, and the segment
    that ends at step t sends fragment (t / (H/P) - 1) mod P, so each fragment is
    synchronised every H steps and the link carries 1/P of the model at a time. Each
    fragment has its own outer optimizer state."""

    fragments: int = Field(4, ge=1, le=64, description="P: fragments (inner_steps must be a multiple of it)")
    tau: int | None = Field(
        None,
        ge=0,
        description="overlap in inner steps: a fragment's pseudo-gradient leaves tau steps before its segment "
        "ends and the new global fragment is merged when the segment ends, so its exchange hides behind tau "
        "steps of compute; 0 to H/P - 1; null: a fifth of a segment (5 steps at H = 100, P = 4)",
    )
    alpha: float = Field(
        0.0,
        ge=0,
        le=1,
        description="merge of a received fragment: local <- alpha x local + (1 - alpha) x global (0: replace, "
        "as DiLoCo does; the paper uses 0.5 with overlap, 0 measured better here: see docs/modes.md)",
    )


class CompressionConfig(_Strict):
    """Codecs of what islands send (pseudo-gradients; gradients in ddp) and receive."""

    codec: str = Field(
        "none",
        description=f"one of {sorted(CODEC_NAMES)}: fp32, bf16 (2x fewer bytes), int8 or int4 with one fp32 scale per "
        "chunk (about 4x, 8x); decoded and accumulated in fp32",
    )
    downlink: str = Field(
        "none",
        description="codec of what islands receive: none sends the new parameters (a fragment of them in mode "
        "streaming); a lossy codec sends the change of the copy islands hold, and the coordinator applies the "
        "same decoded change to its published copy, so islands and coordinator never drift",
    )
    chunk: int = Field(
        512,
        ge=16,
        description="values per int8/int4 scale (also the alignment of coordinator slices); 512 costs int4 1.6% "
        "more bytes than 4096 and cost streaming 0.25% of eval loss against 1.4% (bench streaming)",
    )
    error_feedback: bool = Field(
        False,
        description="islands keep what a lossy codec rounded away and add it to their next pseudo-gradient, so "
        "the rounding does not accumulate over rounds",
    )

    @model_validator(mode="after")
    def _check(self) -> CompressionConfig:
        for name in ("codec", "downlink"):
            if getattr(self, name) not in CODEC_NAMES:
                raise ValueError(f"{name}: unknown codec {getattr(self, name)!r}; choose one of {sorted(CODEC_NAMES)}")
        return self


class CheckpointConfig(_Strict):
    """Coordinator checkpoints (global params, outer state, version, membership, data positions)."""

    every_rounds: int = Field(5, ge=0, description="checkpoint every N rounds and at the end; 0 disables")
    path: str | None = Field(None, description="folder (default: out_dir/checkpoint); shared storage on a cluster")
    max_restarts: int = Field(3, ge=0, description="coordinator restarts from its checkpoint before the run fails")
    keep: int = Field(
        3, ge=1, description="checkpoints kept; a restart falls back to an older one if the newest is corrupt"
    )


class OnFailure(str, Enum):
    CONTINUE = "continue"
    RESTART = "restart"


class ElasticConfig(_Strict):
    """Membership changes: target island count, replacement of dead islands, joins, drains."""

    min_islands: int = Field(1, ge=1, description="scale-down floor")
    max_islands: int = Field(64, ge=1, description="scale-up ceiling")
    replace_dead: bool = Field(True, description="launch a replacement when an island dies (target kept)")
    on_failure: OnFailure = Field(
        OnFailure.CONTINUE,
        description="continue (the others train on; only the failed island's work is lost) or restart (every "
        "failure stops every island's work, the run resumes from its last step after restart_s: the "
        "stop-the-world recovery of a checkpoint-restart job, kept as a baseline)",
    )
    restart_s: float = Field(30.0, ge=0, description="on_failure restart: seconds the fleet stands still per failure")
    join_weight: float = Field(0.5, gt=0, le=1, description="weight factor of a newcomer's first contribution")
    join_rewarmup_steps: int = Field(20, ge=0, description="a newcomer ramps its lr up over this many steps")
    drain: Literal["finish", "abandon"] = Field(
        "finish", description="a draining island finishes its round, or drops it"
    )
    placement_timeout_s: float = Field(600.0, gt=0, description="give up on a requested island after this long")
    orphan_timeout_s: float = Field(
        60.0,
        gt=0,
        description="an island whose coordinator has been gone this long (driver killed, restarts exhausted) "
        "releases itself and its node",
    )
    late_grace_s: float = Field(
        600.0,
        gt=0,
        description="an island whose work is past its deadline is waited for this long more, then released "
        "as hung and replaced (its work is retrained by the next owner of its shards)",
    )


class ApiConfig(_Strict):
    """The control plane served with the run (see the README's control-plane section)."""

    enabled: bool = Field(False, description="serve the REST API, /metrics and the dashboard with the run")
    host: str = Field("127.0.0.1", description="0.0.0.0 to expose it (on KubeRay: through the head Service)")
    port: int = Field(8600, ge=1, le=65535, description="port of the control plane")
    public_reads: bool = Field(
        False,
        description="serve reads (status, islands, events, history, metrics) without the token; mutations "
        "always need it",
    )


class TaskSpec(_Strict):
    """The user's model and data: an import path `module:factory` and its keyword arguments."""

    factory: str = Field(
        "workers.tasks.lm_task:make_task", description="`module:function` returning a Task, importable on every node"
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the factory, validated by the task before anything starts",
    )


class RayConfig(_Strict):
    """Where the run's Ray lives."""

    address: str | None = Field(None, description="existing cluster; default: $RAY_ADDRESS, else start a local one")
    num_cpus: int | None = Field(
        None, ge=1, description="logical CPUs of a local instance (default: what islands need)"
    )


class CoordinatorConfig(_Strict):
    """The outer step over S shards: each owns 1/S of the parameters and of the outer
    optimizer state, and receives 1/S of every pseudo-gradient straight from the islands."""

    shards: int = Field(1, ge=1, le=256, description="coordinator shards S (1: the coordinator steps alone)")
    threads: int = Field(
        1,
        ge=1,
        le=256,
        description="torch threads of the coordinator and of each shard for "
        "the outer step (more when they have cores islands do not use, e.g. a KubeRay head)",
    )


class RunConfig(_Strict):
    """One training run. `mode: diloco` is synchronous DiLoCo; `mode: ddp` is the
    data-parallel baseline (gradients averaged every step, one AdamW using `inner`);
    `mode: async` is asynchronous Local-SGD (settings in `asynchronous`); `mode: overlap`
    is CO2, communication hidden behind the next round's computation (settings in `overlap`);
    `mode: streaming` is Streaming DiLoCo (settings in `streaming`)."""

    mode: Mode = Field(
        Mode.DILOCO,
        description="diloco (synchronous DiLoCo), ddp (data-parallel baseline: k islands = k x batch), "
        "async (asynchronous Local-SGD), overlap (CO2) or streaming (Streaming DiLoCo)",
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
    out_dir: str = Field("runs/latest", description="outputs: config, metrics, events, summary, final model")
    init_from: str | None = Field(
        None,
        description="start from these weights instead of the seed's initialisation: a final.pt, or a "
        "checkpoint folder (its newest valid checkpoint); recorded in summary.json",
    )
    # sections (each documented by its model's docstring in docs/configuration.md)
    islands: IslandsConfig = Field(default_factory=IslandsConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    asynchronous: AsyncConfig = Field(default_factory=AsyncConfig)
    diloco: DilocoConfig = Field(default_factory=DilocoConfig)
    overlap: OverlapConfig = Field(default_factory=OverlapConfig)
    streaming: StreamingConfig = Field(default_factory=StreamingConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    link: LinkConfig = Field(default_factory=LinkConfig)
    robust: RobustConfig = Field(default_factory=RobustConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    task: TaskSpec = Field(default_factory=TaskSpec)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _warm_steps(self) -> RunConfig:
        """Resolve `warm_start.steps: null` (auto) once, so every part of the run reads one number."""
        w = self.warm_start
        if w.steps is None:
            scratch = self.init_from is None and self.mode != Mode.DDP
            w.steps = max(self.total_inner_steps // 4, self.inner.warmup_steps) if scratch else 0
        if w.steps and self.mode == Mode.DDP and w.path is None:
            raise ValueError(
                "warm_start.steps in mode ddp needs warm_start.path (it continues a finished warm start; "
                "there is no fork to train one for)"
            )
        if w.path is not None and not Path(w.path).is_dir():
            raise ValueError(f"warm_start.path: no such folder: {w.path}")
        return self

    @field_validator("init_from")
    @classmethod
    def _exists(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).exists():
            raise ValueError(f"no such file or folder: {path}")
        return path

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.mode != Mode.DILOCO and self.outer.drop_prob:
            raise ValueError("outer.drop_prob applies to mode diloco only")
        if self.mode == Mode.DDP and self.coordinator.shards > 1:
            raise ValueError(
                "coordinator.shards > 1 needs a DiLoCo-family mode (diloco, async, overlap); "
                "the ddp baseline steps on one coordinator"
            )
        if self.tracks_copy:
            self._check_tracked_copy()
        a = self.asynchronous
        if a.quorum is not None and a.quorum > self.islands.count:
            raise ValueError(f"asynchronous.quorum = {a.quorum} is above islands.count = {self.islands.count}")
        if self.diloco.dylu and self.mode != Mode.DILOCO:
            raise ValueError("diloco.dylu applies to mode diloco only")
        if a.c > 1.0 / (a.delay or self.islands.count):
            raise ValueError(f"asynchronous.c must be at most 1/N = {1 / (a.delay or self.islands.count):g}")
        return self

    def _check_tracked_copy(self) -> None:
        what = "mode streaming" if self.mode == Mode.STREAMING else "compression.downlink"
        if self.mode == Mode.DDP:
            raise ValueError(
                "compression.downlink needs a DiLoCo-family mode: the ddp baseline receives exact parameters"
            )
        if self.coordinator.shards > 1:
            raise ValueError(f"{what} needs coordinator.shards = 1 (the published copy lives on the coordinator)")
        if self.islands.workers > 1 and self.islands.sharding == Sharding.FSDP:
            raise ValueError(f"{what} needs islands.sharding = zero1 (an FSDP island holds no whole copy)")
        p = self.streaming.fragments
        if self.mode == Mode.STREAMING:
            if self.inner_steps % p:
                raise ValueError(f"inner_steps = {self.inner_steps} must be a multiple of streaming.fragments = {p}")
            segment = self.inner_steps // p
            if self.streaming.tau is not None and self.streaming.tau >= segment:
                raise ValueError(
                    f"streaming.tau = {self.streaming.tau} must be shorter than a segment (inner_steps / fragments "
                    f"= {segment}): a fragment leaves after at least one step of its segment"
                )

    @property
    def streaming_tau(self) -> int:
        """τ resolved: `streaming.tau`, or a fifth of a segment when null."""
        tau = self.streaming.tau
        return tau if tau is not None else self.inner_steps // self.streaming.fragments // 5

    @property
    def tracks_copy(self) -> bool:
        """Islands hold a copy of the published parameters that changes keep up to date."""
        return self.mode == Mode.STREAMING or self.compression.downlink != "none"

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.path or f"{self.out_dir}/checkpoint"

    @property
    def num_shards(self) -> int:
        return self.data_shards or 4 * self.islands.count

    def island_link(self, index: int) -> LinkConfig:
        """Island `index`'s link; islands past `islands.links` (joiners, replacements) use `link`."""
        links = self.islands.links
        return links[index] if links and index < len(links) else self.link

    def deadline_s(self, steps: int) -> float:
        """How long work of `steps` inner steps may take before its island is late."""
        return self.round_timeout_s + steps * self.step_timeout_s

    @property
    def total_inner_steps(self) -> int:
        """Inner steps per island of this run's rounds (the warm start not included)."""
        return self.rounds * self.inner_steps

    @property
    def warm_steps(self) -> int:
        """Inner steps trained before the fork (resolved: never null after validation)."""
        return self.warm_start.steps or 0

    @property
    def schedule_steps(self) -> int:
        """Length of the inner learning-rate schedule: the warm start, then the rounds."""
        return self.inner.schedule_steps or self.warm_steps + self.total_inner_steps

    @property
    def island_threads(self) -> int:
        return self.islands.threads or max(1, int(self.islands.cpus))
