"""FSDP2 islands (`islands.sharding: fsdp`): each worker of an island holds 1/N of every
parameter, gradient and optimizer state (`torch.distributed.fsdp.fully_shard`), for a model
that does not fit one accelerator. The rest of the island speaks in whole flat vectors, so
`ShardedParams` gives the `FlatParams` interface over the shards: the whole vector is
materialised only at a round's edges (the global θ scattered into the shards when a round
starts, one all-gather when it ends to form Δ), never per inner step."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..wire.flat import as_tensor


def shard_model(model: nn.Module, device_type: str, world: int) -> None:
    """`fully_shard` every block of the model (each element of its `nn.ModuleList`s: the
    transformer layers of the bundled GPT and of Hugging Face models), then the root, over
    the process group already formed (gloo on CPU, NCCL on GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for p in model.parameters():
        p.grad = None  # the flat gradient buffer's views: FSDP2 keeps sharded gradients of its own
    mesh = init_device_mesh(device_type, (world,))
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class ShardedParams:
    """`FlatParams`' interface over an FSDP2-sharded model. Parameters are laid out in the
    flat vector in `named_parameters` order, exactly as `FlatParams` laid them out before
    sharding, so the island's Δ means the same coordinates as everyone else's."""

    def __init__(self, model: nn.Module, layout: dict[str, tuple[int, torch.Size]], rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.params: list[tuple[int, torch.Size, Any]] = [
            (*layout[name], p) for name, p in model.named_parameters() if p.requires_grad
        ]
        if len(self.params) != len(layout):
            raise ValueError(f"sharded model has {len(self.params)} parameters, the flat layout {len(layout)}")
        self.numel = sum(shape.numel() for _, shape, _ in self.params)
        self.locals = [p.to_local() for _, _, p in self.params]  # this worker's shards (views)

    @staticmethod
    def layout(model: nn.Module) -> dict[str, tuple[int, torch.Size]]:
        """Each trainable parameter's offset and shape in the flat vector (before sharding)."""
        out, offset = {}, 0
        for name, p in model.named_parameters():
            if p.requires_grad:
                out[name] = (offset, p.shape)
                offset += p.numel()
        return out

    def load(self, values: np.ndarray | torch.Tensor) -> None:
        """Scatter the global flat θ into this worker's shards (rows chunked as FSDP2 does)."""
        src = as_tensor(values)
        if src.shape != (self.numel,):
            raise ValueError(f"flat parameters have shape {tuple(src.shape)}, expected ({self.numel},)")
        with torch.no_grad():
            for (offset, shape, _), local in zip(self.params, self.locals, strict=True):
                chunks = src[offset : offset + shape.numel()].view(shape).chunk(self.world, dim=0)
                if self.rank < len(chunks) and local.numel():
                    local.copy_(chunks[self.rank])

    def full(self) -> torch.Tensor:
        """The whole flat θ in host memory: one all-gather per parameter, once per round
        (each gathered parameter leaves the device at once, so the device never holds
        more than one whole parameter beyond its shards)."""
        with torch.no_grad():
            return torch.cat([p.full_tensor().reshape(-1).cpu() for _, _, p in self.params])

    def full_grad(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.grad.full_tensor().reshape(-1).cpu() for _, _, p in self.params])

    def zero_grad(self) -> None:
        for _, _, p in self.params:
            p.grad = None

    def clip_grad(self, max_norm: float) -> None:
        """The global gradient norm from the shards (one all-reduce), the same rule as
        `FlatParams.clip_grad`; vectorised over the shards with torch's foreach kernels."""
        grads = [p.grad.to_local() for _, _, p in self.params if p.grad is not None]
        sq = torch.zeros((), device=self.locals[0].device)
        if grads:
            sq = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float()) ** 2
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        if norm > max_norm:
            torch._foreach_mul_(grads, max_norm / norm)

    def numpy(self) -> np.ndarray:
        return self.full().detach().cpu().numpy().copy()
