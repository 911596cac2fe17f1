"""Assembling a run: the task's model (same seed everywhere, `init_from`'s weights, or the
warm start's), the outer step over it — whole, or over coordinator slices — the mode's
policies, and the round engine driving an island pool; and `PhasedRun`, a run with its
warm start in front. The coordinator actor and the tests build through here, so both run
exactly the same engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orchestrator.config import Mode, RunConfig
from orchestrator.engine.checkpoints import load_initial_weights
from orchestrator.engine.engine import RoundEngine
from orchestrator.engine.outer_step import LocalOuter, LocalSlices, Outer, SliceCalls, SlicedOuter
from orchestrator.engine.policies import build_policies, outer_rule
from orchestrator.engine.pool import IslandPool
from orchestrator.engine.types import RunFailed
from orchestrator.engine.warm_start import WarmStart, load_warm_start, mark_finished, pending, warm_config, warm_run_id
from workers.flat import FlatParams, slice_bounds
from workers.fragments import FragmentedTask, fragment_model
from workers.task import load_task


def build_engine(
    cfg: RunConfig,
    pool: IslandPool,
    run_id: str = "local",
    slices: Callable[[RunConfig, Any, list[tuple[int, int]]], SliceCalls] | None = None,
    on_record: Callable[[dict[str, Any], dict[str, dict[str, Any]]], None] | None = None,
) -> RoundEngine:
    """The engine for `cfg` driving `pool`; with `coordinator.shards` > 1 the outer step is
    split over slices reached through `slices` (in process by default)."""
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    task.prepare()
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    flat = FlatParams(model)
    warm: WarmStart | None = None
    initial = None
    if cfg.warm_steps:
        warm = load_warm_start(cfg, flat.numel)
        flat.load(warm.params)
    elif cfg.init_from:
        initial = start_from(Path(cfg.init_from), model, flat)
    fragments = None
    if cfg.mode == Mode.STREAMING:  # the same fragments as every island computes from its model
        groups = task.layer_groups(model) if isinstance(task, FragmentedTask) else None
        fragments = fragment_model(model, cfg.streaming.fragments, groups)
    outer: Outer
    if cfg.coordinator.shards > 1:
        bounds = slice_bounds(flat.numel, cfg.coordinator.shards, cfg.compression.chunk)
        params = flat.data.detach().numpy()
        calls = slices(cfg, params, bounds) if slices is not None else LocalSlices(outer_rule(cfg), params, bounds)
        outer = SlicedOuter(flat.data, bounds, calls)
    else:
        outer = LocalOuter(flat.data, outer_rule(cfg), fragments)
    policies = build_policies(cfg, flat.numel, fragments)
    return RoundEngine(cfg, task, model, flat, outer, policies, pool, run_id, on_record, initial, warm, fragments)


def start_from(path: Path, model: torch.nn.Module, flat: FlatParams) -> dict[str, str]:
    """Load `init_from` into the model before anything else sees it (the outer state and
    the first published version start from it); what `summary.json` records of it."""
    kind, weights, digest = load_initial_weights(path)
    if isinstance(weights, torch.Tensor):
        if weights.numel() != flat.numel:
            raise RunFailed(f"init_from: {path} holds {weights.numel()} parameters, this task's model {flat.numel}")
        flat.load(weights)
    else:
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as err:
            raise RunFailed(f"init_from: {path} does not fit this task's model: {err}") from err
    return {"path": str(path.resolve()), "kind": kind, "sha256": digest}


PoolFactory = Callable[[RunConfig, str], IslandPool]


class PhasedRun:
    """A run from its warm start, when it has one still to train, to its end: the warm
    phase is a run of its own (`engine/warm_start.py`, run id `<run_id>-warm`), then the
    main run forks from it. `engine` is the phase running now (what the control plane
    reads and steers). A coordinator restarted in either phase resumes that phase."""

    def __init__(self, cfg: RunConfig, run_id: str, make_pool: PoolFactory, **engine: Any) -> None:
        self.cfg, self.run_id, self.make_pool, self.options = cfg, run_id, make_pool, engine
        self.warm_cfg = warm_config(cfg) if pending(cfg, run_id) else None
        if self.warm_cfg is not None:
            wid = warm_run_id(run_id)
            self.engine = build_engine(self.warm_cfg, make_pool(self.warm_cfg, wid), wid, **engine)
        else:
            self.engine = self._main()

    def _main(self) -> RoundEngine:
        return build_engine(self.cfg, self.make_pool(self.cfg, self.run_id), self.run_id, **self.options)

    @property
    def warming(self) -> bool:
        return self.warm_cfg is not None and self.engine.cfg is self.warm_cfg

    def execute(self) -> dict[str, Any]:
        """Run to the end; a warm phase that was stopped ends the run there (its summary,
        marked `phase: warm_start`, says so)."""
        if self.warming:
            summary = self.engine.execute()
            self.engine.pool.close()
            if summary["state"] != "finished":
                return {**summary, "phase": "warm_start"}
            mark_finished(self.cfg, self.run_id, summary)
            self.engine = self._main()
        return self.engine.execute()
