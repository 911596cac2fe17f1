"""Training's loss in bounded memory: the output layer and cross-entropy `tokens` positions at a
time, forward and backward (the logits recomputed in backward), equal to the whole-logits
loss and its gradients — of the hidden states, of a tied or untied output weight, of a bias,
of every parameter of a real Hugging Face model — with ignored positions counting for
nothing; and no operation allocates the whole logits (the profiler's per-operation memory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from archipelago.workers.tasks.chunked_loss import ChunkedCrossEntropy, causal_lm_train_loss


def _whole(hidden, weight, bias, labels):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 64, 10_000])
def test_the_chunked_loss_and_its_gradients_are_the_whole_ones(with_bias, tokens):
    torch.manual_seed(0)
    hidden = torch.randn(3, 21, 16, requires_grad=True)
    weight = torch.randn(101, 16, requires_grad=True)
    bias = torch.randn(101, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 101, (3, 21))
    labels[0, :5] = -100  # ignored positions: no loss, no gradient
    want = _whole(hidden, weight, bias, labels)
    grads = torch.autograd.grad(want, [hidden, weight] + ([bias] if with_bias else []))
    got = ChunkedCrossEntropy.apply(hidden, weight, bias, labels, tokens, -100)
    mine = torch.autograd.grad(got, [hidden, weight] + ([bias] if with_bias else []))
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6, abs=1e-6)
    for a, b in zip(mine, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.all(mine[0][0, :5] == 0)  # an ignored position's hidden state gets no gradient


def test_the_chunked_backward_passes_gradcheck():
    torch.manual_seed(1)
    hidden = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(33, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 33, (2, 9))
    logits = F.linear(hidden, weight)
    want = F.cross_entropy(logits.reshape(-1, 33), labels.reshape(-1))
    got = ChunkedCrossEntropy.apply(hidden, weight, None, labels, 4, -100)
    # the chunked loss computes its logits in fp32, as the model's own path (`.float()`) does
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert torch.autograd.gradcheck(
        lambda h, w: ChunkedCrossEntropy.apply(h, w, None, labels, 4, -100).double(),
        (hidden, weight),
        eps=1e-3,
        atol=1e-3,
    )


def test_a_hf_model_trains_with_every_gradient_the_whole_logits_give():
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    for tied in (True, False):
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            "llama",
            vocab_size=211,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            tie_word_embeddings=tied,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        x, y = torch.randint(0, 211, (4, 24)), torch.randint(0, 211, (4, 24))
        logits = model(input_ids=x).logits
        whole = F.cross_entropy(logits.reshape(-1, 211), y.reshape(-1))
        want = torch.autograd.grad(whole, list(model.parameters()))
        chunked = causal_lm_train_loss(model, (x, y), tokens=10)
        got = torch.autograd.grad(chunked, list(model.parameters()))
        assert float(chunked.detach()) == pytest.approx(float(whole.detach()), rel=1e-6)
        for (name, _), a, b in zip(model.named_parameters(), got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_no_operation_allocates_the_whole_logits():
    """Forward and backward over 4,096 positions and a 32,000-token vocabulary: the whole
    logits are 524 MB of fp32, allocated in one piece by the whole path (and again for their
    gradient); chunks of 256 positions allocate 33 MB at a time."""
    torch.manual_seed(0)
    hidden = torch.randn(4096, 64, requires_grad=True)
    weight = torch.randn(32_000, 64, requires_grad=True)
    labels = torch.randint(0, 32_000, (4096,))

    def peak(fn) -> int:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = fn()
            loss.backward()
        events = [e for e in prof.events() if e.cpu_memory_usage > 0]
        return max((e.cpu_memory_usage for e in events), default=0)

    whole = peak(lambda: _whole(hidden, weight, None, labels))
    chunked = peak(lambda: ChunkedCrossEntropy.apply(hidden, weight, None, labels, 256, -100))
    logits_bytes = 4096 * 32_000 * 4
    assert whole >= logits_bytes  # the whole path allocates the logits in one piece
    assert chunked <= logits_bytes / 8, (chunked, whole)


class _MatmulDtypes(TorchDispatchMode):
    """The input dtypes and shapes of every matmul dispatched inside it, forward and backward alike."""

    MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS:
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            self.shapes.append(tuple(n for a in args if isinstance(a, torch.Tensor) for n in a.shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_bias", [False, True])
def test_under_bf16_autocast_every_matmul_of_the_head_is_bf16_and_the_gradients_the_whole_ones(with_bias):
    """A body ending in a norm returns fp32 hidden states under autocast (the norm runs in
    fp32), and autograd runs a Function's backward outside autocast: the head's matmuls
    still run in bf16 (the tensor cores), forward and backward, the weight's gradient summed
    in fp32, and the gradients are the whole-logits path's under autocast to bf16 rounding.
    The vocabulary (257) is padded to a multiple of 64 in every matmul, the tensor cores'
    alignment, and the padding changes nothing."""
    torch.manual_seed(2)
    hidden = torch.randn(4, 64, 32, requires_grad=True)
    weight = torch.randn(257, 32, requires_grad=True)
    bias = torch.randn(257, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 257, (4, 64))
    leaves = [hidden, weight] + ([bias] if with_bias else [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _whole(hidden, weight, bias, labels)
        with _MatmulDtypes() as forward:
            got = ChunkedCrossEntropy.apply(hidden, weight, bias, labels, 50, -100)
    wanted = torch.autograd.grad(want, leaves)
    with _MatmulDtypes() as backward:
        mine = torch.autograd.grad(got, leaves)
    assert forward.seen and backward.seen
    assert {d for dtypes in forward.seen + backward.seen for d in dtypes} == {torch.bfloat16}
    # the head's rows padded from 257 to 320 (a multiple of 64): no matmul sees the odd width
    assert all(320 in dims and 257 not in dims for dims in forward.shapes + backward.shapes)
    assert got.item() == pytest.approx(want.item(), rel=1e-2)
    for a, b in zip(mine, wanted):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


def test_without_autocast_the_head_runs_in_the_hidden_states_dtype():
    """fp32 in, fp32 matmuls: the fp32 path (the default run's precision) is neither lowered nor padded."""
    hidden = torch.randn(2, 8, 16, requires_grad=True)
    weight = torch.randn(33, 16, requires_grad=True)
    with _MatmulDtypes() as seen:
        loss = ChunkedCrossEntropy.apply(hidden, weight, None, torch.randint(0, 33, (2, 8)), 5, -100)
        torch.autograd.grad(loss, [hidden, weight])
    assert seen.seen and {d for dtypes in seen.seen for d in dtypes} == {torch.float32}
    assert all(33 in dims and 64 not in dims for dims in seen.shapes)  # nor padded: no tensor cores to align for
