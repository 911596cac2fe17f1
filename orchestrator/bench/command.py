"""`archipelago bench`: registered through the `archipelago.commands` entry point
(pyproject.toml), so the command line finds it without importing it."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench import fleet_spec
from archipelago.orchestrator.bench.registry import available, publish, run_bench
from archipelago.orchestrator.bench.report import ScenarioUnavailable, measured_commit, replot, require_plotting

log = logging.getLogger(__name__)


def register(sub: Any, common: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Adds `bench` to the command's subparsers; its handler."""
    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="run a benchmark scenario (writes DIR/<scenario>.json, .png, .md); `bench publish` copies "
        "reports into the documentation",
    )
    bench.add_argument(
        "scenario", help=f"one of: {', '.join(available())} (orchestrator/bench/registry.py); or publish"
    )
    bench.add_argument("reports", nargs="*", metavar="SCENARIO", help="publish: these reports (default: all in DIR)")
    bench.add_argument("--quick", action="store_true", help="smaller budget (minutes)")
    bench.add_argument("--out", default="bench-out", help="output folder (publish: where the reports are)")
    bench.add_argument("--docs", default="docs", help="publish: the documentation folder (default: docs)")
    bench.add_argument(
        "--dirty-ok", action="store_true", help="publish: also reports measured with uncommitted changes"
    )
    bench.add_argument(
        "--replot", action="store_true", help="only draw DIR/<scenario>.png again from DIR/<scenario>.json (no run)"
    )
    bench.add_argument(
        "--dry-run",
        action="store_true",
        help="gpu only: print each part's expected seconds (from a model of its steps) and budget; run nothing",
    )
    bench.add_argument(
        "--parts",
        default=None,
        help="gpu only: run only these parts, comma-separated (see --dry-run), the others reported as not run",
    )
    bench.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="gpu only: the whole scenario's budget (default 480 s); a part that would overrun it is skipped",
    )
    fleet_spec.add_arguments(bench)
    return bench_command


def bench_command(args: argparse.Namespace) -> int:
    if args.scenario == "publish":
        try:
            published = publish(Path(args.out), Path(args.docs), args.reports or None, dirty_ok=args.dirty_ok)
        except (ScenarioUnavailable, OSError, ValueError) as err:
            log.error("cannot publish: %s", err)
            return 2
        sys.stdout.write(f"published {', '.join(published)} into {args.docs} (and its benchmarks.md)\n")
        return 0
    if args.reports:
        log.error("only `bench publish` takes more than one scenario")
        return 2
    if args.scenario not in available():
        log.error("unknown scenario %r; available: %s", args.scenario, ", ".join(available()))
        return 2
    if args.replot:
        try:
            require_plotting()
            sys.stdout.write(f"{replot(Path(args.out) / f'{args.scenario}.json')}\n")
        except (ScenarioUnavailable, OSError, ValueError) as err:
            log.error("cannot replot %s: %s", args.scenario, err)
            return 2
        return 0
    if args.dry_run:
        if args.scenario != "gpu":
            log.error("--dry-run plans `bench gpu` only")
            return 2
        from archipelago.orchestrator.bench.gpu import dry_run

        sys.stdout.write(f"{dry_run(args.quick)}\n")
        return 0
    options: dict[str, Any] = {}
    if args.parts is not None:
        from archipelago.orchestrator.bench.gpu import part_names

        wanted = tuple(p.strip() for p in args.parts.split(",") if p.strip())
        unknown = sorted(set(wanted) - set(part_names()))
        if args.scenario != "gpu" or unknown or not wanted:
            log.error("--parts names parts of `bench gpu`: %s (unknown: %s)", ", ".join(part_names()), unknown)
            return 2
        options["parts_only"] = wanted
    if args.budget is not None:
        if args.scenario != "gpu" or args.budget <= 0:
            log.error("--budget is `bench gpu`'s whole budget, in seconds above 0")
            return 2
        options["budget_s"] = args.budget
    if fleet_spec.given(args):
        if args.scenario != "fleet":
            log.error("%s describe the fleet of `bench fleet` only", ", ".join(fleet_spec.given(args)))
            return 2
        try:
            options["spec"] = fleet_spec.spec_of(args)
        except ValueError as err:
            log.error("bench fleet: %s", err)
            return 2
    try:
        measured_commit()  # the commit whose code runs, read before it runs
        result = run_bench(args.scenario, args.quick, Path(args.out), **options)
    except ScenarioUnavailable as err:
        log.error("%s", err)
        return 2
    sys.stdout.write(f"{result.summary}\nresults: {Path(args.out) / args.scenario}.json, .png, .md\n")
    return 0
