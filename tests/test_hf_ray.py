"""The Hugging Face task end to end on Ray: a tiny Llama from config with the tokenizer
trained on the embedded corpus, through `archipelago run` (the asynchronous run of the same
model is in process, in test_hf_task.py): the eval loss falls by at least 20 % from the
untrained model's in a short run, and the model comes back exported. No warm start (its
fork restarts every island: the default run's tests cover it), which kept this test near a
minute."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from tests.helpers import TINY_LLAMA, fell_20_percent

pytestmark = pytest.mark.ray


def test_archipelago_run_trains_a_tiny_llama_in_sync_mode(corpus_cache, tmp_path):
    sets = [*TINY_LLAMA, "warm_start.steps=0", f"task.kwargs.cache_dir={corpus_cache}", f"out_dir={tmp_path}"]
    cmd = [sys.executable, "-m", "orchestrator.cli", "-q", "run", *[a for s in sets for a in ("--set", s)]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    fell_20_percent(summary)
    assert (tmp_path / "export" / "model.safetensors").exists()
