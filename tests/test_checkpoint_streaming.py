"""Checkpoints stream to their file: no copy of the whole state in memory (measured in a
fresh process), and a write that fails part-way leaves no file a resume could take."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint, save_checkpoint

_MEASURE = """
import json, resource, sys, torch
from archipelago.orchestrator.engine.state.checkpoints import save_checkpoint, load_checkpoint
n = int(sys.argv[2])
state = {"run_id": "r", "params": torch.randn(n), "momentum": torch.randn(n), "version": 1}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
save_checkpoint(sys.argv[1], state)
saved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"state_kb": 8 * n / 1024, "save_extra_kb": saved - before}))
"""


def test_saving_holds_no_second_copy_of_the_state(tmp_path):
    n = 25_000_000  # 200 MB of state: a copy would show as ~200 MB more peak
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "ck"), str(n)], capture_output=True, text=True, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["save_extra_kb"] < 0.2 * seen["state_kb"], seen  # checkpoint peak <= 1.2 x the state
    assert load_checkpoint(tmp_path / "ck")["params"].numel() == n


def test_a_write_that_fails_part_way_leaves_the_previous_checkpoint_the_newest(tmp_path):
    state = {"run_id": "r", "params": torch.randn(1000), "version": 1}
    save_checkpoint(tmp_path, state)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk gone mid-write")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, {**state, "version": 2, "z": Unpicklable()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state-000001.pt", "state-000001.pt.sha256"]
    assert load_checkpoint(tmp_path)["version"] == 1


def test_a_file_whose_digest_never_came_is_not_trusted(tmp_path):
    save_checkpoint(tmp_path, {"run_id": "r", "params": torch.zeros(10), "version": 1})
    save_checkpoint(tmp_path, {"run_id": "r", "params": torch.ones(10), "version": 2})
    (tmp_path / "state-000002.pt.sha256").unlink()  # a crash between the file and its digest
    assert load_checkpoint(tmp_path)["version"] == 1
