"""Assembling a run: the task's model (same seed everywhere, `init_from`'s weights, or the
warm start's), the outer step over it — whole, or over coordinator slices — the mode's
policies, and the round engine driving an island pool; and `PhasedRun`, a run with its
warm start in front. The coordinator actor and the tests build through here, so both run
exactly the same engine."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from archipelago.workers.runtime.storage import Folder
from archipelago.workers.tasks.task import Task, load_task
from archipelago.workers.wire.flat import FlatParams, slice_bounds
from archipelago.workers.wire.fragments import FragmentedTask, Fragments, fragment_model

from ..config import RunConfig
from ..config_operations import EvalPlace
from ..mode_settings import StreamingSettings
from ..modes import mode_of, settings_of
from .commands import Inbox
from .engine import RoundEngine
from .fleet.fleet import FailurePolicy, Fleet, ScalingPolicy
from .fleet.island_states import IslandStates
from .outputs.evaluation import Evaluator
from .outputs.outputs import OnRecord, Outputs
from .outputs.persistence import RunCore, restore
from .outputs.startup import Startup
from .policies import Ablation, Policies, build_policies, run_inbox
from .pool import IslandPool
from .requests import OperatorRequests
from .state.checkpoints import load_checkpoint, load_initial_weights, run_folder
from .state.flights import RunState
from .state.ledger import DataLedger
from .state.lifecycle import Lifecycle
from .state.membership import Membership
from .state.records import EventLog
from .state.stats import RunStats
from .state.views import RunStatus
from .step.outer import LocalOuter, Outer
from .step.rules import outer_rule
from .step.screen import Sizes
from .step.slices import LocalSlices, SliceCalls, SlicedOuter, copy_kept
from .types import Event, Phase, RunFailed, RunPhase
from .warm_start import (
    WarmStart,
    first_phase,
    load_warm_start,
    mark_finished,
    version0_digest,
)
from .work.inflight import InFlight
from .work.publisher import Publisher
from .work.stragglers import HangRule, TailStop

log = logging.getLogger(__name__)


def build_engine(
    cfg: RunConfig,
    pool: IslandPool,
    run_id: str = "local",
    slices: Callable[[RunConfig, Any, list[tuple[int, int]]], SliceCalls] | None = None,
    on_record: OnRecord | None = None,
    inbox: Inbox | None = None,
    takes_changes: bool = True,
    hands_over: bool = False,
    evaluator: Callable[[RunConfig], Evaluator | None] | None = None,
    ablation: Ablation | None = None,
) -> RoundEngine:
    """The engine for `cfg` driving `pool`; with `coordinator.shards` > 1 the outer step is
    split over slices reached through `slices` (in process by default); `evaluation.where:
    actor` evaluates through the evaluator `evaluator` starts (a Ray actor). `inbox`,
    `takes_changes` and `hands_over`: see `RoundEngine`. `ablation`: a benchmark's change to
    the run's decisions (`Ablation`; none in a run of the product)."""
    cfg = cfg.for_run(run_id)  # an `out_dir` with `{run_id}`: this run's own folder (the driver's runs come resolved)
    if cfg.evaluation.where != EvalPlace.COORDINATOR and evaluator is None:
        raise RunFailed(f"evaluation.where: {cfg.evaluation.where.value} needs a coordinator on Ray (archipelago run)")
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    task.prepare()
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    flat = FlatParams(model, grads=False)  # the coordinator never holds a gradient
    warm: WarmStart | None = None
    initial = None
    if cfg.warm_steps:
        warm = load_warm_start(cfg, flat.numel)
        flat.load(warm.params)
    elif cfg.init_from:
        initial = start_from(Path(cfg.init_from), model, flat)
    fragments = None
    if mode_of(cfg).fragments:  # the same fragments as every island computes from its model
        groups = task.layer_groups(model) if isinstance(task, FragmentedTask) else None
        fragments = fragment_model(model, settings_of(cfg, StreamingSettings).fragments, groups)
    outer: Outer
    rule = outer_rule(cfg)
    if cfg.coordinator.slices > 1:
        bounds = slice_bounds(flat.numel, cfg.coordinator.slices, cfg.compression.chunk)
        params = flat.data.detach().numpy()
        calls = slices(cfg, params, bounds) if slices is not None else LocalSlices(rule, params, bounds, copy_kept(cfg))
        outer = SlicedOuter(flat.data, bounds, calls, rule.merge)
    else:
        outer = LocalOuter(flat.data, rule, fragments)
    return assemble(
        cfg=cfg,
        run_id=run_id,
        task=task,
        model=model,
        flat=flat,
        outer=outer,
        pool=pool,
        fragments=fragments,
        on_record=on_record,
        init_from=initial,
        warm=warm,
        inbox=inbox or run_inbox(cfg),
        takes_changes=takes_changes,
        hands_over=hands_over,
        evaluator=evaluator(cfg) if evaluator is not None else None,
        ablation=ablation or Ablation(),
    )


def assemble(
    *,
    cfg: RunConfig,
    run_id: str,
    task: Task,
    model: torch.nn.Module,
    flat: FlatParams,
    outer: Outer,
    pool: IslandPool,
    fragments: Fragments | None,
    on_record: OnRecord | None,
    init_from: dict[str, str] | None,
    warm: WarmStart | None,
    inbox: Inbox,
    takes_changes: bool,
    hands_over: bool,
    evaluator: Evaluator | None,
    ablation: Ablation,
) -> RoundEngine:
    """The engine's parts, wired: the run's state (continued from its newest checkpoint
    if it has one, or from the warm start's data positions), its outputs, the work in
    flight, the fleet and the operator's requests."""
    policies = build_policies(cfg, flat.numel, fragments, ablation)
    core, state, checkpoints = _run_core(cfg, run_id, flat, outer, pool, fragments, policies, warm, init_from)
    resumed = state is not None
    lifecycle = Lifecycle()
    outputs = Outputs(
        core=core,
        task=task,
        model=model,
        inbox=inbox,
        lifecycle=lifecycle,
        resumed=resumed,
        pool=pool,
        on_record=on_record,
        evaluator=evaluator,
    )
    events = outputs.events
    if resumed:
        events.add(Event.RESTART, version=core.run.version, rounds_done=core.stats.rounds_done)
    fleet = _fleet(core, pool, policies, events, outputs, inbox if takes_changes else None, ablation, resumed=resumed)
    requests = OperatorRequests(core=core, inbox=inbox, events=events, takes_changes=takes_changes)
    if takes_changes:
        inbox.members = core.members
        inbox.journal = fleet.journal
        inbox.settle(core.members.target)
    return RoundEngine(
        **vars(core),  # the parts a checkpoint restored, as they are
        task=task,
        model=model,
        pool=pool,
        inbox=inbox,
        speeds=policies.speeds,
        startup=Startup(),
        lifecycle=lifecycle,
        outputs=outputs,
        inflight=_inflight(core, pool, policies, events, fragments),
        fleet=fleet,
        requests=requests,
        checkpoints=checkpoints,
        resumed=resumed,
        init_from=init_from,
        warm=warm,
        takes_changes=takes_changes,
        hands_over=hands_over,
    )


def _run_core(
    cfg: RunConfig,
    run_id: str,
    flat: FlatParams,
    outer: Outer,
    pool: IslandPool,
    fragments: Fragments | None,
    policies: Policies,
    warm: WarmStart | None,
    init_from: dict[str, str] | None,
) -> tuple[RunCore, dict[str, Any] | None, Folder]:
    """The run's state: continued from its newest checkpoint if it has one (returned with
    the checkpoint and its folder), else from the warm start's data positions."""
    members = Membership(cfg.islands.count)
    run = RunState(cfg.rounds, cfg.inner_steps, members, hang_after_steps=cfg.elastic.hang_after_steps)
    ledger = DataLedger(cfg.num_shards)
    stats = RunStats()
    publisher = Publisher(cfg=cfg, pool=pool, outer=outer, flat=flat.data, fragments=fragments, lag=policies.pacing.lag)
    states = IslandStates(cfg, run_id)
    checkpoints = run_folder(cfg.checkpoint_dir, run_id)
    if removed := checkpoints.sweep():  # this coordinator is the folder's only writer: the rest died writing
        log.warning("removed %d temporary file(s) of an interrupted checkpoint in %s", len(removed), checkpoints)
    state = load_checkpoint(checkpoints, cfg.checkpoint.resume_from) if cfg.checkpoint.every_rounds else None
    if state is not None and state["run_id"] != run_id:  # a folder copied or renamed by hand
        raise RunFailed(f"{checkpoints} holds the checkpoints of run {state['run_id']}, not of {run_id}")
    core = RunCore(
        cfg=cfg,
        run_id=run_id,
        flat=flat,
        outer=outer,
        admission=policies.admission,
        members=members,
        ledger=ledger,
        run=run,
        stats=stats,
        pacing=policies.pacing,
        publisher=publisher,
        states=states,
        quorum=policies.quorum,
    )
    if state is not None:
        restore(core, state)
    elif warm is not None:  # the data the warm start trained is not trained again
        ledger.load_state_dict({**warm.ledger, "tokens": [0] * cfg.num_shards})
    if state is None and init_from is None:  # version 0 is the seed's model, or the warm start's
        publisher.version0 = version0_digest(cfg, flat.data.detach().cpu().numpy())
    return core, state, checkpoints


def _inflight(
    core: RunCore, pool: IslandPool, policies: Policies, events: EventLog, fragments: Fragments | None
) -> InFlight:
    """The work handed out and what comes back of it, with the hang rule and the tail stop
    the config names."""
    cfg, outer = core.cfg, core.outer
    slices = tuple(outer.bounds) if isinstance(outer, SlicedOuter) else None
    return InFlight(
        cfg=cfg,
        pool=pool,
        ledger=core.ledger,
        pacing=policies.pacing,
        run=core.run,
        members=core.members,
        stats=core.stats,
        publisher=core.publisher,
        states=core.states,
        speeds=policies.speeds,
        events=events,
        sizes=Sizes(outer.numel, fragments, slices),
        hangs=HangRule(cfg.elastic),
        tail_stop=TailStop(cfg.elastic.tail_stop) if cfg.elastic.tail_stop is not None else None,
    )


def _fleet(
    core: RunCore,
    pool: IslandPool,
    policies: Policies,
    events: EventLog,
    outputs: Outputs,
    inbox: Inbox | None,
    ablation: Ablation,
    *,
    resumed: bool,
) -> Fleet:
    """The fleet with the scaling and failure policies the config names; `inbox`: the
    operator's commands when this phase takes membership changes."""
    cfg, elastic = core.cfg, core.cfg.elastic
    return Fleet(
        cfg=cfg,
        run_id=core.run_id,
        pool=pool,
        members=core.members,
        run=core.run,
        states=core.states,
        admission=policies.admission,
        events=events,
        disk=outputs.disk,
        inbox=inbox,
        scaling=ScalingPolicy(abandon=elastic.drain == "abandon", spares=elastic.spares),
        failures=FailurePolicy(elastic.replace_dead, ablation.restart_s),
        resumed=resumed,
    )


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
    main run forks from it, taking its islands over (`IslandPool.hand_over`/`adopt`).
    `engine` is the phase running now. Both phases share one
    inbox, so what an operator asks during the warm start carries across the fork (a
    pause stays paused, a stop stops, a target or settings change waits for the main
    phase), and one status (`status`): the run's id, its phase as a field, and `finished`
    only when the main phase is. A coordinator restarted in either phase resumes it."""

    def __init__(self, cfg: RunConfig, run_id: str, make_pool: PoolFactory, **engine: Any) -> None:
        self.cfg, self.run_id, self.make_pool, self.options = cfg, run_id, make_pool, engine
        self.inbox = run_inbox(cfg)
        warm = first_phase(cfg, run_id)
        self.warm_cfg: RunConfig | None = None
        if warm is not None:
            self.warm_cfg, wid = warm
            pool = make_pool(self.warm_cfg, wid)
            ablation = engine.get("ablation")  # the shared start is the plain average: it drops nothing
            shared = {**engine, "ablation": dataclasses.replace(ablation, drop_prob=0.0) if ablation else None}
            self.engine = build_engine(
                self.warm_cfg, pool, wid, inbox=self.inbox, takes_changes=False, hands_over=True, **shared
            )
        else:
            self.engine = self._main()

    def _main(self) -> RoundEngine:
        pool = self.make_pool(self.cfg, self.run_id)
        return build_engine(self.cfg, pool, self.run_id, inbox=self.inbox, **self.options)

    @property
    def phase(self) -> Phase:
        return Phase.WARM_START if self.warming else Phase.MAIN

    def _of_run(self, view: RunStatus) -> RunStatus:
        """A phase's view as the run's: the warm phase reports the run's id, rounds and
        settings, and its end is the main phase's start, not the run's end."""
        if not self.warming:
            return view.model_copy(update={"phase": Phase.MAIN})
        state = RunPhase.STARTING if view.state == RunPhase.FINISHED else view.state
        return view.model_copy(update={"state": state, "phase": Phase.WARM_START, "run_id": self.run_id})

    def status(self) -> RunStatus:
        return self._of_run(self.engine.status())

    def progress(self) -> RunStatus:
        return self._of_run(self.engine.snapshot)

    @property
    def warming(self) -> bool:
        return self.warm_cfg is not None and self.engine.cfg is self.warm_cfg

    def execute(self) -> dict[str, Any]:
        """Run to the end; a warm phase that was stopped ends the run there (its summary,
        marked `phase: warm_start`, says so)."""
        if not self.warming:
            return self.engine.execute()
        summary = self.engine.execute()
        warm_pool = self.engine.pool
        try:
            if summary["state"] != "finished":
                self.inbox.ended = True
                return {**summary, "phase": Phase.WARM_START.value}
            mark_finished(self.cfg, self.run_id, summary)
            # the warm phase's slices leave their nodes to the main phase's now, not when
            # the collector drops their handles: each slice node offers one slice's resource
            self.engine.outer.release()
            self.engine = self._main()
            # the warm start's islands go on as the main phase's, each renewed in its own
            # process (a new process importing torch and loading its task is most of a start)
            self.engine.pool.adopt(warm_pool.hand_over(set(range(self.engine.members.target))))
        finally:
            warm_pool.close()
        main = self.engine.execute()
        # the run started with the warm phase; the main phase's start-up is the fork's
        return {**main, "startup": {**summary["startup"], "fork": main["startup"]}}
