"""The simulator calibrated on the testbed: each row `bench testbed` measured on real shaped
links, run again on the virtual clock (the in-process pool: the product's engine, policies
and islands, really training, time simulated) with what the testbed measured and nothing
else — its step seconds, each island's link rate, the head's card at `ISLANDS` times it,
its four islands and one head — and the simulated time to the same target set beside the
measured one (`simulated / measured`, which should fall in `TOLERANCE`).

What the simulated run prices (`simulation/network.py`): every transfer over its island's
link and the head's card, the head's step at the rates measured on a CPU head, data-
parallel's bucketed all-reduce overlapped with backward (ring or tree). What it does not:
Ray's calls and object transfers beyond their bytes, evaluation (off the head in a
simulation; the testbed's coordinator evaluates every round on its own CPU), the
processes' start. Where a ratio misses, those are the first suspects, and the model, not
the testbed, is what to fix.

Rows. DiLoCo, Streaming DiLoCo int4 and the shipped async default as the testbed runs
them; data-parallel is the simulator's `mode: ddp` with the testbed's 600 steps of the
same schedule, recorded every `H // 2` steps as the testbed's reference run evaluates;
`ddp_bf16` is the bf16 codec (the testbed's gloo runs torch's fp16 hook: the same bytes);
PowerSGD has no simulated counterpart (its low-rank factors and error feedback are not
modelled): its ratio is null, with the reason.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.report import (
    eval_curve,
    machine_info,
    md_table,
    measured_commit,
    seconds_or_unreached,
)
from archipelago.orchestrator.bench.runner import finished, fresh, record_simulation
from archipelago.orchestrator.bench.simulation.config import SimulationConfig
from archipelago.orchestrator.bench.simulation.links import LinkConfig
from archipelago.orchestrator.bench.simulation.pool import InProcessPool
from archipelago.orchestrator.bench.testbed_workload import ARCHIPELAGO, ISLANDS, LR, ROUNDS, H
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.build import build_engine
from archipelago.orchestrator.engine.commands import Stop
from archipelago.orchestrator.engine.state.views import RoundRecord

log = logging.getLogger(__name__)

TOLERANCE = (0.8, 1.25)  # simulated / measured time to target
SIMULATED_AT = "simulated-at"  # beside a simulated run: the commit that ran it
UNSIMULATED = {"ddp_powersgd": "the simulator has no PowerSGD (its low-rank factors and error feedback)"}
DDP_CODECS = {"ddp_fp32": "none", "ddp_bf16": "bf16"}  # the testbed's fp16 hook: bf16's bytes


class UnknownRow(ValueError):
    """A testbed row the calibration has no simulated run for."""


def settings(row: str, seed: int) -> list[str]:
    """The simulated run of testbed row `row`: the testbed's workload and the row's mode;
    data-parallel's same 600 steps of one schedule recorded (evaluated) every H // 2 steps,
    as the testbed's reference run evaluates."""
    common = [f"islands.count={ISLANDS}", f"seed={seed}", f"inner.lr={LR}", "warm_start.steps=0"]
    if row in ARCHIPELAGO:
        return [*common, f"inner_steps={H}", f"rounds={ROUNDS}", *(a.removeprefix("--set=") for a in ARCHIPELAGO[row])]
    if row not in DDP_CODECS:
        raise UnknownRow(f"testbed row {row!r} has no simulated run (known: {[*ARCHIPELAGO, *DDP_CODECS]})")
    ddp = ["mode=ddp", f"inner_steps={H // 2}", f"rounds={ROUNDS * 2}", f"compression.codec={DDP_CODECS[row]}"]
    return [*common, *ddp]


def fleet_of(island_mbit: float, step_s: float) -> SimulationConfig:
    """The testbed's machines as a simulated fleet: islands at `step_s` a step, each on a
    link of `island_mbit` both ways (no delay: the testbed has none), the head's card at
    `ISLANDS` times it, the head's step priced, DDP's all-reduce overlapped."""
    return SimulationConfig(
        virtual_step_s=step_s,
        link=LinkConfig(bandwidth_gbps=island_mbit / 1e3, latency_ms=0.0),
        head_gbps=ISLANDS * island_mbit / 1e3,
        price_head=True,
        ddp_overlap=True,
    )


def first_at_or_below(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first record's time whose eval loss is at or below `target` (not the initial
    evaluation's), as the testbed times its rows: not interpolated between records."""
    return next((t for t, loss in curve[1:] if loss <= target), None)


def simulate(row: str, island_mbit: float, step_s: float, target: float, work: Path, seed: int = 0) -> float | None:
    """Simulated seconds for testbed row `row` to reach eval loss `target` at `island_mbit`
    (None: not within the budget); the run stops at its first record at or below it, as the
    testbed's does (a run of the same config in `work` that finished or was so stopped is
    reused)."""
    out = work / f"{row}-{island_mbit:g}mbit-s{seed}"
    cfg = load_config(None, [*settings(row, seed), f"out_dir={out}"])
    sim = fleet_of(island_mbit, step_s)
    summary = finished(cfg, sim, ended=("finished", "stopped"))
    if summary is None:
        fresh(cfg, sim)
        record_simulation(cfg, sim)
        (out / SIMULATED_AT).write_text(str(measured_commit()["commit"]))
        engine = None

        def stop_at_target(_status: Any, _islands: Any, entry: RoundRecord) -> None:
            loss = entry.eval_loss
            if engine is not None and loss is not None and loss <= target:
                engine.submit(Stop(now=True))

        engine = build_engine(cfg, InProcessPool(cfg, sim), "calibration", on_record=stop_at_target)
        summary = engine.execute()
    return first_at_or_below(eval_curve(out, summary, "clock_seconds"), target)


def simulated_at(row: str, island_mbit: float, work: Path, seed: int = 0) -> str:
    """The commit that simulated `row`'s run in `work` (a run kept from before runs named
    theirs: "unstamped")."""
    stamp = work / f"{row}-{island_mbit:g}mbit-s{seed}" / SIMULATED_AT
    return stamp.read_text().strip() if stamp.exists() else "unstamped"


def judge(measured: float | None, simulated: float | None) -> dict[str, Any]:
    """One row's calibration: simulated ÷ measured against `TOLERANCE`; null, with the
    reason, where either side never reached the target."""
    if measured is None or simulated is None:
        side = "the testbed's run" if measured is None else "the simulated run"
        why = f"{side} did not reach the target within its budget"
        return {"measured_s": measured, "simulated_s": simulated, "ratio": None, "ok": None, "why": why}
    ratio = simulated / measured
    return {
        "measured_s": measured,
        "simulated_s": simulated,
        "ratio": ratio,
        "ok": TOLERANCE[0] <= ratio <= TOLERANCE[1],
    }


def calibrate(regimes: dict[str, dict[str, Any]], step_s: float, target: float, work: Path) -> dict[str, Any]:
    """Per regime and row: the testbed's measured seconds to `target`, the simulator's (the
    mean over the seeds the testbed measured), and their ratio against `TOLERANCE`
    (`regimes` as `bench testbed` reports them)."""
    out: dict[str, Any] = {}
    for name, regime in regimes.items():
        mbit = float(regime["island_mbit"])
        rows: dict[str, Any] = {}
        for row, measured in regime["rows"].items():
            real = measured["seconds_to_target"]
            if row in UNSIMULATED:
                rows[row] = {
                    "measured_s": real,
                    "simulated_s": None,
                    "ratio": None,
                    "ok": None,
                    "why": UNSIMULATED[row],
                }
                continue
            seeds = sorted(int(s) for s in measured["seeds"])
            times = [simulate(row, mbit, step_s, target, work / name, seed) for seed in seeds]
            simulated = None if None in times else sum(t for t in times if t is not None) / len(times)
            rows[row] = {
                **judge(real, simulated),
                "simulated_at": [simulated_at(row, mbit, work / name, s) for s in seeds],
            }
            log.info("calibration %s %s: measured %s s, simulated %s s", name, row, real, simulated)
        out[name] = rows
    return {"tolerance": list(TOLERANCE), "regimes": out}


def calibration_table(calibration: dict[str, Any]) -> str:
    """The calibration as a markdown table: a row per regime and testbed row."""
    lo, hi = calibration["tolerance"]
    rows = [
        [
            regime,
            row,
            seconds_or_unreached(c["measured_s"]),
            "not simulated" if row in UNSIMULATED else seconds_or_unreached(c["simulated_s"]),
            "-" if c["ratio"] is None else f"{c['ratio']:.2f}",
            c.get("why") or ("yes" if c["ok"] else "no"),
        ]
        for regime, at in calibration["regimes"].items()
        for row, c in at.items()
    ]
    return md_table(["regime", "row", "measured s", "simulated s", "simulated / measured", f"in {lo}-{hi}"], rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m archipelago.orchestrator.bench.testbed_calibration REPORT WORK`: the
    calibration of a published `testbed.json` (its rows are not measured again), written
    into its `calibration` with the commit that simulated it beside the one that measured."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("report", type=Path, help="a testbed.json (docs/testbed.json)")
    parser.add_argument("work", type=Path, help="the simulated runs' folder (a rerun reuses finished ones)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = json.loads(args.report.read_text())
    result = calibrate(report["regimes"], float(report["step_s"]), float(report["target"]), args.work)
    result["simulated_at"] = machine_info()
    result["measured_at_commit"] = report["machine"]["commit"]
    report["calibration"] = result
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    markdown = args.report.with_suffix(".md")
    if markdown.exists():
        section = f"{CALIBRATION_HEADING}\n\n{describe(result)}\n\n{calibration_table(result)}\n"
        markdown.write_text(with_section(markdown.read_text(), section))
    sys.stdout.write(calibration_table(result) + "\n")
    return 0


CALIBRATION_HEADING = "### The simulator calibrated on these rows"


def with_section(page: str, section: str) -> str:
    """`page` with its calibration section replaced by `section` (or `section` added after
    its last section): what follows the old one — the next heading, the plot — is kept."""
    before, found, after = page.partition(CALIBRATION_HEADING)
    if not found:
        head, image, tail = page.rpartition("\n![")
        return f"{head.rstrip()}\n\n{section}\n![{tail}" if image else f"{page.rstrip()}\n\n{section}"
    lines = after.split("\n")
    rest = next((i for i, line in enumerate(lines[1:], 1) if line.startswith(("### ", "## ", "!["))), len(lines))
    return f"{before}{section}\n" + "\n".join(lines[rest:])


def describe(calibration: dict[str, Any]) -> str:
    """What the calibration is, and where its two halves were measured."""
    at = calibration["simulated_at"]
    return (
        f"Each row run again on the virtual clock with what the testbed measured (its step, link rates, four islands "
        f"and one head), at commit {at['commit']} ({at['date']}); the rows were measured at "
        f"{calibration['measured_at_commit']}. `orchestrator/bench/testbed_calibration.py` says what is priced."
    )


if __name__ == "__main__":
    raise SystemExit(main())
