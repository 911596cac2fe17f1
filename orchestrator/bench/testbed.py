"""`testbed`: wall-clock time to a target eval loss on real shaped links — archipelago's
rows against torch DDP with the hooks its users switch on — on the WAN testbed
(`netlab*.py`): a head machine and `ISLANDS` island machines, each a network namespace
with a tbf-shaped link (no delay or loss: `netem` does not work on this kind of host).

Regimes. A regime is an exchange-to-compute ratio: the seconds one fp32 copy of the
model takes over an island's link ÷ the seconds of one inner step. For a 1 B-parameter
model (32 Gbit in fp32) with a 1-s step that is 32 at 1 Gbit/s, 3.2 at 10 and 0.32 at
100 (`RATIOS`). Here the model is the default task's GPT (its parameters P) and the step
its measured seconds S with `ISLANDS` islands sharing this machine's cores, so an
island's link runs at 32·P / (ratio · S) bit/s. The head's card carries every island's
transfer: it runs at `ISLANDS` × that (its busy share is reported), so the head is not
the bottleneck by construction of the rates, only by what crosses it.

Rows (the same task, data shards, inner AdamW and schedule, lr, batch per island):
- `ddp_fp32`, `ddp_bf16`, `ddp_powersgd`: torch DDP over gloo across the island machines
  (no hook; `fp16_compress_hook`, since gloo refuses bf16's; `powerSGD_hook` rank
  `POWERSGD_RANK`). DDP's arithmetic does not depend on the link: its steps to the target
  are counted once, in a full run at the fastest regime, and its seconds per step are
  measured on each regime's links over `DDP_TIMED_STEPS` steps (after `DDP_WARM_STEPS`);
  its time to target is their product (`method` in the report says so).
- `diloco`, `streaming_int4`, `async` (the shipped async default): `archipelago run` on
  the head with its Ray cluster on the machines, run in full on every regime; the time to
  target is the wall-clock seconds of the first round record at or below the target.

Every row's time starts with the parameters' first distribution on the row's links —
archipelago's islands' first download, DDP's rendezvous and rank 0's broadcast — and leaves
out the processes' own start (Ray's nodes and driver; torch's import), reported apart.
Per row: the bytes that crossed each card (the kernel's counters) beside the payload the
row counted, and the head card's busy share (bytes through it ÷ its rate × the row's time).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.ddp_baseline import Hook
from archipelago.orchestrator.bench.netlab_cluster import Role, in_machine
from archipelago.orchestrator.bench.netlab_scenario import Link, MachineSpec, Scenario, Testbed, keep, kept
from archipelago.orchestrator.bench.report import BenchResult, Panel, md_table, seconds_or_unreached
from archipelago.orchestrator.bench.testbed_calibration import CALIBRATION_HEADING, calibrate, calibration_table
from archipelago.orchestrator.bench.testbed_faults import cases, run_case
from archipelago.orchestrator.bench.testbed_workload import (
    ARCHIPELAGO,
    DDP_STEPS,
    ISLANDS,
    LR,
    POWERSGD_RANK,
    POWERSGD_START,
    ROUNDS,
    ROWS,
    TARGET,
    H,
)

log = logging.getLogger(__name__)

RATIOS = {"1gbps": 32.0, "10gbps": 3.2, "100gbps": 0.32}  # 1 B params in fp32 over the link ÷ a 1-s step
# the timing runs: an all-reduce at 1 Gbit/s-equivalent takes minutes (a step is its bytes
# over the link), so one warm step and one timed; PowerSGD's from its earliest start (torch
# wants 2 plain steps first), its plain steps timed in the same run
DDP_WARM_STEPS, DDP_TIMED_STEPS = 1, 1
TIMED_POWERSGD_START = 2
# Ray's object manager re-requests a pull every 10 s by default and the sender pushes the
# object again: at 2.5 Mbit/s a 29-MB object took ~4x its bytes and its round missed its
# deadline (measured, docs/wan-testbed.md); the testbed's head sets what a slow link needs.
SYSTEM_CONFIG = {"object_manager_pull_timeout_ms": 300_000}
UNSTAMPED = "unstamped"  # a run kept before runs named the commit that measured them
DDP_ROWS = {"ddp_fp32": Hook.FP32, "ddp_bf16": Hook.FP16, "ddp_powersgd": Hook.POWERSGD}
HOOKS = {Hook.FP32: "none", Hook.FP16: "fp16_compress_hook", Hook.POWERSGD: "powerSGD_hook"}


def scenario(island_mbit: float, ray: bool) -> Scenario:
    link = Link(up_mbit=island_mbit, down_mbit=island_mbit)
    head = Link(up_mbit=island_mbit * ISLANDS, down_mbit=island_mbit * ISLANDS)
    machines = [MachineSpec(name=f"island{i}", role=Role.ISLAND, cpus=1, link=link) for i in range(ISLANDS)]
    return Scenario(head=head, machines=machines, system_config=SYSTEM_CONFIG if ray else {})


def run_archipelago(row: str, island_mbit: float, seed: int, work: Path) -> dict[str, Any]:
    """One archipelago row on the testbed at `island_mbit`."""
    out = work / f"{row}-{island_mbit:g}mbit-s{seed}"
    if (earlier := kept(out)) is not None:
        return earlier
    out.mkdir(parents=True, exist_ok=True)
    with Testbed(scenario(island_mbit, ray=True), out / "logs") as bed:
        argv = bed.archipelago_run(
            out / "run",
            f"--set=islands.count={ISLANDS}",
            f"--set=inner_steps={H}",
            f"--set=rounds={ROUNDS}",
            f"--set=seed={seed}",
            f"--set=inner.lr={LR}",
            "--set=warm_start.steps=0",
            *ARCHIPELAGO[row],
        )
        metrics = out / "run" / "metrics.jsonl"
        report = bed.run(argv, out / "run.log", metrics, timeout_s=3600, enough=lambda: _reached(metrics))
    summary = json.loads((out / "run" / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    curve = [(r["wall_seconds"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    reached = next((t for t, loss in curve if loss <= TARGET), None)
    # an island's seconds per inner step, from the rounds' own records (each island beside the
    # others): the last record's compute (cumulative) over every round's steps
    compute = sum(records[-1].get("island_compute_seconds", {}).values()) if records else 0.0
    steps = sum(sum(r["inner_steps"].values()) for r in records)
    return keep(
        out,
        {
            "rc": report["rc"],
            "seconds_to_target": reached,
            "seconds": summary["wall_seconds"],
            "run_seconds": report["seconds"],  # the command's, Ray's driver start included: the cards' window
            "startup_s": summary.get("startup_seconds"),
            "curve": curve,
            "card_bytes": report["card_bytes"],
            "payload_bytes": summary["bytes_communicated"],
            "final_eval_loss": summary["final_eval_loss"],
            "step_s": compute / steps if steps else None,
            "faults": report["faults"],
        },
    )


def _reached(metrics: Path) -> bool:
    """Whether a round record of the run is at or below the target (then it is stopped)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            loss = json.loads(line).get("eval_loss")
        except ValueError:  # a line being written
            continue
        if loss is not None and loss <= TARGET:
            return True
    return False


def run_ddp(
    hook: Hook, island_mbit: float, seed: int, steps: int, work: Path, to_target: bool, powersgd_start: int
) -> dict[str, Any]:
    """DDP with `hook` over the island machines at `island_mbit` (no Ray on them)."""
    out = work / f"ddp_{hook.value}-{island_mbit:g}mbit-s{seed}-{steps}"
    if (earlier := kept(out)) is not None:
        return earlier
    out.mkdir(parents=True, exist_ok=True)
    with Testbed(scenario(island_mbit, ray=False), out / "logs") as bed:
        assert bed.net is not None
        machines = [bed.net.machines[f"island{i}"] for i in range(ISLANDS)]
        before, t0 = bed.cards(), time.monotonic()
        procs = []
        for rank, m in enumerate(machines):
            argv = [
                sys.executable,
                "-m",
                "archipelago.orchestrator.bench.ddp_baseline",
                f"--rank={rank}",
                f"--world={ISLANDS}",
                f"--master={machines[0].address}",
                f"--hook={hook.value}",
                f"--powersgd-rank={POWERSGD_RANK}",
                f"--powersgd-start={powersgd_start}",
                f"--steps={steps}",
                f"--lr={LR}",
                f"--seed={seed}",
                f"--eval-every={H // 2 if to_target else steps}",
                f"--target={TARGET}",
                f"--out={out / 'rank0.json'}",
                *(["--stop-at-target"] if to_target else []),
            ]
            with (out / f"rank{rank}.log").open("wb") as log_file:
                env = os.environ | {"GLOO_SOCKET_IFNAME": m.inner}
                procs.append(subprocess.Popen(in_machine(m, argv), stdout=log_file, stderr=subprocess.STDOUT, env=env))
        codes = _wait_all(procs)
        seconds = time.monotonic() - t0
        after = bed.cards()
    if any(codes):
        raise TestbedRunFailed(f"DDP {hook.value} at {island_mbit:g} Mbit/s ended {codes}; see {out}")
    result = json.loads((out / "rank0.json").read_text())
    result["card_bytes"] = {k: vars(after[k] - before[k]) for k in after}
    result["wall_s"] = seconds
    return keep(out, result)


class TestbedRunFailed(RuntimeError):
    """A row's processes failed on the testbed: the report cannot be made without it."""


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 7200) -> list[int]:
    """Every rank's exit status; one that fails ends the others (blocked in a collective
    with it, they would wait for good)."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


def _params() -> int:
    """The default task's GPT's parameters (built from its config, as every row's)."""
    from archipelago.workers.tasks.task import load_task

    model = load_task("archipelago.workers.tasks.lm_task:make_task", {}).build_model()
    return sum(p.numel() for p in model.parameters())


def island_rates(params: int, step_s: float) -> dict[str, float]:
    """Each regime's island link in Mbit/s: one fp32 copy over it takes `ratio` steps."""
    return {name: params * 32 / (ratio * step_s) / 1e6 for name, ratio in RATIOS.items()}


def testbed(quick: bool, work: Path) -> BenchResult:
    seeds = (0,) if quick else (0, 1)
    work.mkdir(parents=True, exist_ok=True)
    # the step time S: the DiLoCo row on a fast link (its compute per step, every island beside the others)
    probe = run_archipelago("diloco", 1000.0, 0, work / "probe")
    step_s = float(probe["step_s"])
    fastest = min(RATIOS, key=lambda k: RATIOS[k])
    reference = {}
    for hook in Hook:  # steps to the target: at the fastest regime's links (the step count is the link's to none)
        mbit = island_rates(_params(), step_s)[fastest]
        reference[hook] = run_ddp(hook, mbit, 0, DDP_STEPS, work / "ddp-reference", True, POWERSGD_START)
    params = int(reference[Hook.FP32]["params"])
    rates = island_rates(params, step_s)
    regimes: dict[str, dict[str, Any]] = {}
    for name, mbit in rates.items():
        rows: dict[str, dict[str, Any]] = {}
        for row in ("diloco", "streaming_int4", "async"):
            runs = [run_archipelago(row, mbit, s, work / name) for s in seeds]
            rows[row] = _row(row, runs, mbit)
        for row, hook in DDP_ROWS.items():
            plain = TIMED_POWERSGD_START if hook == Hook.POWERSGD else 0  # its all-reduce steps before it compresses
            steps = plain + DDP_WARM_STEPS + DDP_TIMED_STEPS
            timed = run_ddp(hook, mbit, 0, steps, work / name, False, TIMED_POWERSGD_START)
            rows[row] = _ddp_row(row, reference[hook], timed, plain)
        regimes[name] = {"ratio": RATIOS[name], "island_mbit": round(mbit, 3), "rows": rows}
    faults = {case.name: run_case(case, work / "faults") for case in cases()}
    calibration = calibrate(regimes, step_s, TARGET, work / "calibration")
    return _result(quick, regimes, step_s, params, seeds, faults, calibration)


def _row(row: str, runs: list[dict[str, Any]], mbit: float) -> dict[str, Any]:
    reached = [r["seconds_to_target"] for r in runs]
    ok = [t for t in reached if t is not None]
    # the head card's busy share: the bytes through it over its capacity both ways in the
    # command's window (the window its counters were read over)
    busy = [
        (r["card_bytes"]["head"]["sent"] + r["card_bytes"]["head"]["received"])
        * 8
        / (mbit * ISLANDS * 1e6 * 2 * r["run_seconds"])
        for r in runs
    ]
    return {
        "description": ROWS[row],
        "method": "full run on the testbed; the first round record at or below the target",
        "seconds_to_target": statistics.mean(ok) if len(ok) == len(runs) else None,
        "seeds": {i: t for i, t in enumerate(reached)},
        "card_bytes": runs[0]["card_bytes"],
        "payload_bytes": runs[0]["payload_bytes"],
        "head_busy_share": round(statistics.mean(busy), 4),
        "head_busy_share_seeds": [round(b, 4) for b in busy],
        "final_eval_loss": [r["final_eval_loss"] for r in runs],
        "curves": [r["curve"] for r in runs],
        "measured_at": sorted({r.get("measured_at") or UNSTAMPED for r in runs}),
    }


def _ddp_row(row: str, reference: dict[str, Any], timed: dict[str, Any], plain: int) -> dict[str, Any]:
    """A DDP row: its steps to the target (the reference run) at the seconds per step its
    timed run took on these links. PowerSGD: the timed run's first `plain` steps are a plain
    all-reduce (the timed one after the warm one gives their seconds); the reference run's
    first `POWERSGD_START` steps are counted at those seconds, the rest at the compressed
    step's."""
    times = timed["step_s"]
    step_s = statistics.mean(times[plain + DDP_WARM_STEPS :])
    plain_s = statistics.mean(times[DDP_WARM_STEPS:plain]) if plain > DDP_WARM_STEPS else step_s
    uncompressed = POWERSGD_START if plain else 0
    reached_step = next((s for _, s, loss in reference["curve"] if loss <= TARGET), None)
    seconds = None
    if reached_step is not None:  # its start on these links (rendezvous, rank 0's parameters broadcast)
        # included, as archipelago's rows include their first download
        seconds = (
            timed["init_s"] + min(reached_step, uncompressed) * plain_s + max(0, reached_step - uncompressed) * step_s
        )
    payload = sum(r["sent"] + r["received"] for k, r in timed["card_bytes"].items() if k != "head")
    per_step = payload / max(1, timed["steps"])
    return {
        "description": ROWS[row],
        "method": "start-up + steps to target (a full run at the fastest regime) x seconds per step, both "
        "measured on these links",
        "hook": HOOKS[DDP_ROWS[row]],
        "init_s": timed["init_s"],
        "seconds_to_target": seconds,
        "steps_to_target": reached_step,
        "step_s": step_s,
        "seeds": {0: seconds},
        "card_bytes": timed["card_bytes"],
        "payload_bytes": None,  # DDP counts none of its own: its bytes are the cards'
        "card_bytes_per_step": per_step,
        "timed_steps": timed["steps"],  # the steps `card_bytes` crossed the cards for (and its start)
        "head_busy_share": 0.0,  # DDP's ring runs among the islands
        "curves": [[(t, loss) for t, _, loss in reference["curve"]]],
        "measured_at": sorted({r.get("measured_at") or UNSTAMPED for r in (reference, timed)}),
    }


def _result(
    quick: bool,
    regimes: dict[str, dict[str, Any]],
    step_s: float,
    params: int,
    seeds: tuple[int, ...],
    faults: dict[str, dict[str, Any]],
    calibration: dict[str, Any],
) -> BenchResult:
    lines, panels, verdicts = [], [], {}
    for name, regime in regimes.items():
        rows = regime["rows"]
        ddp, diloco = _best(rows, ddp=True), _best(rows, ddp=False)
        ratio = None if ddp is None or diloco is None else diloco / ddp
        verdicts[name] = ratio
        table = [
            [
                k,
                seconds_or_unreached(r["seconds_to_target"]),
                _b(r["card_bytes"]) + (f" ({r['timed_steps']} steps)" if "timed_steps" in r else ""),
                _b(r["payload_bytes"]),
                f"{r['head_busy_share']:.2f}",
            ]
            for k, r in rows.items()
        ]
        lines.append(
            f"### {name}-equivalent: ratio {regime['ratio']}, islands at {regime['island_mbit']:.2f} Mbit/s\n\n"
            + md_table(
                ["row", "s to target", "card bytes (islands; DDP: its timing run)", "payload bytes", "head busy"], table
            )
            + f"\n\nbest DiLoCo-family / best DDP: {'-' if ratio is None else f'{ratio:.2f}x'}\n"
        )
        panels.append(
            Panel(
                x_label=f"seconds ({name}-equivalent)",
                curves={k: [tuple(p) for p in r["curves"][0]] for k, r in rows.items() if r["curves"]},
            )
        )
    slow = verdicts.get("1gbps")
    summary = (
        f"testbed: at the 1 Gbit/s-equivalent regime the best DiLoCo-family row takes "
        f"{'-' if slow is None else f'{slow:.2f}x'} the best DDP variant's time to eval loss {TARGET}"
    )
    # a rerun into the same folder keeps what was measured before: each part names its commit
    measured_at = sorted(
        {c for reg in regimes.values() for r in reg["rows"].values() for c in r["measured_at"]}
        | {f.get("measured_at") or UNSTAMPED for f in faults.values()}
    )
    header = (
        f"Step {step_s:.3f} s with {ISLANDS} islands on this machine's cores; the GPT has {params:,} parameters; "
        f"seeds {list(seeds)}; its runs measured at {', '.join(measured_at)} (each row's and scenario's "
        "`measured_at`).\n\n"
    )
    passed = all(f["pass"] for f in faults.values())
    lines.append(_faults_table(faults))
    summary += f"; faults {'pass' if passed else 'FAIL'}"
    lines.append(f"{CALIBRATION_HEADING}\n\n{calibration_table(calibration)}")
    methods = {f"{n}/{k}": r for n, reg in regimes.items() for k, r in reg["rows"].items()}
    return BenchResult(
        scenario="testbed",
        quick=quick,
        methods=methods,
        summary=summary,
        markdown=header + "\n".join(lines),
        panels=panels,
        extra={
            "regimes": regimes,
            "target": TARGET,
            "step_s": step_s,
            "params": params,
            "ratio_1gbps": slow,
            "faults": faults | {"pass": passed},
            "measured_at": measured_at,
            "calibration": calibration,
        },
    )


def _faults_table(faults: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            "pass" if f["pass"] else "FAIL",
            f"{f['seconds']:.0f}",
            str(f["losses"]),
            str(f["api"]["slowest_s"]),
            ", ".join(k for k, ok in f["checks"].items() if not ok) or "-",
        ]
        for name, f in faults.items()
    ]
    return "### Network faults (shipped defaults, real timing)\n\n" + md_table(
        ["scenario", "result", "s", "islands lost", "slowest API read (s)", "failed checks"], rows
    )


def _best(rows: dict[str, dict[str, Any]], ddp: bool) -> float | None:
    """The least time to target of the DDP rows (`ddp`) or of the DiLoCo-family rows."""
    times = [r["seconds_to_target"] for k, r in rows.items() if k.startswith("ddp") == ddp]
    reached = [t for t in times if t is not None]
    return min(reached) if reached else None


def _b(card: Any) -> str:
    if card is None:
        return "-"
    if isinstance(card, dict):
        total = sum(v["sent"] + v["received"] for k, v in card.items() if k != "head")
        return f"{total / 1e6:.1f} MB"
    return f"{card / 1e6:.1f} MB"
