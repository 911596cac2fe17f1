"""An island: one model replica, its inner optimizer and its data stream.

A plain class, so unit tests drive it in-process and production holds it in a Ray actor
(`IslandActor`, `workers/runtime/island_actor.py`). Parameters arrive as a flat numpy array (one object-store read per
version) and leave as one flat numpy pseudo-gradient; the inner optimizer state and the
data position persist across rounds, as DiLoCo requires.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..tasks.task import load_task, split_batch, to_device
from ..wire.compress import ErrorFeedback
from ..wire.flat import FlatParams, ParamStore, as_tensor
from ..wire.fragments import FragmentedTask, fragment_model
from ..wire.fragments import positions as fragment_positions
from ..wire.handoff import verify
from ..wire.messages import RoundResult, SavedState, WorkKind, WorkOrder
from ..wire.spec import Precision
from ..wire.sync import ChangeOutOfOrder, apply_change, whole_version
from . import inner_state
from .card import card_bytes
from .compiling import compiled_forward
from .island_spec import IslandSpec
from .optim import build_inner, inner_params, inner_schedule, muon_params
from .order_steps import Tail, Tally
from .rounds import rounds_for
from .shard_streams import ShardStreams
from .staging import PinnedStage, staged
from .version0 import version0

log = logging.getLogger(__name__)


class Superseded(RuntimeError):
    """The work in flight was abandoned: the coordinator that handed it out is gone."""


class Island:
    def __init__(self, spec: IslandSpec) -> None:
        t0 = time.perf_counter()
        torch.set_num_threads(spec.threads)
        self.spec = spec
        use_cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.task = load_task(spec.task_factory, spec.task_kwargs)
        # where an island's start-up goes (`startup` in summary.json): its task, its model, its probe
        self.startup = {"task_s": time.perf_counter() - t0}
        torch.manual_seed(spec.seed)
        self.model = self.task.build_model().to(self.device)
        flat = FlatParams(self.model)
        self.flat: ParamStore = flat
        # compiled for the forward passes only: the parameters stay the flat buffer's views
        self.forward_model = compiled_forward(self.model) if spec.inner.compiles_on(self.device.type) else self.model
        self.bf16 = spec.inner.precision == Precision.BF16
        self.start = torch.empty_like(flat.data)
        self.optimizer, self.scheduler = build_inner(
            spec.inner,
            inner_params(spec.inner, self.model, flat),
            spec.total_inner_steps,
            spec.start_step,
            spec.rewarmup_steps,
            muon_params(self.model),
        )
        self.schedule_origin = spec.start_step  # the run's inner step the schedule's own step 0 stands for
        self.num_shards = spec.num_shards or spec.num_islands
        self.data = ShardStreams(self.task, self.num_shards, spec.seed)
        self.turn = 0  # round-robin offset when used without a coordinator
        self.probed_steps_per_s: float | None = None
        self.feedback: dict[int | None, ErrorFeedback] = {}  # per fragment: each has its own residual
        groups = self.task.layer_groups(self.model) if isinstance(self.task, FragmentedTask) else None
        self.fragments = fragment_model(self.model, spec.fragments, groups) if spec.fragments else None
        self.copy: torch.Tensor | None = None  # the published parameters as this island holds them
        self.stage = PinnedStage()  # their way onto a GPU (`staging.py`; its buffer is allocated on first use)
        self.held: int | None = None  # their version
        self.inner_steps_done = 0  # over the island's life: a restarted coordinator's test that it kept its state
        self.work_begun_at = 0  # inner_steps_done when its current work began (heartbeats: its steps of that work)
        self.work_ticket: int | None = None  # ... and that work's ticket (a count is read against its own work)
        self.running = False
        self.tail: Tail | None = None  # a streaming order's τ steps, training after its result left
        self.superseded = threading.Event()  # the work in flight was given by a coordinator that is gone
        # a notice: (ticket, perf_counter time no step may end after, or the steps it may take)
        self.stopping: tuple[int, float, int | None] | None = None
        self.rounds = rounds_for(self)  # what it does with an order, by the mode's kind of round
        self.state_writes = inner_state.StateWrites()  # its inner state, written off the rounds' path
        self.restored = None  # placed to continue a saved inner state: whether it could
        if spec.restore_state is not None and spec.state_folder is not None:
            self.restored = inner_state.continue_from(
                spec.state_folder, spec.restore_state, self.optimizer, self.feedback, spec.index, spec.feedback_decay
            )
        # the run's first parameters as this island has them (built from the seed, or the warm
        # start's file), kept until the run moves past them; their hash decides whether it downloads them
        self.built, self.built_sha256 = version0(spec, flat.full()) if spec.builds_version0 else (None, None)
        self.startup["model_s"] = time.perf_counter() - t0 - self.startup["task_s"]

    def reset(self, spec: IslandSpec) -> None:
        """Become the new island `spec` describes, in this process (the run's main phase
        taking over a warm start's island): built exactly as a newly placed island is, so
        training is the same; what carries over is the process, its imports and the task's
        per-process caches, which are most of an island's start."""
        try:
            self.settle()
        except Exception:  # the island is renewed whatever its last steps did
            log.warning("island %d: its last streaming tail failed before a reset", self.spec.index, exc_info=True)
        self.written()
        self.data.close()
        self.__init__(spec)  # type: ignore[misc]

    def rejoin(self, spec: IslandSpec) -> dict[str, Any]:
        """Taken over by a pool as the island `spec` describes; answers as `describe`. An
        island started for this very spec that has not trained yet (the command starts a
        new run's islands while the coordinator's process starts) is kept as it is; any
        other is renewed (`reset`)."""
        if spec != self.spec or self.inner_steps_done or self.held is not None:
            self.reset(spec)
        return self.describe()

    def order(self, version: int, steps: int, kind: WorkKind = WorkKind.TRAIN) -> WorkOrder:
        """A work order without a coordinator (in-process use): the island's own contiguous
        block of shards, as the coordinator would assign it with all islands present."""
        k, n = self.spec.num_islands, self.num_shards
        own = {s: self.data.position(s) for s in range(n) if s * k // n == self.spec.index}
        order = WorkOrder(
            island=self.spec.index, ticket=-1, version=version, kind=kind, steps=steps, shards=own, turn=self.turn
        )
        self.turn += steps
        return order

    def identity(self) -> dict[str, Any]:
        """Where this island runs and how far it has trained (no compute: safe to answer
        while a round is in flight)."""
        import os
        import socket

        tail = self.tail  # read once: `run`, on another thread, may be letting it go
        return {
            "island": self.spec.index,
            "device": str(self.device),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "numel": self.flat.numel,
            "inner_steps_done": self.inner_steps_done,
            "work_steps_done": self.inner_steps_done - self.work_begun_at,
            "work_ticket": self.work_ticket,
            "card_bytes": card_bytes(),  # a transfer in progress is progress (card.py)
            "optimizer_state": len(self.optimizer.state),
            "inner_state_restored": self.restored,
            "startup": dict(self.startup),
            "busy": self.running or (tail is not None and tail.alive()),
            "built_sha256": self.built_sha256,
        }

    def describe(self) -> dict[str, Any]:
        """`identity` and the probed speed (its first call runs the probe, when the spec
        asks for one: otherwise the first round measures it, and the island joins sooner)."""
        speed = self.probe() if self.spec.probe else None  # first: its seconds are part of the start-up
        return {**self.identity(), "steps_per_s": speed}

    def attach(self) -> dict[str, Any]:
        """A restarted coordinator takes this island over: the round it is training was
        handed out by the coordinator that died (its result would go nowhere), so it is
        given up at its next inner step, and the new coordinator's work starts at once. The
        inner optimizer state, the data streams and the copy it holds are kept."""
        if self.running:
            self.superseded.set()
        return self.identity()

    def probe(self, steps: int = 2) -> float | None:
        """Inner steps per second, measured once on an eval batch before any work (this
        worker's forward and backward, no update, no collective), so the coordinator can size a new island's first H to its speed. It is a
        prior: the first measured round replaces it (it does not see data loading)."""
        if self.probed_steps_per_s is None:
            started = time.perf_counter()
            batch = self._worker_share(next(iter(self.task.eval_batches())))
            self._local_pass(batch)  # the first pass pays one-off costs
            t0 = time.perf_counter()
            for _ in range(steps):
                self._local_pass(batch)
            self.flat.zero_grad()
            self.probed_steps_per_s = steps / (time.perf_counter() - t0)
            self.startup["probe_s"] = time.perf_counter() - started
        return self.probed_steps_per_s

    def _worker_share(self, batch: Any) -> Any:
        """The part of an island's batch this worker computes (all of it on one worker)."""
        return batch

    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, int]:
        """One inner step's gradient of the island's batch (a group overrides this)."""
        return self._local_pass(batch)

    def _local_pass(self, batch: Any) -> tuple[torch.Tensor, int]:
        """Forward and backward of `batch` in this process, in `inner.micro_batches` equal
        parts whose gradients accumulate (each weighted by its share of the batch's tokens,
        so the gradient is the whole batch's), under bf16 autocast if asked: loss and weight.
        The loss stays a tensor on the device (float64): reading it every step would make
        the host wait for the device; the round reads the sum once, at its end."""
        batch = to_device(batch, self.device)
        self.flat.zero_grad()
        parts = self.spec.inner.micro_batches
        weight = self.task.batch_weight(batch)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(parts):
            part = split_batch(batch, i, parts, "inner.micro_batches") if parts > 1 else batch
            share = self.task.batch_weight(part) / weight
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = self.task.loss(self.forward_model, part)
            (loss * share).backward()
            total += loss.detach().double() * share
        return total, weight

    def _clip(self) -> None:
        if self.spec.inner.grad_clip is not None:
            self.flat.clip_grad(self.spec.inner.grad_clip)

    def _step(self) -> None:
        self.optimizer.step()

    def _seek_schedule(self, step: int) -> None:
        """Put the lr schedule at the run's inner step `step` (the scheduler continues from
        there). The schedule counts the island's own steps from where it was placed
        (`start_step`); an island whose first work begins elsewhere — a hot spare promoted
        long after it was placed, a joiner whose placement took a while — starts it again
        from there, so its re-warmup ramps over its own first steps."""
        if self.inner_steps_done == 0 and step != self.schedule_origin:
            self.schedule_origin = step
            self.scheduler = inner_schedule(
                self.optimizer, self.spec.inner, self.spec.total_inner_steps, step, self.spec.rewarmup_steps
            )
        local = max(0, step - self.schedule_origin)
        self.scheduler.last_epoch = local
        for group, base, fn in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * fn(local)

    def run(self, order: WorkOrder, params: np.ndarray | None, *, detach_tail: bool = False) -> RoundResult:
        """Do one work order from the global `params`. `TRAIN` is DiLoCo's inner phase:
        `steps` inner steps, Δ = θ_start − θ_end back; `GRADIENT` is the ddp step: one
        batch's gradient at `params`, no local update. The inner optimizer state and the
        data streams persist across orders, as DiLoCo requires.

        `detach_tail` (the Ray actor asks for it): a streaming order whose Δ is taken τ
        steps before its end answers at that point and trains the τ steps after it has
        answered (`order_steps.py`), so its exchange really overlaps them. The result reports the
        whole order (every batch is read before it leaves); the next order, or `reset`,
        waits for the tail first. Without `detach_tail` the tail is trained before the
        answer; the numbers are the same either way."""
        self.settle()
        self.superseded.clear()
        self.running = True
        try:
            return self._run(order, params, detach_tail)
        finally:
            self.running = False

    def stop(self, *, ticket: int, within_s: float | None = None, after_steps: int | None = None) -> None:
        """A preemption notice for work `ticket` (in progress, or not begun): it takes no
        step that would end more than `within_s` from now (None: none after the one in
        progress; a step is never cut short), or — told by a pool that keeps its own
        clock which steps fit — none after its `after_steps`-th; and sends what it has trained: a
        partial pseudo-gradient whose weight is the tokens it trained, the rest of its
        batches left for the ledger to hand to another island. Called beside the work (the
        actor's control group), so it is only a note the work reads before each step."""
        by = -math.inf if within_s is None else time.perf_counter() + within_s
        self.stopping = (ticket, by, after_steps)

    def settle(self) -> None:
        """Wait for a detached tail to finish training (raising what it raised) and for the
        inner state's snapshot to be taken: the model, the optimizer, the residuals and the
        data streams are this thread's again."""
        self.state_writes.taken()
        tail, self.tail = self.tail, None
        if tail is not None:
            tail.wait()

    def _run(self, order: WorkOrder, params: np.ndarray | None, detach_tail: bool) -> RoundResult:
        self.work_begun_at, self.work_ticket = self.inner_steps_done, order.ticket
        if order.handoff_sha256 is not None:  # before anything of it is used
            verify(order, params)
        if order.schedule_step is not None:
            self._seek_schedule(order.schedule_step)
        t0 = time.perf_counter()
        src = self.rounds.start(order, self._landed(self._sync(order, params)))
        if src is not None:
            self.flat.load(src)
        self.model.train()
        # its first step is queued next: on a CPU the parameters are in place; on a GPU their copy
        # is only queued (non_blocking, its last piece may be in flight); the step runs after it on the stream
        started_at = time.time()
        tally = Tally(positions=dict(order.shards), shard_tokens=dict.fromkeys(order.shards, 0))
        done = self.rounds.work(order, tally, detach_tail)
        return RoundResult(
            island=self.spec.index,
            version=order.version,
            payload=done.payload,
            weight=tally.weight,
            steps=done.steps,
            mean_loss=float(tally.losses) / max(1, tally.steps),  # the round's one read of its losses
            compute_s=time.perf_counter() - t0 + done.tail_pace_s * done.tail_steps,
            finished_at=time.time(),
            positions=tally.positions,
            shard_tokens=tally.shard_tokens,
            ticket=order.ticket,
            fragment=order.fragment,
            tail_steps=done.tail_steps,
            tail_s=done.tail_s,
            saved_state=done.saved,
            started_at=started_at,
            stream_states=self.data.states(order.shards),
        )

    def save_state(self) -> SavedState | None:
        """Save the inner state (optimizer, codec residuals) where the spec says, for a
        checkpoint near, beside the rounds that follow; None where it names no folder."""
        folder = self.spec.state_folder
        return self.state_writes.start(folder, self.spec.index, self.optimizer, self.feedback) if folder else None

    def written(self, timeout_s: float | None = None) -> None:
        """Wait for the inner state being written, if any (at most `timeout_s`): its pool is
        about to end the island, or a checkpoint is to name the file (only once on storage)."""
        self.state_writes.ended(timeout_s)

    def train_on(self, batches: Iterable[tuple[int, Any]], tally: Tally, *, stoppable: bool = False) -> bool:
        """Inner steps on `batches`, each counted in `tally`; True if a notice stopped them
        (`stop`: only where `stoppable`, before the pseudo-gradient is taken — after it, the
        result must report every step of the order, so a streaming tail trains to its end).
        Its batch is read only once a step is decided on, so a stopped work has read what
        it trained and nothing more."""
        began, stream = time.perf_counter(), iter(batches)
        while not (stoppable and self._stop_due(tally.steps, began)):
            item = next(stream, None)
            if item is None:
                return False
            if self.superseded.is_set():
                raise Superseded(f"island {self.spec.index}: its coordinator restarted; round given up")
            shard, batch = item
            loss, weight = self.inner_step(batch)
            tally.trained(shard, loss, weight)
        return True

    def _stop_due(self, steps: int, began: float) -> bool:
        """Whether a notice for this work forbids its next step: one more step, at the pace
        of those before it, would end past the notice's time (with no step taken yet, the
        pace is unknown and only a notice with no time left stops it)."""
        if self.stopping is None or self.stopping[0] != self.work_ticket:
            return False
        _, by, after_steps = self.stopping
        if after_steps is not None:
            return steps >= after_steps
        now = time.perf_counter()
        return now + ((now - began) / steps if steps else 0.0) > by

    def inner_step(self, batch: Any) -> tuple[torch.Tensor, int]:
        """One inner step."""
        loss, weight = self.forward_backward(batch)
        self._clip()
        self._step()
        self.scheduler.step()
        self.inner_steps_done += 1
        return loss, weight

    def hold(self, order: WorkOrder, params: Any) -> None:
        """A hot spare kept current: take `order`'s version (whole, or its changes) as a work
        would, train nothing, and stand on it — its own parameters are that version, as a
        new island's first work would start them (a streaming island continues from them)."""
        if order.handoff_sha256 is not None:
            verify(order, params)
        self._sync(order, params)
        if self.copy is not None:
            with torch.no_grad():
                self.flat.full().copy_(self.copy)

    def _sync(self, order: WorkOrder, params: Any) -> torch.Tensor | None:
        """Bring this island's copy of the global parameters to `order.version`: the full
        copy (`params`), or the changes since the version it holds. Returns what to start
        from, or None for a streaming island that continues from its local parameters
        (a received fragment is merged into them instead)."""
        if order.built:  # version 0 as this island built it, which hashes to the coordinator's
            if self.built is None:
                raise ChangeOutOfOrder("told to start from the parameters it built, which it no longer holds")
            params = self.built
        elif self.built is not None and order.version > 0:
            self.built = None  # the run moved past them
        if not self.spec.tracks_copy:
            return as_tensor(params)
        full = params is not None
        if full:  # joining, after a coordinator restart, or too far behind for changes
            # into the buffer it already holds: on a GPU one host-to-device copy, not a copy to
            # the device and a second one there (`.to(...).clone()` made both, every full version)
            source = as_tensor(params)
            if self.copy is None or self.copy.numel() != source.numel():
                self.copy = torch.empty(source.numel(), dtype=self.flat.full().dtype, device=self.device)
            self._copy_in(source, self.copy)
            self.held = order.version
        elif self.copy is None:
            raise ChangeOutOfOrder(f"changes to version {order.version} given to an island that holds no copy")
        else:
            copy = self.copy
            for version, parts in itertools.groupby(order.changes, key=lambda change: change.version):
                if self.held is None or version != self.held + 1:
                    raise ChangeOutOfOrder(f"change to version {version} given to a copy of {self.held}")
                for change in whole_version(list(parts), copy.numel()):
                    if change.span is not None:  # a coordinator slice's part
                        positions: Any = slice(*change.span)
                    else:
                        positions = fragment_positions(self.fragments, change.fragment, self.device)
                    apply_change(copy, change, positions)
                    if self.fragments is not None:
                        self._merge(positions)
                self.held = version
        if self.held != order.version:
            raise ChangeOutOfOrder(f"work from version {order.version} given to a copy of {self.held}")
        return self.copy if self.fragments is None or full else None

    def _landed(self, src: torch.Tensor | None) -> torch.Tensor | None:
        """What the round starts from, on the island's device: parameters `_sync` hands over
        in host memory (the object store's array, as it arrived) land once in the round's
        start buffer on a GPU, through the pinned stage, and the round then copies them on
        the device; elsewhere (a CPU, or an island group whose start is kept on the host)
        the round reads them where they are, as before."""
        if src is None or src.device.type != "cpu" or not staged(self.start.device):
            return src
        return self._copy_in(src, self.start)

    def _copy_in(self, source: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """`into` ← `source` (host memory): onto a GPU through the pinned stage, without
        holding the host until it has landed (`staging.py`); elsewhere one plain copy."""
        if staged(into.device):
            self.stage.copy(source, into)
        else:
            into.copy_(source)
        return into

    def _merge(self, positions: Any) -> None:
        """Streaming DiLoCo's merge of a fragment that came back: α·local + (1 − α)·global."""
        assert self.copy is not None
        local = self.flat.full()  # the live buffer (an FSDP island, with no whole buffer, cannot stream)
        with torch.no_grad():
            local[positions] = torch.lerp(self.copy[positions], local[positions], self.spec.merge_alpha)
