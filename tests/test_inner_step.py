"""An island's inner step options: gradient accumulation over micro-batches, bf16
autocast, torch.compile; and batches that do not split are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.workers.runtime.island import Island
from archipelago.workers.runtime.optim import build_inner
from archipelago.workers.tasks.task import split_batch
from tests.helpers import TINY_LM, in_process_run

# the shared tiny GPT (later overrides win), on 2 islands with fewer eval batches and a shorter warmup
TINY_GPT = [*TINY_LM, "task.kwargs.eval_batches=2", "islands.count=2", "inner.warmup_steps=2"]


def _cfg(cache: str, *extra: str):
    return load_config(None, [*TINY_GPT, f"task.kwargs.cache_dir={cache}", *extra])


def _round(cfg) -> np.ndarray:
    torch.manual_seed(cfg.seed)
    island = Island(island_spec(cfg, 0))
    return island.run(island.order(0, 4), island.flat.numpy()).delta()


def test_micro_batches_give_the_whole_batchs_step(corpus_cache):
    # SGD: the update is the gradient itself (Adam would magnify fp32 rounding of near-zero
    # gradients into visible differences)
    one = _round(_cfg(corpus_cache, "inner.optimizer=sgd"))
    four = _round(_cfg(corpus_cache, "inner.optimizer=sgd", "inner.micro_batches=4"))
    assert np.abs(one).max() > 1e-3  # it moved
    np.testing.assert_allclose(four, one, rtol=0, atol=1e-7)


def test_a_batch_that_does_not_split_is_a_clear_error(corpus_cache):
    with pytest.raises(ValueError, match=r"multiple of islands\.workers"):
        split_batch((torch.zeros(6, 3),), 0, 4, "islands.workers")
    with pytest.raises(ValueError, match=r"multiple of inner\.micro_batches"):
        _round(_cfg(corpus_cache, "inner.micro_batches=3"))


def test_bf16_autocast_trains_within_2_percent_of_fp32(corpus_cache, tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = _cfg(
            corpus_cache,
            f"inner.precision={precision}",
            "rounds=4",
            "inner_steps=10",
            f"out_dir={tmp_path / precision}",
        )
        engine, _, _ = in_process_run(cfg)
        runs[precision] = engine.summary
    fp32, bf16 = runs["fp32"]["final_eval_loss"], runs["bf16"]["final_eval_loss"]
    assert fp32 < 0.8 * runs["fp32"]["initial_eval_loss"]  # it trained
    assert abs(bf16 / fp32 - 1) < 0.02, (fp32, bf16)
    assert bf16 != fp32  # autocast really ran in bf16


def test_an_unknown_precision_names_the_field():
    from archipelago.orchestrator.config_load import ConfigError

    with pytest.raises(ConfigError, match=r"inner\.precision"):
        load_config(None, ["inner.precision=fp8"])


def test_a_compiled_model_takes_the_eager_step(corpus_cache):
    eager = _round(_cfg(corpus_cache, "inner.optimizer=sgd"))
    compiled = _round(_cfg(corpus_cache, "inner.optimizer=sgd", "inner.compile=true"))
    assert np.abs(eager).max() > 1e-3
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_inner_optimizer_steps_one_flat_parameter_as_it_would_each_tensor(corpus_cache, optimizer):
    """AdamW and SGD step one parameter over the flat buffer (`inner_params`): the same
    round as the optimizer over the model's own tensors, to float rounding."""
    cfg = _cfg(corpus_cache, f"inner.optimizer={optimizer}", "inner.weight_decay=0.1")
    torch.manual_seed(cfg.seed)
    island = Island(island_spec(cfg, 0))
    assert [p.numel() for g in island.optimizer.param_groups for p in g["params"]] == [island.flat.numel]
    start = island.flat.numpy()
    flat = island.run(island.order(0, 4), start).delta()
    torch.manual_seed(cfg.seed)
    spec = island_spec(cfg, 0)
    each = Island(spec)
    each.optimizer, each.scheduler = build_inner(
        cfg.inner, each.model.parameters(), spec.total_inner_steps, spec.start_step, spec.rewarmup_steps
    )
    assert len(each.optimizer.param_groups[0]["params"]) > 10
    per_tensor = each.run(each.order(0, 4), start).delta()
    assert np.abs(flat).max() > 1e-3  # it moved
    np.testing.assert_allclose(flat, per_tensor, rtol=0, atol=1e-6)


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere():
    """On CUDA the island's AdamW is torch's fused kernel, as the bare loop's is (the ratio
    `bench bareloop` reports then measures orchestration); on the CPU it stays `foreach`, so
    the CPU's numbers do not move. The CUDA run itself: `tests/test_cuda.py`."""
    from types import SimpleNamespace

    from archipelago.workers.runtime.optim import adamw_kernel

    assert adamw_kernel([torch.nn.Parameter(torch.zeros(3))]) == {"foreach": True}
    on_cuda = [SimpleNamespace(device=torch.device("cuda", i)) for i in range(2)]
    assert adamw_kernel(on_cuda) == {"fused": True}  # type: ignore[arg-type]
    assert adamw_kernel([*on_cuda, torch.nn.Parameter(torch.zeros(1))]) == {"foreach": True}  # type: ignore[list-item]
