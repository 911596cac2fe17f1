"""The sharded coordinator in real Ray runs: S = 2 trains the same model as S = 1 (sync
DiLoCo, merging by the mean or by RDA; round results may arrive in another order, so equal
to float rounding), and a
lost shard is rebuilt from the run's checkpoint (the path `--resume` takes too). The
sliced outer step in async and overlap is checked in process (test_runs_in_process.py)."""

from __future__ import annotations

import json

import pytest
import torch

from archipelago.orchestrator.runtime.driver import run
from tests.helpers import run_until_records, tiny_lm_config

pytestmark = pytest.mark.ray


def _cfg(tmp_path, corpus_cache, name, *extra):
    return tiny_lm_config(
        tmp_path / name,
        corpus_cache,
        "islands.count=2",
        "rounds=3",
        "inner_steps=5",
        "compression.chunk=1024",
        "checkpoint.every_rounds=1",
        *extra,
    )


def _final(path):
    return torch.cat([t.reshape(-1) for t in torch.load(path, weights_only=True).values()])


@pytest.mark.parametrize("merge", ["mean", "radial_directional"])
def test_two_shards_train_the_same_model_as_one(ray_local, tmp_path, corpus_cache, merge):
    """With RDA the slice actors also take the direction and send their parts of its norm."""
    one = run(_cfg(tmp_path, corpus_cache, "s1", f"outer.merge={merge}"), show_progress=False)
    two = run(_cfg(tmp_path, corpus_cache, "s2", "coordinator.shards=2", f"outer.merge={merge}"), show_progress=False)
    assert two["outer_steps"] == one["outer_steps"] == 3
    assert two["bytes_communicated"] == one["bytes_communicated"]
    assert two["final_eval_loss"] == pytest.approx(one["final_eval_loss"], abs=1e-5)
    assert torch.allclose(_final(tmp_path / "s2" / "final.pt"), _final(tmp_path / "s1" / "final.pt"), atol=1e-6)


def test_a_lossy_downlink_through_two_slices_trains_one_coordinators_model(ray_local, tmp_path, corpus_cache):
    """Each slice actor keeps its part of the islands' int8 copy and puts its part's change
    in its own node's object store; islands fetch both parts (Ray resolves them as the
    order's arguments) and train the model one coordinator's int8 downlink trains. The
    bytes differ only by each part's framing (a 4-byte chunk size, once a version)."""
    one = run(_cfg(tmp_path, corpus_cache, "d1", "compression.downlink=int8"), show_progress=False)
    two = run(
        _cfg(tmp_path, corpus_cache, "d2", "coordinator.shards=2", "compression.downlink=int8"), show_progress=False
    )
    assert two["outer_steps"] == one["outer_steps"] == 3
    assert 0 < two["bytes_communicated"] - one["bytes_communicated"] <= 4 * 2 * 3  # 2 islands, 3 versions
    assert two["final_eval_loss"] == pytest.approx(one["final_eval_loss"], abs=1e-5)
    assert torch.allclose(_final(tmp_path / "d2" / "final.pt"), _final(tmp_path / "d1" / "final.pt"), atol=1e-6)


def test_a_lost_shard_restarts_the_coordinator_from_its_checkpoint(ray_local, tmp_path, corpus_cache):
    import ray

    from archipelago.orchestrator.runtime.names import NAMESPACE

    cfg = _cfg(tmp_path, corpus_cache, "out", "coordinator.shards=2", "rounds=8")
    thread, box = run_until_records(cfg, "shardloss", 3)
    metrics = tmp_path / "out" / "metrics.jsonl"
    shard = next(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("archipelago-shardloss-slice-1-")
    )
    ray.kill(ray.get_actor(shard, namespace=NAMESPACE))
    thread.join(timeout=240)
    assert box["summary"]["outer_steps"] == 8
    versions = [json.loads(line)["version"] for line in metrics.read_text().splitlines()]
    assert versions == list(range(1, 9))  # rounds after the checkpoint redone, none lost or doubled
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    assert kinds.count("restart") == 1
