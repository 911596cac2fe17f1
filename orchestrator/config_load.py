"""Load a `RunConfig` from YAML plus dotted `key=value` overrides, with errors that name
the field and the reason (and the task's own kwargs validated up front too)."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from archipelago.workers.runtime.storage import Folder, is_url
from archipelago.workers.tasks.task import TaskError, load_task

from .config import RUN_PLACEHOLDER, RunConfig
from .config_operations import TrackingBackend
from .mode_settings import Mode
from .modes import MODES

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The configuration is invalid; the message names each bad field."""


class _Loader(yaml.SafeLoader):
    """YAML with 1.2's floats: PyYAML (YAML 1.1) reads `1e4` or `3e-4` as a *string*, which
    typed fields coerced but a task's free-form kwargs (a model architecture's `rope_theta:
    1e4`) passed on to transformers as the text '1e4'."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: builds plain values only


MODE_NAMES = frozenset(m.value for m in Mode)


def format_error(err: ValidationError, prefix: str = "") -> str:
    """Each error as `where: what`; an error inside the `mode` union said as its mode's
    (not pydantic's `mode.async.quorum`), with the modes that have a setting another has not."""
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        msg = e["msg"]
        if loc[:1] == ["mode"] and len(loc) > 1 and loc[1] in MODE_NAMES:  # the union's member: said in words
            mode = loc.pop(1)
            if e["type"] == "extra_forbidden" and len(loc) == 2:
                others = [m.value for m in Mode if loc[1] in MODES[m].settings.model_fields]
                msg = f"not a setting of mode {mode}" + (f" (one of mode {', '.join(others)})" if others else "")
        elif loc == ["mode"] and e["type"] == "union_tag_invalid":
            msg = f"{e['ctx']['tag']!r} is not a mode: one of {', '.join(sorted(MODE_NAMES))}"
        where = ".".join(str(p) for p in (prefix, *loc) if p != "") or "config"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`outer.lr=0.5` → (['outer', 'lr'], 0.5). Values are parsed as YAML scalars/lists."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key.path=value")
    try:
        value = _yaml(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {err}") from err
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`overrides` set into `data`, in order. `mode` is a section with a shorthand: `mode=async`
    sets its name (keeping settings set before it), `mode.quorum=3` after `mode: async` adds a
    setting to that mode."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            if part == "mode" and node is data and isinstance(node.get(part), str):
                node[part] = {"name": node[part]}
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path)}: {part!r} is not a section")
            node = child
        if path == ["mode"] and isinstance(node.get("mode"), dict) and not isinstance(value, dict):
            node["mode"]["name"] = value
        else:
            node[path[-1]] = value
    return data


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, check_task: bool = True
) -> RunConfig:
    """Resolve the run config. Raises `ConfigError` and starts nothing if anything is wrong."""
    return validate_config(read_config_data(path, overrides or []), check_task)


def read_config_data(path: str | Path | None, overrides: list[str]) -> dict[str, Any]:
    """The config file's mapping with `overrides` applied and moved settings at their
    place, not validated yet."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = _yaml(Path(path).read_text())
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err}") from err
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping, not {type(loaded).__name__}")
        data = loaded or {}
    return upgraded(apply_overrides(data, overrides))


def validate_config(data: dict[str, Any], check_task: bool = True) -> RunConfig:
    """`data` as a run's config; ConfigError naming the field if it is not one."""
    if SIMULATION in data:
        raise ConfigError(
            f"{SIMULATION}: a run's config has no simulation section: a simulated fleet runs with "
            "`archipelago simulate` (or a bench), which read it beside the run's config"
        )
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_error(err)) from err
    if check_task:
        check_task_spec(cfg)
    return cfg


SIMULATION = "simulation"  # read by `archipelago.orchestrator.bench.simulation.config`, refused here


# settings that moved, so a config written for an earlier release still loads (those
# moved into `simulation` are a bench's or a simulated fleet's: a run's config refuses them
# there, pointing to `archipelago simulate`)
MOVED = {
    ("islands", "simulated_slowdown"): ("simulation", "slowdown"),
    ("islands", "virtual_step_s"): ("simulation", "virtual_step_s"),
    ("islands", "links"): ("simulation", "links"),
    ("link",): ("simulation", "link"),
    ("outer", "drop_prob"): ("simulation", "drop_prob"),
}


def _restart_baseline(data: dict[str, Any]) -> None:
    """`elastic.on_failure` and `elastic.restart_s` (releases before 0.2): `restart` is the
    checkpoint-restart baseline, now `simulation.restart_s`; `continue` is what every run does."""
    elastic = data.get("elastic")
    if not isinstance(elastic, dict) or not {"on_failure", "restart_s"} & elastic.keys():
        return
    on_failure, restart_s = elastic.pop("on_failure", "continue"), elastic.pop("restart_s", 30.0)
    if on_failure == "restart":
        data.setdefault("simulation", {})["restart_s"] = restart_s
        log.warning("elastic.on_failure restart is now simulation.restart_s = %s (a bench's baseline)", restart_s)
    else:
        log.warning("elastic.on_failure and elastic.restart_s are gone: a failure never halts a run's fleet")


# the mode sections before `mode` held its mode's settings (releases before 0.3): their
# settings are the mode's now, but for the speeds' smoothing, which every mode reads
MODE_SECTIONS = ("asynchronous", "diloco", "overlap", "streaming")
RUN_WIDE = {"speed_smoothing"}


def _mode_sections(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Each old mode section's settings moved into `mode` (`speed_smoothing` to the run's
    top level); the old names it read, for one warning. A setting given at both places is
    an error naming both; one the run's mode has not is refused by the mode's settings, as
    the old check refused it."""
    read: list[tuple[str, str]] = []
    for section in MODE_SECTIONS:
        if section not in data:
            continue
        old = data.pop(section)
        if not isinstance(old, dict):
            raise ConfigError(f"{section}: a section of settings, now the mode's own (`mode`)")
        mode = data.get("mode", {"name": "diloco"})
        mode = {"name": mode} if isinstance(mode, str) else mode
        data["mode"] = mode
        for key, value in old.items():
            holder, new = (data, key) if key in RUN_WIDE else (mode, f"mode.{key}")
            if key in holder:
                raise ConfigError(f"{section}.{key} moved to {new}: give it once, at {new}")
            holder[key] = value
            read.append((f"{section}.{key}", new))
    return read


def upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each moved setting at its new place (one warning names them); one given
    at both places is an error naming them. A checkpoint's saved config is read through it
    too."""
    _restart_baseline(data)
    for old, new in MOVED.items():
        *parents, leaf = old
        holder: dict[str, Any] = data
        for key in parents:
            inner = holder.get(key)
            holder = inner if isinstance(inner, dict) else {}
        if leaf not in holder:
            continue
        section = data.setdefault(new[0], {})
        if not isinstance(section, dict) or new[1] in section:
            raise ConfigError(f"{'.'.join(old)} moved to {'.'.join(new)}: give it once, at {'.'.join(new)}")
        section[new[1]] = holder.pop(leaf)
        log.warning("%s is now %s (read from the old name)", ".".join(old), ".".join(new))
    if read := _mode_sections(data):
        log.warning(
            "settings read from the mode sections, which are gone (a mode's settings are its `mode` section; the "
            "old names will stop working in a later release): %s",
            ", ".join(f"{old} as {new}" for old, new in read),
        )
    return data


def check_task_spec(cfg: RunConfig) -> None:
    """Build the task object (cheap: no data is read) so bad task kwargs fail now."""
    try:
        load_task(cfg.task.factory, cfg.task.kwargs)
    except TaskError as err:
        cause = err.__cause__
        if isinstance(cause, ValidationError):
            raise ConfigError(format_error(cause, "task.kwargs")) from err
        raise ConfigError(f"task.factory: {err}") from err


def dump_config(cfg: RunConfig, *, reads_only: bool = False) -> str:
    """The config as YAML; `reads_only`: its mode's settings cut to those a run of it reads
    with these settings (`ModeSettings.unread`)."""
    data = cfg.model_dump(mode="json")
    if reads_only:
        unread, _ = cfg.mode.unread()
        data["mode"] = {k: v for k, v in data["mode"].items() if k not in unread}
    return yaml.safe_dump(data, sort_keys=False)


def _probe_store(field: str, location: str) -> None:
    """Object storage: its fsspec package installed, the bucket reachable and writable."""
    try:
        folder = Folder(location)
        probe = f".archipelago-probe-{os.getpid()}"
        folder.write(probe, b"")
        folder.delete(probe)
    except ImportError as err:
        raise ConfigError(f"{field}: {location} needs its storage package ({err}); the s3 extra has s3fs") from err
    except Exception as err:  # the SDK's errors vary by store: any means the run could not checkpoint
        raise ConfigError(f"{field}: {location} is not writable: {type(err).__name__}: {err}") from err


# What a config can name that an optional extra provides: (the extra, the modules it brings
# that the run imports). Checked by name (`importlib.util.find_spec`), nothing imported.
HF_TASK = "archipelago.workers.tasks.hf_task"
EXTRAS = {
    "hf": ("transformers", "tokenizers", "safetensors"),
    "s3": ("s3fs",),
    "gcs": ("gcsfs",),
}
BACKEND_MODULES = {
    TrackingBackend.TENSORBOARD: "tensorboard",
    TrackingBackend.MLFLOW: "mlflow",
    TrackingBackend.WANDB: "wandb",
}
STORES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # a URL's scheme -> its extra


def needed_extras(cfg: RunConfig) -> list[tuple[str, str, tuple[str, ...]]]:
    """(the field, the extra, its modules) for every optional extra `cfg` needs: the Hugging
    Face task, an object-storage URL anywhere in it, each tracking back-end."""
    needs: list[tuple[str, str, tuple[str, ...]]] = []
    if cfg.task.factory.split(":")[0] == HF_TASK:
        needs.append(("task.factory", "hf", EXTRAS["hf"]))

    def urls(value: Any, field: str) -> None:
        if isinstance(value, dict):
            for key, each in value.items():
                urls(each, f"{field}.{key}" if field else str(key))
        elif isinstance(value, list):
            for i, each in enumerate(value):
                urls(each, f"{field}[{i}]")
        elif isinstance(value, str) and (extra := STORES.get(value.partition("://")[0])) and "://" in value:
            needs.append((field, extra, EXTRAS[extra]))

    urls(cfg.model_dump(mode="json"), "")
    needs += [(f"tracking.backends: {b.value}", "tracking", (BACKEND_MODULES[b],)) for b in cfg.tracking.backends]
    return needs


def check_extras(cfg: RunConfig) -> None:
    """Refuse a config that needs an optional extra this environment lacks, naming the extra
    to install (before: a traceback from deep in the plan or the run, exit 1, or a tracker
    silently off)."""
    for field, extra, modules in needed_extras(cfg):
        if missing := [m for m in modules if importlib.util.find_spec(m) is None]:
            raise ConfigError(
                f"{field} needs the `{extra}` extra, which is not installed here ({', '.join(missing)} missing): "
                f"pip install 'archipelago-diloco[{extra}]' (from a checkout: pip install -e '.[{extra}]')"
            )


def check_folders(cfg: RunConfig) -> None:
    """Refuse, before any compute, a run whose outputs or checkpoints could not be written:
    each folder is created and a probe file written and removed in it. Without this an
    unwritable `checkpoint.path` (a regular file, a read-only mount) was found only at the
    first checkpoint, after that much training."""
    folders = [("out_dir", cfg.out_dir)]
    if cfg.checkpoint.every_rounds or cfg.checkpoint.path:
        folders.append(("checkpoint.path", cfg.checkpoint_dir))
    # a run's own folder is named once its id is known: the folder above it is checked
    folders = [(f, d.split(RUN_PLACEHOLDER)[0].rstrip("/") or "." if RUN_PLACEHOLDER in d else d) for f, d in folders]
    for field, folder in folders:
        if is_url(folder):
            _probe_store(field, folder)
            continue
        path = Path(folder)
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".archipelago-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            what = "is a file, not a folder" if path.is_file() else f"is not writable: {err.strerror or err}"
            raise ConfigError(f"{field}: {folder} {what}") from err
