"""Streaming DiLoCo and the compressed downlink on a real local Ray instance: the changes
islands receive go through Ray as they do in process, so the run's numbers are the
in-process engine's; and a crashed island's replacement gets the full copy."""

from __future__ import annotations

import pytest

from archipelago.orchestrator.runtime.driver import run
from tests.helpers import in_process_engine, tiny_lm_config

pytestmark = pytest.mark.ray


def _cfg(tmp_path, corpus_cache, name, *extra):
    return tiny_lm_config(
        tmp_path / name,
        corpus_cache,
        "task.kwargs.n_layers=4",
        "islands.count=2",
        "rounds=3",
        "inner_steps=8",
        "mode=streaming",
        "mode.fragments=4",
        "compression.codec=int4",
        "compression.downlink=int4",
        *extra,
    )


def test_streaming_with_4_bits_both_ways_on_ray_is_the_in_process_run(ray_local, tmp_path, corpus_cache):
    summary = run(_cfg(tmp_path, corpus_cache, "ray"), show_progress=False)
    engine, _ = in_process_engine(_cfg(tmp_path, corpus_cache, "local"))
    local = engine.execute()
    assert summary["state"] == "finished" and summary["outer_steps"] == 12 and summary["rounds_done"] == 3
    assert summary["final_eval_loss"] == pytest.approx(local["final_eval_loss"], abs=1e-6)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    for key in ("bytes_sent", "bytes_received", "peak_exchange_bytes"):
        assert summary[key] == local[key], key
    assert {k: v["applied"] for k, v in summary["fragments"].items()} == {str(p): 6 for p in range(4)}


def test_streaming_islands_answer_before_their_tau_steps_and_the_run_is_the_in_process_one(
    ray_local, tmp_path, corpus_cache
):
    """Segments of 4 steps with Δ taken after 2: on Ray each island answers at that point
    and trains the other 2 while the coordinator steps (`workers/runtime/order_steps.py`); in
    process it trains them first. The same steps in the same order: the same run."""
    tail = ("mode.fragments=2", "mode.tau=2")
    summary = run(_cfg(tmp_path, corpus_cache, "ray", *tail), show_progress=False)
    engine, _ = in_process_engine(_cfg(tmp_path, corpus_cache, "local", *tail))
    local = engine.execute()
    assert summary["state"] == "finished" and summary["outer_steps"] == 6
    assert summary["final_eval_loss"] == pytest.approx(local["final_eval_loss"], abs=1e-6)
    for key in ("bytes_sent", "bytes_received", "peak_exchange_bytes"):
        assert summary[key] == local[key], key


SPARSE = [
    "compression.codec=topk:0.02+int2",
    "compression.downlink=topk:0.02+int2",
    "compression.error_feedback=true",
    "compression.feedback_decay=0.95",
    "outer.optimizer=sparseloco",
    "outer.lr=0.7",
    "islands.build_version0=true",
]


def test_a_sparse_streaming_run_on_ray_is_the_in_process_run_and_downloads_nothing_at_the_start(
    ray_local, tmp_path, corpus_cache
):
    summary = run(_cfg(tmp_path, corpus_cache, "ray", *SPARSE), show_progress=False)
    engine, _ = in_process_engine(_cfg(tmp_path, corpus_cache, "local", *SPARSE))
    local = engine.execute()
    assert summary["state"] == "finished" and summary["outer_steps"] == 12
    assert summary["final_eval_loss"] == pytest.approx(local["final_eval_loss"], abs=1e-6)
    for key in ("bytes_sent", "bytes_received", "peak_exchange_bytes", "bytes_bootstrap"):
        assert summary[key] == local[key], key
    assert summary["bytes_bootstrap"] == 0 and summary["bytes_communicated"] < 0.02 * summary["num_params"] * 4 * 24
