"""GPU check: the default GPT task and the Hugging Face task (a Llama from config with the
trained tokenizer) train on CUDA in bf16 — four islands sharing one device through
fractional GPUs, and one island of two workers where there are two GPUs — with tokens per
second and model FLOPs utilisation (MFU) for each. It refuses to run without CUDA: a CPU
figure would not answer the question."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from orchestrator.bench.report import BenchResult, ScenarioUnavailable, md_table
from orchestrator.bench.runner import Table, one_ray, run_methods
from orchestrator.config_load import load_config
from workers.tasks.task import load_task
from workers.wire.flat import FlatParams

log = logging.getLogger(__name__)

COMMON = ["warm_start.steps=0", "inner.precision=bf16", "inner.warmup_steps=20", "inner.lr=1e-3", "eval_every=1000"]
GPT = [
    "task.kwargs.d_model=512",
    "task.kwargs.n_layers=8",
    "task.kwargs.n_heads=8",
    "task.kwargs.context=512",
    "task.kwargs.batch_size=32",
]
LLAMA = [
    "task.factory=workers.tasks.hf_task:make_task",
    "task.kwargs.model_config={model_type: llama, hidden_size: 768, intermediate_size: 2048, num_hidden_layers: 12, "
    "num_attention_heads: 12, num_key_value_heads: 4, tie_word_embeddings: true}",
    "task.kwargs.context=1024",
    "task.kwargs.batch_size=16",
]


def peak_bf16_flops(size: int = 8192, repeats: int = 20) -> float:
    """The device's achievable dense bf16 matmul FLOP/s, measured (datasheet peaks are
    rarely reached; MFU against what the device does here is the honest ratio)."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - t0)


def _params(overrides: list[str]) -> int:
    cfg = load_config(None, [*COMMON, *overrides])
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    task.prepare()
    return FlatParams(task.build_model()).numel


def methods(quick: bool, gpus: int) -> tuple[list[str], Table]:
    """The base overrides and the rows: fractional-GPU islands of each task, and an island
    of two workers (FSDP2) where there are two GPUs."""
    rounds, steps = (2, 20) if quick else (4, 50)
    table: Table = {
        "gpt_4x0.25gpu": ("default GPT, 4 islands on 1 GPU", [*GPT, "islands.count=4", "islands.gpus=0.25"]),
        "llama_4x0.25gpu": ("HF Llama, 4 islands on 1 GPU", [*LLAMA, "islands.count=4", "islands.gpus=0.25"]),
    }
    if gpus >= 2:
        table["llama_1x2workers"] = (
            "HF Llama, 1 island of 2 FSDP2 workers (2 GPUs)",
            [*LLAMA, "islands.count=1", "islands.workers=2", "islands.gpus=1", "islands.sharding=fsdp"],
        )
    return [*COMMON, f"rounds={rounds}", f"inner_steps={steps}"], table


def gpu(quick: bool, work: Path) -> BenchResult:
    import torch

    if not torch.cuda.is_available():
        raise ScenarioUnavailable(
            "bench gpu needs a CUDA device and none is visible (torch.cuda.is_available() is False)"
        )
    gpus = torch.cuda.device_count()
    base, table = methods(quick, gpus)
    peak = peak_bf16_flops()
    with one_ray(8):
        summaries = run_methods(base, table, work)
    rows: dict[str, dict[str, Any]] = {}
    for name, (description, overrides) in table.items():
        s = summaries[name]
        numel = _params(overrides)
        tokens_per_s = s["tokens"] / s["train_seconds"]
        devices = 2 if "2workers" in name else 1
        rows[name] = {
            "description": description,
            "params": numel,
            "tokens_per_s": tokens_per_s,
            # 6 N FLOPs per token (forward and backward), attention's share left out
            "mfu": 6 * numel * tokens_per_s / (peak * devices),
            "final_eval_loss": s["final_eval_loss"],
            "initial_eval_loss": s["initial_eval_loss"],
            "train_seconds": s["train_seconds"],
        }
    device = torch.cuda.get_device_name(0)
    table_md = md_table(
        ["run", "params", "tokens/s", "MFU", "eval loss (start → end)"],
        [
            [
                k,
                f"{r['params'] / 1e6:.1f} M",
                f"{r['tokens_per_s']:,.0f}",
                f"{100 * r['mfu']:.1f}%",
                f"{r['initial_eval_loss']:.3f} → {r['final_eval_loss']:.3f}",
            ]
            for k, r in rows.items()
        ],
    )
    best = max(rows.values(), key=lambda r: r["mfu"])
    return BenchResult(
        scenario="gpu",
        quick=quick,
        methods=rows,
        summary=f"gpu: {device} x{gpus}, best MFU {100 * best['mfu']:.1f}% ({best['description']})",
        markdown=f"Device: {device} ×{gpus}; measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s (MFU is against it).\n\n"
        + table_md,
        extra={"device": device, "gpus": gpus, "peak_bf16_flops": peak},
    )
