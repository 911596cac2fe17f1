"""`startup`: from the command to the first inner step (and to the first outer step), as a
user meets it: each row is `python -m archipelago.orchestrator.cli run` in a fresh process (its
imports counted), with its own private Ray (cold) or joining a Ray already running
(`ray start --head`, warm), for the default config and for k = 1, 2, 4, 8 islands (none
serves the control plane: `api.enabled` is off by default, and its start is measured
apart, in `docs/findings/startup.md`).

Where the seconds go comes from the run's own `summary.json` (`startup`): the command
before Ray (interpreter, imports, config, data cache), Ray's start, the coordinator
actor, the islands' placement and start (the slowest island's task, model and speed
probe), the evaluation before the first dispatch, and dispatch to the first step; for the
default config also the warm start's fork (the main phase renewing the warm start's
islands in their processes).
Nothing is reused between rows: every row is a new run; the default config's rows, which
the checks read, are each the median of 3 runs (a run varies by about a second).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.report import BenchResult, Panel, checks_table, md_table, targets_met

REPO = Path(__file__).resolve().parents[2]  # the checkout the runs import
# first inner step within 8 s of the command with its own Ray, 5 s joining a running one
# (torchft spawns and forms a quorum in about 5 s)
TARGET_S = {"cold": 8.0, "warm": 5.0}
COUNTS = (1, 2, 4, 8)
REPEATS = 3  # the default config's rows (the checks): the median of 3 fresh runs, each one shown
# the default config, cut to what reaching the first outer step needs (its start-up does
# not depend on how long it trains): a 2-step warm start still forks, 1 round of 5 steps
DEFAULT = ["warm_start.steps=2", "rounds=1", "inner_steps=5"]  # as shipped: `api.enabled` is off by default
PARTS = (
    ("before Ray", ("command", "before_ray_s")),
    ("Ray start", ("command", "ray_s")),
    ("coordinator", ("command", "coordinator_s")),
    ("islands joined", ("islands_joined_s",)),
    ("  island task", ("island_task_s",)),
    ("  island model", ("island_model_s",)),
    ("  island probe", ("island_probe_s",)),
    ("first eval", ("first_eval_s",)),
    ("dispatch to step", ("dispatch_to_first_step_s",)),
    ("fork (islands renewed)", ("fork", "engine_to_first_step_s")),
)


def _row(name: str, sets: list[str], work: Path, address: str | None) -> dict[str, Any]:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address:
        env["RAY_ADDRESS"] = address
    args = [sys.executable, "-m", "archipelago.orchestrator.cli", "-q", "run", "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"startup row {name} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "startup_seconds": summary["startup_seconds"],
        "first_outer_step_seconds": summary["first_outer_step_seconds"],
        "startup": summary["startup"],
        "overrides": sets,
        "ray": "running" if address else "started by the command",
    }


def _median_row(name: str, sets: list[str], work: Path, address: str | None, repeats: int) -> dict[str, Any]:
    """The run with the median start-up of `repeats` fresh runs (a single run of the same
    config varies by about a second on 2 cores), with every run's figures beside it."""
    runs = sorted(
        (_row(f"{name}_{i}", sets, work, address) for i in range(repeats)), key=lambda r: r["startup_seconds"]
    )
    return {
        **runs[len(runs) // 2],
        "startup_seconds_runs": [r["startup_seconds"] for r in runs],
        "first_outer_step_seconds_runs": [r["first_outer_step_seconds"] for r in runs],
    }


def _part(row: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = row["startup"]
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _start_head(cpus: int) -> str:
    """A running Ray, as a cluster's head is; its workers import this checkout (they inherit
    the head's environment, as a node's do from its image)."""
    subprocess.run(["ray", "stop", "--force"], capture_output=True, check=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    started = subprocess.run(
        ["ray", "start", "--head", f"--num-cpus={cpus}", "--include-dashboard=false", "--disable-usage-stats"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if started.returncode != 0:
        raise RuntimeError(f"ray start --head failed: {started.stderr[-2000:]}")
    return "auto"


def startup(quick: bool, work: Path) -> BenchResult:
    counts = (1, 4) if quick else COUNTS
    rows = {
        f"k{k}": [f"islands.count={k}", "warm_start.steps=0", "rounds=1", "inner_steps=5", "api.enabled=false"]
        for k in counts
    }
    rows = {"default": DEFAULT, **rows}
    results: dict[str, dict[str, Any]] = {}
    repeats = 1 if quick else REPEATS
    for name, sets in rows.items():
        results[f"{name}_cold"] = _median_row(f"{name}_cold", sets, work, None, repeats if name == "default" else 1)
    address = _start_head(max(counts))
    try:
        for name, sets in rows.items():
            n = repeats if name == "default" else 1
            results[f"{name}_warm"] = _median_row(f"{name}_warm", sets, work, address, n)
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, check=False)
    checks = {
        f"default_{ray}_first_inner_step_within_{TARGET_S[ray]:.0f}s": {
            "value": results[f"default_{ray}"]["startup_seconds"],
            "target": TARGET_S[ray],
            "ok": results[f"default_{ray}"]["startup_seconds"] <= TARGET_S[ray],
        }
        for ray in ("cold", "warm")
    }
    curves = {
        f"{ray} Ray: {what}": [(float(k), results[f"k{k}_{ray}"][key]) for k in counts]
        for ray in ("cold", "warm")
        for what, key in (("first inner step", "startup_seconds"), ("first outer step", "first_outer_step_seconds"))
    }
    head = results["default_cold"]
    line = (
        f"startup: default config {head['startup_seconds']:.1f}s to the first inner step, "
        f"{head['first_outer_step_seconds']:.1f}s to the first outer step (its own Ray); "
        f"{results['default_warm']['startup_seconds']:.1f}s with Ray running; {targets_met(checks)}"
    )
    return BenchResult(
        "startup",
        quick,
        results,
        line,
        _markdown(results, checks),
        [
            Panel(
                "islands k",
                curves,
                y_label="seconds from the command",
                references={f"target, {r} Ray": t for r, t in TARGET_S.items()},
            )
        ],
        extra={"checks": checks, "target_seconds": TARGET_S},
    )


def _markdown(results: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]]) -> str:
    def cell(v: float | None) -> str:
        return "–" if v is None else f"{v:.1f}"

    names = list(results)

    def runs(row: dict[str, Any]) -> str:
        each = row["startup_seconds_runs"]
        return "–" if len(each) < 2 else ", ".join(f"{v:.1f}" for v in each)

    totals = md_table(
        ["run", "Ray", "first inner step (s)", "first outer step (s)", "first inner step, each run (s)"],
        [
            [n.rsplit("_", 1)[0], results[n]["ray"], cell(results[n]["startup_seconds"]),
             cell(results[n]["first_outer_step_seconds"]), runs(results[n])]
            for n in names
        ],
    )  # fmt: skip
    parts = md_table(
        ["part (s)", *names], [[label, *(cell(_part(results[n], p)) for n in names)] for label, p in PARTS]
    )
    return (
        f"Command to first inner step on an idle machine, target ≤ {TARGET_S['cold']:.0f} s with the "
        f"command's own Ray and ≤ {TARGET_S['warm']:.0f} s with Ray running.\n\n{totals}\n\n"
        f"The default config's rows are each the median of "
        f"{len(results['default_cold']['startup_seconds_runs'])} fresh runs.\n\n"
        f"Where it goes (island parts: the slowest island's; the islands' processes start beside the "
        f"coordinator's, so their start is inside the coordinator's part, and `islands joined` counts "
        f"from the engine's creation; the fork: the main phase's engine to its first step, after the "
        f"warm start):\n\n{parts}\n\n{checks_table(checks)}"
    )
