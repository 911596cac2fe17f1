"""`bench bareloop`: what an island adds to training, against the loop a user would write.

One process, one device: the island (`Island`, the product's own code, given a work order
of H steps from the global parameters, as a round is: loading them, H inner steps through
its data streams, flat buffers, inner optimizer, clip and schedule, then Δ and its
encoding) and a bare torch loop on the same model, batch, optimizer settings, precision
and compile setting (`AdamW(model.parameters())` foreach — fused on CUDA —,
`clip_grad_norm_`, the same LR schedule, the task's own batches and loss), alternately,
each after a warm-up round, `alternations` times. The ratio of each alternation is the
island's round over the bare loop's H steps; the report gives their median. The bare loop
reads its summed loss once at its end (on CUDA its one wait for the device), as a round
reads its losses once and its Δ leaves the device once.

The model is the 25.6 M GPT (the default task at d = 512, 8 layers, context 512); on a
CPU a batch of 1 × 256 tokens keeps a step near a second, which makes per-step overheads
weigh more than at a GPU's batch: the harsher test.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.report import BenchResult, Panel, md_table
from archipelago.orchestrator.config import RunConfig

log = logging.getLogger(__name__)

GPT_25M = ["task.kwargs.d_model=512", "task.kwargs.n_layers=8", "task.kwargs.n_heads=8"]
CPU_BATCH = ["task.kwargs.context=256", "task.kwargs.batch_size=1", "islands.threads=2"]
CUDA_BATCH = ["task.kwargs.context=512", "task.kwargs.batch_size=32", "inner.precision=bf16", "inner.compile=true"]


class BareLoop:
    """The loop a user writes for the island's task, on its device: the task's model and
    batches and loss, AdamW over the model's parameters with the island's settings and
    kernel (`adamw_kernel`: fused on CUDA, foreach elsewhere), its lr schedule, clip and
    precision (bf16 autocast over fp32 weights), its forward compiled as the island compiles
    it (`compiled_forward`), each batch in `micro_batches` parts whose gradients accumulate,
    each weighted by its share of the batch's tokens as the island weights them. Nothing is
    read back per step: the losses are summed on the device and `train` hands the sum over,
    for the caller to read once (on a GPU, the one wait for the device).

    `micro_loss` is what a subclass changes (the reference loop, `reference.py`, compiles
    the whole loss); everything else the two loops share."""

    def __init__(self, task: Any, model: Any, cfg: RunConfig, device: Any, micro_batches: int | None = None) -> None:
        import torch

        from archipelago.workers.runtime.optim import adamw_kernel, lr_factor
        from archipelago.workers.wire.spec import Precision

        self.task, self.model, self.device, self.inner = task, model, device, cfg.inner
        self.micro_batches = micro_batches or cfg.inner.micro_batches
        self.bf16 = cfg.inner.precision == Precision.BF16
        params = list(model.parameters())
        inner, total = cfg.inner, cfg.schedule_steps
        self.optimizer = torch.optim.AdamW(
            params, lr=inner.lr, betas=inner.betas, weight_decay=inner.weight_decay, **adamw_kernel(params)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, inner, total))
        self.loss = self.micro_loss()

    def micro_loss(self) -> Callable[[Any], Any]:
        """A micro-batch's loss: the task's, around the model's forward compiled as the
        island compiles it (the loss itself runs eagerly around it, as on the island)."""
        from archipelago.workers.runtime.compiling import compiled_forward

        forward = compiled_forward(self.model) if self.inner.compiles_on(self.device.type) else self.model
        return functools.partial(self.task.loss, forward)

    def train(self, batches: Iterator[Any], steps: int) -> Any:
        """`steps` steps on the next of `batches`; the sum of their losses, a float64 tensor on the device."""
        import torch

        from archipelago.workers.tasks.task import split_batch, to_device

        parts = self.micro_batches
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.model.train()
        for _ in range(steps):
            batch = to_device(next(batches), self.device)
            weight = self.task.batch_weight(batch)
            self.optimizer.zero_grad(set_to_none=True)
            for i in range(parts):
                part = split_batch(batch, i, parts, "micro-batches") if parts > 1 else batch
                share = self.task.batch_weight(part) / weight
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss = self.loss(part)
                (loss * share).backward()
                total += loss.detach().double() * share
            if self.inner.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip, foreach=True)
            self.optimizer.step()
            self.scheduler.step()
        return total


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
    bare = BareLoop(task, task.build_model().to(device), cfg, device)
    batches = iter(task.train_batches(0, cfg.num_shards, cfg.seed))
    float(bare.train(batches, 2))  # its warm-up, read as every run of it is: the one wait for the device
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
        float(bare.train(batches, steps))
        bare_s.append(time.perf_counter() - t0)
    ratios = [i / b for i, b in zip(island_s, bare_s)]
    return {
        "device": str(device),
        "params": island.flat.numel,
        "tokens_per_step": int(cfg.task.kwargs["batch_size"]) * int(cfg.task.kwargs["context"]),
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
