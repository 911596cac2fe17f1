"""A Hugging Face causal language model as an Archipelago task (`archipelago.workers.tasks.hf_task:make_task`).

Any `AutoModelForCausalLM`: loaded by name or local path (`model`), or built from a config
and initialised from scratch (`model_config: {model_type: llama, hidden_size: ...}`, or
`preset: tiny-llama`). The tokenizer is the model's, one named by `tokenizer`, or a
byte-level BPE trained on the corpus and cached (the default: no download). Documents are
tokenised, joined by EOS and packed into fixed-length windows through the same shard and
position contract as the default task, so data is trained exactly once across membership
changes. Needs the `[hf]` extra (`pip install -e '.[hf]'`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, model_validator

from ..data.encoders import HFEncoder
from ..data.manifest import DataError
from .chunked_loss import causal_lm_eval_loss, causal_lm_train_loss
from .task import Batch, token_batch
from .text_data import (
    Documents,
    document_order,
    fixed_batches,
    island_part,
    window_batches,
)
from .text_source import TextCorpus, TextDataConfig
from .tokenizer import trained_tokenizer

# A Llama small enough to train on a laptop CPU in minutes (~1 M parameters with the
# 2,048-token trained tokenizer; the embedding is tied to the output layer).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
}
TOKENS_FORMAT = 1


class HFTaskConfig(TextDataConfig):
    """Keyword arguments of `archipelago.workers.tasks.hf_task:make_task` (validated; unknown keys rejected)."""

    # `model` and the `model_config` alias are the names transformers users know; pydantic
    # reserves `model_config` for this class setting, so the field is `architecture`.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), populate_by_name=True)
    model: str | None = Field(None, description="a model name on the Hub or a local path: train from its weights")
    architecture: dict[str, Any] | None = Field(
        None,
        alias="model_config",
        description="a transformers config with model_type (e.g. {model_type: llama, hidden_size: 512}): "
        "a model initialised from scratch; vocab_size and max_position_embeddings default to the tokenizer's and context",
    )
    preset: Literal["tiny-llama"] | None = Field(None, description="a bundled model_config (tiny-llama: ~1 M params)")
    tokenizer: str | None = Field(
        None, description="tokenizer name or path (default: the model's, or a BPE trained on the corpus and cached)"
    )
    vocab_size: int = Field(2048, ge=259, description="size of the trained tokenizer (when one is trained)")
    activation_checkpointing: bool = Field(False, description="recompute activations in backward (less memory)")
    eval_rows: int = Field(4, ge=1, description="rows evaluated per forward (bounds evaluation's activations)")
    eval_loss_tokens: int = Field(
        1024, ge=1, description="positions whose logits exist at once when the evaluation loss is computed"
    )
    train_loss_tokens: int | None = Field(
        4096,
        ge=1,
        description="positions whose logits exist at once in training's loss, forward and backward (recomputed "
        "in backward); null: the whole micro-batch's logits, as the model's own forward keeps them",
    )

    @model_validator(mode="after")
    def _check_model(self) -> HFTaskConfig:
        given = [
            k for k, v in (("model", self.model), ("model_config", self.architecture), ("preset", self.preset)) if v
        ]
        if len(given) != 1:
            raise ValueError(f"give exactly one of model, model_config, preset (got {given or 'none'})")
        if self.architecture is not None and "model_type" not in self.architecture:
            raise ValueError("model_config needs a model_type (e.g. llama, gpt2, qwen2)")
        return self


class HFCausalLMTask:
    """Implements `archipelago.workers.tasks.task.Task` (and `ExportableTask`) for a Hugging Face causal LM."""

    def __init__(self, cfg: HFTaskConfig) -> None:
        self.cfg = cfg
        self.corpus = TextCorpus(cfg)
        self._tokenizer: Any = None
        self._documents: dict[str, Documents] = {}
        self._packed: np.ndarray | None = None

    # -- tokens ----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            c = self.cfg
            if c.tokenizer or c.model:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(c.tokenizer or c.model)
            elif self.corpus.is_prepared:  # the tokenizer `data prepare` stored with the corpus
                self._tokenizer = _prepared_tokenizer(Path(c.prepared[0].path))
            elif self.corpus.streamed:  # train on the stream's first documents
                texts, size = [], 0
                for text in self.corpus.stream("train"):
                    texts.append(text)
                    size += len(text)
                    if size >= 8_000_000:
                        break
                self._tokenizer = trained_tokenizer(texts, c.vocab_size, c.cache)
            else:
                self._tokenizer = trained_tokenizer(self.corpus.texts("train"), c.vocab_size, c.cache)
            if self._tokenizer.eos_token_id is None:
                raise ValueError(f"tokenizer {c.tokenizer or c.model!r} has no EOS token to separate documents")
        return self._tokenizer

    @property
    def eos(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        return list(self.tokenizer(list(texts), add_special_tokens=False)["input_ids"])

    def documents(self, part: Literal["train", "eval"]) -> Documents:
        """A file-backed source's documents tokenised, cached in memory and on disk (keyed by
        the tokenizer and the files), so islands load arrays instead of re-tokenising."""
        if part not in self._documents:
            train, evals = self.corpus.files()
            key = hashlib.sha1(f"{TOKENS_FORMAT}:{self.tokenizer.backend_tokenizer.to_str()}".encode())
            for f in train if part == "train" else evals:
                key.update(f"{f}:{f.stat().st_size}".encode())
            path = self.cfg.cache / f"tokens-{key.hexdigest()[:16]}" / f"{part}.npz"
            if path.exists():
                with np.load(path) as z:
                    docs = Documents(z["tokens"], z["offsets"])
            else:
                docs = Documents.of(self._encode(self.corpus.texts(part)))
                _save_documents(docs, path)
            self._documents[part] = docs
        return self._documents[part]

    def encoder(self) -> HFEncoder:
        """How this task turns text into tokens (`archipelago data prepare` uses it)."""
        return HFEncoder(self.tokenizer.name_or_path)

    # -- data ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Prepare the corpus, train the tokenizer and tokenise once, on the driver."""
        self.corpus.prepare(self.encoder().identity if self.corpus.is_prepared else None)
        if not (self.corpus.streamed or self.corpus.is_prepared):
            self.documents("train")
            self.documents("eval")

    def packed(self) -> np.ndarray:
        """The training documents packed in their split's order, once per process."""
        if self._packed is None:
            docs = self.documents("train")
            self._packed = docs.packed(document_order(len(docs), self.cfg.split), self.eos)
        return self._packed

    def _encode_one(self, text: str) -> np.ndarray:
        return np.asarray([*self._encode([text])[0], self.eos], dtype=np.int64)

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int = 0) -> Iterator[Batch]:
        c = self.cfg
        if self.corpus.is_prepared:
            return self.corpus.prepared(self.encoder().identity).train_batches(shard, num_shards, seed, start)
        if self.corpus.streamed:
            return self.corpus.stream_batches(shard, num_shards, self._encode_one, start)
        tokens = island_part(self.packed(), shard, num_shards)
        return window_batches(tokens, c.context, c.batch_size, seed * 1_000_003 + shard, start)

    def resume_batches(self, shard: int, num_shards: int, seed: int, start: int, state: dict) -> Iterator[Batch]:
        """A streamed shard's batches from position `start`, where `state` left it."""
        return self.corpus.stream_batches(shard, num_shards, self._encode_one, start, state)

    def eval_batches(self) -> Sequence[Batch]:
        c = self.cfg
        if self.corpus.is_prepared:
            return self.corpus.prepared(self.encoder().identity).eval_batches(c.eval_batches)
        if self.corpus.streamed:
            return self.corpus.eval_stream(self._encode_one, c.eval_batches)
        docs = self.documents("eval")
        return fixed_batches(docs.packed(np.arange(len(docs)), self.eos), c.context, c.batch_size, c.eval_batches)

    # -- model -----------------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        c = self.cfg
        if c.model:
            model = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(self._architecture(tokens=True), dtype=torch.float32)
        return self._configured(model)

    def _configured(self, model: Any) -> Any:
        """The run's settings on a built model: activation checkpointing, no KV cache."""
        if self.cfg.activation_checkpointing:  # transformers' newer name first, the older one before it existed
            enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
            enable()
        model.config.use_cache = False
        return model

    def _architecture(self, *, tokens: bool, vocab: int | None = None) -> Any:
        """The transformers config of a model from `model_config`/`preset`; `tokens`: with
        the tokenizer's special token ids (the tokenizer is then loaded), else only what
        the shapes need. The vocabulary: `model_config.vocab_size`, `vocab`, or the tokenizer's."""
        from transformers import AutoConfig

        c = self.cfg
        arch = dict(PRESETS[c.preset] if c.preset else c.architecture or {})
        model_type = arch.pop("model_type")
        if arch.get("vocab_size") is None:
            arch["vocab_size"] = vocab if vocab is not None else len(self.tokenizer)
        arch.setdefault("max_position_embeddings", c.context)
        if tokens:
            arch.setdefault("eos_token_id", self.eos)
            arch.setdefault("bos_token_id", self.tokenizer.bos_token_id)
            arch.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        return AutoConfig.for_model(model_type, **arch)

    # -- planning (`PlannableTask`) ---------------------------------------------------------------
    def plan_vocab(self) -> int:
        """The vocabulary size without downloading: `model_config.vocab_size`, a named
        tokenizer's from the local cache, or the trained tokenizer's (cached, or its target
        size `vocab_size` when training it would read a stream). Raises `PlanInputError`."""
        from transformers import AutoConfig, AutoTokenizer

        c = self.cfg
        if c.architecture and c.architecture.get("vocab_size") is not None:
            return int(c.architecture["vocab_size"])
        try:
            if c.model:
                return int(AutoConfig.from_pretrained(c.model, local_files_only=True).vocab_size)
            if c.tokenizer:
                return len(AutoTokenizer.from_pretrained(c.tokenizer, local_files_only=True))
        except (OSError, ValueError) as err:
            raise PlanInputError(
                f"task.kwargs: the vocabulary of {c.model or c.tokenizer!r} is not in the local cache and the config "
                "does not state it: add task.kwargs.model_config.vocab_size, or download it once"
            ) from err
        return c.vocab_size if self.corpus.streamed else len(self.tokenizer)

    def plan_model(self) -> torch.nn.Module:
        """The architecture without downloading anything (`plan_vocab`), or a named
        model's config from the local cache."""
        from transformers import AutoConfig, AutoModelForCausalLM

        c = self.cfg
        if c.model:
            try:
                config = AutoConfig.from_pretrained(c.model, local_files_only=True)
            except (OSError, ValueError) as err:
                raise PlanInputError(f"task.kwargs.model: {c.model!r}'s config is not in the local cache") from err
        else:
            config = self._architecture(tokens=False, vocab=self.plan_vocab())
        return self._configured(AutoModelForCausalLM.from_config(config, dtype=torch.float32))

    def plan_batch(self, rows: int) -> Batch:
        return token_batch(rows, self.cfg.context, self.plan_vocab())

    def eval_rows(self) -> int:
        return min(self.cfg.eval_rows, self.cfg.batch_size)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The mean next-token loss in bounded memory (`workers/tasks/chunked_loss.py`):
        without autograd (evaluation) `eval_rows` rows and `eval_loss_tokens` positions of
        logits at a time; in training `train_loss_tokens` positions of logits at a time,
        forward and backward."""
        if not torch.is_grad_enabled():
            return causal_lm_eval_loss(model, batch, rows=self.cfg.eval_rows, tokens=self.cfg.eval_loss_tokens)
        return causal_lm_train_loss(model, batch, tokens=self.cfg.train_loss_tokens)

    def batch_weight(self, batch: Batch) -> int:
        return int(batch[1].numel())

    # -- export ----------------------------------------------------------------------------
    def save_pretrained(self, model: Any, out_dir: Path) -> None:
        """The model (safetensors) and its tokenizer, loadable with `from_pretrained`."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per shard written is noise in run logs
        model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)


class PlanInputError(ValueError):
    """What a plan needs to shape the model is neither in the config nor cached locally."""


def _prepared_tokenizer(corpus: Path) -> Any:
    from transformers import AutoTokenizer

    folder = corpus / "tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        raise DataError(
            f"prepared corpus {corpus} carries no tokenizer (prepared by a byte-level task?): name one with `tokenizer`"
        )
    return AutoTokenizer.from_pretrained(folder)


def _save_documents(docs: Documents, path: Path) -> None:
    """Written by rename, so an island never reads a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, tokens=docs.tokens, offsets=docs.offsets)
    os.replace(tmp, path)


def make_task(**kwargs: object) -> HFCausalLMTask:
    """Factory named in config as `archipelago.workers.tasks.hf_task:make_task`."""
    return HFCausalLMTask(HFTaskConfig(**kwargs))
