"""Atomic coordinator checkpoints: one `state.pt` in the checkpoint folder, replaced with
`os.replace`, so a crash mid-write never leaves a torn checkpoint behind.

On a cluster point `checkpoint.path` at shared storage (NFS, a mounted bucket) so a
coordinator restarted on another node finds it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FILE = "state.pt"


def save_checkpoint(folder: Path, state: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, folder / FILE)
    return folder / FILE


def load_checkpoint(folder: Path) -> dict[str, Any] | None:
    path = folder / FILE
    if not path.exists():
        return None
    return torch.load(path, weights_only=False)
