"""How text becomes token ids for a prepared corpus: the task's own tokenisation, named by
an identity the manifest records, so a run refuses a corpus made by another tokenizer.

Encoders are small picklable values (a tokenizer is loaded lazily in the process that
encodes), so `data prepare` can hand them to worker processes or Ray tasks."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

BYTES_IDENTITY = "bytes/utf-8+nul"


class Encoder(Protocol):
    @property
    def identity(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def separator(self) -> int: ...

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The documents' tokens laid end to end, each followed by the separator, and the
        length of each (separator included)."""
        ...


def _laid_end_to_end(docs: list[np.ndarray], separator: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    out: np.ndarray = np.full(int(lengths.sum()), separator, dtype=dtype)
    ends = np.cumsum(lengths)
    for d, end in zip(docs, ends):
        out[end - 1 - len(d) : end - 1] = d
    return out, lengths


class ByteEncoder:
    """UTF-8 bytes, documents separated by NUL: the default GPT task's tokens."""

    identity = BYTES_IDENTITY
    vocab_size = 256
    separator = 0

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        raw = [t.encode("utf-8", errors="replace") for t in texts]
        tokens = np.frombuffer(b"".join(r + b"\x00" for r in raw), dtype=np.uint8)
        return tokens, np.fromiter((len(r) + 1 for r in raw), dtype=np.int64, count=len(raw))


class HFEncoder:
    """A Hugging Face tokenizer (a Hub name or a local folder), documents separated by EOS."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "_tokenizer": None}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.name)
            if self._tokenizer.eos_token_id is None:
                raise ValueError(f"tokenizer {self.name!r} has no EOS token to separate documents")
        return self._tokenizer

    @property
    def identity(self) -> str:
        spec = self.tokenizer.backend_tokenizer.to_str()
        return f"hf/{hashlib.sha256(spec.encode()).hexdigest()[:16]}"

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def separator(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return _laid_end_to_end([np.asarray(i, dtype=dtype) for i in ids], self.separator, dtype)
