"""The island compiles a Hugging Face model's repeated blocks in place, so every path through
them runs compiled: the task's chunked training loss, which calls the model's body and not
the model, ran uncompiled under a whole-model wrapper. A model without a body of its own
(the default GPT, whose loss calls it) is compiled whole: one graph, faster for a small
model's step. Counted here with Dynamo's counting backend (nothing is code-generated)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from archipelago.workers.runtime.compiling import compiled_forward, repeated_blocks
from archipelago.workers.tasks.chunked_loss import causal_lm_train_loss
from tests.helpers import is_compiled


def _tiny_llama() -> nn.Module:
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=12,  # past Dynamo's recompile limit (8), had each block its own graph
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,  # as the task builds it (a cache's per-layer index would specialise each block)
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _loss(model: nn.Module) -> torch.Tensor:
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    return causal_lm_train_loss(model, (x, torch.roll(x, -1, 1)), tokens=8)


def test_the_repeated_blocks_are_the_largest_list_of_one_class():
    model = _tiny_llama()
    assert repeated_blocks(model) == list(model.model.layers)
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []  # no ModuleList
    mixed = nn.Module()
    mixed.parts = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    assert repeated_blocks(mixed) == []


def test_the_chunked_training_loss_runs_compiled_blocks_which_a_whole_model_wrapper_misses():
    model = _tiny_llama()
    want = _loss(model)
    torch._dynamo.reset()
    wrapper_counter = CompileCounter()
    wrapped = torch.compile(model, backend=wrapper_counter)
    _loss(wrapped).backward()
    assert wrapper_counter.frame_count == 0  # the loss calls the body, past the wrapper
    torch._dynamo.reset()
    counter = CompileCounter()
    forward = compiled_forward(model, backend=counter)
    assert forward is model and is_compiled(forward)
    got = _loss(forward)
    got.backward()
    assert counter.frame_count == 1  # the blocks ran compiled, all twelve through one graph
    torch.testing.assert_close(got, want)  # with the same numbers
    assert all(p.grad is not None for p in model.model.layers.parameters())


def test_a_model_without_repeated_blocks_is_compiled_whole():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    counter = CompileCounter()
    forward = compiled_forward(model, backend=counter)
    assert forward is not model and is_compiled(forward) and not is_compiled(model)
    forward(torch.randn(3, 4))
    assert counter.frame_count == 1


def test_the_default_gpt_whose_loss_calls_it_is_compiled_whole_in_one_graph():
    """Its blocks repeat, but it has no body of its own: a wrapper, one frame for the model."""
    from archipelago.workers.tasks.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(context=16, d_model=32, n_layers=4, n_heads=2))
    assert len(repeated_blocks(model)) == 4
    torch._dynamo.reset()
    counter = CompileCounter()
    forward = compiled_forward(model, backend=counter)
    assert forward is not model and is_compiled(forward)
    assert not any(getattr(b, "_compiled_call_impl", None) for b in repeated_blocks(model))
    forward(torch.randint(0, 256, (2, 16))).sum().backward()
    assert counter.frame_count == 1
