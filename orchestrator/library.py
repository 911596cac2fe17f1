"""The Python API: what the `archipelago` command does, as functions a program calls —
build a run's config, plan it, train it, read its summary — for users who drive training
from their own code (as Ray Train's users call `TorchTrainer.fit()`) rather than a shell.
The command is a shell over the same functions (`cli.py`), so the two cannot drift.
`import archipelago` gives them (`archipelago.config`, `.plan`, `.run`, `.summary`,
`.__version__`), imported on first use: the import itself stays light.

    import archipelago
    cfg = archipelago.config(None, "rounds=4", "islands.count=2")
    plan = archipelago.plan(cfg)          # plan.fits: whether it fits, plan.lines(): why
    summary = archipelago.run(cfg)        # trains on Ray (a local instance if none is up)
    print(summary["final_eval_loss"])
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .build_info import commit, version
from .config import RunConfig
from .config_load import ConfigError, check_extras, check_folders, load_config

if TYPE_CHECKING:
    from .plan.cluster import Cluster
    from .plan.planner import Plan

log = logging.getLogger(__name__)
__all__ = ["ConfigError", "RunConfig", "commit", "config", "plan", "run", "summary", "version"]


def config(file: str | Path | None = None, *overrides: str) -> RunConfig:
    """A run's config: the YAML `file` (None: the embedded default), then each override
    (`"outer.lr=0.5"`, as `--set` takes them). Raises `ConfigError` naming the field, and
    where the config needs an optional extra that is not installed, which one."""
    cfg = load_config(str(file) if file is not None else None, list(overrides))
    check_extras(cfg)
    return cfg


def plan(
    cfg: RunConfig,
    cluster: Cluster | str | Path | None = None,
    *,
    accelerator_memory: int | None = None,
    link_gbps: float | None = None,
    step_s: float | None = None,
) -> Plan:
    """Memory, bytes and time per process and per link of `cfg` on `cluster` (a `Cluster`,
    a RayCluster or RayJob manifest's path, or None: this machine, its GPUs' memory taken
    as `accelerator_memory` where given, and a config asking for GPUs it lacks planned on
    its CPU, as it would run here; `run`'s own plan does the same). `Plan.fits` says
    whether it fits — a refusal is its answer, not an exception; `Plan.lines()` is what
    `archipelago plan` prints. Raises `ClusterError` for a manifest it cannot read."""
    from .plan.cluster import from_manifest, this_machine
    from .plan.planner import DEFAULT_STEP_S, on_cpu, plan_run

    if cluster is None:
        cluster = this_machine(accelerator_memory)
        if not cluster.head.gpus and (cfg.islands.gpus or cfg.evaluation.gpus):
            log.info("this machine has no GPU: its islands and evaluator are planned on its CPU, as they would run")
            cfg = on_cpu(cfg)
    elif isinstance(cluster, (str, Path)):
        cluster = from_manifest(cluster)
    return plan_run(cfg, cluster, link_gbps=link_gbps, step_s=step_s or DEFAULT_STEP_S)


def run(
    cfg: RunConfig, *, run_id: str | None = None, progress: bool = False, started_at: float | None = None
) -> dict[str, Any]:
    """Train `cfg` to the end on Ray (the instance `ray.address` names, else one started
    here) and return its summary (also `summary.json` in its folder). `run_id`: an earlier
    run's, to continue it from its checkpoints. Raises `PlanRefused` where the plan refuses
    it before anything starts, `RunFailed` where it failed."""
    from .runtime.driver import run as train

    check_folders(cfg)  # as `archipelago run`: outputs and checkpoints writable before any compute
    return train(cfg, run_id=run_id, show_progress=progress, started_at=started_at)


def summary(folder: str | Path) -> dict[str, Any]:
    """The summary of the run whose outputs are in `folder`, a local one or on object
    storage (its `summary.json`)."""
    from archipelago.workers.runtime.storage import Folder

    return json.loads(Folder(str(folder)).read("summary.json"))
