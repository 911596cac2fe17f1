"""A language model's evaluation loss in bounded memory.

A causal LM's forward returns `[rows, context, vocab]` logits: at GPT-2's 50,257-token
vocabulary that is 206 MB of fp32 per 1,024-token row, and an evaluation batch of 64 rows
is 13 GB before `cross_entropy` makes its own copy. Evaluation needs none of it whole:
the loss is a sum over tokens. So the rows go through the model a few at a time
(`rows`), and the output layer and the cross-entropy run over `tokens` positions at a
time on the final hidden states, so at most `tokens × vocab` logits exist at once. The
result is the same mean as the whole-batch loss (to float rounding: the sums are taken
in float64), and the peak no longer grows with the batch or the vocabulary's product
with the context.

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


def _token_loss_sum(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, tokens: int) -> torch.Tensor:
    """The sum of the cross-entropy over every position, `tokens` positions of logits at a time."""
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for start in range(0, flat_y.numel(), tokens):
        logits = head(flat_h[start : start + tokens]).float()
        total += F.cross_entropy(logits, flat_y[start : start + tokens], reduction="sum").double()
    return total


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
            total += _token_loss_sum(hidden, model.get_output_embeddings(), ys, tokens)
        else:
            logits = model(input_ids=xs).logits
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), ys.reshape(-1), reduction="sum"
            ).double()
    return (total / y.numel()).float()
