"""An island's inner step never waits on its device: nothing in it reads a tensor back to
the host (`.item()`, `float()`, `bool()`, `.tolist()`, `.numpy()`, `.cpu()`). On a GPU each
such read stalls the step until the queue drains; on this CPU there is no queue to stall,
so the reads are counted where they are made, with a `TorchFunctionMode`, and compared
between rounds of 1 and 4 inner steps of the default island: what a step adds is zero in
the project's code. The round's own reads, once a round, are the documented ones
(docs/architecture.md, "An island's host reads")."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.workers.runtime.island import Island

READS = {
    torch.Tensor.item,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__bool__,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}
PROJECT = ("orchestrator", "workers", "api")  # the folders, however the package is imported


class HostReads(TorchFunctionMode):
    """Each read of a tensor back to the host, by where it was made: (the project's function
    that made it, or torch's module when torch made it on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            stack = traceback.extract_stack()[:-1]
            ours = [f for f in stack if _ours(f.filename)]
            if ours and stack[-1] is ours[-1]:  # made in the project's code
                where = f"{'/'.join(Path(ours[-1].filename).parts[-2:])}:{ours[-1].name}"
            else:  # made by torch (or a library) on its own
                where = stack[-1].filename.split("site-packages/")[-1]
            self.seen[(func.__name__, where)] += 1
        return func(*args, **(kwargs or {}))


def _ours(filename: str) -> bool:
    parts = Path(filename).parts
    return any(p in parts for p in PROJECT) and "site-packages" not in parts and "tests" not in parts


def _reads(island: Island, steps: int) -> collections.Counter[tuple[str, str]]:
    params = island.flat.numpy()  # the published parameters, as the pool hands them in
    order = island.order(0, steps)
    with HostReads() as reads:
        island.run(order, params)
    return reads.seen


def test_an_inner_step_of_the_default_island_reads_nothing_back_to_the_host(corpus_cache):
    cfg = load_config(None, [f"task.kwargs.cache_dir={corpus_cache}", "warm_start.steps=0"])
    torch.manual_seed(cfg.seed)
    island = Island(island_spec(cfg, 0))
    _reads(island, 1)  # the first round builds the optimizer's state
    one, four = _reads(island, 1), _reads(island, 4)
    per_step = {k: four[k] - one.get(k, 0) for k in four if four[k] != one.get(k, 0)}
    # torch's AdamW (foreach, off CUDA) reads its step counter, a host tensor, twice a step;
    # on CUDA the island's AdamW is fused and keeps it on the device (test_inner_step)
    assert per_step == {("item", "torch/optim/optimizer.py"): 6}, per_step
    # once a round: the Δ encoded on the host (uplink) and the losses summed on the device, read
    assert {k: v for k, v in four.items() if "optimizer.py" not in k[1]} == {
        ("cpu", "runtime/uplink.py:encode_update"): 1,
        ("numpy", "runtime/uplink.py:encode_update"): 1,
        ("__float__", "runtime/island.py:_run"): 1,
    }, four
