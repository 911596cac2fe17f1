"""The reference loop (`orchestrator/bench/reference.py`), on the CPU: it trains the task's
model (its loss falls), its micro-batches accumulate to the whole batch's step, its compiled
loss — the model and the chunked head in one graph, forward and backward — trains as the
uncompiled one does, and a step of it makes only the documented host syncs. `bench gpu`
runs it on CUDA, compiled by Inductor; here Dynamo and AOTAutograd compile it without code
generation (`aot_eager`), which takes seconds where Inductor's C++ takes half a minute."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from archipelago.orchestrator.bench.bareloop import BareLoop
from archipelago.orchestrator.bench.reference import ReferenceLoop, reference_run
from archipelago.orchestrator.config_load import load_config
from archipelago.workers.tasks.task import load_task
from tests.helpers import TINY_LM
from tests.host_syncs import HostSyncs


def _losses(loop: BareLoop, cfg, steps: int) -> list[float]:
    batches = iter(loop.task.train_batches(0, cfg.num_shards, cfg.seed))
    return [float(loop.train(batches, 1)) for _ in range(steps)]


def _loop(cfg, kind: type[BareLoop], **kwargs) -> BareLoop:
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    task.prepare()
    torch.manual_seed(cfg.seed)
    return kind(task, task.build_model(), cfg, torch.device("cpu"), **kwargs)


def test_the_reference_loop_trains_and_reports_its_rate_and_profile(corpus_cache):
    cfg = load_config(None, [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}"])
    got = reference_run(cfg, micro_rows=4, warmup=5, steps=10)
    assert got["rows"] == 8 and got["micro_rows"] == 4 and got["micro_batches"] == 2
    assert got["tokens_per_step"] == 8 * 32 and got["tokens_per_s"] > 0 and not got["compiled"]  # a CPU: eager
    assert got["params"] == sum(p.numel() for p in _loop(cfg, BareLoop).model.parameters())
    losses = got["losses"]
    assert losses["profiled"] < losses["timed"] < losses["warmup"] < math.log(256), losses  # it learns
    profile = got["profile"]
    assert profile["device"] == "cpu" and profile["step_s"] > 0 and profile["warmup_s"] > 0
    assert profile["top"] and profile["head_share"] is None  # the default GPT has no chunked head
    with pytest.raises(ValueError, match="do not divide"):
        reference_run(cfg, micro_rows=3)


def test_its_micro_batches_accumulate_to_the_whole_batchs_step_as_the_bare_loops_one_batch(corpus_cache):
    """Uncompiled, the reference loop is the bare loop: in 2 micro-batches it takes the steps
    the bare loop takes on the whole batch (to float rounding)."""
    cfg = load_config(None, [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}"])
    bare = _losses(_loop(cfg, BareLoop), cfg, 4)
    split = _losses(_loop(cfg, ReferenceLoop, micro_rows=4, compiles=False), cfg, 4)
    assert split == pytest.approx(bare, rel=1e-5) and split[-1] < split[0]


@pytest.mark.parametrize("task", ["gpt", "gpt2"])
def test_its_compiled_loss_trains_as_the_uncompiled_one(corpus_cache, task):
    """The whole micro-batch loss in one graph: for the default GPT its model and
    cross-entropy; for a transformers GPT-2, its body and the chunked loss's head (an
    autograd Function, its backward traced too), in two chunks a micro-batch."""
    hf = []
    if task == "gpt2":
        pytest.importorskip("transformers")
        hf = [
            "task.factory=archipelago.workers.tasks.hf_task:make_task",
            "task.kwargs.model_config={model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2, resid_pdrop: 0, "
            "embd_pdrop: 0, attn_pdrop: 0}",
            "task.kwargs.train_loss_tokens=64",
        ]
    common = [o for o in TINY_LM if not (hf and o.startswith(("task.kwargs.d_model", "task.kwargs.n_")))]
    cfg = load_config(None, [*common, f"task.kwargs.cache_dir={corpus_cache}", *hf])
    eager = _losses(_loop(cfg, ReferenceLoop, micro_rows=4, compiles=False), cfg, 3)
    counter = CompileCounterWithBackend("aot_eager")  # Dynamo and AOTAutograd, counted, no code generated
    compiled = _loop(cfg, ReferenceLoop, micro_rows=4, compiles=True, backend=counter)
    assert _losses(compiled, cfg, 3) == pytest.approx(eager, rel=1e-4)
    assert counter.frame_count == 1  # one graph: no break in the loss


def test_a_step_of_the_reference_loop_makes_only_the_documented_host_syncs(corpus_cache):
    cfg = load_config(None, [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}"])
    loop = _loop(cfg, ReferenceLoop, micro_rows=4, compiles=False)
    batches = iter(loop.task.train_batches(0, cfg.num_shards, cfg.seed))
    loop.train(batches, 1)  # the optimizer's state built
    with HostSyncs() as syncs:
        total = loop.train(batches, 1)
    assert syncs.unexplained() == {} and syncs.seen, syncs.seen  # foreach AdamW's host step counters only
    float(total)


def test_bench_gpu_sets_every_loops_rate_and_mfu_side_by_side(corpus_cache):
    """The report's table from the parts' own outputs, measured here on the CPU: the
    reference loop and the island in process on one model, the island and the bare loop
    alternately on another; each MFU is 6 N FLOPs a token at its rate over the peak."""
    from archipelago.orchestrator.bench import bareloop, gpu
    from archipelago.orchestrator.bench.gpu_profile import profile_island

    overrides = [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}"]
    cfg = load_config(None, overrides)
    reference = reference_run(cfg, micro_rows=4, warmup=1, steps=2)
    profiled = profile_island(cfg, warmup=1, steps=2)
    ratio = bareloop.compare(overrides, steps=2, alternations=1)
    loops = gpu.loop_rates(ratio, profiled, reference, None, 8 * 32, 1e12, 2e12)
    assert [(r["loop"], r["micro_batches"]) for r in loops] == [
        ("reference loop", 2),
        ("island", 1),
        ("island", 1),
        ("bare loop", 1),
    ]
    assert loops[0]["tokens_per_s"] == reference["tokens_per_s"] and loops[1]["tokens_per_s"] > 0
    for r in loops:
        assert r["mfu"] == pytest.approx(6 * r["params"] * r["tokens_per_s"] / 1e12) == 2 * r["mfu_measured_peak"]
    text = gpu._loops_md({"loops": loops, "reference_124m": reference})
    assert "reference loop" in text and "uncompiled" in text and reference["profile"]["top"][0]["name"] in text
    assert gpu._loops_md({"loops": [], "reference_124m": None}) == "Not measured."
