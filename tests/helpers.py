"""Shared test helpers: a tiny GPT config, a mid-run hook for Ray tests, and the in-process
engine (real `Island` objects through the in-process pool, no Ray)."""

from __future__ import annotations

import functools
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from archipelago.orchestrator.bench.simulation.config import SimulationConfig, load_simulated
from archipelago.orchestrator.bench.simulation.pool import Fault, InProcessPool
from archipelago.orchestrator.bench.simulation.runner import run_in_process
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.engine.build import build_engine
from archipelago.orchestrator.engine.engine import RoundEngine
from archipelago.orchestrator.engine.state.logfiles import read_lines
from archipelago.workers.runtime.island import Island
from tests.toy_tasks import READS

# tests of one phase leave the warm start out (its own tests are in test_warm_start.py)
NO_WARM = "warm_start.steps=0"

# tests of other mechanisms leave the preflight out (its own tests are in test_plan.py): it
# measures each distinct config once, seconds apiece in a suite of many small configs
NO_PREFLIGHT = "preflight=false"

# a GPT small enough for a Ray test to train a few rounds in seconds
TINY_LM = [
    NO_WARM,
    NO_PREFLIGHT,
    "task.kwargs.d_model=32",
    "task.kwargs.n_layers=1",
    "task.kwargs.n_heads=2",
    "task.kwargs.context=32",
    "task.kwargs.batch_size=8",
    "task.kwargs.eval_batches=4",
    "inner.warmup_steps=5",
    "inner.lr=0.01",
]


# a tiny Llama from config (the [hf] extra) that two islands train in seconds
TINY_LLAMA = [
    NO_PREFLIGHT,
    "task.factory=archipelago.workers.tasks.hf_task:make_task",
    "task.kwargs.preset=tiny-llama",
    "task.kwargs.context=32",
    "task.kwargs.batch_size=16",
    "task.kwargs.eval_batches=4",
    "islands.count=2",
    "ray.num_cpus=2",
    "rounds=6",
    "inner_steps=15",
    "inner.lr=0.01",
    "inner.warmup_steps=5",
]


def fell_20_percent(summary: dict[str, Any]) -> None:
    """The eval loss fell by at least 20 % from the untrained model's (before the warm start, if any)."""
    untrained = (summary["warm_start"] or summary)["initial_eval_loss"]
    assert summary["final_eval_loss"] <= 0.8 * untrained, (untrained, summary["final_eval_loss"])


def tiny_lm_config(out: str | Path, corpus_cache: str, *extra: str) -> RunConfig:
    """The tiny GPT on the session's cached corpus, writing to `out`, with `extra` overrides."""
    return load_scenario([*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}", f"out_dir={out}", *extra])


def events(folder: str | Path) -> list[dict[str, Any]]:
    """A run folder's events.jsonl."""
    return [json.loads(line) for line in read_lines(Path(folder) / "events.jsonl")]


def assert_trained_once(
    record: str, position: list[int], folders: list[str | Path], lost: Counter | None = None
) -> None:
    """Every batch a toy island read (`READS[record]`), less the work its runs' `lost` events
    (and `lost`) gave back, is each batch below its shard's ledger `position` exactly once."""
    lost = Counter(lost or ())
    for folder in folders:
        for e in events(folder):
            if e["kind"] == "lost":
                for s, (start, n) in e["spans"].items():
                    lost.update((int(s), i) for i in range(start, start + n))
    trained = Counter(READS[record]) - lost
    assert all(c == 1 for c in trained.values()), [k for k, c in trained.items() if c > 1][:5]
    assert set(trained) == {(s, i) for s, p in enumerate(position) for i in range(p)}


_CENTERS = ("[1.0,0.0]", "[-0.5,2.0]", "[0.5,0.5]")


def toy_quadratic(islands: int, batch_s: float, *extra: str) -> list[str]:
    """Overrides for the toy quadratic task most Ray tests train: one center per island,
    `batch_s` seconds per batch (so rounds take real time), plain SGD with no warmup."""
    return [
        "task.factory=tests.toy_tasks:make_quadratic",
        f"task.kwargs.centers=[{','.join(_CENTERS[:islands])}]",
        f"task.kwargs.batch_s={batch_s}",
        f"islands.count={islands}",
        "inner.optimizer=sgd",
        "inner.lr=0.1",
        "inner.warmup_steps=0",
        NO_WARM,
        *extra,
    ]


def run_until_records(cfg: RunConfig, run_id: str, records: int, timeout_s: float = 120.0):
    """Start `run(cfg)` in a thread and return once metrics.jsonl has `records` rounds, so a
    test can break something mid-run; returns (thread, box), the summary lands in box."""
    import threading
    import time
    from pathlib import Path

    from archipelago.orchestrator.runtime.driver import run

    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(summary=run(cfg, show_progress=False, run_id=run_id)))
    thread.start()
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    deadline = time.time() + timeout_s
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < records):
        time.sleep(0.05)
    return thread, box


def stop_once_contributed(run_id: str, metrics: Path, island: int, thread, timeout_s: float = 150.0) -> None:
    """Wait until `island` has contributed to a recorded round (or `timeout_s`), then stop
    the run at its round's end and wait for it: a test that needs a newcomer to contribute
    runs as many rounds as this machine needs for that, no more."""
    import time

    import ray

    from archipelago.orchestrator.engine.commands import Stop
    from archipelago.orchestrator.runtime.names import NAMESPACE, coordinator_name

    deadline = time.time() + timeout_s
    while thread.is_alive() and time.time() < deadline:
        if metrics.exists() and any(island in json.loads(line)["contributed"] for line in read_lines(metrics)):
            break
        time.sleep(0.1)
    ray.get(ray.get_actor(coordinator_name(run_id), namespace=NAMESPACE).submit.remote(Stop()))
    thread.join(timeout=60)


@functools.cache
def _scratch() -> tempfile.TemporaryDirectory:
    """The folder of runs given no `out_dir`, removed when the test process ends (they
    held 2 MB apiece and every run of the suite left them in the system's temp folder);
    made on first use, so processes that import this module and run nothing leave none."""
    return tempfile.TemporaryDirectory(prefix="archipelago-tests-")


def remove_scratch() -> None:
    """Remove the runs' folder now, if one was made: the suite leaves through `os._exit`
    once Ray was loaded (`conftest.py`), which skips the removal at exit."""
    if _scratch.cache_info().currsize:
        _scratch().cleanup()
        _scratch.cache_clear()


# out_dir -> the fleet a test's config was loaded with (`load_scenario`): a test names its
# fleet among its settings (`simulation.slowdown=[1,1,4]`), and the run's config has none
FLEETS: dict[str, SimulationConfig] = {}


def load_scenario(overrides: list[str]) -> RunConfig:
    """The run's config of `overrides`, its `simulation.*` settings kept for its pool
    (`in_process_engine`) under its `out_dir`."""
    cfg, sim = load_simulated(None, overrides)
    if cfg.out_dir == RunConfig().out_dir:  # a folder of its own, so its fleet is its own
        cfg = cfg.model_copy(update={"out_dir": tempfile.mkdtemp(prefix="run-", dir=_scratch().name)})
    FLEETS[cfg.out_dir] = sim
    return cfg


def run_simulated(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` run to the end in this process (the product's phases) on the fleet it was
    loaded with; its summary."""
    return run_in_process(cfg, FLEETS.get(cfg.out_dir) or SimulationConfig())


def in_process_engine(
    cfg: RunConfig, faults: list[Fault] | None = None, run_id: str = "local", **pool: Any
) -> tuple[RoundEngine, InProcessPool]:
    """The engine over an in-process pool, on the fleet its config was loaded with
    (`load_scenario`; none: speed 1, instant links); `cfg.out_dir` defaults to a fresh
    temp folder."""
    sim = FLEETS.get(cfg.out_dir)
    if cfg.out_dir == RunConfig().out_dir:
        cfg = cfg.model_copy(update={"out_dir": tempfile.mkdtemp(prefix="run-", dir=_scratch().name)})
    p = InProcessPool(cfg, sim, faults=faults, **pool)
    return build_engine(cfg, p, run_id, ablation=sim.ablation() if sim is not None else None), p


def in_process_run(cfg: RunConfig) -> tuple[RoundEngine, list[Island], list[torch.Tensor]]:
    """Run `cfg` to the end in this process; returns the engine, the islands and the
    global parameters after every round."""
    engine, pool = in_process_engine(cfg)
    islands: list[Island] = []
    history: list[torch.Tensor] = []

    def record(*_: Any) -> None:
        engine.outer.copy_to(engine.flat.data)  # a sliced coordinator's parameters are in its slices
        history.append(engine.flat.data.clone())
        islands[:] = [pool.islands[i] for i in sorted(pool.islands)]

    engine.outputs.on_record = record
    engine.execute()
    return engine, islands, history


def run_tokens(cfg: RunConfig) -> int:
    """The tokens a run of `cfg` trains: its islands × rounds × H × a batch's tokens (the
    budget every row of a benchmark must share)."""
    per_step = cfg.task.kwargs["batch_size"] * cfg.task.kwargs["context"]
    return cfg.islands.count * cfg.rounds * cfg.inner_steps * per_step


def coordinator_plan(cfg: RunConfig, params: int = 1000) -> Any:
    """The plan's coordinator need for `cfg` with a model of `params` parameters and nothing
    else measured (every other figure 0), on this machine: what the plan counts per
    parameter, read without measuring a model."""
    from archipelago.orchestrator.plan.cluster import this_machine
    from archipelago.orchestrator.plan.memory import ModelMemory
    from archipelago.orchestrator.plan.planner import make_plan

    model = ModelMemory(
        params=params, process=0, runtime=0, outer_runtime=0, data=0, train_rows=1,
        train_peak=0, train_parts=dict.fromkeys(("optimizer_state", "gradients", "activations_and_temporaries"), 0),
        eval_rows=1, eval_peak=0, eval_set=0, measure_s=0.0,
    )  # fmt: skip
    return next(n for n in make_plan(cfg, model, this_machine()).needs if n.process == "coordinator")


def is_compiled(forward) -> bool:
    """Whether `forward` (what `workers/runtime/compiling.compiled_forward` returned, or a
    plain model) runs compiled: a whole-model wrapper, or every repeated block compiled in place."""
    import torch

    from archipelago.workers.runtime.compiling import repeated_blocks

    if isinstance(forward, torch._dynamo.eval_frame.OptimizedModule):
        return True
    blocks = repeated_blocks(forward)
    return bool(blocks) and all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
