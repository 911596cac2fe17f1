"""Optimizers without the `torch._dynamo` import.

torch imports `torch._dynamo` the first time a process builds, steps or saves any
`torch.optim` optimizer: `Optimizer.add_param_group`, `zero_grad`, `state_dict` and
`load_state_dict` are wrapped by `torch._disable_dynamo`, which imports it on first call,
and `SGD.step`/`Adam.step` by `_use_grad_for_differentiable`, which imports it on every
call. All of it only keeps torch.compile from tracing into the optimizer. That import
costs about 1.1 s of CPU (more than `import torch` itself): measured in `bench startup`,
it was the largest part of every island's start and of the coordinator's, paid by 5
processes side by side on 2 cores. Archipelago never compiles an optimizer
(`inner.compile` compiles the model's forward only), so its processes skip it.

Importing this module applies the first change (`skip_dynamo_import`, idempotent): the
module that defines the optimizers (`workers/runtime/optim.py`: the islands', ddp's and
the outer step's Adam) imports it, and `orchestrator/engine/policies.py` imports that
module before it builds any outer optimizer (in the coordinator and in every coordinator
slice), so no process has to remember a call before its first optimizer. Both changes call the very functions torch would, so results are bitwise the same
(`tests/test_no_dynamo.py`); where torch's wrappers are not what this module expects, it
changes nothing and torch imports `torch._dynamo` as before.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

import torch
import torch._compile

_DISABLED = torch._compile._disable_dynamo(lambda: None).__code__  # the wrapper's code, shared by all
_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")

T = TypeVar("T", bound=type[torch.optim.Optimizer])


def skip_dynamo_import() -> None:
    """Mark `Optimizer`'s dynamo-disabled methods as disabled already (the wrapper caches
    the disabled function on the first call; this caches the function itself), so that no
    call imports `torch._dynamo`. For processes that compile no optimizer: every island
    and coordinator."""
    for name in _WRAPPED:
        method = getattr(torch.optim.Optimizer, name)
        raw = getattr(method, "__wrapped__", None)
        if raw is not None and getattr(method, "__code__", None) is _DISABLED:
            raw.__dynamo_disable = raw


def plain_step(cls: T) -> T:
    """A subclass of `cls` whose `step` is torch's own step body, called under `no_grad`
    as `_use_grad_for_differentiable` calls it for a non-differentiable optimizer, without
    that wrapper's `import torch._dynamo` and graph break (a no-op outside torch.compile)."""
    raw = inspect.unwrap(cls.step)
    if raw is cls.step:  # not wrapped: nothing to skip
        return cls

    def step(self: Any, closure: Any = None) -> Any:
        with torch.no_grad():
            return raw(self, closure)

    return type(cls.__name__, (cls,), {"step": step, "__doc__": cls.__doc__, "__module__": __name__})  # type: ignore[return-value]


skip_dynamo_import()
