"""`archipelago simulate`: a run of the product on a simulated fleet, on this machine.

The islands really train as Ray actors; time is the virtual clock of `ray_pool.py`, and
the fleet — speeds, links, the head's card, what is priced — is the `simulation` section
of the config file or `--set simulation.*` settings, which `archipelago run` refuses (a run's
config has no simulation field). Registered through the `archipelago.commands` entry point,
as `bench` is: the product's command line does not import this package.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def register(sub: Any, common: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Adds `simulate` to the command's subparsers; its handler."""
    from archipelago.orchestrator.cli import config_args

    p = sub.add_parser(
        "simulate",
        parents=[common],
        help="train on a simulated fleet: the config's `simulation` section (speeds, links, the head's card) "
        "on a virtual clock",
    )
    config_args(p)  # the config file may hold a `simulation` section; `--set simulation.slowdown=[1,1,2,4]`
    p.add_argument("--out", help="output folder (overrides out_dir)")
    return simulate_command


def simulate_command(args: argparse.Namespace) -> int:
    from archipelago.orchestrator.bench.simulation.config import load_simulated
    from archipelago.orchestrator.config_load import ConfigError, check_folders

    overrides = [*args.overrides, *([f"out_dir={args.out}"] if args.out else [])]
    try:
        cfg, sim = load_simulated(args.config, overrides)
        check_folders(cfg)
    except ConfigError as err:
        log.error("invalid config: %s", err)
        return 2
    from archipelago.orchestrator.bench.simulation.ray_pool import run_simulated
    from archipelago.orchestrator.cli import train
    from archipelago.orchestrator.runtime.driver import process_started_at

    shown = logging.getLogger("archipelago").level <= logging.INFO
    return train(lambda: run_simulated(cfg, sim, show_progress=shown, started_at=process_started_at()))
