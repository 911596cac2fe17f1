"""The data-parallel training a user would really run on the testbed's links: torch DDP
across the island machines (gloo: the testbed is CPU machines), stock bucketing and
overlap, with a communication hook torch ships — none (fp32), fp16 compression (gloo
refuses bf16's hook: "requires CUDA 11+ and NCCL 2.10+"), PowerSGD — on the same task, data
shards, inner optimizer and schedule as every archipelago row.

`python -m archipelago.orchestrator.bench.ddp_baseline --rank R ...` is one rank; the
testbed starts one per island machine (`testbed.py`), as `torchrun` would on each node.
Rank 0 evaluates every `--eval-every` steps and writes the curve: seconds of training
(evaluation excluded: the others wait for it at their next all-reduce, and archipelago's
evaluation runs beside its rounds, so counting it would charge DDP for it), step, eval loss."""

from __future__ import annotations

import argparse
import json
import logging
import time
from enum import Enum
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Hook(str, Enum):
    """The communication hooks a DDP user switches on (`torch.distributed.algorithms.ddp_comm_hooks`)."""

    FP32 = "fp32"  # no hook: the stock all-reduce of fp32 buckets
    FP16 = "fp16"  # fp16_compress_hook
    POWERSGD = "powersgd"  # powerSGD_hook with error feedback


def register_hook(model: Any, hook: Hook, rank: int, start_iter: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == Hook.FP16:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == Hook.POWERSGD:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter, random_seed=0
        )
        model.register_comm_hook(state, in_order(powerSGD_hook.powerSGD_hook))


def in_order(hook: Any) -> Any:
    """`hook` with each bucket's collectives issued after the previous bucket's ended.
    PowerSGD chains two all-reduces per bucket through futures; on gloo the second ones of
    two buckets were issued in a different order on different ranks (a size mismatch:
    "5120 vs 4864", seen here with DDP's two buckets of this model), so a bucket waits for
    the one before. It gives up overlapping one bucket's compression with the next
    bucket's gradients, a fraction of a step here."""
    last: list[Any] = [None]

    def ordered(state: Any, bucket: Any) -> Any:
        if last[0] is not None:
            last[0].wait()
        last[0] = hook(state, bucket)
        return last[0]

    import torch
    import torch.distributed as dist

    # DDP checks the hook's annotations as objects (this module's are strings)
    ordered.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return ordered


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from archipelago.workers.runtime.optim import build_inner
    from archipelago.workers.tasks.task import load_task
    from archipelago.workers.wire.spec import InnerConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task = load_task(args.factory, json.loads(args.task_kwargs))
    task.prepare()
    model = task.build_model()
    t_init = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=args.world
    )
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters: every rank starts there
    register_hook(ddp, Hook(args.hook), args.powersgd_rank, args.powersgd_start)
    inner = InnerConfig(lr=args.lr)
    opt, schedule = build_inner(inner, ddp.parameters(), args.steps)
    batches = task.train_batches(args.rank, args.world, args.seed)
    evals = task.eval_batches()
    curve: list[tuple[float, int, float]] = []
    step_s: list[float] = []
    eval_s, start = 0.0, time.monotonic()

    def evaluate(step: int) -> float:
        nonlocal eval_s
        t = time.monotonic()
        model.eval()
        with torch.no_grad():
            loss = sum(float(task.loss(model, b)) for b in evals) / len(evals)
        model.train()
        eval_s += time.monotonic() - t
        curve.append((round(time.monotonic() - start - eval_s, 3), step, loss))
        return loss

    if args.rank == 0:
        evaluate(0)
    reached = None
    for step in range(1, args.steps + 1):
        t = time.monotonic()
        loss = task.loss(ddp, next(batches))
        loss.backward()
        if inner.grad_clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), inner.grad_clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.monotonic() - t)
        if step % args.eval_every:
            continue
        stop = torch.zeros(1)
        if args.rank == 0 and evaluate(step) <= args.target and reached is None:
            reached = curve[-1][0]
            stop += 1
        if args.stop_at_target:
            dist.broadcast(stop, 0)  # every rank stops together
            if stop.item():
                break
    dist.destroy_process_group()
    return {
        "rank": args.rank,
        "hook": args.hook,
        "steps": len(step_s),
        "init_s": round(start - t_init, 3),
        "step_s": step_s,
        "curve": curve,
        "eval_s": round(eval_s, 3),
        "seconds_to_target": reached,
        "params": sum(p.numel() for p in model.parameters()),
    }


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="rank 0's address")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--hook", choices=[h.value for h in Hook], default=Hook.FP32.value)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start", type=int, default=10, help="plain all-reduce steps before PowerSGD")
    p.add_argument("--factory", default="archipelago.workers.tasks.lm_task:make_task")
    p.add_argument("--task-kwargs", default="{}")
    p.add_argument("--steps", type=int, required=True, help="the step budget (the schedule's length)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--target", type=float, default=0.0, help="the eval loss whose first reach is timed")
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--out", required=True, help="rank 0's report (JSON)")
    return p


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    args = arguments().parse_args()
    report = train(args)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
