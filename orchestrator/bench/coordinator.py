"""`bench coordinator`: the coordinator's outer step at model scale — 1 M to 1 B parameters,
S = 1, 2, 4 slices — seconds per round, bytes per second against memcpy, peak memory per
slice, and the checkpoint's time and peak.

Each (size, S) is measured in a fresh process (so its peak is its own): the production
outer step (`LocalOuter` with the run's outer rule, DiLoCo's Nesterov, and its admission)
over one slice's share of the parameters, N / S, on `ISLANDS` synthetic pseudo-gradients
that arrive before the measurement starts (what the object store hands the coordinator;
not counted in its peak, as the issue's bound says). A round's seconds are the median of
`ROUNDS` after one warm-up; memcpy is measured on the same vector in the same process. A
sliced coordinator's slices run on their own nodes at once, so a round with S slices takes
one slice's time: measured one slice at a time here (this machine has 2 cores), which is
said in the report. Then the pseudo-gradients are freed, the process's peak is reset
(`/proc/self/clear_refs`), and a checkpoint of the slice's state (parameters and momentum)
is written to local disk through `save_checkpoint`: its seconds and its peak. A size whose
predicted memory does not fit this machine is not run, and the report says where the curve
stops and why.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.report import BenchResult, Panel, md_table
from archipelago.orchestrator.plan.fresh import run_fresh

SIZES = (1_000_000, 10_000_000, 100_000_000, 1_000_000_000)
SLICES = (1, 2, 4)
ISLANDS = 4
ROUNDS = 5
MB = 1e6


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    """Linux: the peak resident size (VmHWM) starts again from the current size."""
    Path("/proc/self/clear_refs").write_text("5")


def _warm_up(cfg: Any, islands: int) -> None:
    """One step on a small vector first: the compiled kernels (numba's LLVM,
    ~0.1 GB held for the process's life) is the process's, not the parameters', memory."""
    import numpy as np
    import torch

    from archipelago.orchestrator.engine.step.outer import Commit, LocalOuter
    from archipelago.orchestrator.engine.step.rules import outer_rule
    from archipelago.orchestrator.engine.types import Contribution

    outer = LocalOuter(torch.zeros(1 << 16), outer_rule(cfg))
    parts = [Contribution(island=i, version=0, delta=np.ones(1 << 16, np.float32), weight=1.0) for i in range(islands)]
    outer.commit(outer.propose(parts), Commit(weights={c.island: c.weight for c in parts}))


def probe(numel: int, islands: int, rounds: int) -> dict[str, Any]:
    """One slice of `numel` parameters, in this (fresh) process: see the module's docstring."""
    import numpy as np
    import torch

    from archipelago.orchestrator.bench.datapath_probes import memcpy_gbps
    from archipelago.orchestrator.config_load import load_config
    from archipelago.orchestrator.engine.policies import build_policies
    from archipelago.orchestrator.engine.step.outer import Commit, LocalOuter
    from archipelago.orchestrator.engine.step.rules import outer_rule
    from archipelago.orchestrator.engine.threads import usable_cores
    from archipelago.orchestrator.engine.types import Contribution

    torch.set_num_threads(usable_cores())  # a barrier's step: the islands wait, the node's cores step
    cfg = load_config(None, ["mode=diloco", f"islands.count={islands}", "warm_start.steps=0"])
    base = np.random.default_rng(0).random(numel, dtype=np.float32)
    arriving = [base * np.float32((i + 1) * 1e-3) for i in range(islands)]
    del base
    memcpy = memcpy_gbps(numel, 5)
    _warm_up(cfg, islands)
    _reset_peak()
    before = _status_kb("VmRSS") * 1024
    flat = torch.zeros(numel)
    outer = LocalOuter(flat, outer_rule(cfg))
    admission = build_policies(cfg, numel).admission
    times = []
    for version in range(rounds + 1):  # the first builds the momentum and the mean buffer
        contributions = [Contribution(island=i, version=version, delta=d, weight=1.0) for i, d in enumerate(arriving)]
        t0 = time.perf_counter()
        proposal = outer.propose(contributions)
        verdicts = [admission.judge(c, f, version, version) for c, f in zip(contributions, proposal.facts)]
        outer.commit(
            proposal, Commit(weights={c.island: c.weight for c, v in zip(contributions, verdicts) if v.admitted})
        )
        if version:
            times.append(time.perf_counter() - t0)
    peak = _status_kb("VmHWM") * 1024 - before
    del arriving, contributions
    outer.copy_to(flat)
    state_bytes, checkpoint_s, checkpoint_extra = _checkpoint(flat, outer)
    seconds = statistics.median(times)
    return {
        "numel": numel,
        "seconds": seconds,
        "gbps": islands * 4 * numel / seconds / 1e9,
        "memcpy_gbps": memcpy,
        "peak_bytes": peak,
        "state_bytes": state_bytes,
        "checkpoint_seconds": checkpoint_s,
        "checkpoint_peak_bytes": state_bytes + checkpoint_extra,
        "threads": torch.get_num_threads(),
    }


def _checkpoint(flat: Any, outer: Any) -> tuple[int, float, int]:
    """The outer state's bytes (parameters and optimizer state), the seconds to write it
    as a checkpoint, and the memory writing it added to the peak."""
    import torch

    from archipelago.orchestrator.engine.state.checkpoints import save_checkpoint

    state = {"run_id": "bench", "params": flat, "outer": outer.state_dict()}
    state_bytes = sum(
        t.untyped_storage().nbytes()
        for t in [flat, *[v for s in outer.state_dict()["optimizer"]["state"].values() for v in s.values()]]
        if isinstance(t, torch.Tensor) and t.numel() > 1
    )
    holding = _status_kb("VmRSS") * 1024
    _reset_peak()
    with tempfile.TemporaryDirectory(dir=os.environ.get("ARCHIPELAGO_BENCH_TMP")) as folder:
        t0 = time.perf_counter()
        save_checkpoint(folder, state)
        seconds = time.perf_counter() - t0
    return state_bytes, seconds, max(0, _status_kb("VmHWM") * 1024 - holding)


def _fits(numel: int, islands: int) -> bool:
    """Whether one slice of `numel` fits this machine: the arriving pseudo-gradients, the
    parameters, momentum and the mean buffer, and a margin."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (islands + 3.5) * 4 * numel + 2**30 < 0.8 * memory


def _run_probe(numel: int) -> dict[str, Any]:
    return run_fresh("archipelago.orchestrator.bench.coordinator", str(numel), str(ISLANDS), str(ROUNDS))


def _fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares line of a slice's seconds per round on the parameters it steps (N / S),
    from 10 M up: every row whose share is that large is a point (a line through two points
    would fit by construction, so fewer than three is no fit)."""
    pts = [(r["params"] / r["slices"], r["seconds_per_round"]) for r in rows if r["params"] / r["slices"] >= 10_000_000]
    if len(pts) < 3:
        return {}
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    intercept = my - slope * mx
    worst = max(abs(intercept + slope * x - y) / y for x, y in pts)
    return {
        "seconds_per_million_params": slope * 1e6,
        "intercept_seconds": intercept,
        "max_relative_residual": worst,
        "points": n,
    }


def measure_rows(sizes: tuple[int, ...]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every (size, S) of `sizes` x `SLICES` that fits this machine, each in a fresh process;
    and the ones that do not fit."""
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for params in sizes:
        for s in SLICES:
            share = -(-params // s)
            if not _fits(share, ISLANDS):
                skipped.append(f"{params / 1e6:,.0f} M at S = {s}")
                continue
            got = _run_probe(share)
            rows.append(
                {
                    "params": params,
                    "slices": s,
                    "seconds_per_round": got["seconds"],
                    "gbps": ISLANDS * 4 * params / got["seconds"] / 1e9,
                    "memcpy_gbps": got["memcpy_gbps"],
                    "vs_memcpy": got["gbps"] / got["memcpy_gbps"],
                    "peak_mb": got["peak_bytes"] / MB,
                    "peak_bound_mb": 4.5 * 4 * params / s / MB,
                    "checkpoint_seconds": got["checkpoint_seconds"],
                    "checkpoint_peak_mb": got["checkpoint_peak_bytes"] / MB,
                    "state_mb": got["state_bytes"] / MB,
                    "threads": got["threads"],
                }
            )
    return rows, skipped


def _checks(rows: list[dict[str, Any]], fit: dict[str, float]) -> dict[str, dict[str, Any]]:
    s1 = [r for r in rows if r["slices"] == 1]
    return {
        "linear_from_10m": {
            "target": "seconds per round linear in the parameters a slice steps, from 10 M up (fit's max residual <= 15 %)",
            "measured": fit.get("max_relative_residual"),
            "met": bool(fit) and fit["max_relative_residual"] <= 0.15,
        },
        "memcpy_at_s1": {
            "target": "coordinator >= 0.7x memcpy at every size, S = 1",
            "measured": min((r["vs_memcpy"] for r in s1), default=None),
            "met": bool(s1) and all(r["vs_memcpy"] >= 0.7 for r in s1),
        },
        "peak_per_slice": {
            "target": "peak per slice <= 4.5 x 4 bytes x parameters / S",
            "measured": max((r["peak_mb"] / r["peak_bound_mb"] for r in rows), default=None),
            "met": all(r["peak_mb"] <= r["peak_bound_mb"] for r in rows),
        },
        "checkpoint_peak": {
            "target": "checkpoint peak <= 1.2 x the state",
            "measured": max((r["checkpoint_peak_mb"] / r["state_mb"] for r in rows), default=None),
            "met": all(r["checkpoint_peak_mb"] <= 1.2 * r["state_mb"] for r in rows),
        },
    }


def _markdown(
    rows: list[dict[str, Any]], fit: dict[str, float], skipped: list[str], checks: dict[str, dict[str, Any]]
) -> str:
    table = md_table(
        ["params", "S", "s / round", "GB/s", "x memcpy", "peak / slice", "bound", "checkpoint", "ckpt peak / state"],
        [
            [
                f"{r['params'] / 1e6:,.0f} M",
                str(r["slices"]),
                f"{r['seconds_per_round']:.4f}",
                f"{r['gbps']:.2f}",
                f"{r['vs_memcpy']:.2f}",
                f"{r['peak_mb']:,.0f} MB",
                f"{r['peak_bound_mb']:,.0f} MB",
                f"{r['checkpoint_seconds']:.2f} s",
                f"{r['checkpoint_peak_mb'] / r['state_mb']:.3f}",
            ]
            for r in rows
        ],
    )
    checks_md = md_table(
        ["check", "measured", "met"],
        [
            [c["target"], f"{c['measured']:.3f}" if isinstance(c["measured"], float) else "-", str(c["met"])]
            for c in checks.values()
        ],
    )
    stops = (
        f"Not run (one slice's pseudo-gradients, parameters, momentum and mean would not fit this machine's "
        f"memory): {', '.join(skipped)}."
        if skipped
        else "Every size ran."
    )
    fit_line = (
        f"Fit of a slice's seconds per round on the parameters it steps (N / S), the {fit.get('points', 0)} rows "
        f"from 10 M up: {fit['seconds_per_million_params'] * 1e3:.3f} ms per million parameters "
        f"{fit['intercept_seconds'] * 1e3:+.2f} ms, max residual {100 * fit['max_relative_residual']:.1f} %."
        if fit
        else "Too few sizes for a fit."
    )
    return (
        f"{ISLANDS} pseudo-gradients a round into the production outer step (Nesterov: the mean with the norms in one pass, the step in place), one slice of N / S "
        "per fresh process; a round with S slices takes one slice's time (each slice on its own node: measured one "
        "at a time on this 2-core machine). GB/s counts the pseudo-gradients' bytes read; memcpy is the same "
        "process's copy of one slice's vector. Peak per slice: parameters, momentum, the mean buffer and the "
        "step's temporaries, not the arriving pseudo-gradients. Checkpoint peak: the state plus what writing it "
        f"added.\n\n{table}\n\n{fit_line} {stops}\n\n{checks_md}"
    )


def coordinator(quick: bool, work: Path) -> BenchResult:
    rows, skipped = measure_rows(SIZES[:3] if quick else SIZES)
    fit = _fit(rows)
    checks = _checks(rows, fit)
    panels = [
        Panel(
            x_label="parameters",
            y_label="seconds per round",
            curves={
                f"S = {s}": [(r["params"], r["seconds_per_round"]) for r in rows if r["slices"] == s] for s in SLICES
            },
            log_x=True,
        )
    ]
    met = sum(c["met"] for c in checks.values())
    return BenchResult(
        scenario="coordinator",
        quick=quick,
        methods={f"{r['params']}_s{r['slices']}": r for r in rows},
        summary=f"coordinator: {len(rows)} rows to {max(r['params'] for r in rows) / 1e6:,.0f} M parameters, "
        f"{met}/{len(checks)} checks met",
        markdown=_markdown(rows, fit, skipped, checks),
        panels=panels,
        extra={"rows": rows, "fit": fit, "checks": checks, "not_run": skipped, "islands": ISLANDS},
    )


if __name__ == "__main__":
    numel, islands, rounds = (int(a) for a in sys.argv[1:4])
    sys.stdout.write(json.dumps(probe(numel, islands, rounds)) + "\n")
