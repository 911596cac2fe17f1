"""Runs a table of configurations one after another on one Ray instance, so every
method of a scenario is measured side by side on the same machine in one process."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from archipelago.orchestrator.bench.simulation.config import SimulationConfig, load_simulated
from archipelago.orchestrator.bench.simulation.network import Network
from archipelago.orchestrator.bench.simulation.ray_pool import run_simulated
from archipelago.orchestrator.bench.simulation.runner import run_in_process
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import SIMULATION, dump_config, load_config
from archipelago.orchestrator.engine.warm_start import MARKER, mark_finished, warm_config, warm_dir, warm_run_id
from archipelago.orchestrator.runtime.driver import init_ray, run

log = logging.getLogger(__name__)

Table = dict[str, tuple[str, list[str]]]  # name -> (description, overrides)
# the benchmarks compare methods from one data-parallel warm start, as the DiLoCo paper
# does (pinned: the product's default mode may change without changing these runs)
WARM_MODE = "ddp"


def continue_warm(steps: int, folder: Path) -> list[str]:
    """The overrides of a run that continues the finished warm start in `folder`."""
    return [f"warm_start.steps={steps}", f"warm_start.path={folder}", f"warm_start.mode={WARM_MODE}"]


def real_link(bandwidth_gbps: float) -> list[str]:
    """A simulated link of `bandwidth_gbps` (no latency) waited for in real time
    (`simulation.clock: real`): for rows whose walls are compared — on the virtual clock a
    real wall holds no link."""
    return [
        f"simulation.link.bandwidth_gbps={bandwidth_gbps:.6g}",
        "simulation.link.latency_ms=0",
        "simulation.clock=real",
    ]


@contextmanager
def one_ray(num_cpus: int) -> Iterator[None]:
    """One local Ray instance for a whole scenario: every run in it joins this one (a
    fresh instance per run costs about ten seconds of start and stop each)."""
    started = init_ray(load_config(None, [f"ray.num_cpus={num_cpus}", "warm_start.steps=0"]))
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def same_config(out: Path, cfg: RunConfig, sim: SimulationConfig | None = None) -> bool:
    """Whether the run in `out` had `cfg` (on the fleet `sim`): its `config.yaml` read back
    equals it (a setting added since, absent from the file, compares at its default, so a
    new option whose default is the old behaviour does not invalidate earlier runs), and its
    `simulation.json` (`record_simulation`) says the same fleet. Raises OSError if `out`
    holds no config."""
    text = (out / "config.yaml").read_text()
    try:
        same = text == dump_config(cfg) or load_config(out / "config.yaml", []) == cfg
    except ValueError:  # a setting since removed or renamed
        return False
    fleet = out / SIMULATION_FILE
    if sim is None:
        return same and not fleet.exists()
    try:
        return same and SimulationConfig.model_validate_json(fleet.read_text()) == sim and _priced_alike(out, cfg, sim)
    except (OSError, ValueError):
        return False


SIMULATION_FILE = "simulation.json"  # beside a simulated run's config: the fleet it ran on
PRICES_FILE = "prices.json"  # ... and the rates its network charged (`Network.pricing`)
# prices added since runs were first recorded: a run with no prices file was charged none of them
PRICED_SINCE = ("decode_s_per_value_and_island", "encode_s_per_value")


def prices(cfg: RunConfig, sim: SimulationConfig) -> dict[str, Any]:
    """What the simulated network charges a run of `cfg` on `sim`, as its file holds it."""
    loaded: dict[str, Any] = json.loads(json.dumps(Network(cfg, sim, 1).pricing()))
    return loaded


def _priced_alike(out: Path, cfg: RunConfig, sim: SimulationConfig) -> bool:
    """Whether the run in `out` was charged what this code charges `cfg` now: the rates are
    code, not config, and a run priced at others (a codec's decoding before it was priced)
    is not this run."""
    now = prices(cfg, sim)
    try:
        then = json.loads((out / PRICES_FILE).read_text())
    except OSError:  # recorded before the prices were: charged nothing for what was priced since
        then = {**now, **{k: 0.0 if now.get(k) is not None else None for k in PRICED_SINCE}}
    return bool(then == now)


def record_simulation(cfg: RunConfig, sim: SimulationConfig) -> None:
    """Write the fleet a simulated run of `cfg` runs on, and the prices it is charged, beside its config."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / SIMULATION_FILE).write_text(sim.model_dump_json(indent=2))
    (out / PRICES_FILE).write_text(json.dumps(prices(cfg, sim), indent=2))


def finished(
    cfg: RunConfig, sim: SimulationConfig | None = None, ended: tuple[str, ...] = ("finished",)
) -> dict[str, Any] | None:
    """The summary of a run of exactly `cfg` in its `out_dir` that ended in one of the
    states `ended` (a scenario run again into the same folder, e.g. after it was
    interrupted, reuses it: runs are deterministic in everything but their seconds; a
    scenario that stops its runs at a target also takes `stopped`), else None."""
    out = Path(cfg.out_dir)
    try:
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
        same = same_config(out, cfg, sim)
    except (OSError, ValueError):
        return None
    if not same or summary.get("state") not in ended:
        return None
    log.info("  %-26s reused (finished with the same config)", out.name)
    return summary


def fresh(cfg: RunConfig, sim: SimulationConfig | None = None) -> None:
    """Remove what an earlier run of another config left in `cfg.out_dir`: its checkpoint
    would otherwise be resumed as this run's (a finished one ends at once, its clock at
    zero). An interrupted run of exactly `cfg` is kept, and resumes — unless it is simulated
    (`sim`): a resumed pool's clock starts again at zero, and the run's loss-against-time
    curve would fold back, so such a run starts over."""
    out = Path(cfg.out_dir)
    try:
        same = same_config(out, cfg, sim)
    except OSError:
        return
    if not same or sim is not None:
        why = "of another config" if not same else "on a simulated clock, interrupted,"
        log.info("  %-26s an earlier run %s is removed", out.name, why)
        shutil.rmtree(out)


def simulated(overrides: list[str]) -> tuple[RunConfig, SimulationConfig | None]:
    """A method's config and, if any of its settings are `simulation.*`, its fleet."""
    cfg, sim = load_simulated(None, overrides)
    return cfg, sim if any(o.startswith(f"{SIMULATION}.") for o in overrides) else None


def run_methods(base: list[str], table: Table, work: Path, in_process: bool = False) -> dict[str, dict[str, Any]]:
    """The summary of every method's run (its outputs are in `work/<name>`), on Ray or,
    with `in_process`, on the in-process pool (`run_in_process`); a method with
    `simulation.*` settings on that fleet (on Ray: on the virtual clock)."""
    summaries: dict[str, dict[str, Any]] = {}
    started = False
    try:
        for name, (_, overrides) in table.items():
            cfg, sim = simulated([*base, *overrides, f"out_dir={work / name}"])
            summary = finished(cfg, sim)
            if summary is None:
                fresh(cfg, sim)
                if sim is not None:
                    record_simulation(cfg, sim)
            if summary is None and in_process:
                summary = run_in_process(cfg, sim or SimulationConfig())
            elif summary is None:
                started = init_ray(cfg) or started
                options: dict[str, Any] = {"show_progress": False}
                summary = run(cfg, **options) if sim is None else run_simulated(cfg, sim, **options)
            summaries[name] = summary
            log.info(
                "  %-26s final eval loss %.4f  %9.1f MB  %.0fs",
                name,
                summary["final_eval_loss"],
                summary["bytes_communicated"] / 1e6,
                summary["train_seconds"],
            )
    finally:
        if started:
            ray.shutdown()
    return summaries


def train_warm_start(base: list[str], seed: int, steps: int, out: Path, in_process: bool = False) -> Path:
    """Train the warm start of the run `base` describes (the product's warm phase, alone)
    once, for every method of a scenario to continue (`warm_start.path`); its folder."""
    cfg, sim = simulated(
        [*base, f"seed={seed}", f"warm_start.steps={steps}", f"warm_start.mode={WARM_MODE}", f"out_dir={out}"]
    )
    warm = warm_config(cfg)
    if (warm_dir(cfg) / MARKER).exists() and finished(warm) is not None:
        return warm_dir(cfg)
    run_id = f"bench-s{seed}"  # the marker names it: a run continuing this warm start reads its checkpoint folder
    if in_process:
        summary = run_in_process(warm, sim or SimulationConfig(), warm_run_id(run_id))
    else:
        started = init_ray(warm)
        try:
            summary = run(warm, show_progress=False, run_id=warm_run_id(run_id))
        finally:
            if started:
                ray.shutdown()
    mark_finished(cfg, run_id, summary)
    log.info(
        "  warm start seed %d: eval loss %.4f -> %.4f in %.0fs",
        seed,
        summary["initial_eval_loss"],
        summary["final_eval_loss"],
        summary["train_seconds"],
    )
    return warm_dir(cfg)
