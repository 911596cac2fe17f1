"""`api`, `workers` and `orchestrator` are generic names: prove we import this repo's."""

from __future__ import annotations

import importlib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_packages_are_this_repos():
    for name in ("orchestrator", "workers", "api"):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().parent == REPO / name, module.__file__


def test_a_foreign_package_of_the_same_name_is_refused_naming_both(tmp_path):
    """An `api` folder earlier on sys.path (here: the working directory of `python -c`)
    would be imported in place of ours; importing Archipelago says so at once."""
    import os
    import subprocess
    import sys

    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # ours importable, after the working directory
    probe = subprocess.run(
        [sys.executable, "-c", "import orchestrator"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 1
    assert f"should be {REPO / 'api'}" in probe.stderr and str(tmp_path / "api") in probe.stderr


def test_distribution_declares_the_console_script():
    dist = metadata.distribution("archipelago-diloco")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts["archipelago"] == "orchestrator.cli:main"
    torch_req = [r for r in dist.requires or [] if r.startswith("torch") and "extra ==" not in r]
    assert torch_req == ["torch==2.13.0"]
    # the peer (torchft) and the Hugging Face stack are extras, never the default install's
    for extra in ("torchft", "transformers", "tokenizers", "safetensors"):
        assert all("extra ==" in r for r in dist.requires or [] if r.startswith(extra)), extra


def test_a_training_install_pulls_no_plotting_library():
    """matplotlib was a dependency of every install; it is the `bench` extra now, and a
    benchmark without it is refused before any run, saying how to get it."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("matplotlib")]
    assert project["optional-dependencies"]["bench"] == ["matplotlib>=3.8"]
    assert "archipelago-diloco[bench]" in project["optional-dependencies"]["test"]


def test_a_training_install_pulls_no_tracking_or_object_store_library():
    """Tracking back-ends and object-store file systems are extras: a run imports them only
    when its config asks (tests/test_tracking.py checks the imports)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = {"tensorboard", "mlflow", "wandb", "s3fs", "gcsfs", "boto3", "moto"}
    assert not [d for d in project["dependencies"] if d.split(">")[0].split("=")[0].split("[")[0] in optional]
    assert {d.split(">")[0] for d in project["optional-dependencies"]["tracking"]} == {
        "tensorboard", "mlflow-skinny", "wandb",
    }  # fmt: skip
    assert project["optional-dependencies"]["s3"] == ["s3fs>=2024.2"]
