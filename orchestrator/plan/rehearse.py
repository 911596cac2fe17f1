"""A rehearsal: every process of a run, once, at the config's real shapes, each in a
fresh process whose peak memory is read back and set beside the plan's.

On the CPU of the machine it runs on (CI's included): an island worker builds its model
and trains one round of `inner_steps` inner steps through the island's own code (in a
run whose islands save their inner state, beside a snapshot of it); the
coordinator builds the model, takes one outer step on `islands.count` pseudo-gradients
through the production outer step and admission, evaluates (when it is the one that
evaluates) and writes a checkpoint; the evaluation actor's body evaluates once. The plan
of the same config on this machine, without Ray's processes, gives each its expected
peak; a process more than `tolerance` away from it fails the rehearsal. What the
rehearsal proves is that the plan's method holds for this model at these shapes; the
plan of the real cluster (`archipelago plan --cluster`) uses the same numbers.

Run with `archipelago plan --rehearse CONFIG`; a config's data and tokenizer can be
replaced by local stand-ins with `--set` (the shapes are what matters).
"""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from ..config import RunConfig
from ..config_operations import EvalPlace
from .fresh import Fresh
from .planner import at_rows, micro_batch_rows

GIB = 2**30
TOLERANCE = 0.25  # a process's measured peak within 25 % of the plan's
# glibc's allocator with its mmap threshold fixed (128 KiB): a large block is mapped when
# allocated and unmapped when freed, so a process's peak resident memory is what it held at
# once, reproducible to the MB. With the default, adaptive threshold a freed block raises it
# and later blocks come from a heap that keeps freed pages resident by timing: the flagship's
# island at 4 rows peaked at 6.27 and 6.59 GiB in two runs of one command, and its peak at 16
# rows read off the line through 4 and 6 rows came out from 0.51x to 1.18x of the plan's.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rehearsed:
    role: str
    planned: int  # bytes: the plan's peak for this process on this machine
    measured: int  # bytes: the process's peak resident memory (or read off the line through `at_rows`)
    seconds: float
    # an island rehearsed at smaller micro-batches: rows -> its measured peak, and the rows of
    # the config's own micro-batch that `measured` is read off the line through them at
    at_rows: dict[int, int] | None = None
    rows: int | None = None

    @property
    def ratio(self) -> float:
        return self.measured / self.planned

    def line(self) -> str:
        scaled = (
            ""
            if self.at_rows is None
            else f"  (at {self.rows} rows a micro-batch, read off the line through "
            + ", ".join(f"{r} rows {m / GIB:.2f} GiB" for r, m in self.at_rows.items())
            + ")"
        )
        return (
            f"{self.role:<12} planned {self.planned / GIB:6.2f} GiB  measured {self.measured / GIB:6.2f} GiB  "
            f"({self.ratio:.2f}x)  in {self.seconds:.1f} s{scaled}"
        )


def on_the_line(peaks: dict[int, int], rows: int) -> int:
    """The peak at `rows` rows on the line through two measured (rows, peak): a step's
    activations grow with the rows of its micro-batch, everything else (parameters,
    gradients, optimizer state, copies, the runtime) does not."""
    (r1, m1), (r2, m2) = sorted(peaks.items())
    return int(m1 + (m2 - m1) * (rows - r1) / (r2 - r1))


def _peak() -> int:
    """This process's peak resident memory: VmHWM, which starts afresh at exec (getrusage's
    ru_maxrss does not: it keeps the forking parent's, a test runner's 2 GiB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _island(cfg: RunConfig) -> None:
    from archipelago.workers.runtime import inner_state
    from archipelago.workers.runtime.island import Island

    from ..engine.specs import island_spec

    island = Island(island_spec(cfg, 0))
    params = island.flat.numpy()
    held = None
    if cfg.keeps_island_state:
        # its inner state's snapshot held while a round trains, as when its write (to a slow
        # bucket) lasts the next round: the state made first by a step on the zero gradients
        # (the values are not what is measured; a second round would double the rehearsal)
        island.optimizer.step()
        held = inner_state.snapshot(island.optimizer, island.feedback)
    island.run(island.order(0, cfg.inner_steps), params)
    del held


def _coordinator(cfg: RunConfig) -> None:
    import numpy as np
    import torch

    from archipelago.workers.tasks.task import load_task
    from archipelago.workers.wire.flat import FlatParams

    from ..engine.outputs.evaluation import LocalEvaluator
    from ..engine.policies import build_policies
    from ..engine.state.checkpoints import save_checkpoint
    from ..engine.step.outer import Commit, LocalOuter
    from ..engine.step.rules import outer_rule
    from ..engine.types import Contribution

    task = load_task(cfg.task.factory, cfg.task.kwargs)
    task.prepare()
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    flat = FlatParams(model, grads=False)
    outer = LocalOuter(flat.data, outer_rule(cfg))
    admission = build_policies(cfg, flat.numel).admission
    # every page of each written, as an island's would be (the values are not what is measured:
    # drawing 4 x 114 M normal samples took half the coordinator's rehearsal)
    arriving = [
        Contribution(island=i, version=0, delta=np.full(flat.numel, 1e-3 * (i + 1), dtype=np.float32), weight=1.0)
        for i in range(cfg.islands.count)
    ]
    proposal = outer.propose(arriving)
    verdicts = [admission.judge(c, f, 0, 0) for c, f in zip(arriving, proposal.facts)]
    outer.commit(proposal, Commit(weights={c.island: c.weight for c, v in zip(arriving, verdicts) if v.admitted}))
    del arriving, proposal
    if cfg.evaluation.where == EvalPlace.COORDINATOR:
        outer.copy_to(flat.data)
        LocalEvaluator(task=task, model=model, threads=torch.get_num_threads).submit(version=1, params=flat.data)
    with tempfile.TemporaryDirectory() as folder:
        outer.copy_to(flat.data)
        state = {"run_id": "rehearsal", "params": flat.data.detach(), "outer": outer.state_dict()}
        save_checkpoint(folder, state)


def _evaluator(cfg: RunConfig) -> None:
    from archipelago.workers.tasks.task import PlannableTask

    from ..engine.outputs.evaluation import EvaluationWorker

    worker = EvaluationWorker(cfg)
    held = worker.batches  # the whole evaluation set stays held, as in a run
    if isinstance(worker.task, PlannableTask):
        # a task that evaluates `eval_rows` rows a forward peaks in each forward alike: the
        # first one's rows are evaluated, not the whole set (16 forwards of the flagship's)
        rows = worker.task.eval_rows()
        worker.batches = [tuple(t[:rows] for t in held[0])]
    worker.evaluate(worker.flat.numpy())
    del held


def _main(role: str) -> None:
    cfg = RunConfig.model_validate_json(sys.stdin.read())
    t0 = time.perf_counter()
    {"island": _island, "coordinator": _coordinator, "evaluator": _evaluator}[role](cfg)
    sys.stdout.write(json.dumps({"role": role, "peak": _peak(), "seconds": time.perf_counter() - t0}) + "\n")


def rehearse_role(cfg: RunConfig, role: str, timeout_s: float = 1800) -> Fresh:
    """One process of the run, started in a fresh interpreter (its allocator as `ALLOCATOR_ENV`
    sets it); its answer is its peak and its seconds."""
    return Fresh(
        "archipelago.orchestrator.plan.rehearse",
        role,
        stdin=cfg.model_dump_json(),
        timeout_s=timeout_s,
        env=ALLOCATOR_ENV,
    )


def rehearse(cfg: RunConfig, scale_rows: tuple[int, int] | None = None) -> list[Rehearsed]:
    """Each of the run's processes rehearsed beside its plan on this machine (no Ray), with
    the codecs that plan chose where `cfg` left them `auto`. `scale_rows`: a micro-batch
    too large to train on this CPU (a GPU config's 16 rows of 1,024 tokens) — the island is
    rehearsed at micro-batches of these two row counts instead, and its peak at the config's
    own is read off the line through them (`on_the_line`)."""
    from .cluster import this_machine
    from .planner import on_cpu, plan_run

    cfg = on_cpu(cfg)
    plan = plan_run(cfg, this_machine(), under_ray=False)
    cfg = plan.config(cfg)
    planned = {n.process: n.total for n in plan.needs if n.memory == "host"}
    roles = ["island", "coordinator"] + (["evaluator"] if cfg.evaluation.where == EvalPlace.ACTOR else [])
    # side by side, as they run: each peak is its own process's; the seconds include the sharing
    runs = [(role, cfg) for role in roles if not (role == "island" and scale_rows)]
    runs += [("island", at_rows(cfg, r)) for r in scale_rows or ()]
    started = [rehearse_role(c, role) for role, c in runs]
    out = []
    scaled: dict[int, int] = {}
    island_s = 0.0
    try:
        for (role, c), process in zip(runs, started):
            got = process.result()
            if role == "island" and scale_rows:
                scaled[micro_batch_rows(c)] = got["peak"]
                island_s = max(island_s, got["seconds"])
                continue
            key = {"island": "island worker"}.get(role, role)
            out.append(Rehearsed(role=role, planned=planned[key], measured=got["peak"], seconds=got["seconds"]))
        if scale_rows:
            rows = micro_batch_rows(cfg)
            out.insert(
                0,
                Rehearsed(
                    role="island",
                    planned=planned["island worker"],
                    measured=on_the_line(scaled, rows),
                    seconds=island_s,
                    at_rows=scaled,
                    rows=rows,
                ),
            )
    finally:
        for process in started:  # the others, when one failed
            process.cancel()
    return out


if __name__ == "__main__":
    _main(sys.argv[1])
