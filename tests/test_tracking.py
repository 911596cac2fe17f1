"""Experiment tracking, read back with each library's own reader: TensorBoard's event
accumulator, MLflow's client over its file store, W&B's offline run files and its record
store. The records are a real run's (a crash, a join, a drain); tracking off imports none
of the three libraries."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.engine.commands import AddIslands, Drain
from tests.conftest import REPO
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine

LIBRARIES = ("wandb", "mlflow", "tensorboard", "torch.utils.tensorboard")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One run tracked by all three back-ends, fed as the coordinator feeds them."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from archipelago.orchestrator.runtime.tracking import Tracking

    tmp_path = tmp_path_factory.mktemp("tracked")
    cfg = scenario_cfg(tmp_path, "diloco", "tracking.backends=[tensorboard,mlflow,wandb]", "tracking.project=tests")
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.CRASH, 1, order=2)], join_s=2.0, run_id="tracked")
    tracking = Tracking(cfg, "tracked")
    assert len(tracking.trackers) == 3
    records: list[dict] = []
    seen = [0]

    def feed(_status, islands, record):
        new = engine.events.since(seen[0])
        seen[0] += len(new)
        records.append(record.as_dict())
        tracking.record(record, islands, new)

    engine.outputs.on_record = feed
    drive(engine, at={2: lambda e: e.submit(AddIslands(count=1)), 4: lambda e: e.submit(Drain(island=0))})
    tracking.finish(engine.summary)
    return Path(cfg.out_dir) / "tracking", records, engine.summary


def test_tensorboard_event_files_hold_the_runs_scalars_config_and_events(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, records, _ = tracked
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    eval_loss = events.Scalars("eval_loss")
    assert [e.step for e in eval_loss] == [r["round"] for r in records]
    assert [e.value for e in eval_loss] == pytest.approx([r["eval_loss"] for r in records], rel=1e-6)
    assert [e.value for e in events.Scalars("bytes_sent")] == [r["bytes_sent"] for r in records]
    assert {"island/0/staleness", "island/2/train_loss"} <= set(events.Tags()["scalars"])
    texts = set(events.Tags()["tensors"])
    assert {"config/text_summary", "events/text_summary", "summary/text_summary"} <= texts
    logged = b"".join(t.tensor_proto.string_val[0] for t in events.Tensors("events/text_summary")).decode()
    assert '"kind": "crash"' in logged and '"kind": "drain"' in logged and '"kind": "join"' in logged


def test_the_mlflow_run_has_params_metric_histories_events_and_the_summary(tracked, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store, as the run wrote it

    folder, records, summary = tracked
    client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.data.tags["archipelago.run_id"] == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["mode.name"] == '"diloco"' and run.data.params["inner_steps"] == "4"
    history = client.get_metric_history(run.info.run_id, "eval_loss")
    assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(r["eval_loss"])) for r in records]
    assert client.get_metric_history(run.info.run_id, "island.0.staleness")
    saved = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path)))
    assert json.loads(saved.read_text())["tokens"] == summary["tokens"]
    logged = Path(client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path))).read_text()
    assert {"crash", "join", "drain"} <= {json.loads(line)["kind"] for line in logged.splitlines()}


def _wandb_records(path: Path):
    """The records of a W&B offline run file: its 7-byte header (`:W&B`, magic, version),
    then LevelDB-log framing (32 KiB blocks; per chunk crc32, length, type: full, first,
    middle, last), each record a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the block's zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _exit_records(path: Path) -> int:
    try:
        return sum(record.WhichOneof("record_type") == "exit" for record in _wandb_records(path))
    except Exception:  # a record being written: not ended yet
        return 0


def test_the_wandb_offline_run_holds_the_history_config_events_and_summary(tracked):
    folder, records, summary = tracked
    (run_dir,) = (folder / "wandb").glob("offline-run-*-tracked")
    path = next(run_dir.glob("*.wandb"))
    # `finish` returns once W&B's service has the run; on loaded cores its writer thread
    # closed the file later (CI once read it with no record yet): waited for, within 60 s
    deadline = time.monotonic() + 60
    while _exit_records(path) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    rows, config, final, kinds = [], {}, {}, Counter()
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        kinds[kind] += 1
        if kind == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates if item.key})
        elif kind == "summary":
            final.update({item.key: json.loads(item.value_json) for item in record.summary.update if item.key})
    losses = [(row["_step"], row["eval_loss"]) for row in rows if "eval_loss" in row]
    assert kinds["exit"] == 1, f"the file is read before W&B ended it: {dict(kinds)}"
    assert losses == [(r["round"], pytest.approx(r["eval_loss"])) for r in records], dict(kinds)
    assert config["mode"]["name"] == "diloco" and config["inner_steps"] == 4
    (table,) = (run_dir / "files" / "media" / "table").glob("events_*.table.json")  # the events, as a table
    logged = json.loads(table.read_text())
    assert logged["columns"][2] == "kind" and {"crash", "join", "drain"} <= {row[2] for row in logged["data"]}
    assert final["tokens"] == summary["tokens"] and final["rounds_done"] == 6


def test_tracking_off_imports_none_of_the_libraries(tmp_path):
    overrides = [
        "task.factory=tests.toy_tasks:make_quadratic",
        "task.kwargs.centers=[[1.0,0.0]]",
        "warm_start.steps=0",
        "rounds=2",
        f"out_dir={tmp_path / 'off'}",
    ]
    script = (
        "import sys, json; from archipelago.orchestrator.config_load import load_config; "
        "from archipelago.orchestrator.runtime import coordinator, driver; from orchestrator import cli; "
        "from tests.helpers import in_process_engine; "
        f"cfg = load_config(None, {json.dumps(overrides)}); assert cfg.tracking.backends == []; "
        "in_process_engine(cfg)[0].execute(); "
        f"print(json.dumps(sorted(m for m in {LIBRARIES!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
