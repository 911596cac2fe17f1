"""The Hugging Face task end to end on Ray: a tiny Llama from config with the tokenizer
trained on the embedded corpus, on the session's Ray instance (the asynchronous run of the
same model is in process, in test_hf_task.py; the command line's own start is covered by
the default run's tests): the eval loss falls by at least 20 % from the untrained model's
in a short run, and the model comes back exported. No warm start (its fork restarts every
island: the default run's tests cover it)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.runtime.driver import run
from tests.helpers import TINY_LLAMA, fell_20_percent

pytestmark = pytest.mark.ray


def test_a_tiny_llama_trains_on_ray_in_sync_mode_and_is_exported(ray_local, corpus_cache, tmp_path):
    sets = [*TINY_LLAMA, "warm_start.steps=0", f"task.kwargs.cache_dir={corpus_cache}", f"out_dir={tmp_path}"]
    summary = run(load_config(None, sets), show_progress=False)
    fell_20_percent(summary)
    assert (tmp_path / "export" / "model.safetensors").exists()
