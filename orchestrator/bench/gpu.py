"""`bench gpu`: everything a GPU day should measure, in one command, written at once.

On any machine: an island's round against a bare torch loop on this machine's CPU
(`bareloop.py`, the 25.6 M GPT) and the coordinator's outer step at 1 M to 100 M
parameters on this host (`coordinator.py`). With CUDA, besides: the same island-vs-bare-loop
ratio on the GPU (bf16, compiled), and runs of the default GPT and the Hugging Face task on
CUDA in bf16 — a 124 M GPT-2 (GPT-2 small's shape) as one island on the GPU, the 25.6 M GPT
and a ~100 M Llama as four islands sharing it through fractional GPUs, one island of two
workers where there are two GPUs — with tokens per second and model FLOPs utilisation (MFU)
against the device's datasheet bf16 dense peak (the convention llm.c and the speedruns
report against; 989 TFLOP/s for an H100 SXM or an H200), with the MFU against the bf16
matmul peak measured on the device beside it (`mfu_measured_peak`). Without CUDA the GPU rows are reported as not
measured (null in the JSON), never as a CPU figure standing in for them. Start-up has its
own scenario, `bench startup`."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.report import BenchResult, md_table
from archipelago.orchestrator.bench.runner import Table, one_ray, run_methods
from archipelago.orchestrator.config_load import load_config
from archipelago.workers.tasks.task import load_task
from archipelago.workers.wire.flat import FlatParams

log = logging.getLogger(__name__)

COMMON = ["warm_start.steps=0", "inner.precision=bf16", "inner.warmup_steps=20", "inner.lr=1e-3", "eval_every=1000"]
GPT = [
    "task.kwargs.d_model=512",
    "task.kwargs.n_layers=8",
    "task.kwargs.n_heads=8",
    "task.kwargs.context=512",
    "task.kwargs.batch_size=32",
]
GPT2_124M = [
    "task.factory=archipelago.workers.tasks.hf_task:make_task",
    "task.kwargs.model_config={model_type: gpt2, vocab_size: 50257}",  # GPT-2 small: 12 x 768, 1,024 positions
    "task.kwargs.context=1024",
    "task.kwargs.batch_size=16",
    "inner.compile=true",
]
LLAMA = [
    "task.factory=archipelago.workers.tasks.hf_task:make_task",
    "task.kwargs.model_config={model_type: llama, hidden_size: 768, intermediate_size: 2048, num_hidden_layers: 12, "
    "num_attention_heads: 12, num_key_value_heads: 4, tie_word_embeddings: true}",
    "task.kwargs.context=1024",
    "task.kwargs.batch_size=16",
]


# datasheet dense bf16 tensor-core FLOP/s (without sparsity), by a part of the device's name;
# the first that matches (a PCIe H100 before the SXM one)
DATASHEET_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def datasheet_bf16_flops(device_name: str) -> float | None:
    """The datasheet's dense bf16 peak of the device `device_name` names, None if not listed."""
    return next((flops for part, flops in DATASHEET_BF16 if part in device_name), None)


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
        "gpt2_124m_1gpu": ("GPT-2 small (124 M), 1 island on 1 GPU", [*GPT2_124M, "islands.count=1", "islands.gpus=1"]),
        "gpt_4x0.25gpu": ("default GPT, 4 islands on 1 GPU", [*GPT, "islands.count=4", "islands.gpus=0.25"]),
        "llama_4x0.25gpu": ("HF Llama, 4 islands on 1 GPU", [*LLAMA, "islands.count=4", "islands.gpus=0.25"]),
    }
    if gpus >= 2:
        table["llama_1x2workers"] = (
            "HF Llama, 1 island of 2 FSDP2 workers (2 GPUs)",
            [*LLAMA, "islands.count=1", "islands.workers=2", "islands.gpus=1", "islands.sharding=fsdp"],
        )
    return [*COMMON, f"rounds={rounds}", f"inner_steps={steps}"], table


def _cuda_rows(quick: bool, work: Path, gpus: int, peak: float, datasheet: float | None) -> dict[str, dict[str, Any]]:
    base, table = methods(quick, gpus)
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
            # 6 N FLOPs per token (forward and backward), attention's share left out; against the
            # datasheet's peak where the device is listed, else (said in the report) the measured one
            "mfu": 6 * numel * tokens_per_s / ((datasheet or peak) * devices),
            "mfu_measured_peak": 6 * numel * tokens_per_s / (peak * devices),
            "final_eval_loss": s["final_eval_loss"],
            "initial_eval_loss": s["initial_eval_loss"],
            "train_seconds": s["train_seconds"],
        }
    return rows


def gpu(quick: bool, work: Path) -> BenchResult:
    import torch

    from archipelago.orchestrator.bench import bareloop
    from archipelago.orchestrator.bench.coordinator import SIZES, measure_rows

    cuda = torch.cuda.is_available()
    steps, alternations = (10, 3) if quick else (50, 5)
    ratios = {"cpu": bareloop.compare([*bareloop.GPT_25M, *bareloop.CPU_BATCH, "islands.gpus=0"], steps, alternations)}
    coordinator_rows, _ = measure_rows(SIZES[:3])
    rows: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {"device": None, "gpus": 0, "peak_bf16_flops": None, "datasheet_bf16_flops": None}
    if cuda:
        ratios["cuda"] = bareloop.compare(
            [*bareloop.GPT_25M, *bareloop.CUDA_BATCH, "islands.gpus=1"], steps, alternations
        )
        gpus = torch.cuda.device_count()
        peak = peak_bf16_flops()
        name = torch.cuda.get_device_name(0)
        datasheet = datasheet_bf16_flops(name)
        rows = _cuda_rows(quick, work, gpus, peak, datasheet)
        extra = {"device": name, "gpus": gpus, "peak_bf16_flops": peak, "datasheet_bf16_flops": datasheet}
    mfu_124m = rows["gpt2_124m_1gpu"]["mfu"] if "gpt2_124m_1gpu" in rows else None
    extra.update(
        island_vs_bare_loop={"cpu": ratios["cpu"]["ratio"], "cuda": ratios["cuda"]["ratio"] if cuda else None},
        island_vs_bare_loop_runs=ratios,
        mfu_124m=mfu_124m,
        coordinator_rows=coordinator_rows,
    )
    device = (
        f"{extra['device']} x{extra['gpus']}; "
        + (
            f"MFU against the datasheet's bf16 dense peak, {extra['datasheet_bf16_flops'] / 1e12:.0f} TFLOP/s"
            if extra["datasheet_bf16_flops"]
            else "not in the datasheet table: MFU against the measured peak"
        )
        + f"; measured bf16 matmul peak {extra['peak_bf16_flops'] / 1e12:.0f} TFLOP/s"
        if cuda
        else "no CUDA device"
    )
    mfu_text = f"{100 * mfu_124m:.1f}%" if mfu_124m is not None else "not measured"
    return BenchResult(
        scenario="gpu",
        quick=quick,
        methods=rows,
        summary=f"gpu: {device.split(';')[0]}; island / bare loop cpu {ratios['cpu']['ratio']:.3f}"
        + (f", cuda {ratios['cuda']['ratio']:.3f}" if cuda else ", cuda not measured")
        + f"; MFU 124 M {mfu_text}",
        markdown=_markdown(device, ratios, rows, coordinator_rows, cuda),
        panels=[bareloop.ratio_panel(ratios)],
        extra=extra,
    )


def _markdown(
    device: str,
    ratios: dict[str, dict[str, Any]],
    rows: dict[str, dict[str, Any]],
    coordinator_rows: list[dict[str, Any]],
    cuda: bool,
) -> str:
    """The island against the bare loop, the runs on the GPU, and the coordinator on this host."""
    ratio_md = md_table(
        ["device", "island round / bare loop (median of alternations)", "each"],
        [[k, f"{r['ratio']:.3f}", ", ".join(f"{x:.3f}" for x in r["ratios"])] for k, r in ratios.items()]
        + ([] if cuda else [["cuda", "not measured (no CUDA device)", "-"]]),
    )
    coordinator_md = md_table(
        ["params", "S", "s / round", "x memcpy", "peak / slice", "checkpoint"],
        [
            [
                f"{r['params'] / 1e6:,.0f} M",
                str(r["slices"]),
                f"{r['seconds_per_round']:.4f}",
                f"{r['vs_memcpy']:.2f}",
                f"{r['peak_mb']:,.0f} MB",
                f"{r['checkpoint_seconds']:.2f} s",
            ]
            for r in coordinator_rows
        ],
    )
    runs_md = (
        md_table(
            ["run", "params", "tokens/s", "MFU", "MFU (measured peak)", "eval loss (start → end)"],
            [
                [
                    k,
                    f"{r['params'] / 1e6:.1f} M",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{100 * r['mfu']:.1f}%",
                    f"{100 * r['mfu_measured_peak']:.1f}%",
                    f"{r['initial_eval_loss']:.3f} → {r['final_eval_loss']:.3f}",
                ]
                for k, r in rows.items()
            ],
        )
        if rows
        else "Runs on CUDA (MFU, the 124 M GPT-2 among them): not measured (no CUDA device)."
    )
    return (
        f"Device: {device}.\n\n### Island against a bare torch loop\n\n{ratio_md}\n\n"
        f"### Runs on the GPU\n\n{runs_md}\n\n### The coordinator on this host\n\n{coordinator_md}\n"
    )
