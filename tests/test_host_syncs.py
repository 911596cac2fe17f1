"""An island's inner step never waits on its device. Two counts, on the default island:
- below Python (`tests/host_syncs.py`: a `TorchDispatchMode`), every operation one inner
  step dispatches that would make a GPU's host wait — a value read back (`.item()`,
  `float()`, `bool()`), an output shaped by the values (`nonzero`, `masked_select`,
  `unique`, a boolean index), a copy to the CPU — by the site that made it: only the
  documented ones (`ALLOWED`);
- at the project's calls (a `TorchFunctionMode`), every read of a tensor back to the host
  (`.item()`, `float()`, `bool()`, `.tolist()`, `.numpy()`, `.cpu()`: the last three
  dispatch nothing on a CPU), compared between rounds of 1 and 4 inner steps: what a step
  adds is zero in the project's code. The round's own reads, once a round, are the
  documented ones (docs/architecture.md, "An island's host reads")."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.workers.runtime.island import Island
from tests.host_syncs import ALLOWED, LIBRARIES, HostSyncs, site_path

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
                where = site_path(stack[-1].filename)
            self.seen[(func.__name__, where)] += 1
        return func(*args, **(kwargs or {}))


def _ours(filename: str) -> bool:
    parts = Path(filename).parts
    return any(p in parts for p in PROJECT) and not any(p in parts for p in LIBRARIES) and "tests" not in parts


def _default_island(corpus_cache: str) -> Island:
    cfg = load_config(None, [f"task.kwargs.cache_dir={corpus_cache}", "warm_start.steps=0"])
    torch.manual_seed(cfg.seed)
    return Island(island_spec(cfg, 0))


def test_the_sync_counter_sees_each_kind_of_sync_by_its_site():
    """What the island's test relies on: each kind is seen, inside torch's functions too,
    and named by the line's function; work that never waits is not counted."""
    x = torch.arange(-2.0, 3.0)
    weight = torch.nn.Parameter(x.clone())
    weight.grad = x.clone()

    def reads() -> None:
        x.sum().item()
        float(x.max())
        if x.min() < 0:  # bool()
            x[x > 0]
        torch.where(x > 0)  # nonzero
        torch.unique(x)
        x.repeat_interleave(torch.ones(5, dtype=torch.long))
        torch.nn.utils.clip_grad_norm_([weight], 1.0, error_if_nonfinite=True)

    with HostSyncs() as syncs:
        (x * 2).softmax(0).cumsum(0)  # none of these waits
        x.repeat_interleave(2)  # its output size is known
        reads()
    sites = {op for op, where in syncs.seen if where == "tests/test_host_syncs.py:reads"}
    assert sites == {"aten._local_scalar_dense", "aten.index", "aten.nonzero", "aten.repeat_interleave"}
    # made inside torch's functions: named by them
    assert ("aten._unique2", "torch/functional.py:_unique_impl") in syncs.seen
    assert any(op == "aten._local_scalar_dense" and "clip_grad" in where for op, where in syncs.seen), syncs.seen
    assert syncs.unexplained() == {k: n for k, n in syncs.seen.items()}


def test_one_inner_step_of_the_default_island_makes_only_the_documented_host_syncs(corpus_cache):
    island = _default_island(corpus_cache)
    island.run(island.order(0, 1), island.flat.numpy())  # the optimizer's state built, as in any later round
    shard = next(iter(island.order(1, 1).shards))
    batch = next(iter(island.task.train_batches(shard, island.num_shards, island.spec.seed)))
    with HostSyncs() as syncs:
        island.inner_step(batch)
    assert syncs.unexplained() == {}, syncs.seen
    # foreach AdamW reads its host step counter twice a step for the island's one flat parameter
    assert syncs.seen == {next(iter(ALLOWED)): 2}, syncs.seen


def _reads(island: Island, steps: int) -> collections.Counter[tuple[str, str]]:
    params = island.flat.numpy()  # the published parameters, as the pool hands them in
    order = island.order(0, steps)
    with HostReads() as reads:
        island.run(order, params)
    return reads.seen


def test_an_inner_step_of_the_default_island_reads_nothing_back_to_the_host(corpus_cache):
    island = _default_island(corpus_cache)
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
