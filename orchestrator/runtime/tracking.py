"""Experiment tracking: what a run's users read in TensorBoard, MLflow or W&B (the config,
per-round losses, throughput, bytes, staleness per island, membership events and the final
summary), written by the coordinator next to `metrics.jsonl`. Every back-end works offline
by default (TensorBoard event files, an MLflow file store, W&B offline mode) under
`out_dir/tracking/`, and its library is imported only when `tracking.backends` lists it:
they are the `tracking` extra, never dependencies of a training install.

A coordinator restarted by Ray carries on the same tracked run: TensorBoard appends to its
folder, MLflow finds its run by the `archipelago.run_id` tag, W&B resumes the run id."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from ..config import RunConfig
from ..config_load import dump_config
from ..config_operations import TrackingBackend
from ..engine.state.views import EventRecord, RoundRecord
from ..engine.types import IslandState

log = logging.getLogger(__name__)

# record keys every back-end charts, by round
SCALARS = (
    "eval_loss",
    "train_loss",
    "tokens_total",
    "tokens_per_s",
    "bytes_sent",
    "bytes_received",
    "staleness",
    "lr",
    "islands_alive",
    "round_seconds",
)
RUN_TAG = "archipelago.run_id"


def scalars(record: RoundRecord, islands: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The numbers one round gives the trackers: the run's, and each live island's staleness
    and train loss (`island/<i>/…`)."""
    values = {k: getattr(record, k) for k in SCALARS}
    out = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
    out.update({f"eval/{name}": value for name, value in (record.eval_metrics or {}).items()})
    for island, stats in islands.items():
        if IslandState(stats.get("state", "starting")).gone:
            continue
        out[f"island/{island}/staleness"] = float(stats.get("staleness_last", 0))
        loss = record.island_train_loss.get(island)
        if loss is not None:
            out[f"island/{island}/train_loss"] = float(loss)
    return out


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}` (the config as parameters)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Tracker(Protocol):
    def scalars(self, values: dict[str, float], step: int) -> None: ...
    def events(self, events: list[EventRecord], step: int) -> None: ...
    def finish(self, summary: dict[str, Any]) -> None: ...


class TensorBoardTracker:
    def __init__(self, cfg: RunConfig, run_id: str, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard"))
        self.writer.add_text("config", f"run {run_id}\n\n```yaml\n{dump_config(cfg)}```")

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def events(self, events: list[EventRecord], step: int) -> None:
        if events:
            self.writer.add_text("events", "\n\n".join(json.dumps(e.as_dict()) for e in events), step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", f"```json\n{json.dumps(summary, indent=2)}\n```")
        self.writer.close()


class MlflowTracker:
    """Through `MlflowClient` (no process-global active run: the coordinator is an actor)."""

    def __init__(self, cfg: RunConfig, run_id: str, folder: Path) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking.mlflow_uri
        if uri is None:  # the offline default: MLflow's file store (maintained, but no longer the
            # default of MLflow 3, which asks for this opt-in; a database or server URI needs none)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (folder / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = cfg.tracking.project
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        runs = self.client.search_runs([experiment], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'")
        if runs:  # a restarted coordinator: the same run
            self.run = runs[0].info.run_id
        else:
            self.run = self.client.create_run(experiment, run_name=run_id, tags={RUN_TAG: run_id}).info.run_id
            params = [Param(k, json.dumps(v)[:6000]) for k, v in flat(cfg.model_dump(mode="json")).items()]
            for start in range(0, len(params), 100):  # MLflow takes 100 parameters per batch
                self.client.log_batch(self.run, params=params[start : start + 100])
        self.logged: list[dict[str, Any]] = []

    def scalars(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k.replace("/", "."), v, now, step) for k, v in values.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run, metrics=metrics[start : start + 1000])

    def events(self, events: list[EventRecord], step: int) -> None:
        self.logged.extend(e.as_dict() for e in events)
        if events:
            self.client.log_text(self.run, "".join(json.dumps(e) + "\n" for e in self.logged), "events.jsonl")

    def finish(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run, summary, "summary.json")
        self.client.set_terminated(self.run, "FINISHED" if summary.get("state") == "finished" else "KILLED")


class WandbTracker:
    def __init__(self, cfg: RunConfig, run_id: str, folder: Path) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=cfg.tracking.project,
            dir=str(folder),
            mode=cfg.tracking.wandb_mode,
            id=run_id,
            name=run_id,
            resume="allow",
            config=cfg.model_dump(mode="json"),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.logged: list[list[Any]] = []

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def events(self, events: list[EventRecord], step: int) -> None:
        for e in events:
            self.logged.append([step, e.time, e.kind.value, e.island, json.dumps(e.model_extra)])

    def finish(self, summary: dict[str, Any]) -> None:
        columns: list[str | int] = ["round", "time", "kind", "island", "detail"]
        self.run.log({"events": self.wandb.Table(columns=columns, data=self.logged)})
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish(exit_code=0 if summary.get("state") == "finished" else 1)


BACKENDS: dict[TrackingBackend, type[TensorBoardTracker] | type[MlflowTracker] | type[WandbTracker]] = {
    TrackingBackend.TENSORBOARD: TensorBoardTracker,
    TrackingBackend.MLFLOW: MlflowTracker,
    TrackingBackend.WANDB: WandbTracker,
}


class Tracking:
    """The configured trackers, fed each round's record and the events since the last one.
    A tracker that fails is logged and dropped: tracking must never end a run."""

    def __init__(self, cfg: RunConfig, run_id: str) -> None:
        folder = Path(cfg.out_dir) / "tracking"
        folder.mkdir(parents=True, exist_ok=True)
        self.trackers: list[Tracker] = []
        for backend in cfg.tracking.backends:
            try:
                self.trackers.append(BACKENDS[backend](cfg, run_id, folder))
            except ImportError as err:
                log.error("tracking: %s is not installed (pip install -e '.[tracking]'): %s", backend.value, err)
            except Exception:
                log.exception("tracking: %s could not start; the run goes on without it", backend.value)

    def _each(self, what: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, what)(*args)
            except Exception:
                log.exception("tracking: %s failed in %s and is dropped", type(tracker).__name__, what)
                self.trackers.remove(tracker)

    def record(self, record: RoundRecord, islands: dict[str, dict[str, Any]], events: list[EventRecord]) -> None:
        """One round of the main phase (a warm start's rounds are summed up in the summary:
        trackers want one increasing step)."""
        step = record.round
        self._each("scalars", scalars(record, islands), step)
        self._each("events", events, step)

    def finish(self, summary: dict[str, Any]) -> None:
        self._each("finish", summary)
