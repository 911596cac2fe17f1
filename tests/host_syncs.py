"""Counting the operations that make a GPU's host wait for its device, on a CPU.

A training step on a GPU runs ahead of its device: the host queues kernels and goes on.
An operation that needs a value back — `.item()`, `float(t)`, `bool(t)`, `int(t)` (all
`aten._local_scalar_dense` underneath), `aten.is_nonzero`, `aten.equal` — or that cannot
know its output's shape before the values exist — `aten.nonzero` (and `torch.where(mask)`),
`aten.masked_select`, `aten.unique*`, `aten.repeat_interleave` without its output size, an
index by a boolean mask — makes the host wait until the device has drained its queue, and
so does a copy of a device tensor to the CPU. On this CPU nothing waits, but the same
operations are dispatched: `HostSyncs`, a `TorchDispatchMode`, sees each one below Python
(inside torch's own functions too, where a `TorchFunctionMode` sees nothing) and counts it
by the site that made it. A copy to the CPU from a device is never seen here (there is no
device), which is why the function-level count in `test_host_syncs.py` is kept beside it.

`ALLOWED` is the documented list of the syncs a training step may make (docs/architecture.md,
"An island's host reads"), each with why; every other site fails the tests that use it."""

from __future__ import annotations

import collections
import os
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

READ_BACK = {aten._local_scalar_dense, aten.is_nonzero, aten.equal}  # a value back on the host
DATA_SHAPED = {  # an output whose shape the values decide
    aten.nonzero,
    aten.argwhere,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
}
MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}  # a boolean index: a nonzero
COPIES = {aten._to_copy, aten.copy_}  # a device tensor brought to the CPU

# Frames that only pass a call on (torch's wrappers, this mode): the site is the frame before them.
PLUMBING = ("torch/utils/_python_dispatch.py", "torch/_compile.py", "torch/_dynamo/", "torch/overrides.py", __file__)

# The syncs a training step may make, by (operation, site): why each is harmless.
ALLOWED: dict[tuple[str, str], str] = {
    (
        "aten._local_scalar_dense",
        "torch/optim/optimizer.py:_get_value",
    ): "torch's AdamW off CUDA (foreach) reads its step counter, a tensor kept on the host even when the "
    "parameters are on a GPU (not capturable): no device to wait for. On CUDA the island's AdamW, the bare "
    "loop's and the reference loop's are fused, and keep the counter on the device (none)."
}


TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__))  # torch's package, wherever it is installed
LIBRARIES = ("site-packages", "dist-packages")  # the folders other libraries are installed in


def site_path(filename: str) -> str:
    """A file named as its site is: `torch/optim/optimizer.py` for torch's (its path below
    torch's own package, wherever torch is installed: site- or dist-packages, a conda or a
    source tree), `transformers/models/gpt2/modeling_gpt2.py` for another library's (its
    path below site- or dist-packages), `runtime/island.py` for the project's (its folder
    and file)."""
    real = os.path.realpath(filename)
    if real.startswith(TORCH_DIR + os.sep):
        return "torch/" + Path(os.path.relpath(real, TORCH_DIR)).as_posix()
    parts = Path(filename).parts
    below = [i for i, part in enumerate(parts) if part in LIBRARIES]
    return "/".join(parts[below[-1] + 1 :] if below else parts[-2:])


def _site(stack: list[traceback.FrameSummary]) -> str:
    """Where an operation was made: the innermost frame that is not a wrapper's, as
    `torch/optim/optimizer.py:_get_value` (its file by `site_path`, then its function)."""
    frame = next(f for f in reversed(stack) if not any(p in f.filename for p in PLUMBING))
    return f"{site_path(frame.filename)}:{frame.name}"


def _syncs(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the operation `func(*args, **kwargs)` makes a GPU's host wait (see the module)."""
    packet = func.overloadpacket
    if packet in READ_BACK or packet in DATA_SHAPED:
        return True
    if packet is aten.repeat_interleave:
        return kwargs.get("output_size") is None
    if packet in MASK_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if packet in COPIES:
        source = args[1] if packet is aten.copy_ else args[0]
        destination = kwargs.get("device") or (args[0].device if packet is aten.copy_ else None)
        return source.device.type != "cpu" and destination is not None and torch.device(destination).type == "cpu"
    return False


class HostSyncs(TorchDispatchMode):
    """Every operation in its scope that would make a GPU's host wait, counted by
    (operation, site) in `seen`."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            self.seen[(f"aten.{func.overloadpacket.__name__}", _site(traceback.extract_stack()[:-1]))] += 1
        return func(*args, **kwargs)

    def unexplained(self) -> dict[tuple[str, str], int]:
        """The syncs seen that `ALLOWED` does not explain."""
        return {k: n for k, n in self.seen.items() if k not in ALLOWED}
