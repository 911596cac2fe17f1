"""Flat parameter/grad buffers: one vectorised op per load and per pseudo-gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from archipelago.workers.wire.flat import FlatParams


def test_parameters_and_grads_are_views_of_flat_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    flat = FlatParams(model)
    np.testing.assert_array_equal(flat.numpy(), expected)
    flat.load(np.zeros(flat.numel, dtype=np.float32))
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())
    model(torch.ones(5, 3)).sum().backward()
    assert float(flat.grad.abs().sum()) > 0  # backward accumulated into the flat grad buffer


def test_numpy_is_a_copy_and_shapes_are_checked():
    flat = FlatParams(nn.Linear(2, 2))
    snap = flat.numpy()
    flat.data.add_(1.0)
    assert not np.allclose(snap, flat.numpy())
    with pytest.raises(ValueError, match="shape"):
        flat.load(np.zeros(flat.numel + 1, dtype=np.float32))
