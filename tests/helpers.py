"""In-process DiLoCo driver for unit tests: real `Island` and `SyncServer` objects, no Ray."""
from __future__ import annotations

import torch

from orchestrator.aggregate import Contribution
from orchestrator.config import RunConfig
from orchestrator.outer import build_server_optimizer
from orchestrator.sync_server import SyncServer
from workers.compress import decode
from workers.flat import FlatParams
from workers.island import Island
from orchestrator.launcher import island_spec
from workers.task import load_task

# a GPT small enough for a Ray test to train a few rounds in seconds
TINY_LM = ["task.kwargs.d_model=32", "task.kwargs.n_layers=1", "task.kwargs.n_heads=2",
           "task.kwargs.context=32", "task.kwargs.batch_size=8", "task.kwargs.eval_batches=4",
           "inner.warmup_steps=5", "inner.lr=0.01"]


def run_until_records(cfg: RunConfig, run_id: str, records: int, timeout_s: float = 120.0):
    """Start `run(cfg)` in a thread and return once metrics.jsonl has `records` rounds, so a
    test can break something mid-run; returns (thread, box), the summary lands in box."""
    import threading
    import time
    from pathlib import Path

    from orchestrator.run import run

    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(summary=run(cfg, show_progress=False, run_id=run_id)))
    thread.start()
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    deadline = time.time() + timeout_s
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < records):
        time.sleep(0.05)
    return thread, box


def in_process_run(cfg: RunConfig) -> tuple[SyncServer, list[Island], list[torch.Tensor]]:
    """Run `cfg` synchronously in this process; returns the server, the islands and the
    global parameters after every round."""
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    torch.manual_seed(cfg.seed)
    flat = FlatParams(task.build_model())
    server = SyncServer(flat.data, lambda p: build_server_optimizer(cfg, p), drop_prob=cfg.outer.drop_prob,
                        seed=cfg.seed, grad_clip=cfg.inner.grad_clip if cfg.mode == "ddp" else None)
    islands = [Island(island_spec(cfg, i)) for i in range(cfg.islands.count)]
    history = []
    for _ in range(cfg.rounds):
        params = server.params_numpy().copy()
        results = [isl.run_round(server.version, params, cfg.inner_steps) for isl in islands]
        server.close_round([Contribution(r.island, r.version, decode(r.payload), float(r.weight)) for r in results])
        history.append(flat.data.clone())
    return server, islands, history
