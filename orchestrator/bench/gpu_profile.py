"""`bench gpu`'s profiles: where one training step goes, by torch's profiler — the
island's (the `profile` part) and the reference loop's (the `reference` part, `reference.py`).

An MFU figure says how far a step is from the device's peak, not why. On the H200 the 124 M
GPT-2 island's 6.9 % hid two causes that only a profile showed — the chunked loss's head
running fp32 matmuls, then its bf16 matmuls on kernels for unaligned shapes — and a lease
spent a call of its own on the profile each time. So the scenario profiles the MFU row's
island in process (no Ray: the island's own code, compiled and warmed up first) and reports
its step's wall and device seconds, the share of the device time the loss's head takes, and
the operations (on a GPU, the kernels) that take most of it; the reference loop's step is
profiled the same way beside it, so the next lease starts from where the two differ.

Runs on the CPU too (the CPU's own time stands for the device's), which is how it is tested;
the scenario runs it on CUDA only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from archipelago.orchestrator.config import RunConfig

HEAD_OPS = ("ChunkedCrossEntropy", "ChunkedCrossEntropyBackward")  # the chunked loss's head, forward and back
TOP = 12  # operations listed, by their own device time


def profile_island(cfg: RunConfig, *, warmup: int = 3, steps: int = 10) -> dict[str, Any]:
    """`cfg`'s first island, built in this process (on CUDA where there is one), timed and
    profiled by `time_and_profile`; its parameters beside."""
    import torch

    from archipelago.orchestrator.engine.specs import island_spec
    from archipelago.workers.runtime.island import Island

    island = Island(island_spec(cfg, 0))
    cuda = island.device.type == "cuda"
    params = island.flat.numpy()

    def train(n: int) -> None:
        island.run(island.order(0, n), params)
        if cuda:
            torch.cuda.synchronize()

    return {"params": island.flat.numel, **time_and_profile(train, cuda=cuda, warmup=warmup, steps=steps)}


def time_and_profile(train: Callable[[int], None], *, cuda: bool, warmup: int, steps: int) -> dict[str, Any]:
    """`warmup` steps of `train` (compilation, first allocations), `steps` timed, then
    `steps` under torch's profiler; `train(n)` returns once its n steps are done (on a GPU,
    synchronised). Its seconds a step, its device seconds a step, the share of those the
    chunked loss's head takes as its own operations (None where none ran: a loss compiled
    into the model's graph runs as fused kernels), and the top operations by their own
    device time (ms a step): on a GPU, kernels."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    train(warmup)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    train(steps)
    step_s = (time.perf_counter() - t0) / steps
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        train(steps)
    events = prof.key_averages()

    def own_us(e: Any) -> float:
        return float(e.self_device_time_total if cuda else e.self_cpu_time_total)

    def total_us(e: Any) -> float:
        return float(e.device_time_total if cuda else e.cpu_time_total)

    device_us = sum(own_us(e) for e in events)
    head_us = sum(total_us(e) for e in events if e.key in HEAD_OPS)
    top = sorted(events, key=own_us, reverse=True)[:TOP]
    return {
        "device": "cuda" if cuda else "cpu",
        "steps": steps,
        "warmup_s": warmup_s,
        "step_s": step_s,
        "device_s_per_step": device_us / 1e6 / steps,
        "head_share": head_us / device_us if device_us and head_us else None,
        "top": [
            {"name": e.key, "ms_per_step": own_us(e) / 1e3 / steps, "calls_per_step": e.count / steps} for e in top
        ],
    }


def profile_md(profiled: dict[str, Any] | None) -> str:
    """The profile as the report shows it: a line of totals and the top operations' table."""
    from archipelago.orchestrator.bench.report import md_table

    if not profiled:
        return "Not profiled."
    share = profiled["head_share"]
    line = (
        f"{profiled['step_s'] * 1e3:.1f} ms a step ({profiled['steps']} steps on {profiled['device']}), "
        f"{profiled['device_s_per_step'] * 1e3:.1f} ms of it on the device; the loss's head "
        + (
            f"{100 * share:.0f} % of the device time."
            if share is not None
            else "not seen as its own operations (no chunked head, or one compiled into the model's graph)."
        )
    )
    table = md_table(
        ["operation (own time)", "ms a step", "calls a step"],
        [[t["name"], f"{t['ms_per_step']:.2f}", f"{t['calls_per_step']:.0f}"] for t in profiled["top"]],
    )
    return f"{line}\n\n{table}"
