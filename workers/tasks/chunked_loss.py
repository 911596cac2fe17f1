"""A language model's loss in bounded memory, in evaluation and in training.

A causal LM's forward returns `[rows, context, vocab]` logits: at GPT-2's 50,257-token
vocabulary that is 206 MB of fp32 per 1,024-token row, and an evaluation batch of 64 rows
is 13 GB before `cross_entropy` makes its own copy. Evaluation needs none of it whole:
the loss is a sum over tokens. So the rows go through the model a few at a time
(`rows`), and the output layer and the cross-entropy run over `tokens` positions at a
time on the final hidden states, so at most `tokens × vocab` logits exist at once. The
result is the same mean as the whole-batch loss (to float rounding: the sums are taken
in float64), and the peak no longer grows with the batch or the vocabulary's product
with the context.

Training needs the logits' gradient, which is where the whole `[rows, context, vocab]`
tensor used to be kept: 3.3 GB of fp32 for a 16-row micro-batch of 1,024 tokens at GPT-2's
vocabulary, the largest tensor of a 124 M model's step. `ChunkedCrossEntropy` (the fused
linear-cross-entropy idea) keeps only the hidden states, the output layer's weight and one
log-sum-exp per position: its forward computes the logits `tokens` positions at a time and
drops them, its backward computes them again, chunk by chunk, for the gradient of the
hidden states and of the weight (softmax − one-hot, scaled). The loss and both gradients
equal the whole-logits ones to float rounding (tested to 1e-5 in fp32); the price is the
output layer's matmul once more in backward.

Only for models whose logits are their output layer applied to the last hidden state:
a model that post-processes logits (Gemma 2's soft-capping, Cohere's logit scale) is
evaluated through its own forward, `rows` at a time (`splits_head`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# config fields of transformers models that change logits after the output layer
_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def splits_head(model: Any) -> bool:
    """Whether `model` (a transformers causal LM) computes logits as `lm_head(hidden)`,
    so the output layer can be applied to the hidden states in chunks."""
    config = getattr(model, "config", None)
    if config is None or getattr(model, "base_model", None) is None or model.get_output_embeddings() is None:
        return False
    return all(getattr(config, name, None) in (None, 1, 1.0) for name in _POSTPROCESSING)


def _token_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    tokens: int,
    ignore_index: int = -100,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sum (float64) of the cross-entropy over every position, `tokens` positions of
    logits at a time, each position's log-sum-exp kept in `lse` if given (training's
    backward reads it). The one chunked forward evaluation and training share."""
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    dtype = _matmul_dtype(hidden)
    w, b = _head(weight, bias, dtype)
    vocab = weight.shape[0]
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for start in range(0, flat_y.numel(), tokens):
        end = min(start + tokens, flat_y.numel())
        logits = _logits(flat_h[start:end].to(dtype), w, b, vocab)
        if lse is not None:
            lse[start:end] = torch.logsumexp(logits, dim=-1)
        total += F.cross_entropy(logits, flat_y[start:end], reduction="sum", ignore_index=ignore_index).double()
    return total


def _matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the output layer's matmuls run in: autocast's where it is on (bf16: the
    tensor cores), else the hidden states'. Read in forward and kept for backward, which
    autograd runs outside autocast; applied to the hidden states as well as the weight,
    because a body that ends in a norm returns fp32 hidden states under autocast, and the
    head's backward then ran three fp32 matmuls a chunk (the 124 M GPT-2 on an H200: the
    head 70 % of a step's device time, its matmuls fp32)."""
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype


_ALIGN = 64


def _head(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer in `dtype`; in a 16-bit dtype its rows zero-padded to a multiple of
    64. A vocabulary such as GPT-2's 50,257 makes the logits' rows an odd width, and cuBLAS
    then leaves the tensor-core kernels it uses for aligned 16-bit shapes (on an H200 the
    head's bf16 matmuls ran Ampere's CUTLASS kernels at ~95 TFLOP/s); the padded rows'
    logits are sliced off and their gradients are zero, so nothing else changes. fp32 is
    left unpadded: no tensor cores to align for, and the copies would cost memory."""
    pad = -weight.shape[0] % _ALIGN if dtype.itemsize == 2 else 0
    w = F.pad(weight.to(dtype), (0, 0, 0, pad)) if pad else weight.to(dtype)
    b = None if bias is None else F.pad(bias.to(dtype), (0, pad)) if pad else bias.to(dtype)
    return w, b


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """A chunk's logits in fp32 from the (padded) head, its first `vocab` columns."""
    return F.linear(h, w, b)[:, :vocab].float()


def _widened(g: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """`g` in `dtype` with zero columns up to `width` (the padded head's rows)."""
    if g.shape[1] == width:
        return g.to(dtype)
    out = g.new_empty((g.shape[0], width), dtype=dtype)
    out[:, : g.shape[1]] = g
    out[:, g.shape[1] :] = 0
    return out


class ChunkedCrossEntropy(torch.autograd.Function):
    """mean over the labelled positions of cross_entropy(hidden @ weightᵀ + bias, labels),
    `tokens` positions of logits at a time, forward and backward (see the module's docstring);
    positions labelled `ignore_index` count for nothing, as in `F.cross_entropy`."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        tokens: int,
        ignore_index: int,
    ) -> torch.Tensor:
        flat_y = labels.reshape(-1)
        lse = torch.empty(flat_y.numel(), dtype=torch.float32, device=hidden.device)
        total = _token_loss_sum(hidden, weight, bias, labels, tokens, ignore_index, lse)
        # a tensor, never read on the host: no sync per step on a GPU, and a fake tensor
        # (the plan's measurement) has no value to read
        count = (flat_y != ignore_index).sum().clamp_min(1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, count)
        ctx.tokens, ctx.ignore_index, ctx.dtype = tokens, ignore_index, _matmul_dtype(hidden)
        return (total / count).float()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse, count = ctx.saved_tensors
        flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        w, b = _head(weight, bias, ctx.dtype)
        vocab = weight.shape[0]
        scale = grad_out.float() / count
        grad_h = torch.empty_like(flat_h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, flat_y.numel(), ctx.tokens):
            end = min(start + ctx.tokens, flat_y.numel())
            h, y = flat_h[start:end].to(ctx.dtype), flat_y[start:end]
            # d loss / d logits = (softmax − one-hot) × scale, at labelled positions only
            g = _logits(h, w, b, vocab).sub_(lse[start:end, None]).exp_()
            kept = (y != ctx.ignore_index)[:, None]
            g.scatter_add_(1, torch.where(kept, y[:, None], 0), -kept.to(g.dtype))
            g *= kept * scale
            # the matmuls in forward's dtype (bf16 under autocast), the weight's sum in fp32
            g_low = _widened(g, w.shape[0], ctx.dtype)
            if grad_h is not None:
                grad_h[start:end] = g_low @ w
            if grad_w is not None:
                grad_w += (g_low.t() @ h)[:vocab].float()
            if grad_b is not None:
                grad_b += g.sum(0)
        return (
            grad_h.reshape(hidden.shape) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


def causal_lm_train_loss(
    model: Any, batch: tuple[torch.Tensor, ...], *, tokens: int | None, ignore_index: int = -100
) -> torch.Tensor:
    """The mean next-token loss of `model` on `batch` = (inputs, labels) with autograd, the
    output layer's logits `tokens` positions at a time forward and backward
    (`ChunkedCrossEntropy`); with `tokens` None, or a model that post-processes its logits,
    through the model's own forward, its logits whole."""
    x, y = batch
    if tokens is None or not splits_head(model):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=ignore_index)
    hidden = model.base_model(input_ids=x).last_hidden_state
    head = model.get_output_embeddings()
    loss: torch.Tensor = ChunkedCrossEntropy.apply(hidden, head.weight, head.bias, y, tokens, ignore_index)
    return loss


@torch.no_grad()
def causal_lm_eval_loss(model: Any, batch: tuple[torch.Tensor, ...], *, rows: int, tokens: int) -> torch.Tensor:
    """The mean next-token loss of `model` on `batch` = (inputs, labels), `rows` rows and
    `tokens` logit positions at a time (see the module's docstring)."""
    x, y = batch
    chunked = splits_head(model)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[0], rows):
        xs, ys = x[start : start + rows], y[start : start + rows]
        if chunked:
            hidden = model.base_model(input_ids=xs).last_hidden_state
            head = model.get_output_embeddings()
            total += _token_loss_sum(hidden, head.weight, head.bias, ys, tokens)
        else:
            logits = model(input_ids=xs).logits
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), ys.reshape(-1), reduction="sum"
            ).double()
    return (total / y.numel()).float()
