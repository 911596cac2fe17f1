"""The peer row of `quality`: torchft's DiLoCo (`torchft.local_sgd.DiLoCo`, the bench
distribution's `[peer]` extra) on the same task, data, hyperparameters and warm start as Archipelago's islands.

K replica groups (one process each, gloo, a torchft lighthouse in this process) start
from the warm start's weights; replica r reads exactly the batches Archipelago's island r
reads (the same shards, continuing from the warm start's positions, in the same round-robin
order), steps the same inner AdamW and schedule, and every H steps torchft all-reduces the
pseudo-gradients and steps the same outer Nesterov.

The baseline of both tools' overhead ("islands alone") is a lower bound: replica 0 alone on
the machine with no exchange, times the share of the cores k replicas need (k replicas of
t threads on c cores cannot all finish sooner than max(1, k·t/c) times one alone). Running
the k replicas together without an exchange is not one: on fewer cores than replicas it
measures their contention, and came out slower than either tool's run.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import statistics
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torchft  # noqa: F401  (not installed: ImportError, and `quality` skips the peer row)

from archipelago.orchestrator.bench.overhead import lower_bound
from archipelago.orchestrator.bench.runner import continue_warm
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.state.ledger import assign
from archipelago.orchestrator.engine.warm_start import load_warm_start
from archipelago.orchestrator.mode_settings import StreamingSettings
from archipelago.orchestrator.modes import settings_if
from archipelago.workers.runtime.optim import build_inner
from archipelago.workers.tasks.task import load_task
from archipelago.workers.wire.flat import FlatParams

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port: int = s.getsockname()[1]
        return port


def _replica(rank: int, k: int, cfg_json: str, lighthouse: str | None, out: Any) -> None:
    """Replica group `rank`: Archipelago's island `rank` re-done with torchft (or alone,
    without `lighthouse`); puts (rank, loop seconds, eval loss or None) on `out`."""
    from contextlib import nullcontext

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    cfg = RunConfig.model_validate_json(cfg_json)
    torch.set_num_threads(cfg.island_threads)
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    flat = FlatParams(model)
    warm = load_warm_start(cfg, flat.numel)
    flat.load(warm.params)
    inner, schedule = build_inner(
        cfg.inner, model.parameters(), cfg.schedule_steps, cfg.warm_steps, cfg.elastic.join_rewarmup_steps
    )
    stream = settings_if(cfg, StreamingSettings)
    fragments = _module_fragments(model, stream.fragments) if stream is not None else [model]
    outers = [
        torch.optim.SGD(f.parameters(), lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True) for f in fragments
    ]
    shards = sorted(assign(cfg.num_shards, list(range(k)))[rank])
    position = warm.ledger["position"]
    turn = int(warm.ledger.get("turns", {}).get(str(rank), 0))
    streams = {s: task.train_batches(s, cfg.num_shards, cfg.seed, position[s]) for s in shards}
    diloco: Any = nullcontext()
    manager = None
    if lighthouse is not None:
        store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
            min_replica_size=k,
            use_async_quorum=False,
            load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            replica_id=f"replica{rank}",
            store_addr="localhost",
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            port=_free_port(),
            timeout=timedelta(seconds=120),
            quorum_timeout=timedelta(seconds=120),
            connect_timeout=timedelta(seconds=120),
        )
        streaming = {}
        if stream is not None and len(fragments) > 1:  # our tau and alpha
            streaming = {"fragment_sync_delay": stream.tau_of(cfg.inner_steps), "fragment_update_alpha": stream.alpha}
        diloco = DiLoCo(manager, fragments, inner, outers, sync_every=cfg.inner_steps, **streaming)
    model.train()
    t0 = time.perf_counter()
    with diloco:
        for j in range(cfg.total_inner_steps):
            batch = next(streams[shards[(turn + j) % len(shards)]])
            inner.zero_grad()
            task.loss(model, batch).backward()
            if cfg.inner.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
            inner.step()
            schedule.step()
    seconds = time.perf_counter() - t0
    loss = None
    if rank == 0 and lighthouse is not None:  # the global model, as every replica holds it after the last sync
        model.eval()
        with torch.no_grad():
            losses = [float(task.loss(model, b)) for b in task.eval_batches()]
        loss = sum(losses) / len(losses)
    if manager is not None:
        manager.shutdown(wait=False)
    out.put((rank, seconds, loss))


def _module_fragments(model: torch.nn.Module, p: int) -> list[torch.nn.Module]:
    """torchft's fragments are modules: the blocks strided over P, the other top-level
    modules (embeddings, final norm) with the first fragment (torchft cannot split a
    tensor across fragments, as Archipelago's position-based fragments do)."""
    lists = [m for m in model.children() if isinstance(m, torch.nn.ModuleList)]
    blocks = max(lists, key=len)
    rest = [m for m in model.children() if m is not blocks and any(True for _ in m.parameters())]
    return [
        torch.nn.ModuleList([*(rest if i == 0 else []), *(blocks[j] for j in range(i, len(blocks), p))])
        for i in range(p)
    ]


def _replicas(cfg: RunConfig, k: int, exchange: bool) -> tuple[float, float | None]:
    """(wall seconds of the slowest replica's loop, eval loss of the global model); without
    `exchange`, replica 0 of the k alone."""
    from torchft._torchft import LighthouseServer

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    server = LighthouseServer(bind="[::]:0", min_replicas=k) if exchange else None
    address = server.address() if server is not None else None
    ranks = range(k) if exchange else range(1)
    procs = [ctx.Process(target=_replica, args=(r, k, cfg.model_dump_json(), address, out)) for r in ranks]
    try:
        for p in procs:
            p.start()
        results: list[tuple[int, float, float | None]] = []
        while len(results) < len(procs):  # a replica that died fails the row now, not in half an hour
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                if any(p.exitcode not in (0, None) for p in procs):
                    break
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if server is not None:
            server.shutdown()
    if any(p.exitcode not in (0, None) for p in procs):
        raise RuntimeError(f"a torchft replica failed: exit codes {[p.exitcode for p in procs]}")
    losses = [loss for _, _, loss in results if loss is not None]
    return max(s for _, s, _ in results), (losses[0] if losses else None)


def torchft_diloco(
    base: list[str], overrides: list[str], k: int, warm: dict[int, Path], seeds: tuple[int, ...], warm_steps: int
) -> dict[str, Any]:
    """The peer row: torchft's DiLoCo for each seed, and islands alone (seed 0)."""
    losses, walls = [], []
    configs = {
        s: load_config(None, [*base, *overrides, f"seed={s}", *continue_warm(warm_steps, warm[s])]) for s in seeds
    }
    for s, cfg in configs.items():
        wall, loss = _replicas(cfg, k, exchange=True)
        assert loss is not None
        losses.append(loss)
        walls.append(wall)
        log.info("  %-26s final eval loss %.4f  %.0fs", f"torchft_diloco@s{s}", loss, wall)
    cfg = configs[seeds[0]]
    one, _ = _replicas(cfg, k, exchange=False)  # seed 0's replica 0, training alone on the machine
    alone = lower_bound(one, k, cfg.island_threads, os.cpu_count() or 1)
    numel = FlatParams(load_task(cfg.task.factory, cfg.task.kwargs).build_model()).numel
    rounds = cfg.rounds
    what = "DiLoCo"
    if (frag := settings_if(cfg, StreamingSettings)) is not None:
        tau = frag.tau_of(cfg.inner_steps)
        what = f"Streaming DiLoCo (P={frag.fragments} module fragments, delay {tau}, alpha {frag.alpha})"
    return {
        "description": f"torchft {version('torchft')} {what} (local_sgd.DiLoCo, gloo all-reduce), same everything",
        "overrides": overrides,
        "final_eval_loss": statistics.fmean(losses),
        "final_eval_loss_seeds": losses,
        "final_eval_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "initial_eval_loss": None,
        "tokens": rounds * k * cfg.inner_steps * cfg.task.kwargs["batch_size"] * cfg.task.kwargs["context"],
        "outer_steps": rounds,
        # a ring all-reduce moves 2(k-1)/k of the fp32 pseudo-gradient per replica, each way
        "bytes_communicated": int(rounds * k * 2 * 2 * (k - 1) / k * numel * 4),
        "train_seconds": walls[0],
        "islands_alone_seconds": alone,  # the lower bound of both tools' wall (module docstring)
        "one_replica_alone_seconds": one,
        "overhead_vs_islands_alone": walls[0] / alone - 1,
    }
