"""`bench gpu`: everything a GPU day should measure, in one command that fits a short lease.

A GPU is lent for minutes, so the scenario is a list of parts, each with a time budget it
is held to and an expected time from a model of its steps (`--dry-run` prints them without
running anything), all inside `TOTAL_BUDGET_S`:
- `peak`: the device's dense bf16 matmul rate, measured (MFU is reported against the
  device's datasheet peak, the convention llm.c and the speedruns use — 989 TFLOP/s for an
  H100 SXM or an H200 —, with the measured peak beside it);
- `bareloop`: an island's round against the bare torch loop a user would write, on the GPU
  (`bareloop.py`: the 25.6 M GPT, bf16, compiled, fused AdamW in both), alternately in one
  process; and the island's measured peak of device memory against the plan's accelerator
  side for the same config;
- `profile`: where a step of the 124 M GPT-2 island goes, by torch's profiler in process
  (`gpu_profile.py`: wall and device time a step, the loss's head's share, the top operations);
- `reference`: the same model and batch in the reference loop, trained the way the best open
  loops train (`reference.py`: the whole loss compiled; the batch the island's, the rows the
  plan fits in the GPU, in one micro-batch), its tokens/s and MFU (`mfu_reference`) beside
  the island's and the bare loop's, and its top kernels beside the island's;
- `runs`: the product on Ray — a 124 M GPT-2 (GPT-2 small's shape) as one island on the GPU
  (the MFU row), the 25.6 M GPT and a ~77 M Llama as four islands sharing it through
  fractional GPUs, one island of two FSDP2 workers where there are two GPUs — evaluated on
  the GPU by an evaluation actor, with tokens/s over the rounds after the first (the first
  holds compilation and the first evaluation; the whole run's rate is beside it).
A run still going when its budget ends is stopped at its round's end (`Stop`), a part that
would overrun the whole budget is skipped, and a part that fails is reported with its error
while the others run: the report is always written. Without CUDA nothing is run and every
GPU figure is null, said not measured — never a CPU figure standing in for it (the CPU's
island-vs-bare-loop ratio is `bench bareloop`'s, the coordinator's `bench coordinator`'s).
Start-up has its own scenario, `bench startup`."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.gpu_profile import profile_island, profile_md
from archipelago.orchestrator.bench.reference import reference_run
from archipelago.orchestrator.bench.report import BenchResult, md_table
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import load_config

log = logging.getLogger(__name__)

TOTAL_BUDGET_S = 480.0  # the whole scenario, Ray's start included

COMMON = [
    "warm_start.steps=0",
    "inner.precision=bf16",
    "inner.warmup_steps=20",
    "inner.lr=1e-3",
    "eval_every=1000",  # evaluated at the start and the end only: the rounds between are measured
    "evaluation.where=actor",
    "evaluation.gpus=0.2",  # beside the islands on the GPU they leave it
    "evaluation.cpus=1",
]
GPT = [
    "task.kwargs.d_model=512",
    "task.kwargs.n_layers=8",
    "task.kwargs.n_heads=8",
    "task.kwargs.context=512",
    "task.kwargs.batch_size=32",
]
GPT2_124M = [
    "task.factory=archipelago.workers.tasks.hf_task:make_task",
    # GPT-2 small: 12 x 768, 1,024 positions; pretrained without dropout, as llm.c and nanoGPT
    # pretrain it (transformers' GPT-2 config has 0.1 in three places: kernels a step, and
    # SDPA's slower path with dropout, for no gain in a few hundred steps)
    "task.kwargs.model_config={model_type: gpt2, vocab_size: 50257, resid_pdrop: 0, embd_pdrop: 0, attn_pdrop: 0}",
    "task.kwargs.context=1024",
]
GPT2_ROWS = 16  # the 124 M row's rows a step where the plan picks none (`--dry-run`, before `fill`)
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
ASSUMED_DEVICE = "NVIDIA H200"  # what `--dry-run` plans for on a machine without CUDA

# The expected-time model (`--dry-run`; each part's measured seconds are reported beside it):
# a step is 6 N FLOPs a token at ASSUMED_MFU of the datasheet peak, islands sharing a GPU take
# their turns, and each process pays a fixed start and each compiled model a compilation.
# The fixed costs are those of the H200 run of 2026-11-30 (docs/findings/gpu.md), which
# the first guesses (15, 25 and 45 s) had at 422 s against its measured 343.
ASSUMED_MFU = 0.30
RAY_START_S = 6.0  # Ray's local instance, once
RUN_START_S = 40.0  # a run's actors started, its data and tokenizer prepared, its first evaluation
COMPILE_S = 15.0  # Inductor compiling one model's block, forward and backward (islands in parallel)
EVAL_S = 5.0  # one evaluation of the eval set on the GPU
PROFILE_STEPS = 10  # the `profile` and `reference` parts' steps, timed and then profiled
# Inductor compiling the reference loop's one graph, the 124 M model and its loss forward and
# backward, its 12 blocks unrolled (where the island compiles one block): a guess, three of
# the island's compilations, until a lease measures it (reported as the part's warm-up)
REFERENCE_COMPILE_S = 3 * COMPILE_S
MFU_ROW = "gpt2_124m_1gpu"  # the run whose MFU is the headline, and whose island the profile part profiles


def mfu(params: int, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: 6 N FLOPs a token (forward and backward, attention's share
    left out, as llm.c and the speedruns count) at `tokens_per_s`, over `peak_flops`."""
    return 6 * params * tokens_per_s / peak_flops


def datasheet_bf16_flops(device_name: str) -> float | None:
    """The datasheet's dense bf16 peak of the device `device_name` names, None if not listed."""
    return next((flops for part, flops in DATASHEET_BF16 if part in device_name), None)


def peak_bf16_flops(size: int = 8192, repeats: int = 20) -> float:
    """The device's achievable dense bf16 matmul FLOP/s, measured (datasheet peaks are
    rarely reached; MFU against it is reported beside the datasheet's)."""
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


def tokens_per_step(cfg: RunConfig) -> int:
    """Tokens in one inner step of `cfg`'s task (its batch's rows times its context)."""
    return int(cfg.task.kwargs["batch_size"]) * int(cfg.task.kwargs["context"])


@dataclass(frozen=True, kw_only=True)
class Row:
    """One run of the product on the GPU; its islands and GPUs are its config's."""

    description: str
    overrides: list[str]
    approx_params: int  # the model's, for the expected-time model (a run counts its own)
    budget_s: float

    @functools.cached_property
    def config(self) -> RunConfig:
        return load_config(None, [*COMMON, *self.overrides])

    @property
    def islands(self) -> int:
        return self.config.islands.count

    @property
    def devices(self) -> int:
        """The GPUs the row's islands use (the evaluation actor fits in what they leave), at
        least the one the scenario runs on."""
        i = self.config.islands
        return max(1, math.ceil(round(i.count * i.workers * i.gpus, 6)))


@dataclass(frozen=True, kw_only=True)
class Part:
    """One part of the scenario: its budget and what the model expects it to take."""

    name: str
    description: str
    budget_s: float
    expected_s: float


def _rounds(quick: bool) -> tuple[int, int]:
    """Rounds and inner steps of each run: the first round is start-up, the rest are measured."""
    return (3, 20) if quick else (5, 50)


def rows(quick: bool, gpus: int, mfu_rows: int = GPT2_ROWS) -> dict[str, Row]:
    """The runs: fractional-GPU islands of each task, and an island of two workers (FSDP2)
    where there are two GPUs (the evaluation actor takes the fifth of a GPU they leave);
    the 124 M island at `mfu_rows` rows a step (one micro-batch: the `fill` part's choice)."""
    _, h = _rounds(quick)
    # at more rows, fewer steps a round: the run's tokens (and so its time in its budget) stay those at GPT2_ROWS
    steps = max(5, h * GPT2_ROWS // mfu_rows)
    table = {
        MFU_ROW: Row(
            description=f"GPT-2 small (124 M), 1 island on 1 GPU, {mfu_rows} rows a step",
            overrides=[
                *GPT2_124M,
                f"task.kwargs.batch_size={mfu_rows}",
                f"inner_steps={steps}",
                "islands.count=1",
                "islands.gpus=0.8",
            ],
            approx_params=124_439_808,
            budget_s=130.0,
        ),
        "gpt_4x0.2gpu": Row(
            description="default GPT (25.6 M), 4 islands sharing 1 GPU",
            overrides=[*GPT, "islands.count=4", "islands.gpus=0.2"],
            approx_params=25_613_312,
            budget_s=100.0,
        ),
        "llama_4x0.2gpu": Row(
            description="HF Llama (77 M), 4 islands sharing 1 GPU",
            overrides=[*LLAMA, "islands.count=4", "islands.gpus=0.2"],
            approx_params=77_089_536,
            budget_s=110.0,
        ),
    }
    if gpus >= 2:
        table["llama_1x2workers"] = Row(
            description="HF Llama, 1 island of 2 FSDP2 workers (2 GPUs)",
            overrides=[*LLAMA, "islands.count=1", "islands.workers=2", "islands.gpus=0.9", "islands.sharding=fsdp"],
            approx_params=77_089_536,
            budget_s=90.0,
        )
    return table


def base_overrides(quick: bool) -> list[str]:
    rounds, steps = _rounds(quick)
    return [*COMMON, f"rounds={rounds}", f"inner_steps={steps}"]


def fill_device(quick: bool, gpus: int) -> dict[str, Any]:
    """The 124 M island's rows a step that fill this machine's GPU within the plan's
    `DEVICE_FILL` (`plan.planner.rows_that_fill`), with what it planned them to hold."""
    import torch

    from archipelago.orchestrator.plan.cluster import this_machine
    from archipelago.orchestrator.plan.planner import DEVICE_FILL, rows_that_fill

    cfg = rows(quick, gpus)[MFU_ROW].config
    device = torch.cuda.get_device_properties(0).total_memory
    chosen, planned = rows_that_fill(cfg, this_machine(accelerator_memory=device))
    return {
        "rows": chosen,
        "tokens_per_step": chosen * int(cfg.task.kwargs["context"]),
        "planned_accelerator_bytes": planned,
        "device_bytes": device,
        "fill": DEVICE_FILL,
        "island_share": cfg.islands.gpus,
    }


def step_seconds(params: int, tokens: int, peak: float) -> float:
    """The model's time of one inner step (forward and backward) of `tokens` tokens."""
    return 6 * params * tokens / (peak * ASSUMED_MFU)


def plan_parts(quick: bool, gpus: int, peak: float, mfu_rows: int = GPT2_ROWS) -> list[Part]:
    """Every part with its budget and expected time (see the module's model)."""
    from archipelago.orchestrator.bench import bareloop

    steps, alternations = bareloop.sizes(quick)
    bare_tokens = tokens_per_step(load_config(None, [*bareloop.GPT_25M, *bareloop.CUDA_BATCH]))
    bare_steps = 2 * (2 + alternations * steps)  # warm-up and alternations, island and bare loop
    table = rows(quick, gpus, mfu_rows)
    profiled = table[MFU_ROW]
    # a profiled loop's run after its compile: warm steps and the profiled ones, at the row's size
    profiled_s = 5.0 + (3 + 2 * PROFILE_STEPS) * step_seconds(
        profiled.approx_params, tokens_per_step(profiled.config), peak
    )
    parts = [
        Part(name="peak", description="bf16 matmul peak", budget_s=15.0, expected_s=3.0),
        Part(
            name="bareloop",
            description="island vs bare loop (25.6 M GPT) and the plan's accelerator side",
            budget_s=120.0 if not quick else 90.0,
            expected_s=2 * COMPILE_S + 10.0 + bare_steps * step_seconds(25_482_240, bare_tokens, peak),
        ),
        Part(
            name="plan",
            description="the plan's accelerator side for that island, measured under fake tensors",
            budget_s=60.0,
            expected_s=15.0,
        ),
        Part(
            name="fill",
            description="the 124 M island's rows a step that fill the GPU, by the plan (fake tensors)",
            budget_s=60.0,
            expected_s=20.0,
        ),
        Part(
            name="profile",
            description="where a step of the 124 M GPT-2 island goes (torch's profiler, in process)",
            budget_s=60.0,
            expected_s=COMPILE_S + profiled_s,
        ),
        Part(
            name="reference",
            description="the 124 M GPT-2's model and batch in the reference loop (reference.py), profiled",
            budget_s=120.0,
            expected_s=REFERENCE_COMPILE_S + profiled_s,
        ),
        Part(name="ray", description="Ray's local instance", budget_s=30.0, expected_s=RAY_START_S),
    ]
    rounds, h = _rounds(quick)
    for name, row in table.items():
        steps = rounds * (row.config.inner_steps if "inner_steps" in row.config.model_fields_set else h)
        train = steps * row.islands * step_seconds(row.approx_params, tokens_per_step(row.config), peak) / row.devices
        parts.append(
            Part(
                name=name,
                description=row.description,
                budget_s=row.budget_s,
                expected_s=RUN_START_S + COMPILE_S + 2 * EVAL_S + train,
            )
        )
    return parts


def dry_run(quick: bool) -> str:
    """Each part's budget and expected seconds on this machine's GPU (or, without one, on
    `ASSUMED_DEVICE`), from the model, without running anything."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ASSUMED_DEVICE
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    peak = datasheet_bf16_flops(name) or 989e12
    parts = plan_parts(quick, gpus, peak)
    lines = [
        f"bench gpu on {name} x{gpus}{'' if torch.cuda.is_available() else ' (assumed: no CUDA here)'}: "
        f"steps at {100 * ASSUMED_MFU:.0f}% of {peak / 1e12:.0f} TFLOP/s, a run's start {RUN_START_S:.0f} s, "
        f"a compilation {COMPILE_S:.0f} s, an evaluation {EVAL_S:.0f} s",
        f"{'part':<18} {'expected':>9} {'budget':>8}  what",
    ]
    lines += [f"{p.name:<18} {p.expected_s:>8.0f}s {p.budget_s:>7.0f}s  {p.description}" for p in parts]
    lines.append(
        f"{'total':<18} {sum(p.expected_s for p in parts):>8.0f}s {TOTAL_BUDGET_S:>7.0f}s  "
        "(a part that would overrun the total is skipped)"
    )
    return "\n".join(lines)


class _Parts:
    """Runs parts in order within their budgets and the total, recording each one's
    outcome; a part that fails is recorded with its error and the rest still run."""

    def __init__(self, plan: list[Part], only: tuple[str, ...] | None = None, total_s: float = TOTAL_BUDGET_S) -> None:
        self.plan = {p.name: p for p in plan}
        self.only = only
        self.total_s = total_s
        self.t0 = time.perf_counter()
        self.outcomes: dict[str, dict[str, Any]] = {}

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only

    def run(self, name: str, fn: Callable[[float], Any]) -> Any:
        part = self.plan[name]
        left = self.total_s - (time.perf_counter() - self.t0)
        outcome: dict[str, Any] = {"budget_s": part.budget_s, "expected_s": part.expected_s, "seconds": None}
        self.outcomes[name] = outcome
        if not self.wanted(name) and name != "ray":
            outcome["status"] = "not run (--parts)"
            return None
        if part.expected_s > left:
            outcome["status"] = f"skipped: {part.expected_s:.0f} s expected, {max(0.0, left):.0f} s of the total left"
            log.warning("bench gpu: %s %s", name, outcome["status"])
            return None
        log.info("bench gpu: %s (budget %.0f s, expected %.0f s)", name, part.budget_s, part.expected_s)
        t0 = time.perf_counter()
        try:
            value = fn(min(part.budget_s, left))
            outcome["status"] = "measured"
        except Exception as err:  # a part's failure is reported, and the others still run
            log.exception("bench gpu: %s failed", name)
            outcome["status"] = f"failed: {type(err).__name__}: {err}"
            value = None
        outcome["seconds"] = time.perf_counter() - t0
        return value

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


class _Deadline:
    """Stops the run going on when `budget_s` ends: at its round's end, and, if it has not
    ended a minute later, at once (its summary and records are written either way).
    `cancel` once the run is over, so neither stop reaches the next run."""

    AGAIN_S = 60.0

    def __init__(self, budget_s: float) -> None:
        self.over = threading.Event()
        threading.Thread(target=self._watch, args=(budget_s,), daemon=True, name="bench-deadline").start()

    def cancel(self) -> None:
        self.over.set()

    def _watch(self, budget_s: float) -> None:
        from archipelago.api.handle import HandleError
        from archipelago.orchestrator.engine.commands import Stop
        from archipelago.orchestrator.runtime.run_handle import RayRunHandle, find_run

        for now, wait_s in ((False, budget_s), (True, self.AGAIN_S)):
            if self.over.wait(wait_s):
                return
            log.warning("bench gpu: the run's budget is spent; stopping it%s", " now" if now else "")
            try:
                RayRunHandle(find_run()).submit(Stop(now=now))
            except (LookupError, ValueError, HandleError) as err:  # not started yet, or already gone
                log.warning("bench gpu: could not stop the run: %s", err)


def steady_rates(out_dir: str) -> dict[str, Any]:
    """A run's rates over its rounds after the first (which holds compilation and the first
    evaluation), from its records: `tokens_per_s` over the rounds' wall (what a user gets:
    the islands' exchange and the outer step included) and `island_tokens_per_s` over the
    islands' own seconds in them (the round's work on the island: its parameters in, the
    steps, Δ out; the mean island's, as islands sharing a GPU run at once); each round's
    seconds beside them. The rates are None when fewer than two rounds were recorded."""
    from archipelago.orchestrator.engine.state.logfiles import read_lines

    records = [json.loads(line) for line in read_lines(Path(out_dir) / "metrics.jsonl")]
    island_s: list[float] = []
    before: dict[str, float] = {}
    for r in records:
        now = r.get("island_compute_seconds") or {}
        spent = [v - before.get(k, 0.0) for k, v in now.items()]
        island_s.append(sum(spent) / len(spent) if spent else 0.0)
        before = {**before, **now}
    later = [i for i, r in enumerate(records) if r.get("round", 0) > 1 and r.get("round_seconds")]
    tokens = sum(records[i]["tokens"] for i in later)
    wall = sum(records[i]["round_seconds"] for i in later)
    computing = sum(island_s[i] for i in later)
    return {
        "tokens_per_s": tokens / wall if later and wall else None,
        "island_tokens_per_s": tokens / computing if later and computing else None,
        "rounds": len(later),
        "round_seconds": [r.get("round_seconds") for r in records],
        "island_round_seconds": island_s,
        "coordinator_seconds": [r.get("coordinator_seconds") for r in records],
    }


def _run_row(
    name: str, row: Row, quick: bool, work: Path, peak: float, datasheet: float | None, budget_s: float
) -> dict[str, Any]:
    """One run of the product on the GPU, stopped when `budget_s` is spent; its rates and MFU."""
    from archipelago.orchestrator.runtime.driver import run

    cfg = load_config(None, [*base_overrides(quick), *row.overrides, f"out_dir={work / name}"])
    deadline = _Deadline(budget_s)
    try:
        s = run(cfg, show_progress=False)
    finally:
        deadline.cancel()
    rates = steady_rates(s["out_dir"])
    whole = s["tokens"] / s["train_seconds"]
    steady = rates["tokens_per_s"] is not None
    rate = rates["tokens_per_s"] if steady else whole
    island_rate = rates["island_tokens_per_s"]
    peak_flops = (datasheet or peak) * row.devices
    return {
        "description": row.description,
        "params": s["num_params"],
        "state": s["state"],
        "rounds_done": s["rounds_done"],
        "tokens_per_s": rate,
        "tokens_per_s_over": f"rounds 2-{s['rounds_done']}" if steady else "the whole run (one round)",
        "island_tokens_per_s": island_rate,
        "tokens_per_s_whole_run": whole,
        # 6 N FLOPs per token (forward and backward), attention's share left out; against the
        # datasheet's peak where the device is listed, else (said in the report) the measured one
        "mfu": mfu(s["num_params"], rate, peak_flops),
        "mfu_island": mfu(s["num_params"], island_rate, peak_flops) if island_rate else None,
        "mfu_measured_peak": mfu(s["num_params"], rate, peak * row.devices),
        "per_round": {k: rates[k] for k in ("round_seconds", "island_round_seconds", "coordinator_seconds")},
        "final_eval_loss": s["final_eval_loss"],
        "initial_eval_loss": s["initial_eval_loss"],
        "train_seconds": s["train_seconds"],
        "startup_seconds": s.get("startup_seconds"),
    }


REFERENCE_LOOP = "reference loop"


def loop_rates(
    ratio: dict[str, Any] | None,
    profiled: dict[str, Any] | None,
    reference: dict[str, Any] | None,
    mfu_row: dict[str, Any] | None,
    tokens_124m: int,
    peak_flops: float,
    measured_peak: float,
) -> list[dict[str, Any]]:
    """Every loop's tokens/s and MFU side by side, one row each where its part ran: on the
    124 M GPT-2's model and batch the reference loop and the island in process (the
    `reference` and `profile` parts: the same steps, timed alike) and the island on Ray (the
    MFU row, over its rounds after the first); on the 25.6 M GPT the island's rounds and the
    bare loop's steps (`bareloop`, alternately)."""
    found: list[tuple[str, str, int, int, int, float]] = []  # loop, where, params, tokens a step, micro-batches, rate
    if reference:
        found.append(
            (
                REFERENCE_LOOP,
                "in process",
                reference["params"],
                reference["tokens_per_step"],
                reference["micro_batches"],
                reference["tokens_per_s"],
            )
        )
    if profiled:
        rate = tokens_124m / profiled["step_s"]
        found.append(("island", "in process (profile)", profiled["params"], tokens_124m, 1, rate))
    if mfu_row:
        found.append(("island", f"on Ray ({MFU_ROW})", mfu_row["params"], tokens_124m, 1, mfu_row["tokens_per_s"]))
    if ratio:
        for loop, key in (("island", "island_seconds"), ("bare loop", "bare_seconds")):
            rate = ratio["tokens_per_step"] * ratio["steps"] / statistics.median(ratio[key])
            found.append((loop, "in process (bareloop)", ratio["params"], ratio["tokens_per_step"], 1, rate))
    return [
        {
            "loop": loop,
            "where": where,
            "params": params,
            "tokens_per_step": tokens,
            "micro_batches": micro_batches,
            "tokens_per_s": rate,
            "mfu": mfu(params, rate, peak_flops),
            "mfu_measured_peak": mfu(params, rate, measured_peak),
        }
        for loop, where, params, tokens, micro_batches, rate in found
    ]


def plan_check(overrides: list[str], measured_bytes: int) -> dict[str, Any]:
    """The plan's accelerator memory for one island of `overrides` against its measured peak."""
    from archipelago.orchestrator.plan.planner import plan_run

    cfg = load_config(None, ["warm_start.steps=0", "islands.count=1", *overrides])
    plan = plan_run(cfg)
    need = next(n for n in plan.needs if n.process == "island worker" and n.memory == "accelerator")
    planned = sum(need.parts.values())
    return {
        "planned_bytes": planned,
        "planned_parts": need.parts,
        "measured_peak_bytes": measured_bytes,
        "planned_over_measured": planned / measured_bytes,
    }


def gpu(
    quick: bool, work: Path, parts_only: tuple[str, ...] | None = None, budget_s: float = TOTAL_BUDGET_S
) -> BenchResult:
    """The scenario; `parts_only`: run only these parts (`--parts`: what a short lease has
    time for), the others reported as not run; `budget_s`: the whole scenario's (`--budget`:
    a device script's share of a lease), a part that would overrun it skipped."""
    import torch

    from archipelago.orchestrator.bench import bareloop
    from archipelago.orchestrator.bench.runner import one_ray

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else None
    gpus = torch.cuda.device_count() if cuda else 0
    datasheet = datasheet_bf16_flops(name) if name else None
    parts = _Parts(plan_parts(quick, max(1, gpus), datasheet or 989e12), parts_only, budget_s)
    runs: dict[str, dict[str, Any]] = {}
    ratio: dict[str, Any] | None = None
    check: dict[str, Any] | None = None
    peak: float | None = None
    profiled: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None
    fill: dict[str, Any] | None = None
    loops: list[dict[str, Any]] = []
    if cuda:
        peak = parts.run("peak", lambda _: peak_bf16_flops())
        if peak is None:
            peak = datasheet or 989e12  # the run rows still report against the datasheet
        overrides = [*bareloop.GPT_25M, *bareloop.CUDA_BATCH, "islands.gpus=1"]
        steps, alternations = bareloop.sizes(quick)
        ratio = parts.run("bareloop", lambda budget: bareloop.compare(overrides, steps, alternations, budget))
        if ratio is not None and ratio.get("island_peak_bytes"):
            check = parts.run("plan", lambda _: plan_check(overrides, ratio["island_peak_bytes"]))
        torch.cuda.empty_cache()
        fill = parts.run("fill", lambda _: fill_device(quick, gpus))
        mfu_rows = fill["rows"] if fill else GPT2_ROWS
        for part in plan_parts(quick, gpus, datasheet or 989e12, mfu_rows):  # what the chosen rows expect
            if part.name in (MFU_ROW, "profile", "reference"):
                parts.plan[part.name] = part
        every_row = rows(quick, gpus, mfu_rows)
        profiled = parts.run("profile", lambda _: profile_island(every_row[MFU_ROW].config, steps=PROFILE_STEPS))
        torch.cuda.empty_cache()
        reference = parts.run(
            "reference",
            # the island's batch, `mfu_rows` rows that fill the device, is one micro-batch: nothing accumulates
            lambda _: reference_run(every_row[MFU_ROW].config, steps=PROFILE_STEPS),
        )
        torch.cuda.empty_cache()
        table = {k: r for k, r in every_row.items() if parts.wanted(k)}
        with contextlib.ExitStack() as ray_instance:
            if table:
                parts.run("ray", lambda _: ray_instance.enter_context(one_ray(16)))
            for row_name, row in table.items():
                result = parts.run(row_name, functools.partial(_run_row, row_name, row, quick, work, peak, datasheet))
                if result is not None:
                    runs[row_name] = result
        tokens_124m = tokens_per_step(every_row[MFU_ROW].config)
        loops = loop_rates(ratio, profiled, reference, runs.get(MFU_ROW), tokens_124m, datasheet or peak, peak)
        for p in parts.plan.values():  # the rows `--parts` left out
            parts.outcomes.setdefault(
                p.name,
                {"status": "not run (--parts)", "seconds": None, "budget_s": p.budget_s, "expected_s": p.expected_s},
            )
    else:
        for p in parts.plan.values():
            parts.outcomes[p.name] = {
                "status": "not measured (no CUDA device)",
                "seconds": None,
                "budget_s": p.budget_s,
                "expected_s": p.expected_s,
            }
    mfu_124m = runs[MFU_ROW]["mfu"] if MFU_ROW in runs else None
    mfu_124m_island = runs[MFU_ROW]["mfu_island"] if MFU_ROW in runs else None
    extra: dict[str, Any] = {
        "device": name,
        "gpus": gpus,
        "bench_seconds": parts.elapsed,
        "total_budget_s": budget_s,
        "parts": parts.outcomes,
        "peak_bf16_flops": peak if cuda else None,
        "peak_flops_datasheet": datasheet,
        "mfu_124m": mfu_124m,  # over the rounds' wall
        "mfu_124m_island": mfu_124m_island,  # over the island's own seconds of its rounds
        "island_vs_bare_loop": {"cuda": ratio["ratio"] if ratio else None},
        "island_vs_bare_loop_runs": {"cuda": ratio} if ratio else {},
        "plan_accelerator_check": check,
        "mfu_rows": fill,  # the 124 M island's rows a step and why (None: not planned, GPT2_ROWS used)
        "profile_124m": profiled,
        # the reference loop on the 124 M GPT-2's model and batch (reference.py), in process, and every loop's MFU
        "mfu_reference": next((r["mfu"] for r in loops if r["loop"] == REFERENCE_LOOP), None),
        "reference_124m": reference,
        "loops": loops,
        "model": {
            "assumed_mfu": ASSUMED_MFU,
            "ray_start_s": RAY_START_S,
            "run_start_s": RUN_START_S,
            "compile_s": COMPILE_S,
            "reference_compile_s": REFERENCE_COMPILE_S,
            "eval_s": EVAL_S,
        },
    }
    mfu_text = f"{100 * mfu_124m:.1f}%" if mfu_124m is not None else "not measured"
    reference_text = f"{100 * extra['mfu_reference']:.1f}%" if extra["mfu_reference"] is not None else "not measured"
    summary = (
        f"gpu: {name or 'no CUDA device'}; island / bare loop cuda "
        + (f"{ratio['ratio']:.3f}" if ratio else "not measured")
        + f"; MFU 124 M {mfu_text}, its reference loop {reference_text}; {parts.elapsed:.0f} s"
    )
    from archipelago.orchestrator.bench.bareloop import ratio_panel

    return BenchResult(
        scenario="gpu",
        quick=quick,
        methods=runs,
        summary=summary,
        markdown=_markdown(extra, runs, ratio, check),
        panels=[ratio_panel({"cuda": ratio})] if ratio else [],
        extra=extra,
    )


def _markdown(
    extra: dict[str, Any], runs: dict[str, dict[str, Any]], ratio: dict[str, Any] | None, check: dict[str, Any] | None
) -> str:
    """The parts and their time, the island against the bare loop, the plan's check, the runs."""
    if extra["device"] is None:
        head = "Device: none (no CUDA device): every GPU figure below is not measured."
    else:
        datasheet = extra["peak_flops_datasheet"]
        head = (
            f"Device: {extra['device']} x{extra['gpus']}; MFU against "
            + (
                f"the datasheet's bf16 dense peak, {datasheet / 1e12:.0f} TFLOP/s"
                if datasheet
                else "the measured peak (the device is not in the datasheet table)"
            )
            + (
                f"; measured bf16 matmul peak {extra['peak_bf16_flops'] / 1e12:.0f} TFLOP/s"
                if extra["peak_bf16_flops"]
                else ""
            )
            + f". The whole run: {extra['bench_seconds']:.0f} s of a {extra['total_budget_s']:.0f}-s budget."
        )
    parts_md = md_table(
        ["part", "seconds", "expected", "budget", "outcome"],
        [
            [
                k,
                f"{o['seconds']:.0f}" if o.get("seconds") is not None else "-",
                f"{o['expected_s']:.0f}" if o.get("expected_s") is not None else "-",
                f"{o['budget_s']:.0f}" if o.get("budget_s") is not None else "-",
                o["status"],
            ]
            for k, o in extra["parts"].items()
        ],
    )
    if ratio:
        ratio_md = md_table(
            ["device", "island round / bare loop (median)", "each", "island (median)", "bare loop (median)"],
            [
                [
                    "cuda",
                    f"{ratio['ratio']:.3f}",
                    ", ".join(f"{x:.3f}" for x in ratio["ratios"]),
                    f"{statistics.median(ratio['island_seconds']):.3f} s",
                    f"{statistics.median(ratio['bare_seconds']):.3f} s",
                ]
            ],
        )
    else:
        ratio_md = "Not measured."
    check_md = (
        f"The plan's accelerator memory for that island: {check['planned_bytes'] / 2**30:.2f} GiB planned, "
        f"{check['measured_peak_bytes'] / 2**30:.2f} GiB measured (torch's peak allocated), "
        f"planned / measured {check['planned_over_measured']:.2f}."
        if check
        else "The plan's accelerator side: not checked (no measured peak)."
    )
    if (fill := extra["mfu_rows"]) is not None:
        check_md += (
            f" The 124 M island trains {fill['rows']} rows a step ({fill['tokens_per_step']:,} tokens), the most the "
            f"plan fits in {fill['fill']:.0%} of its {fill['island_share']:g} of the GPU: "
            f"{fill['planned_accelerator_bytes'] / 2**30:.1f} of {fill['device_bytes'] / 2**30:.1f} GiB planned."
        )
    runs_md = (
        md_table(
            [
                "run",
                "params",
                "rounds",
                "tokens/s (rounds 2+)",
                "whole run",
                "MFU",
                "MFU (measured peak)",
                "island's own tokens/s, MFU",
                "eval loss",
            ],
            [
                [
                    k,
                    f"{r['params'] / 1e6:.1f} M",
                    f"{r['rounds_done']} ({r['state']})",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['tokens_per_s_whole_run']:,.0f}",
                    f"{100 * r['mfu']:.1f}%",
                    f"{100 * r['mfu_measured_peak']:.1f}%",
                    f"{r['island_tokens_per_s']:,.0f}, {100 * r['mfu_island']:.1f}%" if r["mfu_island"] else "-",
                    f"{r['initial_eval_loss']:.3f} → {r['final_eval_loss']:.3f}"
                    if r["final_eval_loss"] is not None and r["initial_eval_loss"] is not None
                    else "-",
                ]
                for k, r in runs.items()
            ],
        )
        if runs
        else "Runs on CUDA (MFU, the 124 M GPT-2 among them): not measured."
    )
    return (
        f"{head}\n\n### Parts\n\n{parts_md}\n\n### Island against a bare torch loop\n\n{ratio_md}\n\n{check_md}\n\n"
        f"### Where a step of the 124 M GPT-2 island goes\n\n{profile_md(extra['profile_124m'])}\n\n"
        f"### The loops side by side, and the reference loop's step\n\n{_loops_md(extra)}\n\n"
        f"### Runs on the GPU\n\n{runs_md}\n"
    )


def _loops_md(extra: dict[str, Any]) -> str:
    """Every loop's rate and MFU, then where the reference loop's step goes."""
    if not extra["loops"]:
        return "Not measured."
    table = md_table(
        ["loop", "where", "model", "tokens a step (micro-batches)", "tokens/s", "MFU", "MFU (measured peak)"],
        [
            [
                r["loop"],
                r["where"],
                f"{r['params'] / 1e6:.1f} M",
                f"{r['tokens_per_step']:,} ({r['micro_batches']})",
                f"{r['tokens_per_s']:,.0f}",
                f"{100 * r['mfu']:.1f}%",
                f"{100 * r['mfu_measured_peak']:.1f}%",
            ]
            for r in extra["loops"]
        ],
    )
    reference = extra["reference_124m"]
    if reference is None:
        return f"{table}\n\nThe reference loop: not measured."
    step = (
        f"The reference loop ({'compiled whole' if reference['compiled'] else 'uncompiled'}; its warm-up, "
        f"compilation included, {reference['profile']['warmup_s']:.0f} s; mean loss "
        f"{reference['losses']['warmup']:.3f} over its warm-up, {reference['losses']['profiled']:.3f} at its end): "
    )
    return f"{table}\n\n{step}{profile_md(reference['profile'])}"


def part_names() -> list[str]:
    """Every part `--parts` may name (the two-GPU row's too)."""
    return [p.name for p in plan_parts(quick=False, gpus=2, peak=989e12)]
