"""The Hugging Face task end to end on Ray: a tiny Llama from config with the tokenizer
trained on the embedded corpus, through `archipelago run` (sync) and the driver (async);
with the default warm start (data-parallel, a quarter of the steps) the eval loss falls by
at least 20 % from the untrained model's in a short run, and the model comes back exported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from orchestrator.config_load import load_config
from orchestrator.runtime.driver import run

pytestmark = pytest.mark.ray

TINY_LLAMA = [
    "task.factory=workers.tasks.hf_task:make_task",
    "task.kwargs.preset=tiny-llama",
    "task.kwargs.context=32",
    "task.kwargs.batch_size=16",
    "task.kwargs.eval_batches=4",
    "islands.count=2",
    "ray.num_cpus=2",
    "rounds=6",
    "inner_steps=15",
    "inner.lr=0.01",
    "inner.warmup_steps=5",
]


def _fell_20_percent(summary: dict) -> None:
    untrained = summary["warm_start"]["initial_eval_loss"]  # before the warm start: the model from config
    assert summary["final_eval_loss"] <= 0.8 * untrained, (untrained, summary["final_eval_loss"])


def test_archipelago_run_trains_a_tiny_llama_in_sync_mode(corpus_cache, tmp_path):
    sets = [*TINY_LLAMA, f"task.kwargs.cache_dir={corpus_cache}", f"out_dir={tmp_path}"]
    cmd = [sys.executable, "-m", "orchestrator.cli", "-q", "run", *[a for s in sets for a in ("--set", s)]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    _fell_20_percent(summary)
    assert (tmp_path / "export" / "model.safetensors").exists()


def test_the_driver_trains_a_tiny_llama_in_async_mode(ray_local, corpus_cache, tmp_path):
    # async at 64-token contexts: on 32 the 20 % drop is reached only just (19.9 % in one CI run)
    sets = [*TINY_LLAMA, "task.kwargs.context=64", "mode=async", f"task.kwargs.cache_dir={corpus_cache}"]
    cfg = load_config(None, [*sets, f"out_dir={tmp_path}"])
    summary = run(cfg, show_progress=False)
    assert summary["state"] == "finished" and summary["outer_steps"] >= 6
    _fell_20_percent(summary)
