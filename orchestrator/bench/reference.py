"""`bench gpu`'s `reference` part: the island's model and batch trained the way the best open
loops train them, for the MFU the island's own loop is held to.

The island's 124 M GPT-2 measured 8.4 % of the datasheet's peak on an H200 (11.9 % after the
head's matmuls went to bf16), where llm.c reaches about 35 % for the same model on an H100,
and the island equals the project's bare loop (`bareloop.py`), which mirrors the island's
choices. So a figure of what this model and batch reach on this device, trained as llm.c,
nanoGPT/nanochat and torchtitan train, tells how much of the gap is the loop's and how much
the model's (transformers' GPT-2 rather than a hand-written one) or the device's.

The reference loop is the bare loop (`BareLoop`: the same task, model, batches, AdamW and
schedule, nothing read back per step) with the one thing those loops do differently: the
whole micro-batch loss compiled as one graph (`torch.compile` of the task's loss around the
model, as nanoGPT compiles a model whose forward returns its loss), so the chunked loss's
head — its matmuls, log-sum-exp, softmax and gradient — is compiled and fused with the
model's last block, where the island compiles the model's blocks
(`workers/runtime/compiling.py`) and runs the head eagerly.
Shared with the island and the bare loop, as those loops have them: fused attention (the
model's SDPA), bf16 autocast over fp32 master weights, fused AdamW on CUDA (one kernel a
step), the loss summed on the device and read once, and the micro-batch sized to the
device. In `bench gpu` the batch is the island's, the rows the plan says fill the device
(`plan.planner.rows_that_fill`, its `fill` part), so a step is one micro-batch and nothing
accumulates (`micro_batches` 1 in its report): llm.c sizes its micro-batch to the card the
same way and accumulates to a 0.5 M-token batch, which would make the batch not the
island's and only spread the optimizer's one fused kernel over more tokens. The loop still
splits a batch into micro-batches of `micro_rows` rows, their gradients accumulated, for a
batch larger than a device holds (checked on the CPU: the same steps as one batch).

On a CPU the reference trains uncompiled unless told (`compile`): Inductor's C++ code
generation takes about 30 s for even a two-layer model on the project's 2-core machine,
longer than a smoke test's steps; the compiled path is checked there through Dynamo and
AOTAutograd without code generation (`backend="aot_eager"`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from archipelago.orchestrator.bench.bareloop import BareLoop
from archipelago.orchestrator.bench.gpu_profile import time_and_profile
from archipelago.orchestrator.config import RunConfig


class ReferenceLoop(BareLoop):
    """The bare loop with the whole micro-batch loss compiled (where `compiles`, by `backend`:
    Inductor, or what `torch.compile` takes) and the batch in micro-batches of `micro_rows`
    rows (see the module)."""

    def __init__(
        self,
        task: Any,
        model: Any,
        cfg: RunConfig,
        device: Any,
        *,
        micro_rows: int,
        compiles: bool,
        backend: Any = "inductor",
    ) -> None:
        rows = int(cfg.task.kwargs["batch_size"])
        if micro_rows < 1 or rows % micro_rows:
            raise ValueError(f"micro-batches of {micro_rows} rows do not divide the batch's {rows}")
        self.compiles, self.backend = compiles, backend
        super().__init__(task, model, cfg, device, micro_batches=rows // micro_rows)

    def micro_loss(self) -> Callable[[Any], Any]:
        """The task's loss around the model, as one compiled function (or as it is)."""
        import torch

        loss = functools.partial(self.task.loss, self.model)
        return torch.compile(loss, backend=self.backend) if self.compiles else loss


def reference_run(
    cfg: RunConfig,
    *,
    micro_rows: int | None = None,
    compiles: bool | None = None,
    backend: Any = "inductor",
    warmup: int = 3,
    steps: int = 10,
) -> dict[str, Any]:
    """The reference loop on `cfg`'s task, model and batch, on CUDA where there is one:
    `warmup` steps (compilation), `steps` timed and `steps` profiled (`time_and_profile`).
    `micro_rows`: the rows of a micro-batch (default: the whole batch); `compiles`: as the
    island decides (`inner.compile`) unless given. Its tokens a second, its parameters for
    the MFU, and its mean loss over the warm-up, the timed and the profiled steps (read once
    each, after them)."""
    import torch

    from archipelago.workers.tasks.task import load_task

    device = torch.device("cuda" if torch.cuda.is_available() and cfg.islands.gpus > 0 else "cpu")
    cuda = device.type == "cuda"
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    task.prepare()
    torch.manual_seed(cfg.seed)
    model = task.build_model().to(device)
    rows = int(cfg.task.kwargs["batch_size"])
    loop = ReferenceLoop(
        task,
        model,
        cfg,
        device,
        micro_rows=micro_rows or rows,
        compiles=cfg.inner.compiles_on(device.type) if compiles is None else compiles,
        backend=backend,
    )
    batches = iter(task.train_batches(0, cfg.num_shards, cfg.seed))
    losses: list[float] = []

    def train(n: int) -> None:
        losses.append(float(loop.train(batches, n)) / n)  # the one read, after the n steps

    timed = time_and_profile(train, cuda=cuda, warmup=warmup, steps=steps)
    tokens_per_step = rows * int(cfg.task.kwargs["context"])
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "rows": rows,
        "micro_rows": rows // loop.micro_batches,
        "micro_batches": loop.micro_batches,
        "tokens_per_step": tokens_per_step,
        "compiled": loop.compiles,
        "tokens_per_s": tokens_per_step / timed["step_s"],
        "losses": {"warmup": losses[0], "timed": losses[1], "profiled": losses[2]},
        "profile": timed,
    }
