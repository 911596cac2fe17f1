"""`bench bareloop`: what an island adds to training, against the loop a user would write.

One process, one device: the island (`Island`, the product's own code, given a work order
of H steps from the global parameters, as a round is: loading them, H inner steps through
its data streams, flat buffers, inner optimizer, clip and schedule, then Δ and its
encoding) and a bare torch loop on the same model, batch, optimizer settings, precision
and compile setting (`AdamW(model.parameters())` foreach — fused on CUDA —,
`clip_grad_norm_`, the same LR schedule, the task's own batches and loss), alternately,
each after a warm-up round, `alternations` times. The ratio of each alternation is the
island's round over the bare loop's H steps; the report gives their median. On CUDA the
bare loop synchronises once at its end, as a round does when its Δ leaves the device.

The model is the 25.6 M GPT (the default task at d = 512, 8 layers, context 512); on a
CPU a batch of 1 × 256 tokens keeps a step near a second, which makes per-step overheads
weigh more than at a GPU's batch: the harsher test.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.report import BenchResult, Panel, md_table

log = logging.getLogger(__name__)

GPT_25M = ["task.kwargs.d_model=512", "task.kwargs.n_layers=8", "task.kwargs.n_heads=8"]
CPU_BATCH = ["task.kwargs.context=256", "task.kwargs.batch_size=1", "islands.threads=2"]
CUDA_BATCH = ["task.kwargs.context=512", "task.kwargs.batch_size=32", "inner.precision=bf16", "inner.compile=true"]


def _bare_steps(task: Any, model: Any, cfg: Any, batches: Any, steps: int, device: Any, state: dict) -> None:
    """`steps` steps of the loop a user writes (its optimizer and schedule kept in `state`)."""
    import torch

    from archipelago.workers.runtime.compiling import compiled_forward
    from archipelago.workers.runtime.optim import lr_factor
    from archipelago.workers.wire.spec import Precision

    inner = cfg.inner
    if "optimizer" not in state:
        fused = device.type == "cuda"
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=inner.lr,
            betas=inner.betas,
            weight_decay=inner.weight_decay,
            foreach=not fused,
            fused=fused,
        )
        total = cfg.schedule_steps
        state["optimizer"] = opt
        state["scheduler"] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, inner, total))
        # as the island decides, and compiled as it compiles
        state["forward"] = compiled_forward(model) if inner.compiles_on(device.type) else model
    opt, sched, forward = state["optimizer"], state["scheduler"], state["forward"]
    bf16 = inner.precision == Precision.BF16
    model.train()
    for _ in range(steps):
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = task.loss(forward, (x, y))
        loss.backward()
        if inner.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip, foreach=True)
        opt.step()
        sched.step()
    if device.type == "cuda":
        torch.cuda.synchronize()


def sizes(quick: bool) -> tuple[int, int]:
    """Inner steps a round and alternations."""
    return (10, 3) if quick else (50, 5)


def compare(overrides: list[str], steps: int, alternations: int, budget_s: float | None = None) -> dict[str, Any]:
    """The island's round against the bare loop, alternately in this process (see the module);
    alternations stop once `budget_s` is spent (one always runs). On CUDA, the island's peak
    of allocated device memory over its first round (before the bare loop allocates
    anything): what the plan's accelerator side is checked against."""
    import torch

    from archipelago.orchestrator.config_load import load_config
    from archipelago.orchestrator.engine.specs import island_spec
    from archipelago.workers.runtime.island import Island
    from archipelago.workers.tasks.task import load_task

    cfg = load_config(None, ["warm_start.steps=0", "islands.count=1", "rounds=1000", *overrides])
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    task.prepare()
    island = Island(island_spec(cfg, 0))
    device = island.device
    params = island.flat.numpy()
    t_start = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    island.run(island.order(0, 2), params)  # warm-up: allocations, compilation, the data's first read
    island_peak = torch.cuda.max_memory_allocated(device) if cuda else None
    torch.manual_seed(cfg.seed)
    model = task.build_model().to(device)
    batches = iter(task.train_batches(0, cfg.num_shards, cfg.seed))
    state: dict[str, Any] = {}
    _bare_steps(task, model, cfg, batches, 2, device, state)
    island_s: list[float] = []
    bare_s: list[float] = []
    for a in range(alternations):
        if island_s and budget_s is not None and time.perf_counter() - t_start > budget_s:
            log.warning("bareloop: budget of %.0f s spent after %d alternation(s)", budget_s, len(island_s))
            break
        t0 = time.perf_counter()
        island.run(island.order(a + 1, steps), params)
        island_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _bare_steps(task, model, cfg, batches, steps, device, state)
        bare_s.append(time.perf_counter() - t0)
    ratios = [i / b for i, b in zip(island_s, bare_s)]
    return {
        "device": str(device),
        "params": island.flat.numel,
        "steps": steps,
        "alternations": len(island_s),
        "island_seconds": island_s,
        "bare_seconds": bare_s,
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "overrides": overrides,
        "island_peak_bytes": island_peak,
    }


def ratio_panel(rows: dict[str, dict[str, Any]]) -> Panel:
    """Each alternation's island round over the bare loop, per device, against the target."""
    return Panel(
        x_label="alternation",
        y_label="island round / bare loop",
        curves={k: [(i + 1, x) for i, x in enumerate(r["ratios"])] for k, r in rows.items()},
        references={"target 1.03": 1.03},
    )


def bareloop(quick: bool, work: Path) -> BenchResult:
    import torch

    steps, alternations = sizes(quick)
    rows = {"cpu": compare([*GPT_25M, *CPU_BATCH, "islands.gpus=0"], steps, alternations)}
    if torch.cuda.is_available():
        rows["cuda"] = compare([*GPT_25M, *CUDA_BATCH, "islands.gpus=1"], steps, alternations)
    table = md_table(
        ["device", "params", "H", "island round (median)", "bare loop (median)", "island / bare (median of ratios)"],
        [
            [
                k,
                f"{r['params'] / 1e6:.1f} M",
                str(r["steps"]),
                f"{statistics.median(r['island_seconds']):.2f} s",
                f"{statistics.median(r['bare_seconds']):.2f} s",
                f"{r['ratio']:.3f} (each: {', '.join(f'{x:.3f}' for x in r['ratios'])})",
            ]
            for k, r in rows.items()
        ],
    )
    cuda = "" if "cuda" in rows else " CUDA: not measured (no GPU on this machine)."
    return BenchResult(
        scenario="bareloop",
        quick=quick,
        methods=rows,
        summary="bareloop: island / bare loop " + ", ".join(f"{k} {r['ratio']:.3f}" for k, r in rows.items()),
        markdown=f"Alternately in one process, after a warm-up round each; target <= 1.03.{cuda}\n\n{table}",
        panels=[ratio_panel(rows)],
        extra={"island_vs_bare_loop": {"cpu": rows["cpu"]["ratio"], "cuda": rows.get("cuda", {}).get("ratio")}},
    )
