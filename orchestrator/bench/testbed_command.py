"""`archipelago testbed up|exec|down|run`: a WAN testbed on one Linux host (root), registered
through the `archipelago.commands` entry point beside `bench`.

- `up SCENARIO`: the scenario's machines, links and Ray nodes, left running; prints the
  head's Ray address. `exec -- CMD...` runs CMD on the head as a driver (`archipelago run
  --set ray.address=auto ...` runs there unchanged). `down` removes everything the testbed
  made (also what a crashed or killed testbed left).
- `run SCENARIO [--out DIR]`: up, the scenario's `archipelago run` with its faults on
  their timers, a report (`DIR/testbed-run.json`: exit status, seconds, bytes that crossed
  every card, the faults as fired, the run's summary), down.

Exit 2 where the testbed cannot be made here (not root, no namespaces) or the scenario is
not one, naming why."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from archipelago.orchestrator.bench import netlab
from archipelago.orchestrator.bench.netlab import Machine, Rate
from archipelago.orchestrator.bench.netlab_cluster import RAY_PORT, in_machine, ray_env
from archipelago.orchestrator.bench.netlab_scenario import Testbed, load, write_report

log = logging.getLogger(__name__)


def register(sub: Any, common: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p = sub.add_parser(
        "testbed",
        parents=[common],
        help="a WAN testbed on this host: machines in network namespaces, tc-shaped links, timed faults (root)",
    )
    p.add_argument("action", choices=["up", "exec", "down", "run"])
    p.add_argument("args", nargs="*", metavar="SCENARIO | -- CMD", help="up/run: the scenario YAML; exec: -- CMD...")
    p.add_argument("--out", default="testbed-out", help="run: the report's folder (and the nodes' logs)")
    p.add_argument("--timeout", type=float, default=1800.0, help="run: kill the run after this many seconds")
    return testbed_command


def testbed_command(args: argparse.Namespace) -> int:
    try:
        if args.action == "down":
            netlab.sweep()
            return 0
        netlab.require()
        if args.action == "exec":
            return _exec(args.args)
        if len(args.args) != 1:
            log.error("testbed %s needs one scenario file", args.action)
            return 2
        scenario = load(Path(args.args[0]))
    except netlab.TestbedUnavailable as err:
        log.error("cannot make the testbed here: %s", err)
        return 2
    except (OSError, ValueError, ValidationError) as err:
        log.error("not a testbed scenario: %s", err)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.action == "up":
        bed = Testbed(scenario, out / "logs")
        try:
            bed.up()
        except BaseException:
            bed.down()
            raise
        sys.stdout.write(
            f"testbed up: RAY_ADDRESS={bed.address}; `archipelago testbed exec -- CMD` runs CMD on the head\n"
        )
        return 0
    with Testbed(scenario, out / "logs") as bed:
        run_dir = out / "run"
        argv = bed.archipelago_run(run_dir, *scenario.run)
        report = bed.run(argv, out / "run.log", run_dir / "metrics.jsonl", args.timeout)
    summary = run_dir / "summary.json"
    report["summary"] = json.loads(summary.read_text()) if summary.exists() else None
    report["scenario"] = scenario.model_dump(mode="json")
    write_report(report, out / "testbed-run.json")
    sys.stdout.write(f"testbed run: exit {report['rc']} in {report['seconds']:.0f}s; {out / 'testbed-run.json'}\n")
    return int(report["rc"] != 0)


def _exec(command: list[str]) -> int:
    if not command:
        log.error("testbed exec needs a command")
        return 2
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    if f"{netlab.PREFIX}-head" not in listed:
        log.error("no testbed is up (`archipelago testbed up SCENARIO` first)")
        return 2
    head = Machine(name="head", index=0, rate=Rate(0, 0))  # the first machine: a scenario's head
    env = ray_env() | {"RAY_ADDRESS": f"{head.address}:{RAY_PORT}"}
    return subprocess.run(in_machine(head, command), env=env, check=False).returncode
