"""Run-wide accounting: tokens, bytes, evaluations, time, and what the three views of a
run say about them — one `metrics.jsonl` record per round, the control plane's snapshot,
and `summary.json` (stable key names that scripts and dashboards rely on). Pure logic."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from archipelago.workers.wire.messages import RoundResult

from ...config import RunConfig
from ..types import Decision, IslandState, RunPhase, Verdict
from .distributions import ROUND_SECONDS, STALENESS, Distribution
from .ledger import DataLedger
from .loop_time import LoopClock
from .membership import IslandStats, Membership
from .views import RoundRecord, RunStatus

COUNTERS = (
    "tokens",
    "tokens_applied",
    "bytes_sent",
    "bytes_received",
    "peak_exchange_bytes",
    "bytes_bootstrap",
    "fragments",
    "initial_eval",
    "last_eval",
    "rounds_done",
    "useful_compute_s",
)


class Window:
    """What happened between two records (one recorded round)."""

    def __init__(self, tokens: int) -> None:
        self.t0, self.tokens_before = time.perf_counter(), tokens
        self.contributed: set[int] = set()
        self.rejected: dict[str, str] = {}
        self.dropped: set[int] = set()
        self.staleness: list[int] = []
        self.island_staleness: dict[int, int] = {}  # the most versions each island's results were behind
        self.losses: dict[int, list[float]] = {}
        self.gap_penalty: float | None = None  # overlap with an adaptive penalty: CO2's Λ of its step


class RunStats:
    def __init__(self) -> None:
        self.tokens = self.tokens_applied = self.bytes_sent = self.bytes_received = 0
        self.peak_exchange_bytes = 0  # most bytes one island moved for one piece of work (up + down)
        self.bytes_bootstrap = 0  # islands' first full downloads (part of bytes_received)
        self.fragments: dict[str, dict[str, int]] = {}  # streaming: per fragment updates, bytes, staleness
        self.initial_eval: float | None = None
        self.last_eval: float | None = None
        self.rounds_done = 0
        self.useful_compute_s = 0.0  # island-seconds of work whose update reached the model (goodput)
        self.train_elapsed = 0.0
        self.t0 = self.t_train = time.perf_counter()
        self.window = Window(0)
        self.round_time = Distribution(ROUND_SECONDS)
        self.staleness = Distribution(STALENESS)
        self.loop = LoopClock()  # where the coordinator's time goes, per round and in all

    def start_training(self) -> None:
        """Training time continues across restarts (`train_elapsed` from the checkpoint)."""
        self.t_train = time.perf_counter() - self.train_elapsed
        self.window = Window(self.tokens)
        self.loop.restart()

    def download(self, stats: IslandStats, nbytes: int, bootstrap: bool = False) -> None:
        stats.bytes_received += nbytes
        self.bytes_received += nbytes
        if bootstrap:
            self.bytes_bootstrap += nbytes

    def exchange(self, nbytes: int) -> None:
        """One island's exchange for one piece of work: what it received for it (a first,
        full download excluded) and what it sent back."""
        self.peak_exchange_bytes = max(self.peak_exchange_bytes, nbytes)

    def _fragment(self, r: RoundResult, verdict: Verdict, staleness: int) -> None:
        f = self.fragments.setdefault(
            str(r.fragment), {"updates": 0, "applied": 0, "bytes_sent": 0, "staleness_total": 0, "staleness_max": 0}
        )
        f["updates"] += 1
        f["applied"] += int(verdict.admitted)
        f["bytes_sent"] += r.nbytes
        f["staleness_total"] += staleness
        f["staleness_max"] = max(f["staleness_max"], staleness)

    def account(self, stats: IslandStats, r: RoundResult, verdict: Verdict, staleness: int, trained: bool) -> None:
        """One result the outer step consumed. Its tokens count as trained (applied or not)
        unless its batches were `trained=False`: given back to be trained again."""
        stats.bytes_sent += r.nbytes
        self.bytes_sent += r.nbytes
        stats.compute_s += r.compute_s
        stats.last_train_loss = r.mean_loss
        if trained:
            stats.tokens += r.weight
            self.tokens += r.weight
        stats.observe_staleness(staleness)
        self.staleness.observe(staleness)
        if r.fragment is not None:
            self._fragment(r, verdict, staleness)
        w = self.window
        w.staleness.append(staleness)
        w.island_staleness[r.island] = max(staleness, w.island_staleness.get(r.island, 0))
        w.losses.setdefault(r.island, []).append(r.mean_loss)
        if verdict.admitted:
            self.useful_compute_s += r.compute_s
            stats.rounds_contributed += 1
            stats.last_contribution = time.time()
            self.tokens_applied += r.weight
            w.contributed.add(r.island)
            if verdict.decision == Decision.DOWNWEIGHT:
                stats.downweighted += 1
        elif verdict.decision == Decision.DROP:
            w.dropped.add(r.island)
        else:
            stats.rejections += 1
            w.rejected[str(r.island)] = verdict.why

    def record(
        self, rnd: int, cfg: RunConfig, version: int, eval_loss: float | None, lr: float, members: Membership
    ) -> RoundRecord:
        """The `metrics.jsonl` record of round `rnd` (its evaluation and clock filled in by
        the outputs); starts the next window."""
        w = self.window
        if eval_loss is not None:
            self.last_eval = eval_loss
        now = time.perf_counter()
        islands = members.islands
        extra = {} if w.gap_penalty is None else {"gap_penalty": w.gap_penalty}
        seconds = now - w.t0
        entry = RoundRecord(
            round=rnd,
            version=version,
            mode=cfg.mode.name.value,
            time=time.time(),
            eval_loss=eval_loss,
            train_loss=(sum(sum(v) / len(v) for v in w.losses.values()) / len(w.losses)) if w.losses else None,
            island_train_loss={str(i): sum(v) / len(v) for i, v in sorted(w.losses.items())},
            contributed=sorted(w.contributed),
            rejected=w.rejected,
            dropped=sorted(w.dropped),
            staleness=max(w.staleness, default=0),
            staleness_updates=w.staleness,
            island_staleness={str(i): s for i, s in sorted(w.island_staleness.items())},
            # live islands only: a line per round must not grow with every island ever seen
            inner_steps={str(i): s.inner_steps for i, s in islands.items() if s.state.alive},
            **extra,
            tokens=self.tokens - w.tokens_before,
            tokens_total=self.tokens,
            tokens_applied_total=self.tokens_applied,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            round_seconds=seconds,
            coordinator_seconds=self.loop.take_window(),
            wall_seconds=now - self.t0,
            train_seconds=now - self.t_train,
            tokens_per_s=self.tokens / max(1e-9, now - self.t_train),
            lr=lr,
            islands_alive=len(members.alive()),
            island_idle_fraction={
                str(i): max(0.0, 1 - st.compute_s / max(1e-9, now - self.t_train))
                for i, st in islands.items()
                if st.state in (IslandState.TRAINING, IslandState.LATE)
            },
            island_compute_seconds={
                str(i): st.compute_s
                for i, st in islands.items()
                if st.state in (IslandState.TRAINING, IslandState.LATE)
            },
        )
        self.round_time.observe(seconds)
        self.rounds_done = rnd
        self.window = Window(self.tokens)
        return entry

    def snapshot(
        self, phase: RunPhase, cfg: RunConfig, version: int, members: Membership, round_seconds: float | None
    ) -> RunStatus:
        """What the control plane and the progress line show (the run's settings are added by
        the outputs, `Outputs.status`)."""
        now = time.perf_counter()
        return RunStatus(
            state=phase,
            round=self.rounds_done,
            rounds=cfg.rounds,
            version=version,
            eval_loss=self.last_eval,
            initial_eval_loss=self.initial_eval,
            tokens=self.tokens,
            tokens_per_s=self.tokens / max(1e-9, now - self.t_train),
            bytes_communicated=self.bytes_sent + self.bytes_received,
            islands_alive=len(members.alive()),
            wall_seconds=now - self.t0,
            round_seconds=round_seconds,
            histograms={"round_seconds": self.round_time.view(), "staleness": self.staleness.view()},
        )

    def summary(
        self,
        phase: RunPhase,
        cfg: RunConfig,
        version: int,
        members: Membership,
        ledger: DataLedger,
        numel: int,
        out: Path,
        inner_steps: int,
    ) -> dict[str, Any]:
        """`summary.json`; `inner_steps`: the run's H as it ended (an operator may change it)."""
        now = time.perf_counter()
        islands = members.summary()
        train_s = now - self.t_train
        for s in islands.values():  # time accounting: the share of the run an island was not computing
            s["idle_fraction"] = max(0.0, 1.0 - s["compute_s"] / train_s)
        retired = members.retired
        subs = sum(s["submissions"] for s in islands.values()) + retired.submissions
        alive = [s for s in islands.values() if s["state"] != IslandState.DEAD.value] or list(islands.values())
        return {
            "mode": cfg.mode.name.value,
            "state": phase.value,
            "rounds": cfg.rounds,
            "rounds_done": self.rounds_done,
            "inner_steps": inner_steps,
            "initial_eval_loss": self.initial_eval,
            "final_eval_loss": self.last_eval,
            "tokens": self.tokens,
            "tokens_applied": self.tokens_applied,
            "outer_steps": version,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes_communicated": self.bytes_sent + self.bytes_received,
            "peak_exchange_bytes": self.peak_exchange_bytes,
            "bytes_bootstrap": self.bytes_bootstrap,
            "fragments": self.fragments or None,
            "wall_seconds": now - self.t0,
            "train_seconds": train_s,
            "coordinator_seconds": self.loop.totals(),  # this process's, since training (re)started
            "tokens_per_s": self.tokens / max(1e-9, train_s),
            "compute_seconds": sum(s["compute_s"] for s in alive) / len(alive) if alive else 0.0,
            "useful_compute_seconds": self.useful_compute_s,
            "idle_fraction": sum(s["idle_fraction"] for s in alive) / len(alive) if alive else 0.0,
            "num_params": numel,
            "islands": islands,
            "retired_islands": dataclasses.asdict(retired),
            "shards": {"position": ledger.position, "tokens": ledger.tokens},
            "staleness": {
                "mean": (sum(s["staleness_total"] for s in islands.values()) + retired.staleness_total) / subs
                if subs
                else 0.0,
                "max": max([retired.staleness_max, *(s["staleness_max"] for s in islands.values())]),
            },
            "out_dir": str(out.resolve()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in COUNTERS}, "train_elapsed": time.perf_counter() - self.t_train}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in COUNTERS:
            setattr(self, k, state.get(k, getattr(self, k)))  # a checkpoint older than a counter: from 0
        self.train_elapsed = state["train_elapsed"]
