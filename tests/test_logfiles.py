"""metrics.jsonl and events.jsonl rotated by size (`records.rotate_mib`, `records.keep`):
bounded on disk, read back whole and in order, and a resumed run's log rewound to its
checkpoint even when the log rotated after it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.config_operations import RecordsConfig
from archipelago.orchestrator.engine.build import build_engine
from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint
from archipelago.orchestrator.engine.state.logfiles import read_lines, segments
from archipelago.orchestrator.engine.state.records import EventLog, Recorder
from archipelago.orchestrator.engine.state.views import RoundRecord
from tests.engine_scenarios import check_exactly_once, drive, scenario_cfg
from tests.helpers import in_process_engine

SMALL = 1200 / 2**20  # 1,200 bytes: about ten of the records below


def _recorder(tmp_path: Path, keep: int, last_round: int | None = None) -> Recorder:
    cfg = load_config(None, [f"out_dir={tmp_path}", f"records.rotate_mib={SMALL}", f"records.keep={keep}"])
    return Recorder(tmp_path, cfg, last_round=last_round)


def _rounds(path: Path) -> list[int]:
    return [json.loads(line)["round"] for line in read_lines(path)]


def _write(recorder: Recorder, rounds: range) -> None:
    for r in rounds:
        recorder.record(RoundRecord(round=r, version=r, mode="x" * 100))


def test_a_log_past_its_size_rotates_and_keeps_only_its_newest_files(tmp_path):
    _write(_recorder(tmp_path, keep=3), range(1, 101))
    path = tmp_path / "metrics.jsonl"
    files = segments(path)
    assert [p.name for p in files] == ["metrics.jsonl", "metrics.jsonl.1", "metrics.jsonl.2", "metrics.jsonl.3"]
    assert all(p.stat().st_size < 1200 + 150 for p in files)  # a file is rotated at the write that finds it full
    rounds = _rounds(path)
    assert rounds == list(range(rounds[0], 101)) and rounds[0] > 1  # the oldest went, the rest in order


def test_a_resumed_log_is_rewound_to_its_checkpoint_across_a_rotation(tmp_path):
    _write(_recorder(tmp_path, keep=50), range(1, 61))
    assert len(segments(tmp_path / "metrics.jsonl")) >= 5
    resumed = _recorder(tmp_path, keep=50, last_round=23)  # the checkpoint covered 23 rounds
    path = tmp_path / "metrics.jsonl"
    assert _rounds(path) == list(range(1, 24))
    numbers = [int(p.name.rpartition(".")[2]) for p in segments(path)[1:]]
    assert numbers == list(range(1, len(numbers) + 1))  # no gap left where newer files were
    assert [r for r, _ in resumed.history] == list(range(1, 24))
    _write(resumed, range(24, 41))
    assert _rounds(path) == list(range(1, 41))


def test_a_fresh_run_leaves_no_rotated_file_of_the_run_before(tmp_path):
    _write(_recorder(tmp_path, keep=5), range(1, 40))
    _write(_recorder(tmp_path, keep=5), range(1, 3))
    assert segments(tmp_path / "metrics.jsonl") == [tmp_path / "metrics.jsonl"] and _rounds(
        tmp_path / "metrics.jsonl"
    ) == [1, 2]


def test_events_rotate_and_their_count_spans_the_files(tmp_path):
    rotation = RecordsConfig(rotate_mib=SMALL, keep=20)
    log = EventLog(tmp_path / "events.jsonl", rotation)
    for i in range(60):
        log.add("join", i, pad="y" * 60)
    assert len(segments(tmp_path / "events.jsonl")) > 2
    again = EventLog(tmp_path / "events.jsonl", rotation, append=True)
    assert again.count == 60 and [e["island"] for e in map(json.loads, read_lines(log.path))] == list(range(60))


def test_a_run_restarted_after_its_logs_rotated_records_each_round_once(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco", "records.rotate_mib=0.0005", "records.keep=1000", "rounds=8")
    first, pool = in_process_engine(cfg, run_id="rotating")
    drive(first, until=4)
    saved = load_checkpoint(Path(cfg.checkpoint_dir) / "rotating")["ledger"]["position"]
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved[s], p))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="rotating")
    drive(second)
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    assert len(segments(metrics)) > 2 and len(segments(Path(cfg.out_dir) / "events.jsonl")) > 2
    assert _rounds(metrics) == list(range(1, 9))
    check_exactly_once(cfg, second.summary, lost)  # reads the lost work from every events file


def test_mend_keeps_every_whole_record_wherever_a_write_tore_the_log(tmp_path):
    """A torn prefix with the next line glued to it (a full disk, a later append), a torn
    line alone mid-file (in a rotated file too) and a torn tail: every whole record stays, in
    order, and nothing else."""
    from archipelago.orchestrator.engine.state.logfiles import mend

    path = tmp_path / "metrics.jsonl"
    (tmp_path / "metrics.jsonl.1").write_bytes(b'{"round": 1}\n{"rou\n{"round": 2}\n')
    path.write_bytes(
        b'{"round": 3}\n{"r{"round": 4, "x": {"y": 1}}\n{"round": 5, "x": {"0": 1.2}\n{"round": 6}\n{"round": 7, "eval'
    )
    assert mend(path, "round") > 0  # round 5's line tore after a nested object: that object is no record
    assert [json.loads(line)["round"] for line in read_lines(path)] == [1, 2, 3, 4, 6]
    assert mend(path, "round") == 0  # whole: left as it is
