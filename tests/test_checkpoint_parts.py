"""A sliced coordinator's checkpoint written S + 1 ways: each slice streams its parameters
and outer state into a part beside the coordinator's file, which names each part's
SHA-256 and holds neither; loading joins them back; a part that does not match its digest
makes the checkpoint unusable (the one before it is loaded); pruning takes the parts with
their checkpoint; a run resumed from them continues as one coordinator's does."""

from __future__ import annotations

import torch

from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint, run_folder
from tests.engine_scenarios import scenario_cfg
from tests.helpers import in_process_engine

SLICES = 3
# four islands' centers in 100 dimensions: 100 parameters, slices of 32, 32 and 36 (chunks of 16)
CENTERS = (
    "["
    + ",".join("[" + ",".join(f"{((i * 7 + d * 3) % 11 - 5) / 4:g}" for d in range(100)) + "]" for i in range(4))
    + "]"
)


def _cfg(tmp_path, name, rounds, shards=SLICES):
    return scenario_cfg(
        tmp_path / name,
        "diloco",
        f"rounds={rounds}",
        "checkpoint.keep=2",
        f"coordinator.shards={shards}",
        "compression.chunk=16",
        f"task.kwargs.centers={CENTERS}",
        f"out_dir={tmp_path / name / 'out'}",
        f"checkpoint.path={tmp_path / 'checkpoints' / name}",
    )


def _params(engine):
    engine.outer.copy_to(engine.flat.data)
    return engine.flat.data.clone()


def test_each_slice_writes_its_part_beside_the_checkpoint_and_loading_joins_them(tmp_path):
    cfg = _cfg(tmp_path, "parts", 4)
    engine, _ = in_process_engine(cfg, run_id="parts")
    engine.execute()
    folder = run_folder(cfg.checkpoint_dir, "parts")
    names = sorted(n for n, _ in folder.entries())
    assert [n for n in names if n.endswith(".pt")] == ["state-000003.pt", "state-000004.pt"]  # keep 2
    parts = [f"state-00000{s}.pt.part-{k}" for s in (3, 4) for k in range(SLICES)]
    assert sorted(n for n in names if ".part-" in n) == parts  # the pruned ones' parts went with them
    with open(folder.local_path("state-000004.pt"), "rb") as f:
        head = torch.load(f, weights_only=True)
    assert head["params"] is None and "slices" not in head["outer"]  # nothing of the slices' state
    assert [p["name"] for p in head["parts"]] == parts[SLICES:] and [p["bounds"] for p in head["parts"]] == [
        list(b) for b in engine.outer.bounds
    ]
    state = load_checkpoint(folder)
    assert state["version"] == 4 and "parts" not in state
    assert torch.equal(state["params"], _params(engine))
    assert engine.outer.bounds == [(0, 32), (32, 64), (64, 100)]
    torch.testing.assert_close(
        state["outer"]["slices"], [s.state_dict() for s in engine.outer.calls.slices], rtol=0, atol=0
    )
    # a part that is not what the checkpoint recorded: that checkpoint is unusable, the one before is loaded
    path = folder.local_path(parts[-1])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert load_checkpoint(folder)["version"] == 3


def test_a_run_resumed_from_its_slices_parts_continues_as_one_coordinator_resumed_does(tmp_path):
    """The parts hold what one coordinator's checkpoint holds: resumed at round 3 of 6, a
    sliced run and an unsliced one (each from its own checkpoint) end bit for bit alike."""
    ends = []
    for shards in (1, SLICES):
        first, _ = in_process_engine(_cfg(tmp_path, f"s{shards}", 3, shards), run_id="resumed")
        first.execute()
        resumed, _ = in_process_engine(_cfg(tmp_path, f"s{shards}", 6, shards), run_id="resumed")
        assert resumed.run.version == 3  # built from the checkpoint (its slices' parts where sliced)
        resumed.execute()
        assert resumed.run.version == 6
        ends.append(_params(resumed))
    assert torch.equal(ends[0], ends[1])
