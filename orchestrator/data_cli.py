"""`archipelago data prepare`: the command around `workers/data/prepare.py` (the task's
tokenizer from the run config, a progress bar, exit 2 on data it refuses)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from .config_load import ConfigError, load_config

log = logging.getLogger(__name__)


def prepare_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from archipelago.workers.data.encoders import HFEncoder
    from archipelago.workers.data.manifest import DataError
    from archipelago.workers.data.prepare import PrepareOptions, prepare
    from archipelago.workers.tasks.task import load_task

    if args.shard_tokens < 1024 or args.eval_every < 2:
        log.error("--shard-tokens must be at least 1024 and --eval-every at least 2")
        return 2
    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as err:
        log.error("invalid config: %s", err)
        return 2
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    if not callable(getattr(task, "encoder", None)):
        log.error("task %s does not tokenise text (it has no encoder()): nothing to prepare", cfg.task.factory)
        return 2
    encoder = task.encoder()  # type: ignore[attr-defined]
    options = PrepareOptions(
        column=args.text_column,
        shard_tokens=args.shard_tokens,
        eval_every=args.eval_every,
        workers=args.workers,
        ray_address=args.ray or os.environ.get("RAY_ADDRESS"),  # a job on a cluster tokenises on it
        split=args.split,
        data_files=args.data_files,
    )
    bar = tqdm(total=None, unit=" pieces", desc="tokenising", file=sys.stderr, disable=None)
    started = time.perf_counter()

    def progress(done: int, total: int, tokens: int) -> None:
        bar.total = total
        bar.n = done
        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - started, 1e-9):,.0f} tok/s")
        bar.refresh()

    out = Path(args.out)
    try:
        manifest = prepare(args.source, out, encoder, options, progress)
    except DataError as err:
        bar.close()
        log.error("data refused: %s", err)
        return 2
    bar.close()
    if isinstance(encoder, HFEncoder) and Path(encoder.name).is_dir() and not (out / "tokenizer").exists():
        shutil.copytree(encoder.name, out / "tokenizer")  # the corpus carries its tokenizer
    train, held = manifest.splits["train"], manifest.splits["eval"]
    sys.stdout.write(
        f"{out}: {train.tokens:,} training tokens in {len(train.shards)} shards, {held.tokens:,} held out "
        f"({train.documents + held.documents:,} documents, {manifest.tokenizer}, content {manifest.content_sha256[:16]})\n"
        f"train on it with: --set task.kwargs.source=prepared --set 'task.kwargs.prepared=[{{path: {out}}}]'\n"
    )
    return 0
