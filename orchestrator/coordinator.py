"""The coordinator: owns the global model and runs the rounds of a run.

Orchestration only — the math lives in the servers (pure torch). It publishes the
global parameters once per version (`ray.put` of a numpy array), hands islands their
work, never waits on an island past the round deadline, steps the server, evaluates and
records. It runs inside a Ray actor (`ray.remote(Coordinator)`, threaded so `progress()`
answers mid-round). The loops of the modes are `sync_loop.py` (diloco, ddp),
`async_loop.py` and `overlap_loop.py`.
"""
from __future__ import annotations

import time
from typing import Any

import ray
import torch

from orchestrator.aggregate import Contribution
from orchestrator.config import RunConfig
from orchestrator.controls import OperatorControls, RunControls
from orchestrator.events import EventLog
from orchestrator import persist
from orchestrator.launcher import IslandHandle, find_island, launch_island, release_island
from orchestrator.membership import Membership
from orchestrator.recorder import Recorder
from orchestrator.robust import NormGuard, Quarantine
from orchestrator.shards import ShardBook
from orchestrator.supervisor import Supervisor
from orchestrator.servers import Server, build_server
from orchestrator.shard_actors import start_sharded_server
from orchestrator.sharded_server import ShardedServer
from workers.flat import FlatParams
from workers.island import RoundResult
from workers.task import load_task


class RunFailed(RuntimeError):
    """The run cannot continue (for example every island has died)."""


class Coordinator(OperatorControls):
    def __init__(self, cfg: RunConfig, run_id: str = "local") -> None:
        """Builds the global model; if a checkpoint of this `run_id` exists (Ray restarted
        this actor, or the user resumed the run) continues from it."""
        torch.set_num_threads(cfg.coordinator.threads)
        self.cfg = cfg
        self.run_id = run_id
        self.task = load_task(cfg.task.factory, cfg.task.kwargs)
        self.task.prepare()
        torch.manual_seed(cfg.seed)
        self.model = self.task.build_model()
        self.flat = FlatParams(self.model)
        guard = NormGuard(cfg.robust)
        self.server: Server | ShardedServer
        if cfg.coordinator.shards > 1:
            self.server = start_sharded_server(cfg, self.flat.data, guard, run_id)
        else:
            self.server = build_server(cfg, self.flat.data, guard)
        self.quarantine = Quarantine(cfg.robust.quarantine_after)
        self.eval_batches = list(self.task.eval_batches())
        self.members = Membership()
        self.shards = ShardBook(cfg.num_shards)
        self.handles: dict[int, IslandHandle] = {}
        self.overdue: dict[int, ray.ObjectRef] = {}
        self.snapshot: dict[str, Any] = {"state": "starting", "round": 0, "rounds": cfg.rounds}
        self.t0 = self.t_train = time.perf_counter()
        self.tokens = self.tokens_applied = 0
        self.bytes_sent = self.bytes_received = 0
        self.initial_eval: float | None = None
        self.last_eval: float | None = None
        self._published: tuple[int, ray.ObjectRef] | None = None
        self.rounds_done = self.completed_steps = 0
        self.train_elapsed = 0.0
        self.supervisor = Supervisor(self, cfg.islands.count)
        self.controls = RunControls()
        self.metrics = None  # RayMetrics, created in run() (inside the actor, where Ray is up)
        state = persist.find(cfg.checkpoint_dir, run_id) if cfg.checkpoint.every_rounds else None
        self.resumed = state is not None
        if state is not None:
            persist.restore(self, state)
        self.recorder = Recorder(cfg.out_dir, cfg, keep_records=self.rounds_done if self.resumed else None)
        self.events = EventLog(self.recorder.out / "events.jsonl", append=self.resumed)
        if self.resumed:
            self.events.add("restart", version=self.server.version, rounds_done=self.rounds_done)

    # -- islands ----------------------------------------------------------------------
    def _launch(self) -> None:
        """Start the islands, or after a restart re-attach to the live ones (relaunching
        those that are gone; a relaunched island starts a fresh inner optimizer)."""
        if self.resumed:
            indices = [i for i, s in self.members.islands.items() if s.state not in ("dead", "quarantined")]
        else:
            indices = list(range(self.cfg.islands.count))
        reattached = set()
        for i in indices:
            handle = find_island(self.run_id, i) if self.resumed else None
            if handle is not None:
                reattached.add(i)
            self.handles[i] = handle or launch_island(self.cfg, i, self.run_id)
        for info in ray.get([h.actor.describe.remote() for h in self.handles.values()]):
            i = info["island"]
            if i in self.members.islands:
                self.members.mark(i, "training")
            else:
                self.members.add(i, f"{info['host']}:{info['device']}")
            self.events.add("reattach" if i in reattached else "join", i, node=info["host"], device=info["device"])

    def _fail(self, index: int, reason: str, state: str = "dead") -> None:
        """Release an island that died, raised, or is quarantined; it gets no more work.
        The supervisor replaces it at the next boundary unless `elastic.replace_dead` is off."""
        if self.members.islands[index].state == "drained":
            return  # an abandoned drain: its lost round is expected
        if not self.cfg.elastic.replace_dead:
            self.supervisor.target = max(0, self.supervisor.target - 1)
        self.members.mark(index, state, reason)
        self.events.add("crash" if state == "dead" else state, index, reason=reason)
        self.overdue.pop(index, None)
        handle = self.handles.pop(index, None)
        if handle is not None:
            try:
                release_island(handle)
            except Exception:  # noqa: BLE001 - releasing a dead actor may fail; it is gone either way
                pass

    def mark_late(self, index: int, ref: ray.ObjectRef) -> None:
        """`index` missed the deadline; its result, when it comes, is discarded."""
        self.members.mark(index, "late")
        self.members.islands[index].late_results += 1
        self.overdue[index] = ref
        self.events.add("late", index, deadline_s=self.cfg.round_timeout_s)

    def free_overdue(self) -> None:
        """Islands whose overdue result has now arrived are given work again."""
        for i, ref in list(self.overdue.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self.overdue[i]
                if self.members.islands[i].state == "late":
                    self.members.mark(i, "training")

    def fetch(self, ref: ray.ObjectRef, island: int) -> RoundResult | None:
        """The island's result, or None (and the island released) if it died or raised."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            self._fail(island, f"actor died: {type(err).__name__}")
        except ray.exceptions.RayTaskError as err:
            self._fail(island, f"raised: {str(err).strip().splitlines()[-1]}")
        return None

    def params_ref(self) -> ray.ObjectRef | list[ray.ObjectRef]:
        """The current global parameters in the object store, put once per version (with
        coordinator shards: one reference per shard's slice, the island joins them)."""
        if isinstance(self.server, ShardedServer):
            return self.server.params_slices()
        version = self.server.version
        if self._published is None or self._published[0] != version:
            self._published = (version, ray.put(self.server.params_numpy()))
        return self._published[1]

    @property
    def params_nbytes(self) -> int:
        return self.server.numel * self.flat.data.element_size()

    def count_dispatch(self, island: int) -> tuple[float, dict[int, int]] | None:
        """Account for sending the global parameters to `island`; returns the simulated
        seconds the download takes on its link and the island's data shards {shard: start},
        or None when there are more islands than shards and this one has no data (it idles)."""
        assignment = self.shards.assignment(island, self.members.schedulable())
        if not assignment:
            return None
        self.members.islands[island].bytes_received += self.params_nbytes
        self.bytes_received += self.params_nbytes
        return self.cfg.island_link(island).seconds(self.params_nbytes), assignment

    def delivered_at(self, r: RoundResult) -> float:
        """Wall-clock time at which `r` has crossed the island's (simulated) link."""
        return r.finished_at + self.cfg.island_link(r.island).seconds(r.nbytes)

    def contribution(self, r: RoundResult) -> Contribution:
        """The decoded pseudo-gradient; a newcomer's first one counts `elastic.join_weight`."""
        stats = self.members.islands[r.island]
        weight = float(r.weight)
        if stats.joined_version > 0 and stats.submissions == 0:
            weight *= self.cfg.elastic.join_weight
        return Contribution(r.island, r.version, r.delta(), weight)

    def wait_for_islands(self, busy: set[int] | None = None) -> None:
        """Block (ticking the supervisor) until an island can train; fail if none can come."""
        deadline = time.time() + self.cfg.elastic.placement_timeout_s
        while not self.members.schedulable():
            self.supervisor.tick(busy)
            if not self.supervisor.pending or time.time() > deadline:
                raise self.no_island_left()
            time.sleep(0.05)


    def count_result(self, r: RoundResult, applied: bool, reason: str | None) -> None:
        stats = self.members.islands[r.island]
        stats.bytes_sent += r.nbytes
        self.bytes_sent += r.nbytes
        stats.compute_s += r.compute_s
        stats.last_train_loss = r.mean_loss
        stats.tokens += r.weight
        self.tokens += r.weight  # tokens trained, whether or not the update is applied
        self.completed_steps += r.steps
        self.shards.commit(r.positions, r.shard_tokens)
        if applied:
            stats.rounds_contributed += 1
            stats.last_contribution = time.time()
            self.tokens_applied += r.weight
        elif reason is not None:
            stats.rejections += 1
            self.events.add("rejection", r.island, reason=reason, version=r.version)
        bad = reason is not None and "stale" not in reason  # staleness is the policy's business, not a fault
        if self.quarantine.record(r.island, bad) and stats.state != "dead":
            self._fail(r.island, f"quarantined after {self.quarantine.after} bad updates in a row", "quarantined")

    def no_island_left(self) -> RunFailed:
        return RunFailed("no island can train: " + "; ".join(
            f"island {i}: {s.state} ({s.error})" for i, s in self.members.islands.items()))

    # -- shared by the loops ---------------------------------------------------------------
    def wait(self, refs: list[ray.ObjectRef], num_returns: int) -> tuple[list, list] | None:
        """`ray.wait` up to the round deadline, in short slices so that a stop-now (a job
        being stopped) is seen within 0.2 s instead of after the round. None: aborted."""
        deadline = time.monotonic() + self.cfg.round_timeout_s
        while True:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(refs, num_returns=num_returns, timeout=max(0.0, min(0.2, left)))
            if self.controls.aborting.is_set():
                return None
            if len(ready) >= num_returns or left <= 0.2:
                return ready, pending

    def sync_model(self) -> None:
        """Bring the coordinator's model up to the global parameters (held by the shards
        when the coordinator is sharded) before it is evaluated, checkpointed or saved."""
        if isinstance(self.server, ShardedServer):
            self.server.refresh()

    def evaluate(self) -> float:
        self.sync_model()
        self.model.eval()
        with torch.no_grad():
            losses = [float(self.task.loss(self.model, b)) for b in self.eval_batches]
        return sum(losses) / len(losses)

    def close_record(self, rnd: int, t_round: float, tokens_before: int, train: dict[int, float],
                     extra: dict[str, Any]) -> None:
        """Evaluate if due, append one record to metrics.jsonl, refresh the progress snapshot."""
        due = rnd % self.cfg.eval_every == 0 or rnd == self.cfg.rounds
        eval_loss = self.evaluate() if due else None
        if eval_loss is not None:
            self.last_eval = eval_loss
        now = time.perf_counter()
        self.recorder.record({
            "round": rnd, "version": self.server.version, "mode": self.cfg.mode, "time": time.time(),
            "eval_loss": eval_loss,
            "train_loss": sum(train.values()) / len(train) if train else None,
            "island_train_loss": {str(i): v for i, v in sorted(train.items())},
            **extra,
            "tokens": self.tokens - tokens_before, "tokens_total": self.tokens,
            "tokens_applied_total": self.tokens_applied,
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "round_seconds": now - t_round, "wall_seconds": now - self.t0,
            "train_seconds": now - self.t_train, "tokens_per_s": self.tokens / max(1e-9, now - self.t_train),
            "lr": self.server.lr(), "islands_alive": len(self.members.alive()),
            "island_idle_fraction": {str(i): max(0.0, 1 - st.compute_s / max(1e-9, now - self.t_train))
                                     for i, st in self.members.islands.items() if st.state in ("training", "late")},
        })
        self.rounds_done = rnd
        every = self.cfg.checkpoint.every_rounds
        if every and (rnd % every == 0 or rnd == self.cfg.rounds):
            persist.save(self, now - self.t_train)
            self.events.add("checkpoint", version=self.server.version, round=rnd)
        self._update_snapshot(rnd, "training")
        if self.metrics is not None:
            self.metrics.publish(self.status(), self.members.summary())

    def run(self) -> dict[str, Any]:
        from orchestrator.ray_metrics import RayMetrics

        self.metrics = RayMetrics(self.run_id)
        self._launch()
        self.t_train = time.perf_counter() - self.train_elapsed  # training time continues across restarts
        if not self.resumed:
            self.initial_eval = self.last_eval = self.evaluate()
        self._update_snapshot(self.rounds_done, "training")
        if self.cfg.mode == "async":
            from orchestrator.async_loop import run_async

            run_async(self)
        elif self.cfg.mode == "overlap":
            from orchestrator.overlap_loop import run_overlap

            run_overlap(self)
        else:
            from orchestrator.sync_loop import run_sync

            run_sync(self)
        if self.controls.stopping.is_set():  # stopped early: final eval and checkpoint of where it stands
            if not self.controls.aborting.is_set():  # a stop-now has seconds left: keep the last eval
                self.last_eval = self.evaluate()
            if self.cfg.checkpoint.every_rounds:
                persist.save(self, time.perf_counter() - self.t_train)
            self.events.add("stopped", version=self.server.version, rounds_done=self.rounds_done)
        summary = self._summary()
        self.sync_model()
        self.recorder.finish(summary, self.model)
        self._update_snapshot(self.rounds_done, "stopped" if self.controls.stopping.is_set() else "finished")
        for i in list(self.handles):
            release_island(self.handles.pop(i))
        return summary

    def _update_snapshot(self, rnd: int, state: str) -> None:
        now = time.perf_counter()
        self.snapshot = {
            "state": state, "round": rnd, "rounds": self.cfg.rounds, "version": self.server.version,
            "eval_loss": self.last_eval, "initial_eval_loss": self.initial_eval, "tokens": self.tokens,
            "tokens_per_s": self.tokens / max(1e-9, now - self.t_train),
            "bytes_communicated": self.bytes_sent + self.bytes_received,
            "islands_alive": len(self.members.alive()), "wall_seconds": now - self.t0,
            "round_seconds": self.recorder.history[-1]["round_seconds"] if self.recorder.history else None,
        }

    def _summary(self) -> dict[str, Any]:
        now = time.perf_counter()
        islands = self.members.summary()
        train_s = now - self.t_train
        for s in islands.values():  # time accounting: the share of the run an island was not computing
            s["idle_fraction"] = max(0.0, 1.0 - s["compute_s"] / train_s)
        subs = sum(s["submissions"] for s in islands.values())
        alive = [s for s in islands.values() if s["state"] != "dead"] or list(islands.values())
        return {
            "mode": self.cfg.mode, "state": "stopped" if self.controls.stopping.is_set() else "finished",
            "rounds": self.cfg.rounds, "rounds_done": self.rounds_done, "inner_steps": self.cfg.inner_steps,
            "initial_eval_loss": self.initial_eval, "final_eval_loss": self.last_eval,
            "tokens": self.tokens, "tokens_applied": self.tokens_applied, "outer_steps": self.server.version,
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "bytes_communicated": self.bytes_sent + self.bytes_received,
            "wall_seconds": now - self.t0, "train_seconds": train_s,
            "tokens_per_s": self.tokens / max(1e-9, train_s),
            "compute_seconds": sum(s["compute_s"] for s in alive) / len(alive),
            "idle_fraction": sum(s["idle_fraction"] for s in alive) / len(alive),
            "num_params": self.server.numel, "islands": islands,
            "shards": {"position": self.shards.position, "tokens": self.shards.tokens},
            "staleness": {"mean": sum(s["staleness_total"] for s in islands.values()) / subs if subs else 0.0,
                          "max": max((s["staleness_max"] for s in islands.values()), default=0)},
            "out_dir": str(self.recorder.out.resolve()),
        }

    def progress(self) -> dict[str, Any]:
        return dict(self.snapshot)
