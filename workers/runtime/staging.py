"""The global parameters' way onto a CUDA device at a round's start: through page-locked
memory, asynchronously, in pieces.

The parameters arrive as a flat numpy array in pageable memory (an object-store read). A
copy from pageable memory to a GPU is staged by the driver through its own small pinned
buffers and holds the host until the last byte has landed; on an H200 the 124 M GPT-2
island's two such copies a round (into the round's start and into the live parameters)
took about 140 ms of a ten-step round (docs/findings/gpu.md). Here the parameters are
copied once, piece by piece, into a page-locked buffer this island allocates once and
keeps, and each piece is sent to the device with `non_blocking=True` as soon as it is
staged: the DMA of one piece overlaps the host's copy of the next, and the host goes on to
read the first batch and queue the first step while the last piece is in flight.

The copies are queued on the device's current stream, the one the round's steps run on:
every consumer of the parameters (the start's copy into the live buffer, the first
forward) is queued behind them in order, so nothing waits on the host and no cross-stream
bookkeeping is needed; a side stream would gain nothing here, since the round's first
kernel needs the parameters whole. The buffer is reused round after round: before the
host writes into it again it waits for the last round's copies out of it (an event), which
have long finished by then (the round read its Δ back from the device since).

Only on CUDA: on a CPU the parameters are already where they are trained, and the path
there is exactly what it was (the CPU's numbers, the default run's included, unchanged)."""

from __future__ import annotations

import torch

PIECE = 1 << 24  # elements staged and sent at a time (64 MB of fp32): 8 pieces for the 124 M GPT-2


def staged(destination: torch.device) -> bool:
    """Whether parameters bound for `destination` go through the page-locked stage: on
    CUDA only (a CPU trains from host memory as it is)."""
    return destination.type == "cuda"


def pieces(numel: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """The [lo, hi) spans a flat copy of `numel` elements is staged in, in order."""
    return [(lo, min(lo + piece, numel)) for lo in range(0, numel, piece)]


class PinnedStage:
    """One island's page-locked buffer for its parameters' copy onto its GPU (see the module)."""

    def __init__(self, piece: int = PIECE) -> None:
        self.piece = piece
        self.buffer: torch.Tensor | None = None
        self.emptied: torch.cuda.Event | None = None  # recorded after the last copy out of the buffer

    def copy(self, source: torch.Tensor, into: torch.Tensor) -> None:
        """`into` (on a CUDA device) ← `source` (host memory), queued on the current stream;
        the host returns once the last piece is staged, not when it has landed."""
        if not staged(into.device):
            raise ValueError(f"the pinned stage copies onto a CUDA device, not {into.device}")
        flat_source, flat_into = source.reshape(-1), into.view(-1)
        if self.emptied is not None:
            self.emptied.synchronize()  # the last round's copies have left the buffer
        if self.buffer is None or self.buffer.numel() != flat_source.numel() or self.buffer.dtype != into.dtype:
            self.buffer = torch.empty(flat_source.numel(), dtype=into.dtype, pin_memory=True)
        for lo, hi in pieces(flat_source.numel(), self.piece):
            self.buffer[lo:hi].copy_(flat_source[lo:hi])
            flat_into[lo:hi].copy_(self.buffer[lo:hi], non_blocking=True)
        self.emptied = torch.cuda.Event()
        self.emptied.record(torch.cuda.current_stream(into.device))
