"""The command line's logging: -v/-q choose the level anywhere on the line, one handler per
process however often it is configured, membership faults logged as warnings."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import time
from datetime import datetime

import pytest

from archipelago.orchestrator.cli import build_parser, main
from archipelago.orchestrator.config_load import HF_TASK
from archipelago.orchestrator.config_operations import RecordsConfig
from archipelago.orchestrator.engine.state.records import EventLog
from archipelago.orchestrator.engine.types import Event
from archipelago.orchestrator.logs import PACKAGES, LogFormat, LogSetup, configure, configured, level_for
from tests.conftest import REPO


def _as_embedded() -> None:
    """The package's loggers as an embedding application would find them: no handler, no
    level, propagating. Before each test too: a test elsewhere that ran the command left
    them configured, and pytest attaches its capture handlers to a logger that does not
    propagate (which test ran before depends on how the suite is split among processes)."""
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


@pytest.fixture(autouse=True)
def _restore_logging():
    _as_embedded()
    yield
    _as_embedded()


def test_verbosity_flags_set_the_level_before_or_after_the_subcommand():
    assert level_for(0, 0) == logging.INFO
    assert level_for(1, 0) == logging.DEBUG and level_for(3, 0) == logging.DEBUG
    assert level_for(0, 1) == logging.WARNING and level_for(0, 2) == logging.ERROR
    parser = build_parser()
    for argv in (["-v", "config", "show"], ["config", "show", "-v"], ["run", "-v", "--set", "rounds=1"]):
        assert getattr(parser.parse_args(argv), "verbose", 0) == 1, argv
    assert getattr(parser.parse_args(["run", "-qq"]), "quiet", 0) == 2


def test_one_handler_however_often_configured_and_it_follows_stderr(capsys):
    configure(logging.INFO)
    configure(logging.INFO)
    assert len(logging.getLogger("archipelago").handlers) == 1
    logging.getLogger("archipelago.orchestrator.runtime.driver").info("hello")
    logging.getLogger("archipelago.workers.runtime.island").debug("not at INFO")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO archipelago: hello\n", capsys.readouterr().err)
    configure(logging.DEBUG)
    logging.getLogger("archipelago.api.app").debug("detail")
    err = capsys.readouterr().err
    assert " DEBUG archipelago.api.app: detail" in err


def test_membership_faults_are_warnings_and_routine_events_debug(tmp_path):
    stream = io.StringIO()
    configure(logging.INFO, stream)
    events = EventLog(tmp_path / "events.jsonl", RecordsConfig())
    events.add(Event.JOIN, 1)
    events.add(Event.CRASH, 2, error="node lost")
    assert stream.getvalue().endswith(" WARNING archipelago: crash island 2 error=node lost\n")
    assert stream.getvalue().count("\n") == 1
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 2  # the file has every event


def test_json_logs_are_one_object_a_line_with_time_level_and_the_exception(capsys):
    configure(logging.INFO, fmt=LogFormat.JSON)
    log = logging.getLogger("archipelago.orchestrator.runtime.driver")
    log.info("hello %s", "there")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert first["message"] == "hello there" and first["level"] == "INFO" and first["logger"] == log.name
    assert datetime.fromisoformat(first["time"]).tzinfo is not None
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]
    assert configured() == LogSetup(logging.INFO, LogFormat.JSON)  # what the coordinator is handed
    configure(logging.INFO)


def test_the_version_and_the_log_format_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and re.fullmatch(
        r"archipelago \d+\.\d+\.\d+\S* \(commit \S+\)\n", capsys.readouterr().out
    )
    assert build_parser().parse_args(["run", "--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--log-format", "xml"])


def test_quiet_config_show_prints_only_the_yaml(capsys):
    assert main(["-q", "config", "show", "--set", "rounds=3"]) == 0
    out = capsys.readouterr()
    assert "rounds: 3" in out.out and out.err == ""


def test_config_docs_writes_the_reference(tmp_path, capsys):
    from archipelago.orchestrator.config_docs import render

    assert main(["config", "docs", "--out", str(tmp_path / "c.md")]) == 0
    assert (tmp_path / "c.md").read_text() == render()
    assert "wrote" in capsys.readouterr().err


def test_run_init_from_sets_the_field_and_a_missing_file_is_named(tmp_path, capsys):
    assert main(["run", "--init-from", str(tmp_path / "missing.pt")]) == 2  # before anything starts
    err = capsys.readouterr().err
    assert "invalid config: init_from" in err and "missing.pt" in err


@pytest.mark.parametrize("field", ["checkpoint.path", "out_dir"])
def test_run_refuses_a_folder_it_cannot_write_before_anything_starts(tmp_path, capsys, monkeypatch, field):
    """Before: a `checkpoint.path` that is a regular file was found at the first checkpoint,
    after that much training (a traceback ended the run)."""
    import time

    import archipelago.orchestrator.runtime.driver as driver

    def never(*_args, **_kwargs):
        raise AssertionError("the run was started")

    monkeypatch.setattr(driver, "run", never)  # refused before the driver (and Ray) is reached
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    out = taken if field == "out_dir" else tmp_path / "out"
    started = time.monotonic()
    assert main(["run", "--set", f"{field}={taken}", "--set", f"out_dir={out}"]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert f"invalid config: {field}: {taken} is a file, not a folder" in err
    assert taken.read_text() == "not a folder"


def test_a_commands_start_is_read_to_the_tick_not_to_the_boot_times_second():
    """`startup_seconds` counts from the process's start: a child stamps its own start
    within a few clock ticks after its parent's clock read before spawning it (the
    boot time in whole seconds put it up to a second early)."""
    before = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from archipelago.orchestrator.runtime.driver import process_started_at; print(process_started_at())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    after = time.time()
    tick = 0.011  # /proc counts in clock ticks of 10 ms
    assert before - tick <= float(out.stdout) <= after


def test_the_command_line_and_a_bad_config_do_not_import_torch():
    """`archipelago --help`, and a config error's exit 2, come without importing torch
    (0.8 s of the command's 1.3 s): the task contract the config check uses only names it."""
    code = (
        "import sys; from archipelago.orchestrator.cli import main; "
        "rc = main(['run', '--set', 'islands.count=-1']); print(rc, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert "islands.count" in out.stderr


def test_a_run_reaches_its_actors_without_importing_torch(corpus_cache, tmp_path):
    """What `archipelago run` does before its actors start (the driver, the default task's
    data, the islands' specs, the coordinator's and islands' actor classes) imports no
    torch: the actors' processes do. It was 0.8 s of the command's start-up, on the
    critical path of `bench startup`'s warm row."""
    code = """
import sys
import ray
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.orchestrator.runtime.coordinator import Coordinator
from archipelago.orchestrator.runtime.driver import check_resumable
from archipelago.workers.runtime.island_actor import island_actor_class
from archipelago.workers.tasks.task import load_task

cfg = load_config(None, ["out_dir=OUT", "checkpoint.path=OUT/ckpt", "task.kwargs.cache_dir=CACHE"])
load_task(cfg.task.factory, cfg.task.kwargs).prepare()
specs = [island_spec(cfg, i) for i in range(cfg.islands.count)]
check_resumable(cfg, "no-such-run")
ray.remote(Coordinator), island_actor_class()
print("torch" in sys.modules)
"""
    code = code.replace("OUT", str(tmp_path)).replace("CACHE", corpus_cache)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.split() == ["False"], out.stderr[-3000:]


@pytest.mark.parametrize(
    "argv",
    [["bench", "fleet", "--quick", "--out", "somewhere"], ["simulate", "--set", "mode=async"], ["testbed", "down"]],
    ids=["bench", "simulate", "testbed"],
)
def test_the_labs_commands_where_its_distribution_is_not_installed_say_what_to_install(monkeypatch, capsys, argv):
    """`archipelago bench`, `simulate` and `testbed` are the lab's subcommands (a
    distribution of its own): where no entry point adds them, the command exits 2 naming
    the distribution and how to install it, whatever arguments followed (not argparse's
    "invalid choice")."""
    from archipelago.orchestrator import cli

    monkeypatch.setattr(cli, "_registered", dict)
    monkeypatch.setattr(cli, "HANDLERS", {})
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "archipelago-diloco-bench" in err and "pip install -e orchestrator/bench" in err, err


_WITHOUT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # not importable in this process, as where the extra is not installed
from archipelago.orchestrator.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    "blocked,argv,extra",
    [
        (["transformers"], ["plan", "k8s/hf-llama-config.yaml"], "hf"),
        (
            ["transformers"],
            ["run", "--set", f"task.factory={HF_TASK}:make_task", "--set", "task.kwargs.preset=tiny-llama"],
            "hf",
        ),
        (["s3fs"], ["run", "--set", "checkpoint.path=s3://bucket/runs", "--set", "checkpoint.every_rounds=1"], "s3"),
        (["gcsfs"], ["plan", "--set", "checkpoint.path=gs://bucket/runs"], "gcs"),
        (["wandb"], ["plan", "--set", "tracking.backends=[tensorboard,wandb]"], "tracking"),
    ],
)
def test_a_config_needing_an_extra_that_is_not_installed_exits_2_naming_it(blocked, argv, extra):
    """Before: `plan` of the Hugging Face config without `[hf]` died in a traceback (exit 1),
    an s3:// checkpoint was found out at the store's probe, a tracker was switched off with an
    error line mid-run. Checked by name before anything starts, in `plan` and `run`."""
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT.format(blocked=blocked, argv=["-q", *argv])],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"needs the `{extra}` extra" in out.stderr and f"pip install 'archipelago-diloco[{extra}]'" in out.stderr
    assert f"{blocked[0]} missing" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.ray
def test_with_json_logs_every_line_a_run_prints_is_one_object_with_its_run_id(tmp_path):
    """`--log-format json` on a real run, with `-v`: before, the progress and result lines,
    the coordinator's forwarded lines (prefixed by Ray) and Ray's own stayed text, and no
    record named its run. Every line on stdout and stderr now parses, each with the run's id:
    the driver's, the coordinator's (through Ray's forwarding, unprefixed), Ray's own, the
    progress a record a round and the summary one object."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    sets = ["rounds=1", "inner_steps=2", "warm_start.steps=0", "islands.count=2", f"out_dir={tmp_path / 'out'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "archipelago.orchestrator.cli", "-v", "--log-format", "json", "run"]
        + [a for s in sets for a in ("--set", s)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {r.get("run_id") for r in records} == {(tmp_path / "out" / "run_id").read_text().strip()}
    loggers = {r.get("logger") or r.get("filename") for r in records}
    assert "archipelago.orchestrator.engine.state.records" in loggers  # the coordinator's process, forwarded
    assert "worker.py" in loggers  # Ray's own ("Started a local Ray instance")
    (result,) = [r for r in records if r.get("message") == "summary"]
    assert result["summary"]["final_eval_loss"] == summary["final_eval_loss"]
    assert [r["progress"]["round"] for r in records if "progress" in r][-1] == 1
