"""What a user installing or redistributing the package relies on: a licence, every
third-party import declared, dependency ranges rather than pins for the heavy ones, and an
image build context that leaves secrets, venvs and runs out."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
PRODUCT = ("orchestrator", "workers", "api")  # the folders; imported as archipelago.<folder>
BENCH = REPO / "orchestrator" / "bench"  # the lab (`bench`, `simulate`, `testbed`): a distribution of its own
BENCH_PROJECT = tomllib.loads((BENCH / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_licence_is_apache_2_and_declared():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert any(c.startswith("Topic ::") for c in PROJECT["classifiers"])
    assert (REPO / "docs" / "SECURITY.md").exists()


def test_the_classifiers_claim_only_the_python_ci_runs():
    """Before: 3.10 and 3.12 were claimed, which nothing tested. The suite runs on CI's
    interpreter (both its sets): that version, and only it, is claimed."""
    claimed = {
        c.rsplit(" :: ", 1)[1]
        for c in PROJECT["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    assert claimed == {f"{sys.version_info.major}.{sys.version_info.minor}"}
    assert (
        f"Python {sys.version_info.major}.{sys.version_info.minor} (what CI runs)" in (REPO / "README.md").read_text()
    )


def test_every_third_party_import_is_declared():
    """Each module the product imports from outside the standard library belongs to a
    distribution named in the core dependencies or an extra (a missing `tqdm` once
    broke `archipelago data` on a fresh install)."""
    declared = {_name(r) for r in PROJECT["dependencies"]}
    for extra in PROJECT["optional-dependencies"].values():
        declared |= {_name(r) for r in extra}
    # the bench's folder: its own distribution's (orchestrator/bench/pyproject.toml)
    declared |= {_name(r) for r in BENCH_PROJECT["project"]["dependencies"]}
    for extra in BENCH_PROJECT["project"]["optional-dependencies"].values():
        declared |= {_name(r) for r in extra}
    declared |= {"ray"}  # `ray[default]`
    providers = importlib.metadata.packages_distributions()
    ours = {"archipelago", "tests"}
    missing = {}
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in ours or top in sys.stdlib_module_names:
                        continue
                    dists = {d.lower().replace("_", "-") for d in providers.get(top, [top])}
                    if not dists & declared:
                        missing.setdefault(top, str(path.relative_to(REPO)))
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_heavy_dependencies_are_ranges_so_an_images_own_build_is_kept():
    for name in ("torch", "ray"):
        (spec,) = [r for r in PROJECT["dependencies"] if _name(r) == name]
        assert "==" not in spec and ">=" in spec and "<" in spec, spec


def test_the_constraints_pin_every_requirement_inside_its_range_and_ci_and_the_image_use_them():
    """k8s/constraints.txt is the exact set CI and the image install: every dependency of
    the core and of the test extra (and the extras it names), and of the bench's
    distribution CI installs beside it, is pinned there, at a version its range in
    pyproject.toml admits, so the pins and the ranges cannot drift apart."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    lines = (REPO / "k8s" / "constraints.txt").read_text().splitlines()
    pins = dict(line.lower().replace("_", "-").split("==") for line in lines if line and not line.startswith("#"))
    extras = PROJECT["optional-dependencies"]
    bench = [r for r in BENCH_PROJECT["project"]["dependencies"] if Requirement(r).name != PROJECT["name"]]
    wanted, todo = [*PROJECT["dependencies"], *bench], ["test"]
    while todo:
        for requirement in extras[todo.pop()]:
            req = Requirement(requirement)
            if req.name == PROJECT["name"]:
                todo.extend(req.extras)
            else:
                wanted.append(requirement)
    for requirement in wanted:
        req = Requirement(requirement)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in k8s/constraints.txt"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), (requirement, pins[name])
    assert "-c k8s/constraints.txt" in (REPO / ".ci" / "run").read_text()
    assert "-c /app/k8s/constraints.txt" in (REPO / "k8s" / "Dockerfile").read_text()


def _regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker reads it: `**/` any folders, `*` and `?` within
    one path element."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path, or a folder above it, decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_the_image_context_leaves_secrets_tokens_venvs_and_runs_out():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in (
        "k8s/secret.yaml",
        "api.token",
        "k8s/admin.token",
        ".venv/lib/python3.11/site.py",
        "runs/latest/metrics.jsonl",
        ".git/config",
        ".env",
        "orchestrator/__pycache__/cli.cpython-311.pyc",
    ):
        assert _ignored(path, patterns), path
    for path in ("orchestrator/cli.py", "k8s/raycluster.yaml", "pyproject.toml", "LICENSE", "README.md"):
        assert not _ignored(path, patterns), path


def test_one_import_root_every_package_listed_and_the_wheel_installs_nothing_else(tmp_path):
    """The distribution installs one top-level package, `archipelago` (the three folders as
    archipelago.orchestrator, .workers, .api), never a generic `api` or `workers` that
    collides with a user's own: every folder of Python files is a package (`workers/data`
    was not, and the wheel left it out: an installed, not editable, product failed at its
    first task import), the package list in pyproject.toml is every one but the lab's, and the
    wheel built from it holds nothing outside `archipelago/` but its metadata, the dashboard
    included, no benchmark, simulator or testbed, and registers no subcommand. The lab's own
    wheel holds `archipelago/orchestrator/bench/` (the simulator in it) alone and registers
    `bench`, `testbed` and `simulate`."""
    import shutil
    import subprocess
    import zipfile

    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {f.parent for folder in PRODUCT for f in (REPO / folder).rglob("*.py") if "__pycache__" not in f.parts}
    assert not [f for f in folders if not (f / "__init__.py").exists()], "a folder of modules without __init__.py"
    found = sorted(
        "archipelago." + ".".join(init.parent.relative_to(REPO).parts)
        for folder in PRODUCT
        for init in (REPO / folder).rglob("__init__.py")
        if not init.parent.is_relative_to(BENCH)
    )
    assert sorted(listed) == ["archipelago", *found]  # the root: k8s/pythonpath/archipelago/__init__.py

    def wheel(source: Path) -> list[str]:
        out = tmp_path / source.name
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(out),
                str(source),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        (built,) = out.glob("*.whl")
        return zipfile.ZipFile(built).namelist()

    names = wheel(REPO)
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"archipelago"}, tops
    assert "archipelago/api/dashboard.html" in names and "archipelago/orchestrator/cli.py" in names
    # the root holds its version and the Python API's names, nothing else of the view it sits in
    assert [n for n in names if n.count("/") == 1 and not n.split("/")[0].endswith(".dist-info")] == [
        "archipelago/__init__.py"
    ]
    assert not any(n.startswith("archipelago/orchestrator/bench/") for n in names)  # the lab is not the product's
    assert not any("simulation" in n or "testbed" in n or "netlab" in n for n in names), names
    assert "archipelago/workers/data/corpus.py" in names
    (points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert (
        "archipelago.commands" not in zipfile.ZipFile(next((tmp_path / REPO.name).glob("*.whl"))).read(points).decode()
    )
    # built from a copy: pip builds in the source tree, and a build/ inside the bench's folder
    # would sit inside the product's package folder
    source = shutil.copytree(BENCH, tmp_path / "bench-source", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    bench = wheel(source)
    files = [n for n in bench if ".dist-info/" not in n]
    assert files and all(n.startswith("archipelago/orchestrator/bench/") and n.endswith(".py") for n in files), files
    assert "archipelago/orchestrator/bench/command.py" in files and len(files) == len(list(BENCH.rglob("*.py")))
    assert "archipelago/orchestrator/bench/simulation/pool.py" in files
    assert BENCH_PROJECT["project"]["entry-points"]["archipelago.commands"] == {
        "bench": "archipelago.orchestrator.bench.command:register",
        "testbed": "archipelago.orchestrator.bench.testbed_command:register",
        "simulate": "archipelago.orchestrator.bench.simulation.command:register",
    }
    assert "entry-points" not in PROJECT  # the product registers no subcommand of its own
    assert PROJECT["optional-dependencies"]["bench"] == [f"{BENCH_PROJECT['project']['name']}=={PROJECT['version']}"]
    import archipelago.orchestrator.cli

    # the checkout's own file, through the import-name view (k8s/pythonpath) on sys.path
    assert Path(archipelago.orchestrator.cli.__file__).resolve() == REPO / "orchestrator" / "cli.py"


def test_a_task_factory_named_by_its_old_top_level_module_still_loads_with_a_warning():
    from archipelago.orchestrator.config import TaskSpec

    with pytest.warns(DeprecationWarning, match="archipelago.workers.tasks.lm_task:make_task"):
        spec = TaskSpec(factory="workers.tasks.lm_task:make_task")
    assert spec.factory == "archipelago.workers.tasks.lm_task:make_task"
    assert TaskSpec(factory="tests.toy_tasks:make").factory == "tests.toy_tasks:make"  # not ours: untouched
