"""The Python API (`import archipelago`): its version and commit, a config built, planned
and trained from a program, the command a shell over the same functions."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.helpers import toy_quadratic


def test_import_archipelago_is_light_and_gives_its_version_and_api():
    """The root imports nothing heavy (the command imports it first); `__version__` is the
    installed distribution's; the API's names resolve on first use."""
    code = (
        "import sys, archipelago; v = archipelago.__version__; "
        "print(v, 'torch' in sys.modules, 'pydantic' in sys.modules, archipelago.run.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    version, torch, pydantic, module = out.stdout.split()
    from importlib.metadata import version as installed

    assert version == installed("archipelago-diloco") and (torch, pydantic) == ("False", "False")
    assert module == "archipelago.orchestrator.library"
    import archipelago

    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        archipelago.trian  # noqa: B018


def test_version_names_the_commit_it_was_built_from():
    out = subprocess.run(
        [sys.executable, "-m", "archipelago.orchestrator.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=120,
    )
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    match = re.fullmatch(r"archipelago (\S+) \(commit ([0-9a-f]{12}(?:\+dirty)?|unknown)\)\n", out.stdout)
    assert match, out.stdout
    if head.returncode == 0:  # a checkout: its own commit
        assert match.group(2).removesuffix("+dirty") == head.stdout.strip()
    stated = subprocess.run(
        [sys.executable, "-m", "archipelago.orchestrator.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "ARCHIPELAGO_COMMIT": "0123456789ab"},
        timeout=120,
    )
    assert stated.stdout == f"archipelago {match.group(1)} (commit 0123456789ab)\n"  # the image's, from build.sh


def test_a_config_is_built_and_planned_from_a_program(tmp_path):
    import archipelago

    cfg = archipelago.config(None, "rounds=3", "islands.count=2")
    assert isinstance(cfg, archipelago.RunConfig) and cfg.rounds == 3 and cfg.islands.count == 2
    with pytest.raises(archipelago.ConfigError, match=r"outer\.lr"):
        archipelago.config(None, "outer.lr=-1")
    plan = archipelago.plan(cfg)
    assert plan.fits and any(line.startswith("island worker") for line in plan.lines())
    big = archipelago.plan(archipelago.config(None, "task.kwargs.d_model=16384", "task.kwargs.n_layers=48"))
    assert not big.fits  # a refusal is the plan's answer, not an exception


@pytest.mark.ray
def test_a_run_is_trained_from_a_program_and_its_summary_read_back(ray_local, tmp_path):
    import archipelago

    out = tmp_path / "api-run"
    cfg = archipelago.config(None, *toy_quadratic(2, 0.0, "islands.cpus=0.5", "rounds=2", "inner_steps=2"),
                             f"out_dir={out}")  # fmt: skip
    summary = archipelago.run(cfg, run_id="api")
    assert summary["state"] == "finished" and summary["rounds_done"] == 2
    assert archipelago.summary(out) == summary


def test_the_image_states_the_commit_it_is_built_from():
    """The image holds no .git (.dockerignore): build.sh passes the commit, the Dockerfile
    sets it where `commit()` reads it first."""
    build = (REPO / "k8s" / "image" / "build.sh").read_text()
    dockerfile = (REPO / "k8s" / "Dockerfile").read_text()
    assert '--build-arg "ARCHIPELAGO_COMMIT=${commit:0:12}"' in build
    assert "ARG ARCHIPELAGO_COMMIT" in dockerfile and "ENV ARCHIPELAGO_COMMIT=$ARCHIPELAGO_COMMIT" in dockerfile
