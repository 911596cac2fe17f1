"""A byte-level BPE tokenizer trained on the task's own corpus and cached, so the Hugging
Face task's default needs no download (like the embedded corpus itself)."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
FORMAT_VERSION = 1
TRAIN_BYTES = 8_000_000  # enough text for a few thousand merges; training on more only costs time


def training_sample(texts: Sequence[str], budget: int = TRAIN_BYTES) -> list[str]:
    """Every k-th document, k chosen so the sample is about `budget` characters."""
    stride = max(1, math.ceil(sum(len(t) for t in texts) / budget))
    return list(texts[::stride])


def trained_tokenizer(texts: Sequence[str], vocab_size: int, cache: Path) -> Any:
    """A `PreTrainedTokenizerFast` with `vocab_size` entries (EOS included) trained on a
    sample of `texts`, loaded from `cache` when one was trained on the same sample before
    (the folder name is a hash of it; written by rename, so concurrent processes are safe)."""
    from transformers import PreTrainedTokenizerFast

    sample = training_sample(texts)
    digest = hashlib.sha1(f"{FORMAT_VERSION}:{vocab_size}".encode())
    for t in sample:
        digest.update(t.encode("utf-8", errors="replace"))
    folder = cache / f"tokenizer-bpe{vocab_size}-{digest.hexdigest()[:16]}"
    if not (folder / "tokenizer.json").exists():
        log.info("training a %d-token byte-level BPE tokenizer on %d documents", vocab_size, len(sample))
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tokenizer-"))
        try:
            _train(sample, vocab_size).save_pretrained(tmp)
            os.replace(tmp, folder)
        except OSError:
            if not (folder / "tokenizer.json").exists():  # not a concurrent writer's win: a real error
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _train(texts: Sequence[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
