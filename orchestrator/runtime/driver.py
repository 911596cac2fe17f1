"""The driver of a run: connect to (or start) Ray, place the coordinator and the control
plane, show progress, forward a stop signal, and wait out Ray's restarts of a coordinator
that died."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import yaml
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from archipelago.workers.runtime.storage import durable_write, is_url
from archipelago.workers.tasks.task import load_task

from ..config import AUTO_SHARDS, RUN_PLACEHOLDER, RunConfig
from ..engine.commands import Stop
from ..engine.state.checkpoints import CheckpointError, load_checkpoint, run_folder, runs_in
from ..engine.state.records import CONFIG, RUN_ID, link_latest
from ..engine.types import RunFailed
from ..engine.warm_start import check_warm_start, pending, warm_run_id
from ..logs import LogFormat, configured, emits_json, json_line, set_run
from ..plan.head import with_shards
from ..plan.preflight import preflight
from .control_plane import ControlPlane, api_token
from .coordinator import Coordinator, IslandPools
from .island_actors import prestart_islands, release_islands
from .names import NAMESPACE, coordinator_name
from .progress import ProgressPrinter
from .signals import StopRequest, stop_on_signals

if TYPE_CHECKING:
    from ..engine.policies import Ablation

log = logging.getLogger(__name__)

# Ray frees the objects nobody references in batches, once a second by default. Rounds
# closer together than that get their pseudo-gradients put on object-store pages the
# coordinator has never touched (the freed ones are not free yet), and reading them takes
# a page fault per 64 KB: `bench datapath`, 128 MB a round back to back, 1,954 faults and
# 22 ms a round; with the batches flushed every 100 ms, 0 faults and 16 ms. Applies to the
# Ray instances Archipelago starts; a cluster's nodes take it from their environment
# (`RAY_free_objects_period_milliseconds`, set in `k8s/`).
RAY_SYSTEM_CONFIG = {"free_objects_period_milliseconds": 100}


def _on_a_cluster(cfg: RunConfig, started: bool) -> bool:
    """Whether the run goes onto a Ray cluster the plan must read node by node: one named
    (`ray.address`, $RAY_ADDRESS), or one of several nodes this process had joined before
    (`ray.cluster_utils`, a bench's) — not a private instance on this machine alone."""
    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        return True
    return not started and sum(1 for n in ray.nodes() if n.get("Alive")) > 1


def init_ray(cfg: RunConfig) -> bool:
    """Connect to `ray.address` / $RAY_ADDRESS (`auto`: the cluster `ray start` started on
    this machine), or else start a private local instance sized for the islands. Returns
    True when this call started Ray (and so should shut it down).

    A private instance even when a cluster runs here (`ray start --head`) or a killed
    head left its address file behind: Ray would otherwise join that cluster on its own
    and refuse the sizes we pass (or fail to reach a dead head). Using a cluster is
    always asked for by name."""
    if ray.is_initialized():
        return False
    # `--log-format json`: Ray's workers write JSON too, and their lines reach this process
    # without Ray's "(name pid=…)" prefix, so every line the run prints parses (the CLI
    # turned off Ray's de-duplication, whose summaries are text). At the command's level, but
    # never Ray's own debug lines: a worker writes some as it starts, before it knows the run
    setup = configured()
    structured = (
        ray.LoggingConfig(encoding="JSON", log_level=logging.getLevelName(max(setup.level, logging.INFO)))
        if setup is not None and setup.format == LogFormat.JSON
        else None
    )
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True, logging_config=structured)
        return True
    workers = cfg.islands.count * cfg.islands.workers
    needed = workers * cfg.islands.cpus
    num_cpus = cfg.ray.num_cpus or max(1, int(needed + 0.999))
    num_gpus = int(workers * cfg.islands.gpus + 0.999) if cfg.islands.gpus else None
    # The task's module may live in the working directory: its workers import from there.
    # Through the environment Ray starts with, not a runtime env: the workers Ray starts
    # ahead of time have no runtime env, and only then can the islands' actors use them
    # (measured: 4 actors importing torch ready in 3.4 s instead of 4.3 s). Having those
    # workers import torch ahead (`preload_python_modules`) saved 1.5 s in isolation but
    # nothing in `bench startup` on 2 cores (they compete with the coordinator's start).
    with on_pythonpath(os.getcwd()):
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            log_to_driver=True,
            _system_config=RAY_SYSTEM_CONFIG,
            logging_config=structured,
        )
    return True


@contextmanager
def on_pythonpath(folder: str) -> Iterator[None]:
    """`folder` first on PYTHONPATH while a Ray instance starts (its processes inherit it),
    then PYTHONPATH as it was."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [folder, before] if p)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def start_coordinator(
    cfg: RunConfig,
    run_id: str,
    prestarted: int = 0,
    pool: IslandPools | None = None,
    ablation: Ablation | None = None,
) -> Any:
    """The coordinator actor, pinned to this node so its outputs land where the user looks
    (`pool`: its island pools' class, `RayIslandPool` by default — a simulation's runs on
    its own clock; `ablation`: a benchmark's, none for a run of the product).
    Ray restarts it up to `checkpoint.max_restarts` times; it then resumes from its
    checkpoint. The pin is hard: with a soft one Ray at times placed it on an island's node
    (seen in the multi-node test), where losing that node took the coordinator down too."""
    node_id = ray.get_runtime_context().get_node_id()
    restarts = cfg.checkpoint.max_restarts if cfg.checkpoint.every_rounds else 0
    return (
        ray.remote(Coordinator)
        .options(
            name=coordinator_name(run_id),
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=4,
            max_restarts=restarts,
            max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(cfg, run_id, configured(), prestarted, pool, ablation)
    )


def _poll(coordinator: Any, printer: ProgressPrinter | None) -> None:
    try:
        progress = ray.get(coordinator.progress.remote(), timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return  # restarting; the next poll will tell
    if printer:
        printer.update(progress)


def process_started_at() -> float:
    """When this process started (Linux: from /proc, so the interpreter's and the imports'
    seconds count in a run's start-up); elsewhere, now.

    /proc gives the start in clock ticks since boot. It is read against the clock that
    counts from boot (`CLOCK_BOOTTIME`), not added to /proc/stat's `btime`: that is whole
    seconds, which put the start up to a second early (0.44 s on the machine of
    `docs/startup.md`, measured against a parent's clock)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def run(
    cfg: RunConfig,
    poll_s: float = 0.5,
    show_progress: bool = True,
    run_id: str | None = None,
    started_at: float | None = None,
    pool: IslandPools | None = None,
    ablation: Ablation | None = None,
) -> dict[str, Any]:
    """Train to the end; returns the summary (also in `out_dir/summary.json`). A coordinator
    that dies is restarted by Ray and continues from its last checkpoint; pass the `run_id`
    of an earlier run (with the same `checkpoint.path`) to resume it. `started_at`: when the
    command started (default: now), what `startup_seconds` counts from. `pool`: the
    coordinator's island pools (default: Ray's on the real clock); `ablation`: what a
    benchmark changes in the run's decisions (`engine.policies.Ablation`; none by default)."""
    started_at = started_at or time.time()
    token = api_token(cfg)
    load_task(cfg.task.factory, cfg.task.kwargs).prepare()  # build data caches once, before any actor
    new_run = run_id is None
    run_id = run_id or uuid.uuid4().hex[:12]
    set_run(run_id)  # every JSON line from here on, and the coordinator's, carries it
    template, cfg = cfg.out_dir, cfg.for_run(run_id)  # each run its own folder (`out_dir`'s `{run_id}`)
    if not is_url(cfg.out_dir) and not Path(cfg.out_dir).is_absolute():
        # the coordinator (on this node) writes it from a Ray worker's working directory: the
        # folder is this command's, named whole
        cfg = cfg.model_copy(update={"out_dir": str(Path(cfg.out_dir).resolve())})
    if template != cfg.out_dir and RUN_PLACEHOLDER in template:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        link_latest(template, run_id)
    if cfg.warm_steps and not pending(cfg, run_id):
        check_warm_start(cfg)  # one to reuse, or this run's finished one: it must fit
    command = {"before_ray_s": time.time() - started_at}
    t0 = time.time()
    started = init_ray(cfg)
    command["ray_s"] = time.time() - t0
    if not new_run:
        cfg = resumed_slices(cfg)
    if cfg.preflight:
        t0 = time.time()
        try:
            plan = preflight(cfg, on_ray_cluster=_on_a_cluster(cfg, started))
        except BaseException:
            if started:
                ray.shutdown()
            raise
        command["plan_s"] = time.time() - t0
        # slices and codecs left `auto`, chosen: what every actor is built with and config.yaml records
        cfg = plan.config(cfg)
    printer = ProgressPrinter() if show_progress else None
    coordinator = None
    control_plane = ControlPlane(cfg, run_id, token)
    with stop_on_signals() as stop:  # from here on SIGTERM/SIGINT stop the run cleanly
        try:
            t0 = time.time()
            # a new run's islands start beside the coordinator, not after it (it adopts them)
            prestarted = prestart_islands(cfg, run_id) if new_run else 0
            coordinator = start_coordinator(cfg, run_id, prestarted, pool, ablation)
            control_plane.start()  # while the coordinator starts: its handle resolves the coordinator's name
            ray.get(coordinator.progress.remote())  # up
            command["coordinator_s"] = time.time() - t0
            summary = _drive(cfg, coordinator, printer, poll_s, stop)
            if printer:
                _poll(coordinator, printer)
                printer.close()
            return record_startup(cfg, summary, started_at, command)
        finally:
            control_plane.close()
            if coordinator is not None:
                ray.kill(coordinator, no_restart=True)
            release_islands(run_id)  # the driver's cleanup, whatever happened
            release_islands(warm_run_id(run_id))
            if started:
                ray.shutdown()


def resumed_slices(cfg: RunConfig) -> RunConfig:
    """A continued run steps on the slices it was checkpointed with (a checkpoint's outer
    state is split by them): `coordinator.shards: auto` takes the number its first launch
    chose, from the `config.yaml` that launch wrote, rather than choosing again on a cluster
    that may have changed since."""
    recorded = Path(cfg.out_dir) / CONFIG
    if cfg.coordinator.shards != AUTO_SHARDS or not recorded.is_file():
        return cfg
    shards = (yaml.safe_load(recorded.read_text()).get("coordinator") or {}).get("shards")
    if not isinstance(shards, int):
        return cfg
    log.info("coordinator.shards auto: %d, as this run was checkpointed with (%s)", shards, recorded)
    return with_shards(cfg, shards)


def record_startup(
    cfg: RunConfig, summary: dict[str, Any], started_at: float, command: dict[str, float]
) -> dict[str, Any]:
    """`startup_seconds` (command start to the first inner step on any island) and
    `first_outer_step_seconds`, with the command's own parts, added to the summary and to
    `summary.json` (the coordinator runs on this node: its out_dir is here)."""
    startup = summary.get("startup") or {}

    def since(at: float | None) -> float | None:
        return at - started_at if at is not None else None

    summary = {
        **summary,
        "startup_seconds": since(startup.get("first_inner_step_at")),
        "first_outer_step_seconds": since(startup.get("first_outer_step_at")),
        "startup": {**startup, "command": command},
    }
    path = Path(cfg.out_dir) / "summary.json"
    if path.exists():
        durable_write(path, json.dumps(summary, indent=2).encode())
    return summary


def _drive(
    cfg: RunConfig,
    coordinator: Any,
    printer: ProgressPrinter | None,
    poll_s: float,
    stop: StopRequest,
) -> dict[str, Any]:
    """Wait for the coordinator's run, showing progress, forwarding a stop signal, and
    waiting out Ray's restarts of a coordinator that died."""
    restarts, stop_sent = 0, False
    while True:
        done = coordinator.run.remote()
        try:
            while not ray.wait([done], timeout=poll_s)[0]:
                if printer:  # nothing to show otherwise: each poll is CPU the islands' cores lose
                    _poll(coordinator, printer)
                if stop.event.is_set() and not stop_sent:
                    stop_sent = True
                    log.warning(
                        "%s: stopping now (checkpoint of the last outer step, outputs written)", stop.signal_name
                    )
                    coordinator.submit.remote(Stop(now=True))
            return ray.get(done)
        except ray.exceptions.RayActorError as err:
            restarts += 1
            if restarts > cfg.checkpoint.max_restarts or not cfg.checkpoint.every_rounds:
                raise RunFailed(f"the coordinator died {restarts} time(s): {err}") from err
            log.warning(
                "coordinator died; Ray restarts it from its last checkpoint (%d/%d)",
                restarts,
                cfg.checkpoint.max_restarts,
            )
            _await_restart(coordinator)
            stop_sent = False  # a restarted coordinator has not heard it


def _await_restart(coordinator: Any, timeout_s: float = 300.0) -> None:
    """Wait until the restarted coordinator answers (calls made while Ray is still
    restarting it would fail and be mistaken for another death)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get(coordinator.progress.remote(), timeout=10)
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.2)
    raise RunFailed(f"the coordinator did not come back within {timeout_s:.0f}s")


class ResumeRefused(RunFailed):
    """`--resume` cannot tell which run to continue (bad input: the command exits 2)."""


def resume_id(cfg: RunConfig) -> str:
    """The id of the run whose outputs are in `cfg.out_dir` (for `archipelago run --resume`):
    the one it recorded, or the only run with checkpoints in `checkpoint.path`. Checked
    before any task code is imported: `DIR/config.yaml` may name only the task factory the
    checkpoint was trained with (the file is on a writable volume, and its `module:callable`
    is imported and called)."""
    runs = runs_in(cfg.checkpoint_dir)
    recorded = Path(cfg.out_dir) / RUN_ID
    if recorded.is_file():
        run_id = recorded.read_text().strip()
        if run_id not in runs:
            raise ResumeRefused(f"no checkpoint of run {run_id} (recorded in {recorded}) in {cfg.checkpoint_dir}")
    elif len(runs) == 1:
        run_id = runs[0]
    else:
        held = f"the checkpoints of runs {', '.join(runs)}" if runs else "no checkpoint"
        raise ResumeRefused(f"{cfg.checkpoint_dir} holds {held}, and {cfg.out_dir} names no run to resume")
    check_resumable(cfg, run_id)
    return run_id


def check_resumable(cfg: RunConfig, run_id: str) -> bool:
    """Whether run `run_id` has checkpoints in `checkpoint.path` to continue from (False: it
    starts afresh under that id); refused when they are all corrupt or were trained with
    another task factory than `cfg` names (the config may come from a writable volume)."""
    try:
        state = load_checkpoint(run_folder(cfg.checkpoint_dir, run_id), cfg.checkpoint.resume_from)
    except CheckpointError as err:
        raise ResumeRefused(str(err)) from err
    except ValueError as err:  # an id that cannot name a folder
        raise ResumeRefused(str(err)) from err
    if state is None:
        return False
    trained = state.get("config", {}).get("task", {}).get("factory")
    if trained != cfg.task.factory:
        raise ResumeRefused(
            f"task.factory is {cfg.task.factory!r} in the config, but run {run_id} was trained "
            f"with {trained!r}: a resume imports only the factory its checkpoint recorded"
        )
    return True


def print_summary(summary: dict[str, Any], stream=sys.stdout) -> None:
    """The run's result in a few lines; with `--log-format json` one JSON object (the
    summary whole) on the log's stream, as every other line the run prints."""
    if emits_json():  # on stdout whatever the level, as the text form is
        stream.write(json_line("summary", {"summary": summary}, "archipelago.summary") + "\n")
        stream.flush()
        return
    out = summary["out_dir"]
    warm = summary.get("warm_start")
    if warm:
        stream.write(
            f"warm start ({warm['mode']}, {warm['steps']} steps): eval loss {warm['initial_eval_loss']:.4f} -> "
            f"{warm['final_eval_loss']:.4f} in {warm['train_seconds']:.1f}s, {warm['bytes_communicated'] / 1e6:.1f} MB "
            "exchanged; then the islands forked\n"
        )
    stream.write(
        f"eval loss {summary['initial_eval_loss']:.4f} -> {summary['final_eval_loss']:.4f} | "
        f"{summary['tokens']:,} tokens in {summary['wall_seconds']:.1f}s ({summary['tokens_per_s']:,.0f} tok/s) | "
        f"{summary['bytes_communicated'] / 1e6:.1f} MB exchanged | {summary['outer_steps']} outer steps\n"
        f"results: {out}/summary.json, {out}/metrics.jsonl, model {out}/final.pt\n"
    )
    stream.flush()
    time.sleep(0)  # keep output ordering with Ray's log forwarding
