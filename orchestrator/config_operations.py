"""The run config's sections that say how a run is operated rather than what it trains:
checkpoints, elasticity (membership, failures, drains) and the control plane. Kept apart
from `config.py` (the run as a whole and its cross-field checks), which imports them;
every section is strict, so a misspelt key is an error naming it."""

from __future__ import annotations

import ipaddress
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .config_sections import Strict


class EvalPlace(str, Enum):
    COORDINATOR = "coordinator"  # in the coordinator's process (the head): small models
    ACTOR = "actor"  # an evaluation actor placed on its own resources (an accelerator)


class EvaluationConfig(Strict):
    """Where the global model is evaluated (every `eval_every` rounds). The coordinator's
    process suits a small model; at scale an evaluation actor on an accelerator evaluates
    while the run goes on, and the coordinator only records the result."""

    where: EvalPlace = Field(
        EvalPlace.COORDINATOR,
        description="coordinator (its own process, synchronously: small models) or actor (an evaluation actor "
        "with the resources below, sent each version's parameters; the run does not wait for it)",
    )
    cpus: float = Field(1.0, ge=0, description="Ray CPUs of the evaluation actor")
    gpus: float = Field(0.0, ge=0, description="Ray GPUs of the evaluation actor (CUDA, bf16 per inner.precision)")
    timeout_s: float = Field(
        900.0, gt=0, description="an evaluation not back in this long is recorded as lost (the run goes on)"
    )


class CheckpointConfig(Strict):
    """Coordinator checkpoints (global params, outer state, version, membership, data positions)."""

    every_rounds: int = Field(5, ge=0, description="checkpoint every N rounds and at the end; 0 disables")
    path: str | None = Field(
        None,
        description="folder (default: out_dir/checkpoint) or object storage (s3://bucket/prefix, with the s3 "
        "extra; gs:// with gcs); shared storage on a cluster",
    )
    max_restarts: int = Field(3, ge=0, description="coordinator restarts from its checkpoint before the run fails")
    resume_from: int | None = Field(
        None,
        ge=1,
        description="continue from checkpoint N (state-N.pt, `--resume DIR@N`) instead of the newest; the run's "
        "new checkpoints continue that branch, so a restart does too",
    )
    keep: int = Field(
        3, ge=1, description="checkpoints kept; a restart falls back to an older one if the newest is corrupt"
    )
    island_state: bool = Field(
        True,
        description="islands write their inner optimizer state (moments, error feedback) beside the checkpoints "
        "in the rounds before each one, and a resumed run's islands continue from it",
    )


class RecordsConfig(Strict):
    """`metrics.jsonl` and `events.jsonl`, rotated by size: at 64 islands a record is ~7 KB,
    so a run of weeks would otherwise fill its volume with one file."""

    rotate_mib: float = Field(
        64.0, gt=0, description="a log past this size becomes <name>.1 (the older ones .2, .3, ...) and starts anew"
    )
    keep: int = Field(
        8, ge=0, description="rotated files kept per log, the oldest beyond are deleted (totals: summary.json)"
    )


class ExportConfig(Strict):
    """Snapshots of the global model in its ecosystem's format during the run (tasks that can
    export, e.g. the Hugging Face task), for evaluation harnesses that read that format."""

    every_rounds: int = Field(0, ge=0, description="write out_dir/snapshots/round-N every N rounds; 0: at the end only")
    keep: int = Field(2, ge=1, description="snapshots kept (the oldest are deleted)")


class TrackingBackend(str, Enum):
    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"
    WANDB = "wandb"


class TrackingConfig(Strict):
    """Experiment tracking: the run's config, per-round losses, bytes, staleness per island,
    membership events and the final summary, sent to the trackers its users already read.
    Each back-end is an optional extra (`tracking`) and is imported only when listed."""

    backends: list[TrackingBackend] = Field(
        default_factory=list, description="any of tensorboard, mlflow, wandb; [] (default): none is imported"
    )
    project: str = Field("archipelago", min_length=1, description="W&B project and MLflow experiment")
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI (default: a file store in out_dir/tracking/mlruns)"
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline writes out_dir/tracking/wandb (`wandb sync` uploads it later)"
    )


class ElasticConfig(Strict):
    """Membership changes: target island count, replacement of dead islands, joins, drains."""

    min_islands: int = Field(1, ge=1, description="scale-down floor")
    max_islands: int = Field(64, ge=1, description="scale-up ceiling")
    replace_dead: bool = Field(True, description="launch a replacement when an island dies (target kept)")
    spares: int = Field(
        0,
        ge=0,
        description="hot spares: islands placed and built beside the target that get no work; a failed, hung or "
        "preempted island's place goes to one at once (it starts from the current version and the run's lr "
        "schedule, not from a cold start) and a new spare is placed behind it. They hold their resources: "
        "count them in what the cluster must have",
    )
    join_weight: float = Field(0.5, gt=0, le=1, description="weight factor of a newcomer's first contribution")
    join_rewarmup_steps: int = Field(20, ge=0, description="a newcomer ramps its lr up over this many steps")
    drain: Literal["finish", "abandon"] = Field(
        "finish", description="a draining island finishes its round, or drops it"
    )
    partial_on_notice: bool = Field(
        True,
        description="a preemption notice stops the island's work before its first step that would not end in "
        "time and sends what it trained, weighted by its tokens (the rest of its batches go to another island); "
        "false: the work finishes if the node lasts, else it is lost. An island of several workers always does the latter",
    )
    notice_margin_s: float = Field(
        0.5,
        ge=0,
        description="on Ray: a noticed island's last step ends this long, plus its latest result's measured fetch "
        "time, before its node's deadline — a node is torn down with what its object store holds, so the result "
        "must be off it by then (the notice's and the result's own messages, the coordinator's next read)",
    )
    tail_stop: float | None = Field(
        2.0,
        ge=1,
        description="the budget's end (every step handed out, islands idle; pacings that hand out a budget of "
        "steps and step on groups: async's quorum rule, diloco with dylu, streaming with quorum pacing): a work whose "
        "remaining steps, at the pace its heartbeats report, would take more than this many times longer than "
        "stopping it and training them on the idle islands (its step in progress, their round trip as last measured, "
        "their speeds) is stopped as a notice stops it: what it trained is merged, the rest of its steps go to the "
        "idle islands. A slowed island no longer holds the run's last step. Needs heartbeats (hang_after_steps). "
        "null: the last step waits for every work",
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
    hang_after_steps: float | None = Field(
        5.0,
        gt=0,
        description="heartbeats: an island whose inner steps stop advancing, between the first and the last step "
        "of its work, for this many of its expected step times (from its measured speed; at least 3 x "
        "progress_every_s) is hung at once — its work given back, it is released and replaced — instead of at its "
        "deadline and late_grace_s; a slow island keeps advancing and keeps its work. null: only deadlines",
    )
    progress_every_s: float = Field(
        2.0,
        gt=0,
        description="heartbeats: how often each placed island's progress is read (beside its round, never behind "
        "it; on Ray by a thread of the coordinator's own, so a coordinator busy evaluating or checkpointing still hears it)",
    )
    hang_floor_s: float = Field(
        60.0,
        gt=0,
        description="heartbeats: the limit of silence before an island's first step of a work (its download, a "
        "first step compiling) and after its last (its pseudo-gradient, a state saved), and while its speed is not "
        "known; bytes moving on its node's card are progress there, so a transfer longer than this is not a hang",
    )

    def stall_limit_s(
        self, steps_per_s: float | None, hang_after_steps: float | None, *, stepping: bool
    ) -> float | None:
        """How long an island's progress may stall before it is hung: while it is `stepping`
        (it has reported a step of its work and not yet its last), `hang_after_steps` (the
        run's live value; None: no heartbeats) of its step times, at least three reads of its
        progress — a hang in its data or a collective is seen in seconds; otherwise at least
        `hang_floor_s` too, which covers what may take long without a step (a download, a
        first step compiling, a state saved after the last) and an island whose speed is not
        known yet (one that hangs in its first round never reports one)."""
        if hang_after_steps is None:
            return None
        steps = max(hang_after_steps / steps_per_s, 3 * self.progress_every_s) if steps_per_s else None
        if stepping and steps is not None:
            return steps
        return max(steps or 0.0, self.hang_floor_s, 3 * self.progress_every_s)


class ApiConfig(Strict):
    """The control plane served with the run (see the README's control-plane section)."""

    enabled: bool = Field(False, description="serve the REST API, /metrics and the dashboard with the run")
    host: str = Field("127.0.0.1", description="0.0.0.0 to expose it (on KubeRay: through the head Service)")
    port: int = Field(8600, ge=1, le=65535, description="port of the control plane (the first one it tries)")
    ports: int = Field(
        1,
        ge=1,
        le=100,
        description="how many ports from `port` up the control plane may take: it serves on the first free "
        "one, and past them on one the system picks, so any number of runs on one Ray cluster each get their "
        "own (the run logs its address and writes it to control-plane.url in its folder)",
    )
    public_reads: bool = Field(
        False,
        description="serve reads (status, islands, events, history, metrics) without the token; mutations "
        "always need it",
    )
    tls_cert: str | None = Field(None, description="PEM certificate file: serve HTTPS (with tls_key)")
    tls_key: str | None = Field(None, description="PEM private key file of tls_cert")
    rate_per_s: float = Field(
        50.0,
        ge=0,
        description="requests a second each client may make on average; beyond, 429 with Retry-After (0: no "
        "limit). A client is the operator's token, the read-only token, or else its address, so no client "
        "without a token can drain a token's bucket. The dashboard makes about 2",
    )
    rate_burst: int = Field(100, ge=1, description="requests a client may make at once before rate_per_s applies")
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or networks (10.0.0.0/8) of proxies whose X-Forwarded-For names the client (an "
        "ingress in front of the API). None by default: the socket's peer is the client, since every "
        "`kubectl port-forward` request arrives from loopback and its X-Forwarded-For would be the sender's choice",
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an address or a network (10.0.0.0/8)") from None
        return value

    @model_validator(mode="after")
    def _tls(self) -> ApiConfig:
        """Both files or neither, and readable now: a bad path found when the actor starts
        would cost the run's start-up first."""
        given = [f for f in ("tls_cert", "tls_key") if getattr(self, f) is not None]
        if len(given) == 1:
            raise ValueError(f"api.{given[0]} needs api.{'tls_key' if given[0] == 'tls_cert' else 'tls_cert'} too")
        for field in given:
            if not Path(getattr(self, field)).is_file():
                raise ValueError(f"api.{field}: {getattr(self, field)} is not a file")
        return self
