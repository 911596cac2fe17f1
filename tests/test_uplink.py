"""An island's update leaves encoded where it was computed: on a GPU the value codec and
the error feedback run on the device and only the payload crosses to the host. Over several
rounds, whole and in coordinator slices, the device path sends the payloads the host path
sends, byte for byte, and keeps the same residual (on the device); a saved state holds it
as a host array."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from archipelago.workers.runtime.island_spec import IslandSpec
from archipelago.workers.runtime.uplink import encode_update
from archipelago.workers.wire.compress import ErrorFeedback
from archipelago.workers.wire.messages import Sliced
from archipelago.workers.wire.spec import InnerConfig

SPEC = IslandSpec(
    index=0,
    num_islands=1,
    seed=0,
    task_factory="tests.toy_tasks:make",
    task_kwargs={},
    inner=InnerConfig(),
    total_inner_steps=1,
    chunk=512,
    error_feedback=True,
)


def _parts(wire) -> list[dict[str, np.ndarray]]:
    return list(wire.parts) if isinstance(wire, Sliced) else [wire]


def _compare(device: str, codec: str, shards: int, decay: float) -> None:
    spec = dataclasses.replace(SPEC, codec=codec, coordinator_shards=shards, feedback_decay=decay)
    rng = np.random.default_rng(5)
    host: dict[int | None, ErrorFeedback] = {}
    there: dict[int | None, ErrorFeedback] = {}
    for _ in range(3):
        delta = torch.from_numpy(rng.normal(0, 1e-2, 5_001).astype(np.float32))
        sent_host = _parts(encode_update(delta, spec, host, on_device=False))
        sent_there = _parts(encode_update(delta.to(device), spec, there, on_device=True))
        assert len(sent_host) == len(sent_there) == shards
        for a, b in zip(sent_host, sent_there):
            assert a.keys() == b.keys() and all(isinstance(b[k], np.ndarray) for k in b)
            for key in a:
                assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), (codec, key)
    if codec == "none":
        assert not host and not there  # nothing lost, nothing kept
        return
    residual = there[None].residual
    assert isinstance(residual, torch.Tensor) and residual.device.type == device  # it stayed there
    assert np.array_equal(there[None].host(), host[None].residual)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "fp4", "bf16", "none"])
@pytest.mark.parametrize("shards", [1, 2])
def test_the_device_path_sends_what_the_host_path_sends_and_keeps_the_same_residual(codec, shards):
    _compare("cpu", codec, shards, decay=1.0 if shards == 1 else 0.95)


def test_a_top_k_chain_is_encoded_on_the_host_whatever_asked():
    spec = dataclasses.replace(SPEC, codec="topk:0.1+int2")
    feedback: dict[int | None, ErrorFeedback] = {}
    wire = encode_update(torch.ones(2_000), spec, feedback, on_device=True)
    assert "topk_idx" in wire and isinstance(feedback[None].residual, np.ndarray)


def test_a_residual_restored_as_an_array_moves_to_the_values_once():
    kept = ErrorFeedback()
    kept.residual = np.full(4, 0.5, np.float32)  # as an island's saved state restores it
    out = kept.compensate(torch.ones(4))
    assert torch.equal(out, torch.full((4,), 1.5)) and isinstance(kept.residual, torch.Tensor)
    assert np.array_equal(kept.host(), np.full(4, 0.5, np.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "fp4", "bf16", "none"])
def test_on_cuda_the_payload_and_residual_are_the_hosts(codec):
    _compare("cuda", codec, 2, decay=0.95)
