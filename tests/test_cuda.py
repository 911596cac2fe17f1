"""On a CUDA device: islands train in bf16 there, the HF task included, and islands share
one device through fractional GPUs on Ray. Skipped, saying so, without CUDA (CI has none);
`archipelago bench gpu` measures tokens/s and MFU on the same paths."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.workers.runtime.island import Island
from tests.helpers import TINY_LM, is_compiled

pytestmark = pytest.mark.cuda


def _round(cfg, device: str) -> tuple[Island, np.ndarray]:
    torch.manual_seed(cfg.seed)
    island = Island(replace(island_spec(cfg, 0), device=device))
    return island, island.run(island.order(0, 5), island.flat.numpy()).delta()


@pytest.mark.parametrize("task", ["gpt", "llama"])
def test_a_bf16_island_on_cuda_matches_fp32_on_cpu(corpus_cache, task):
    extra = (
        []
        if task == "gpt"
        else ["task.factory=archipelago.workers.tasks.hf_task:make_task", "task.kwargs.preset=tiny-llama"]
    )
    if task == "llama":
        pytest.importorskip("transformers")
    common = [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}", "islands.count=2", *extra]
    if task == "llama":
        common = [o for o in common if not o.startswith(("task.kwargs.d_model", "task.kwargs.n_"))]
    gpu, on_gpu = _round(load_config(None, [*common, "inner.precision=bf16"]), "cuda")
    _, on_cpu = _round(load_config(None, common), "cpu")
    assert gpu.device.type == "cuda" and gpu.flat.data.dtype == torch.float32  # fp32 master weights
    assert np.isfinite(on_gpu).all()
    cos = float(np.dot(on_gpu, on_cpu) / (np.linalg.norm(on_gpu) * np.linalg.norm(on_cpu)))
    assert cos > 0.95, cos  # the same update, up to bf16 rounding


def test_the_islands_adamw_on_cuda_is_the_fused_kernel_a_bare_loop_uses(corpus_cache):
    cfg = load_config(None, [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}", "inner.precision=bf16"])
    island, _ = _round(cfg, "cuda")
    group = island.optimizer.param_groups[0]
    assert group["fused"] is True and not group["foreach"]


def test_an_island_on_cuda_compiles_its_forward_by_default_and_one_on_the_cpu_does_not(corpus_cache):
    cfg = load_config(None, [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}"])
    assert cfg.inner.compile is None  # the default: decided by the device
    on_gpu = Island(replace(island_spec(cfg, 0), device="cuda"))
    on_cpu = Island(replace(island_spec(cfg, 0), device="cpu"))
    assert is_compiled(on_gpu.forward_model) and not is_compiled(on_cpu.forward_model)


def test_an_island_on_cuda_lands_its_parameters_through_one_pinned_buffer_kept_round_after_round(corpus_cache):
    cfg = load_config(None, [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}", "inner.precision=bf16"])
    torch.manual_seed(cfg.seed)
    island = Island(replace(island_spec(cfg, 0), device="cuda"))
    params = island.flat.numpy()
    island.run(island.order(0, 2), params)
    buffer = island.stage.buffer
    assert buffer is not None and buffer.is_pinned() and island.start.is_cuda
    assert torch.equal(island.start.cpu(), torch.from_numpy(params))  # what its Δ was taken against
    moved = params + 1
    island.run(island.order(1, 2), moved)
    assert island.stage.buffer.data_ptr() == buffer.data_ptr()  # pinned once
    assert torch.equal(island.start.cpu(), torch.from_numpy(moved))


def test_the_pinned_stage_copies_exactly_in_pieces():
    from archipelago.workers.runtime.staging import PinnedStage

    stage = PinnedStage(piece=1000)
    for n in (2500, 3000):  # a new size: a new buffer
        source = torch.randn(n)
        into = torch.empty(n, device="cuda")
        stage.copy(source, into)
        torch.cuda.current_stream().synchronize()
        assert torch.equal(into.cpu(), source) and stage.buffer.numel() == n


@pytest.mark.ray
def test_islands_share_one_gpu_through_fractional_gpus(corpus_cache, tmp_path):
    import ray

    from archipelago.orchestrator.runtime.driver import run

    ray.shutdown()
    cfg = load_config(
        None,
        [
            *TINY_LM,
            f"task.kwargs.cache_dir={corpus_cache}",
            "islands.count=2",
            "islands.gpus=0.5",
            "inner.precision=bf16",
            "rounds=2",
            "inner_steps=5",
            f"out_dir={tmp_path}",
        ],
    )
    summary = run(cfg, show_progress=False)
    assert summary["state"] == "finished" and summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert all("cuda" in isl["node"] for isl in summary["islands"].values())
