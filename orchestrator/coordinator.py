"""The coordinator: runs the rounds of a synchronous run (DiLoCo or the ddp baseline).

Orchestration only — the math lives in `SyncServer` (pure torch). Per round it publishes
the global parameters once (`ray.put` of a numpy array), hands each island its work,
waits with a deadline (a dead or late island closes the round without it, it never
hangs the run), steps the server, evaluates, and records. It runs inside a Ray actor
(`ray.remote(Coordinator)`, a threaded actor so `progress()` answers mid-round).
"""
from __future__ import annotations

import time
from typing import Any

import ray
import torch

from orchestrator.aggregate import Contribution
from orchestrator.config import RunConfig
from orchestrator.launcher import IslandHandle, launch_island, release_island
from orchestrator.membership import Membership
from orchestrator.outer import build_server_optimizer
from orchestrator.recorder import Recorder
from orchestrator.sync_server import RoundOutcome, SyncServer
from workers.flat import FlatParams
from workers.island import RoundResult
from workers.task import load_task


class RunFailed(RuntimeError):
    """The run cannot continue (for example every island has died)."""


class Coordinator:
    def __init__(self, cfg: RunConfig) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.task = load_task(cfg.task.factory, cfg.task.kwargs)
        self.task.prepare()
        torch.manual_seed(cfg.seed)
        self.model = self.task.build_model()
        self.flat = FlatParams(self.model)
        self.server = SyncServer(self.flat.data, lambda p: build_server_optimizer(cfg, p),
                                 drop_prob=cfg.outer.drop_prob, seed=cfg.seed,
                                 grad_clip=cfg.inner.grad_clip if cfg.mode == "ddp" else None)
        self.eval_batches = list(self.task.eval_batches())
        self.recorder = Recorder(cfg.out_dir, cfg)
        self.members = Membership()
        self.handles: dict[int, IslandHandle] = {}
        self.overdue: dict[int, ray.ObjectRef] = {}
        self.snapshot: dict[str, Any] = {"state": "starting", "round": 0, "rounds": cfg.rounds}
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.initial_eval: float | None = None
        self.last_eval: float | None = None

    # -- islands ----------------------------------------------------------------------
    def _launch(self) -> None:
        for i in range(self.cfg.islands.count):
            self.handles[i] = launch_island(self.cfg, i)
        infos = ray.get([h.actor.describe.remote() for h in self.handles.values()])
        for info in infos:
            self.members.add(info["island"], f"{info['host']}:{info['device']}")

    def _free_overdue(self) -> None:
        """Islands whose overdue result has now arrived are given work again."""
        for i, ref in list(self.overdue.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self.overdue[i]
                if self.members.islands[i].state == "late":
                    self.members.mark(i, "training")

    def _fail(self, index: int, reason: str) -> None:
        self.members.mark(index, "dead", reason)
        self.overdue.pop(index, None)
        handle = self.handles.pop(index, None)
        if handle is not None:
            try:
                release_island(handle)
            except Exception:  # noqa: BLE001 - releasing a dead actor may fail; it is gone either way
                pass

    def _dispatch(self, params_ref: ray.ObjectRef, version: int) -> dict[ray.ObjectRef, int]:
        self._free_overdue()
        calls = {}
        nbytes = self.server.numel * self.flat.data.element_size()
        for i in self.members.schedulable():
            actor = self.handles[i].actor
            if self.cfg.mode == "ddp":
                ref = actor.gradient.remote(version, params_ref)
            else:
                ref = actor.run_round.remote(version, params_ref, self.cfg.inner_steps)
            calls[ref] = i
            self.members.islands[i].bytes_received += nbytes
            self.bytes_received += nbytes
        if not calls:
            raise RunFailed("no island can train: " + "; ".join(
                f"island {i}: {s.state} ({s.error})" for i, s in self.members.islands.items()))
        return calls

    def _gather(self, calls: dict[ray.ObjectRef, int]) -> list[RoundResult]:
        ready, pending = ray.wait(list(calls), num_returns=len(calls), timeout=self.cfg.round_timeout_s)
        results = []
        for ref in ready:
            i = calls[ref]
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError as err:
                self._fail(i, f"actor died: {type(err).__name__}")
            except ray.exceptions.RayTaskError as err:
                self._fail(i, f"raised: {str(err).strip().splitlines()[-1]}")
        for ref in pending:
            i = calls[ref]
            self.members.mark(i, "late")
            self.members.islands[i].late_results += 1
            self.overdue[i] = ref
        return results

    # -- one step of the server ---------------------------------------------------------
    def _step(self) -> tuple[list[RoundResult], RoundOutcome]:
        version = self.server.version
        params_ref = ray.put(self.server.params_numpy())
        results = self._gather(self._dispatch(params_ref, version))
        outcome = self.server.close_round(
            [Contribution(r.island, r.version, r.delta, float(r.weight)) for r in results])
        for r in results:
            stats = self.members.islands[r.island]
            stats.bytes_sent += r.delta.nbytes
            self.bytes_sent += r.delta.nbytes
            stats.compute_s += r.compute_s
            stats.last_train_loss = r.mean_loss
            if r.island in outcome.accepted:
                stats.rounds_contributed += 1
                stats.tokens += r.weight
                self.tokens += r.weight
            elif r.island in outcome.rejected:
                stats.rejections += 1
        return results, outcome

    def evaluate(self) -> float:
        self.model.eval()
        with torch.no_grad():
            losses = [float(self.task.loss(self.model, b)) for b in self.eval_batches]
        return sum(losses) / len(losses)

    # -- the run ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self._launch()
        self.t_train = time.perf_counter()
        steps_per_round = self.cfg.inner_steps if self.cfg.mode == "ddp" else 1
        self.initial_eval = self.last_eval = self.evaluate()
        self._update_snapshot(0, "training")
        for rnd in range(1, self.cfg.rounds + 1):
            t_round = time.perf_counter()
            tokens_before, losses, outcomes = self.tokens, {}, []
            for _ in range(steps_per_round):
                results, outcome = self._step()
                outcomes.append(outcome)
                for r in results:
                    losses.setdefault(r.island, []).append(r.mean_loss)
            due = rnd % self.cfg.eval_every == 0 or rnd == self.cfg.rounds
            eval_loss = self.evaluate() if due else None
            self.last_eval = eval_loss if eval_loss is not None else self.last_eval
            self.recorder.record(self._round_record(rnd, eval_loss, losses, outcomes, tokens_before, t_round))
            self._update_snapshot(rnd, "training")
        summary = self._summary()
        self.recorder.finish(summary, self.model)
        self._update_snapshot(self.cfg.rounds, "finished")
        for i in list(self.handles):
            release_island(self.handles.pop(i))
        return summary

    def _round_record(self, rnd: int, eval_loss: float | None, losses: dict[int, list[float]],
                      outcomes: list[RoundOutcome], tokens_before: int, t_round: float) -> dict[str, Any]:
        now = time.perf_counter()
        train = {str(i): sum(v) / len(v) for i, v in sorted(losses.items())}
        return {
            "round": rnd, "version": self.server.version, "mode": self.cfg.mode,
            "eval_loss": eval_loss,
            "train_loss": sum(train.values()) / len(train) if train else None,
            "island_train_loss": train,
            "contributed": sorted({i for o in outcomes for i in o.accepted}),
            "rejected": {str(i): r for o in outcomes for i, r in o.rejected.items()},
            "dropped": sorted({i for o in outcomes for i in o.dropped}),
            "tokens": self.tokens - tokens_before, "tokens_total": self.tokens,
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "round_seconds": now - t_round, "wall_seconds": now - self.t0,
            "tokens_per_s": self.tokens / max(1e-9, now - self.t_train),
            "lr": self.server.lr(), "islands_alive": len(self.members.alive()),
        }

    def _update_snapshot(self, rnd: int, state: str) -> None:
        now = time.perf_counter()
        self.snapshot = {
            "state": state, "round": rnd, "rounds": self.cfg.rounds, "version": self.server.version,
            "eval_loss": self.last_eval, "initial_eval_loss": self.initial_eval, "tokens": self.tokens,
            "tokens_per_s": self.tokens / max(1e-9, now - self.t_train),
            "bytes_communicated": self.bytes_sent + self.bytes_received,
            "islands_alive": len(self.members.alive()), "wall_seconds": now - self.t0,
        }

    def _summary(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        train_s = time.perf_counter() - self.t_train
        return {
            "mode": self.cfg.mode, "rounds": self.cfg.rounds, "inner_steps": self.cfg.inner_steps,
            "initial_eval_loss": self.initial_eval, "final_eval_loss": self.last_eval,
            "tokens": self.tokens, "outer_steps": self.server.version,
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "bytes_communicated": self.bytes_sent + self.bytes_received,
            "wall_seconds": wall, "train_seconds": train_s, "tokens_per_s": self.tokens / max(1e-9, train_s),
            "num_params": self.server.numel, "islands": self.members.summary(),
            "out_dir": str(self.recorder.out.resolve()),
        }

    def progress(self) -> dict[str, Any]:
        return dict(self.snapshot)
