"""`archipelago run` on a machine where Ray left an address behind: a cluster started with
`ray start --head`, or the address file of a head that was killed. Ray would join that
cluster on its own and refuse the sizes the driver passes (a traceback); the driver starts
a private instance instead and uses a cluster only when asked (`ray.address`, $RAY_ADDRESS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from archipelago.orchestrator.cli import main
from tests.helpers import toy_quadratic

pytestmark = [pytest.mark.ray, pytest.mark.quiet]  # the machine's own Ray processes (tests/ray_apart.py)

ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")  # where Ray looks for "the" local cluster


def test_a_stale_cluster_address_file_does_not_break_a_local_run(tmp_path, monkeypatch):
    import ray

    ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    saved = ADDRESS_FILE.read_text() if ADDRESS_FILE.exists() else None
    ADDRESS_FILE.parent.mkdir(parents=True, exist_ok=True)
    ADDRESS_FILE.write_text("127.0.0.1:6553\n")  # a head that is long gone
    try:
        sets = toy_quadratic(1, 0.0, "rounds=2", "inner_steps=2", f"out_dir={tmp_path / 'out'}")
        assert main(["-q", "run", *[a for s in sets for a in ("--set", s)]]) == 0
    finally:
        if saved is None:
            ADDRESS_FILE.unlink(missing_ok=True)
        else:
            ADDRESS_FILE.write_text(saved)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["outer_steps"] == 2
