"""What a run gives back: evaluations, per-round records, checkpoints, the summary and the
views the control plane reads — everything the round engine produces but does not need
to decide its next transition.

Every write goes through `DiskFaults`: a full or unwritable disk is logged, counted in
the status and retried (a checkpoint the disk refused is owed to the next record), and
never ends the run. A checkpoint is written off the engine's thread (`BackgroundSave`):
it is captured once the records of the rounds it covers are written, streamed to its
file while the islands train and the engine takes their results, and the engine's next
outer step waits for it to end (`fence`), so the head never holds a second copy of the
state and a slow write or evaluation delays a round only by what it takes beyond one. The views are rebuilt on the engine's thread when something changed,
so the control plane's threads only ever read finished objects.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import socket
from collections.abc import Callable
from typing import Any

import torch

from archipelago.workers.tasks.task import ExportableTask, Task, export_pretrained
from archipelago.workers.wire.handoff import params_digest

from ..commands import Inbox
from ..pool import IslandPool
from ..state.checkpoints import BackgroundSave, Capture, next_name, run_folder
from ..state.lifecycle import Lifecycle
from ..state.loop_time import Part
from ..state.membership import IslandStats
from ..state.records import DiskFaults, EventLog, Recorder
from ..state.views import RoundRecord, RunStatus, Summary
from ..threads import spare_cores, step_threads
from ..types import Event, RunPhase
from ..warm_start import WarmStart
from .evaluation import Evaluation, Evaluator, LocalEvaluator
from .persistence import RunCore

log = logging.getLogger(__name__)


OnRecord = Callable[[RunStatus, dict[str, dict[str, Any]], RoundRecord], None]  # status, islands, record


class Outputs:
    def __init__(
        self,
        *,
        core: RunCore,
        task: Task,
        model: torch.nn.Module,
        inbox: Inbox,
        lifecycle: Lifecycle,
        resumed: bool,
        pool: IslandPool,
        on_record: OnRecord | None = None,
        evaluator: Evaluator | None = None,
    ) -> None:
        """`core`: the run's state (its live settings, H and the quorum rule's, are there,
        not in the config); `lifecycle`: the run's phase, which the status shows; `pool`:
        the islands, whose inner-state writes a checkpoint waits for before naming them."""
        cfg, run_id, stats = core.cfg, core.run_id, core.stats
        self.quorum = core.quorum  # the quorum pacing's live settings, shown in the status
        self.cfg, self.run_id, self.task, self.model, self.flat, self.outer = (
            cfg,
            run_id,
            task,
            model,
            core.flat,
            core.outer,
        )
        self.members, self.stats, self.inbox, self.on_record = core.members, stats, inbox, on_record
        self.pool = pool
        self.states, self.run, self.publisher = core.states, core.run, core.publisher
        self.evaluator = evaluator or LocalEvaluator(task=task, model=model, threads=self.eval_threads)
        self.evaluated: dict[int, Evaluation] = {}  # version -> its evaluation, the last few
        self.initial_version: int | None = None  # the version whose evaluation is the run's initial one
        self.waiting: list[tuple[RoundRecord, int | None]] = []  # records not written yet, their evaluation
        self.lifecycle = lifecycle
        self.eval_metrics: dict[str, float] | None = None  # the task's own, at the latest evaluation
        self.disk = DiskFaults()
        self.checkpoint_owed = False  # a checkpoint the disk refused: retried at the next record
        # a checkpoint due and not yet captured (its round's records wait for an evaluation):
        # (version, round, the engine's capture); then the one being written, and what it names
        self.wanted: tuple[int, int, Capture] | None = None
        self.saving: tuple[BackgroundSave, int, int] | None = None
        last = stats.rounds_done if resumed else None
        self.recorder = Recorder(cfg.out_dir, cfg, last_round=last, faults=self.disk, run_id=run_id)
        self.events = EventLog(self.recorder.out / "events.jsonl", cfg.records, append=resumed, faults=self.disk)
        self.snapshot = RunStatus(state=lifecycle.now, round=stats.rounds_done, rounds=cfg.rounds)
        lifecycle.listen(self._moved)
        self.islands_view: dict[str, dict[str, Any]] = {}  # what /v1/islands serves (`refresh_islands`)
        self._islands_seen: tuple[Any, ...] | None = None

    # -- evaluation (`engine/outputs/evaluation.py`: the evaluator decides where it runs) ------------------
    def evaluate(self, version: int) -> float | None:
        """Evaluate `version` now and wait for it (a stopped run's last evaluation)."""
        self._submit(version)
        self.collect(wait=True)
        found = self.evaluated.get(version)
        return found.loss if found is not None else None

    def first_evaluation(self, warm: WarmStart | None, version: int) -> None:
        """The evaluation of the version a run starts from, asked for (its result sets
        `stats.initial_eval` when it comes back). Starting from a warm start's final model,
        bit for bit, the warm start's final evaluation is that evaluation (the same model,
        the same task's batches): it is taken, not run again beside the islands' first work."""
        known = warm.evaluated(self.outer.params()) if warm is not None else None
        if known is not None:
            self.stats.initial_eval = self.stats.last_eval = known
            return
        self.initial_version = version
        self._submit(version)
        self.collect(wait=False)

    @property
    def initial_asked(self) -> bool:
        return self.stats.initial_eval is not None or self.initial_version is not None

    def _current_flat(self) -> None:
        """The model's flat buffer brought up to date with the outer step's parameters
        (`Outer.copy_to`), once no checkpoint is reading it."""
        self._settle()
        self.outer.copy_to(self.flat.data)

    def _submit(self, version: int) -> None:
        with self.stats.loop.timed(Part.EVALUATE):
            self._current_flat()
            self.evaluator.submit(version=version, params=self.flat.data, published=self.publisher.exact(version))

    def collect(self, *, wait: bool) -> None:
        """Take the evaluations that came back (with `wait`, every one asked for) and write
        the records they complete, in round order."""
        for e in self.evaluator.results(wait=wait):  # waiting for an evaluation elsewhere is not this process's work
            self._arrived(e)
        while self.waiting and (self.waiting[0][1] is None or self.waiting[0][1] in self.evaluated):
            entry, version = self.waiting.pop(0)
            if version is not None:
                found = self.evaluated[version]
                entry.eval_loss, entry.eval_metrics = found.loss, found.metrics
            self._write(entry)
        if self.wanted is not None and not any(entry.round <= self.wanted[1] for entry, _ in self.waiting):
            self._begin_checkpoint()

    def _arrived(self, e: Evaluation) -> None:
        if e.error is not None:
            log.warning(
                "the evaluation of version %d is lost (%s); its round is recorded without it", e.version, e.error
            )
        self.evaluated[e.version] = e
        for old in [v for v in self.evaluated if v < e.version - 16]:  # a bounded memory of the last few
            del self.evaluated[old]
        if e.loss is None:
            return
        if e.version == self.initial_version and self.stats.initial_eval is None:
            self.stats.initial_eval = e.loss
        self.stats.last_eval, self.eval_metrics = e.loss, e.metrics

    def eval_threads(self) -> int:
        """`coordinator.eval_threads`, or the cores this process may run on less those its
        islands on this host reserve (`islands.cpus` each), at least the outer step's:
        a KubeRay head's spare cores evaluate, cores islands train on are not taken."""
        cfg = self.cfg
        if cfg.coordinator.eval_threads is not None:
            return cfg.coordinator.eval_threads
        here = self._islands_here()
        return max(step_threads(cfg, here), spare_cores(cfg, here))

    def _islands_here(self) -> int:
        host = socket.gethostname()
        return sum(1 for s in self.members.islands.values() if s.state.alive and s.node.split(":")[0] == host)

    def step_threads(self, islands_wait: bool = False) -> int:
        """The outer step's torch threads now (`step_threads`): with the cores the islands
        alive on this host reserve left out, unless every island waits for this step
        (`islands_wait`, a barrier's), whose cores are then idle."""
        return step_threads(self.cfg, 0 if islands_wait else self._islands_here())

    def snapshot_export(self, rnd: int) -> None:
        """Every `export.every_rounds`, the global model in its ecosystem's format under
        `out_dir/snapshots/round-N` (the newest `export.keep` kept): an evaluation harness
        can follow the run without stopping it."""
        every = self.cfg.export.every_rounds
        if not (every and rnd % every == 0 and isinstance(self.task, ExportableTask)):
            return
        self._current_flat()
        folder = self.recorder.out / "snapshots"
        target = folder / f"round-{rnd:06d}"
        state = self.model.state_dict()
        if self.disk.attempt("a snapshot", lambda: export_pretrained(self.task, state, target)):
            for old in sorted(folder.glob("round-*"))[: -self.cfg.export.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def record(self, rnd: int, version: int, clock_s: float, capture: Capture) -> None:
        """Round `rnd`'s record: its evaluation asked for if due, the record written once the
        evaluation is back (records stay in round order); a checkpoint if due (or owed),
        captured once the records through this round are written, so a resumed run's records
        and state agree (`collect`), and written in the background."""
        cfg = self.cfg
        if self.wanted is not None:  # two rounds recorded at once: the first's checkpoint is of its state
            self.fence()
        due = rnd % cfg.eval_every == 0 or rnd == cfg.rounds
        entry = self.stats.record(rnd, cfg, version, None, self.outer.lr(), self.members)
        entry.clock_seconds, entry.eval_metrics = clock_s, None
        self.waiting.append((entry, version if due else None))
        if due:
            self._submit(version)
        self.snapshot_export(rnd)
        every = cfg.checkpoint.every_rounds
        if every and (rnd % every == 0 or rnd == cfg.rounds or self.checkpoint_owed):
            self.wanted = (version, rnd, capture)
        self.collect(wait=False)
        self.update_snapshot(version)

    def _write(self, entry: RoundRecord) -> None:
        self.recorder.record(entry)
        self.update_snapshot(entry.version)
        if self.on_record is not None:
            self.on_record(self.status(), self.members.summary(), entry)

    def checkpoint(self, version: int, rnd: int, capture: Capture) -> None:
        """Checkpoint now and wait for it (a stopped run's)."""
        self.wanted = (version, rnd, capture)
        self.fence()

    def fence(self) -> None:
        """Before anything changes what a checkpoint holds (the engine's next outer step):
        the checkpoint due is captured — the evaluations its records wait for are waited
        for first — and the write in progress has ended."""
        with self.stats.loop.timed(Part.CHECKPOINT):
            if self.wanted is not None:
                self.collect(wait=True)  # every record written: the checkpoint begins there
            self._settle()

    def finish_writing(self) -> None:
        """The run ends on an error: the checkpoint being written is finished (its own
        error logged, not raised over the run's); one not yet captured is not taken of a
        state the error may have left half-changed."""
        try:
            self._settle()
        except Exception:
            log.exception("the checkpoint being written when the run failed could not be finished")

    def _begin_checkpoint(self) -> None:
        assert self.wanted is not None
        (version, rnd, capture), self.wanted = self.wanted, None
        self._settle()  # one write at a time: each prunes the folder the next numbers in
        folder = run_folder(self.cfg.checkpoint_dir, self.run_id)
        names: list[str] = []  # the parts slices write beside it are named after it
        if not self.disk.attempt("a listing of the checkpoints", lambda: names.append(next_name(folder))):
            self.checkpoint_owed = True  # storage unreachable: taken at the next record instead
            return
        name = names[0]
        writing = [i for i, s in self.members.islands.items() if s.inner_state is not None and s.state.alive]
        confirm = self.states.confirmation(
            self.members, self.pool.writes_ending(writing), self.cfg.elastic.hang_floor_s
        )
        save = BackgroundSave(folder, capture(folder, name), self.cfg.checkpoint.keep, name, prepare=confirm)
        self.saving = (save, version, rnd)

    def _settle(self) -> None:
        """Wait for the checkpoint being written, if one is; then count it: saved (an event,
        the islands' superseded states deleted), or owed to the next record if the disk
        refused it (the run goes on from memory; the checkpoints before it stay intact)."""
        if self.saving is None:
            return
        save, version, rnd = self.saving
        try:
            self.checkpoint_owed = not self.disk.attempt("a checkpoint", save.result)
        finally:
            self.saving = None
        if not self.checkpoint_owed:
            self.events.add(Event.CHECKPOINT, version=version, round=rnd, seconds=round(save.seconds, 3))
            self.states.checkpointed(self.states.named_in(save.state), self.disk)

    def summarise(self, version: int, extra: dict[str, Any], ledger: Any) -> dict[str, Any]:
        """The run's summary (also `summary.json`), the final model and, for a task of
        another ecosystem, its export."""
        self.fence()  # every record written, the initial and last evaluations known, the checkpoint on disk
        self.collect(wait=True)
        self.evaluator.close()
        self._current_flat()
        out = self.recorder.out
        built = self.stats.summary(
            self.lifecycle.now, self.cfg, version, self.members, ledger, self.outer.numel, out, self.run.inner_steps
        )
        summary = Summary.model_validate(
            {
                **built,
                **extra,
                "eval_metrics": self.eval_metrics,
                "final_params_digest": params_digest(self.outer.params()),  # what a warm start's fork checks
            }
        )
        self.recorder.finish(summary.as_dict(), self.model)  # first: an export that fails loses neither
        if isinstance(self.task, ExportableTask):  # the model back in its ecosystem's format, too
            export = out / "export"
            try:
                exported = self.disk.attempt(
                    "the export", lambda: export_pretrained(self.task, self.model.state_dict(), export)
                )
            except Exception as err:  # the export's library refused it: the run's outputs stand
                log.exception("the export to %s failed; final.pt and summary.json are written", export)
                summary.export_error = f"{type(err).__name__}: {err}"
            else:
                if exported:
                    summary.export = str(export)
            self.recorder.write_summary(summary.as_dict())
        return summary.as_dict()

    # -- what the control plane reads ------------------------------------------------------------
    def update_snapshot(self, version: int) -> None:
        last = self.recorder.last.round_seconds if self.recorder.last is not None else None
        self.snapshot = self.stats.snapshot(self.lifecycle.now, self.cfg, version, self.members, last)

    def _moved(self, phase: RunPhase) -> None:
        """The run's phase moved: the status shows it at once (its figures at the next record)."""
        self.snapshot.state = phase

    def refresh_islands(self) -> None:
        """Rebuild the view of the islands when something happened (an event or a record)."""
        seen = (self.events.count, self.stats.rounds_done, tuple(s.merge for s in self.members.islands.values()))
        if seen == self._islands_seen:
            return
        self._islands_seen = seen
        view = self.members.summary()
        for i in sorted(self.members.pending):  # requested, waiting for resources or starting up
            view[str(i)] = IslandStats(index=i).as_dict()
        self.islands_view = view

    def status(self) -> RunStatus:
        """The snapshot and the run's live settings (a quorum rule's only under that rule)."""
        settings = {
            "mode": self.cfg.mode.name.value,
            "run_id": self.run_id,
            "target_islands": self.members.target,
            "pending_islands": sorted(self.members.pending),
            "inner_steps": self.run.inner_steps,
            "outer_lr": self.outer.known_lr(),  # never a remote call: this is a control thread's read
            "hang_after_steps": self.run.hang_after_steps,
            "paused": self.inbox.paused.is_set(),
            "stopping": self.inbox.stopping.is_set(),
            "disk_errors": self.disk.count,
            "last_disk_error": self.disk.last,
            **(dataclasses.asdict(self.quorum) if self.quorum is not None else {}),
        }
        return self.snapshot.model_copy(update=settings)
