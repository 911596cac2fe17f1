"""The global parameters' way onto a GPU at a round's start (`workers/runtime/staging.py`):
through a pinned buffer on CUDA, and on a CPU exactly as before — the round reads the
object store's array where it is, and nothing is pinned. The CUDA side is tested on a GPU
(`test_cuda.py`); no fake device stands in for one here."""

from __future__ import annotations

import pytest
import torch

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.workers.runtime.island import Island
from archipelago.workers.runtime.staging import PinnedStage, pieces, staged
from tests.helpers import TINY_LM


def test_only_a_cuda_destination_is_staged_and_in_pieces_that_cover_it_in_order():
    assert staged(torch.device("cuda")) and staged(torch.device("cuda", 1))
    assert not staged(torch.device("cpu")) and not staged(torch.device("meta"))
    assert pieces(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert pieces(8, 4) == [(0, 4), (4, 8)] and pieces(3, 4) == [(0, 3)] and pieces(0, 4) == []


def test_a_cpu_island_starts_from_the_host_array_itself_and_pins_nothing(corpus_cache):
    cfg = load_config(None, [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}"])
    island = Island(island_spec(cfg, 0))
    params = island.flat.numpy()
    order = island.order(0, 1)
    src = island._sync(order, params)
    assert island._landed(src) is src and src.data_ptr() == params.__array_interface__["data"][0]  # no copy
    island.run(order, params)
    assert island.stage.buffer is None and island.stage.emptied is None
    assert torch.equal(island.start, torch.from_numpy(params))
    with pytest.raises(ValueError, match="CUDA"):
        PinnedStage().copy(torch.ones(3), torch.empty(3))
