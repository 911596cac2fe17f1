"""`archipelago data prepare SOURCE OUT`: tokenise a text source once into fixed-size
token shards with a manifest, so runs read any position at once instead of tokenising the
corpus on every island.

Two stages. Pieces of the source (a file, or a slice of a dataset) are tokenised in
parallel (worker processes, or Ray tasks on a cluster) and each is saved under
`OUT/.parts/` as it finishes: an interrupted prepare starts again where it stopped. Then
the parts are laid end to end, in source order, into each split's shards, which only
reads and writes. Documents are held out for evaluation by a rule on their place in the
source (1 in `eval_every`, seeded), the same on every rerun.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from .encoders import Encoder
from .manifest import MANIFEST, DataError, Manifest, read_manifest, token_dtype
from .shards import SplitWriter
from .sources import Piece, find_pieces, read_piece

log = logging.getLogger(__name__)

HOLDOUT_SEED = 0x5EED
PARTS = ".parts"


@dataclass(frozen=True)
class PrepareOptions:
    column: str = "text"
    shard_tokens: int = 1 << 25
    eval_every: int = 200  # one document in this many is held out
    workers: int = 0  # processes (0: the machine's cores)
    ray_address: str | None = None  # tokenise with Ray tasks on this cluster instead
    split: str = "train"  # the split of a `hf:` source
    data_files: str | None = None  # data_files of a `hf:` local builder (json, parquet)


def tokenise_piece(piece: Piece, index: int, encoder: Encoder, eval_every: int) -> dict[str, np.ndarray]:
    """One piece's documents tokenised and divided between train and eval."""
    texts = read_piece(piece)
    held = np.random.default_rng([HOLDOUT_SEED, index]).random(len(texts)) < 1.0 / eval_every
    out: dict[str, np.ndarray] = {}
    for split, keep in (("train", ~held), ("eval", held)):
        tokens, lengths = encoder.encode([t for t, k in zip(texts, keep) if k])
        out[f"{split}_tokens"], out[f"{split}_lengths"] = tokens, lengths
    return out


def prepare(
    source: str, out: Path, encoder: Encoder, options: PrepareOptions, progress: Callable[[int, int, int], None]
) -> Manifest:
    """Prepare `source` into `out` (resuming an interrupted prepare of the same source);
    `progress(pieces_done, pieces, tokens)` is called as pieces finish."""
    out = Path(out)
    job = {"source": source, "tokenizer": encoder.identity, **asdict(options)}
    job.pop("workers"), job.pop("ray_address")
    if (out / MANIFEST).is_file():
        existing = read_manifest(out)
        if existing.source == source and existing.tokenizer == encoder.identity:
            log.info("%s already holds %s prepared with this tokenizer", out, source)
            return existing
        raise DataError(f"{out} already holds another prepared corpus ({existing.source}); choose an empty folder")
    if out.exists() and any(p.name != PARTS for p in out.iterdir()):
        raise DataError(f"{out} is not empty and holds no prepared corpus: choose an empty folder")
    parts = out / PARTS
    parts.mkdir(parents=True, exist_ok=True)
    _check_job(parts / "job.json", job)
    pieces = find_pieces(source, options.column, options.split, options.data_files)
    todo = [i for i in range(len(pieces)) if not (parts / f"part-{i:06d}.npz").is_file()]
    if len(todo) < len(pieces):
        log.info("resuming: %d of %d pieces already tokenised", len(pieces) - len(todo), len(pieces))
    tokens, done = 0, len(pieces) - len(todo)
    for i, arrays in _tokenise(pieces, todo, encoder, options):
        _save_part(parts / f"part-{i:06d}.npz", arrays)
        tokens += int(len(arrays["train_tokens"]) + len(arrays["eval_tokens"]))
        done += 1
        progress(done, len(pieces), tokens)
    manifest = _assemble(out, parts, len(pieces), source, encoder, options.shard_tokens)
    shutil.rmtree(parts)
    return manifest


def _check_job(path: Path, job: dict[str, object]) -> None:
    if path.is_file():
        before = json.loads(path.read_text())
        if before != job:
            raise DataError(
                f"{path.parent.parent} holds an unfinished prepare of other settings ({before}); "
                "use another folder or remove it"
            )
    else:
        path.write_text(json.dumps(job))


def _tokenise(
    pieces: Sequence[Piece], todo: list[int], encoder: Encoder, options: PrepareOptions
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    if not todo:
        return
    if options.ray_address is not None:
        yield from _tokenise_ray(pieces, todo, encoder, options)
        return
    workers = min(options.workers or os.cpu_count() or 1, len(todo))
    if workers == 1:
        for i in todo:
            yield i, tokenise_piece(pieces[i], i, encoder, options.eval_every)
        return
    # spawn: the parent may hold threads (torch's, a progress bar's) that fork would copy mid-lock
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(tokenise_piece, pieces[i], i, encoder, options.eval_every): i for i in todo}
        for f in as_completed(futures):
            yield futures[f], f.result()


def _tokenise_ray(
    pieces: Sequence[Piece], todo: list[int], encoder: Encoder, options: PrepareOptions
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    import ray

    if not ray.is_initialized():
        ray.init(address=options.ray_address or "auto", log_to_driver=False)
    task = ray.remote(num_cpus=1)(tokenise_piece)
    refs = {task.remote(pieces[i], i, encoder, options.eval_every): i for i in todo}
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1)
        yield refs.pop(ready[0]), ray.get(ready[0])


def _save_part(path: Path, arrays: dict[str, np.ndarray]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


def _assemble(out: Path, parts: Path, count: int, source: str, encoder: Encoder, shard_tokens: int) -> Manifest:
    dtype = token_dtype(encoder.vocab_size)
    writers = {split: SplitWriter(out, split, dtype, shard_tokens) for split in ("train", "eval")}
    for i in range(count):
        with np.load(parts / f"part-{i:06d}.npz") as z:
            for split, w in writers.items():
                w.add(z[f"{split}_tokens"], z[f"{split}_lengths"])
    splits = {split: w.close() for split, w in writers.items()}
    if splits["train"].tokens == 0:
        raise DataError(f"source {source}: no text to prepare")
    if splits["eval"].documents == 0:
        raise DataError(f"source {source}: no document held out for evaluation: lower --eval-every")
    manifest = Manifest(
        source=source,
        tokenizer=encoder.identity,
        vocab_size=encoder.vocab_size,
        separator=encoder.separator,
        dtype=dtype,
        splits=splits,
    )
    manifest.write(out)
    return manifest
