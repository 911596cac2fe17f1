"""The documentation cannot drift from the code: the configuration reference is regenerated
and compared, every config field documents itself, every link and anchor resolves, the
control-plane routes in control-plane.md are the app's OpenAPI routes, elasticity.md names every
event kind, the task example in tasks.md runs, and the README keeps to its size and its two commands."""

from __future__ import annotations

import json
import re
import sys
import types
import typing

import pytest
from pydantic import BaseModel

from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_docs import TASKS, render
from archipelago.orchestrator.config_load import ConfigError, load_config
from tests.conftest import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md")), *sorted((DOCS / "findings").glob("*.md"))]


def test_the_configuration_page_is_the_generated_one():
    committed = (DOCS / "configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is stale: run `archipelago config docs --out docs/configuration.md`"
    )


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        for t in (field.annotation, *typing.get_args(field.annotation)):
            for inner in (t, *typing.get_args(t)):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    _models(inner, seen)


def test_every_config_field_says_what_it_means():
    models: set[type[BaseModel]] = set()
    for root in (RunConfig, *TASKS.values()):
        _models(root, models)
    assert len(models) > 12
    missing = [
        f"{m.__name__}.{name}"
        for m in models
        for name, field in m.model_fields.items()
        if not field.description
        and not (m is RunConfig and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))
    ]
    undocumented_sections = [m.__name__ for m in models if not (m.__doc__ or "").strip()]
    assert not missing and not undocumented_sections, (missing, undocumented_sections)


def test_the_generated_page_shows_types_defaults_and_constraints():
    page = render()
    assert "| `inner_steps` | int | `50` | ≥ 1 |" in page
    assert "| `mode` | [`diloco`](#mode-diloco) \\| [`ddp`](#mode-ddp) \\| [`async`](#mode-async) \\|" in page
    assert "| `mode.fragments` | int | `4` | ≥ 1, ≤ 64 |" in page.split("## mode: streaming")[1]
    assert "| `outer.momentum` | float | `0.9` | ≥ 0, < 1 |" in page
    assert "| `task.kwargs.context` | int | `128` | ≥ 8, ≤ 4096 |" in page


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    fence, out = False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6} (.+)$", line)):
            out.add(_slug(m.group(1)))
    return out


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_slug_matches_githubs():
    assert _slug("DiLoCo (`mode: diloco`) — Douillard et al., 2023, arXiv 2311.08105") == (
        "diloco-mode-diloco--douillard-et-al-2023-arxiv-231108105"
    )
    assert _slug("Bundled tasks' `task.kwargs`") == "bundled-tasks-taskkwargs"


def test_the_readme_is_short_and_gives_the_two_commands_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 8 * 1024, f"README is {len(readme.encode())} bytes"
    assert "pip install -e . && archipelago run\n" in readme
    test_command = "pip install -e '.[test]' -e orchestrator/bench && python -m pytest -q"
    assert test_command in readme and test_command in (REPO / ".ci" / "run").read_text()
    # the maths is cited from the project's own docs/algorithms.md, never an outside document
    cited = "ALGORITHMS " + "§"
    sources = [p for pkg in ("orchestrator", "workers", "api") for p in (REPO / pkg).rglob("*.py")]
    assert not [p.name for p in sources if cited in p.read_text()]


def test_the_readmes_figures_are_the_benchmarks_json():
    """What the README quotes from a benchmark is what that benchmark's JSON in docs/ holds."""
    readme = (REPO / "README.md").read_text()
    startup = json.loads((REPO / "docs" / "startup.json").read_text())["methods"]["default_cold"]
    first = re.search(r"first step (\d+) s in", readme)
    assert first is not None and int(first.group(1)) == round(startup["startup_seconds"])
    warm = json.loads((REPO / "docs" / "warmstart.json").read_text())
    row = warm["methods"][f"default_warm_{warm['shipped_warm_start']}_h25"]
    moved = re.search(r"(\d+) MB moved, (\d+)× fewer than data-parallel", readme)
    assert moved is not None
    assert int(moved.group(1)) == int(row["bytes_communicated"] / 1e6)
    assert int(moved.group(2)) == int(row["bytes_ratio_vs_ddp_at_equal_loss"])
    assert f"eval loss {row['final_eval_loss']:.2f}," in readme and f"-> {row['final_eval_loss']:.4f} |" in readme
    checks = json.loads((REPO / "docs" / "fleet.json").read_text())["checks"]
    ratios = re.search(
        r"on DDP's (\d+) machines, (\d+) islands and a sliced head reach the target in ([\d.]+)× the fastest\s+"
        r"simulated DDP's time \((\w+); PowerSGD not simulated\); a slice per island stalls on\s+"
        r"failures \(([\d.]+)×\)",
        readme,
    )
    assert ratios is not None
    equal, sliced = (
        checks[f"{row}_time_le_0.5x_best_ddp_at_16_at_1gbps"] for row in ("quorum_sliced_equal", "quorum_sliced")
    )
    assert float(ratios.group(3)) == round(equal["value"], 2) and float(ratios.group(5)) == round(sliced["value"], 2)
    assert ratios.group(4) == equal["versus"] == sliced["versus"]
    machines = equal["machines"]
    assert int(ratios.group(1)) == machines["quorum_sliced_equal"]["total"] == machines[equal["versus"]]["total"]
    assert int(ratios.group(2)) == machines["quorum_sliced_equal"]["islands"]
    testbed = json.loads((REPO / "docs" / "testbed.json").read_text())
    real = re.search(r"reaches eval loss ([\d.]+) in ([\d.]+)× the best DDP's time", readme)
    assert real is not None
    assert float(real.group(1)) == testbed["target"] and float(real.group(2)) == round(testbed["ratio_1gbps"], 2)


def test_the_quality_reports_token_figure_is_its_json():
    """The 4-island rows' token count in the quality report (and the index quoting it) is
    the JSON's: the generator once quoted the first row, a 1-island baseline's."""
    quality = json.loads((DOCS / "quality.json").read_text())["methods"]
    four = {m["tokens"] for name, m in quality.items() if name.startswith(("ddp_k", "diloco_k4"))}
    assert len(four) == 1
    for page in ("quality.md", "benchmarks.md"):
        quoted = re.search(r"\(([\d,]+) tokens for the 4-island rows\)", (DOCS / page).read_text())
        assert quoted is not None and int(quoted.group(1).replace(",", "")) in four, page


# Figures the findings quote from a report: (page, a pattern with one group per figure,
# the report's JSON, the key path of each figure, a scale, the decimals quoted). A rerun
# that changes a figure fails here until the page says what its JSON says.
Figure = tuple[str, str, str, list[tuple[str, ...]], float, int]
FIGURES: list[Figure] = [
    (
        "findings/fleet.md",
        r"`quorum_sliced` [\d,]+ \(\*\*([\d.]+)× the fastest DDP",
        "experiments/fleet-head-never-fails.json",
        [("checks", "quorum_sliced_time_le_0.5x_best_ddp_at_16_at_1gbps", "value")],
        1,
        2,
    ),
    (
        "findings/fleet.md",
        r"the fastest DDP is `ddp_int8` ([\d,]+) s \(`ddp_bf16` ([\d,]+), fp32 ([\d,]+)",
        "experiments/fleet-head-never-fails.json",
        [("links", "1", "methods", f"{row}_16", "sim_seconds_to_target") for row in ("ddp_int8", "ddp_bf16", "ddp")],
        1,
        0,
    ),
    (
        "findings/fleet.md",
        r"At \*\*10 Gbit/s\*\* DDP wins: `ddp_int8` (\d+) against `quorum_sliced` (\d+)",
        "experiments/fleet-head-never-fails.json",
        [("links", "10", "methods", f"{row}_16", "sim_seconds_to_target") for row in ("ddp_int8", "quorum_sliced")],
        1,
        0,
    ),
    (
        "findings/fleet.md",
        r"`quorum_sliced` \d+ against `ddp`'s [\d,]+ \(\*\*([\d.]+)×: ≤ 0\.5× met",
        "experiments/fleet-ddp-unhooked.json",
        [("checks", "quorum_sliced_time_le_0.5x_ddp_at_16_at_1gbps", "value")],
        1,
        2,
    ),
    (
        "findings/fleet.md",
        r"`quorum_sliced` \d+ against `ddp`'s [\d,]+ \(\*\*([\d.]+)×\*\*\)",
        "experiments/fleet-64.json",
        [("checks", "quorum_sliced_time_le_0.5x_ddp_at_64_at_1gbps", "value")],
        1,
        3,
    ),
    (
        "findings/fleet.md",
        r"At \*\*10 Gbit/s\*\* `quorum_sliced`\s+(\d+) against `ddp`'s (\d+)",
        "experiments/fleet-ddp-unhooked.json",
        [("links", "10", "methods", f"{row}_16", "sim_seconds_to_target") for row in ("quorum_sliced", "ddp")],
        1,
        0,
    ),
    (
        "findings/fleet.md",
        r"still wins: (\d+) against (\d+) at 16 islands, (\d+) against (\d+) at 64",
        "experiments/fleet-64.json",
        [
            ("links", "100", "methods", f"{row}_{k}", "sim_seconds_to_target")
            for k in (16, 64)
            for row in ("ddp", "quorum_sliced")
        ],
        1,
        0,
    ),
    (
        "findings/fleet.md",
        r"goodput at 100 Gbit/s ([\d.]+)\s+\(16 islands\) and ([\d.]+) \(64\) against `quorum`'s ([\d.]+) and ([\d.]+)",
        "experiments/fleet-64.json",
        [("links", "100", "methods", f"{row}_{k}", "goodput") for row in ("quorum_sliced", "quorum") for k in (16, 64)],
        1,
        2,
    ),
    (
        "findings/fleet.md",
        r"\*\*100 Gbit/s\*\* `ddp` (\d+), `sync_dylu` (\d+), `quorum` (\d+), `quorum_int4` (\d+),",
        "experiments/fleet-3grid.json",
        [
            ("links", "100", "methods", f"{row}_16", "sim_seconds_to_target")
            for row in ("ddp", "sync_dylu", "quorum", "quorum_int4")
        ],
        1,
        0,
    ),
    (
        "findings/fleet.md",
        r"Goodput at 100 Gbit/s: `quorum` ([\d.]+) \(0.945 when the\s+head was free\), `sync_dylu` ([\d.]+), `ddp` ([\d.]+)\.",
        "experiments/fleet-3grid.json",
        [("links", "100", "methods", f"{row}_16", "goodput") for row in ("quorum", "sync_dylu", "ddp")],
        1,
        2,
    ),
    (
        "findings/fleet.md",
        r"\*\*goodput\*\*: `quorum` ([\d.]+) / ([\d.]+), `sync_dylu` ([\d.]+) / ([\d.]+), `ddp` ([\d.]+) / ([\d.]+),",
        "experiments/fleet-unpriced.json",
        [("methods", f"{row}_{k}", "goodput") for row in ("quorum", "sync_dylu", "ddp") for k in (16, 64)],
        1,
        3,
    ),
    (
        "findings/fleet.md",
        r"`quorum`\s+(\d+) / (\d+) simulated s, `sync_dylu` (\d+) / (\d+), `ddp` (\d+) / (\d+),",
        "experiments/fleet-unpriced.json",
        [
            ("methods", f"{row}_{k}", "sim_seconds_to_target")
            for row in ("quorum", "sync_dylu", "ddp")
            for k in (16, 64)
        ],
        1,
        0,
    ),
    (
        "findings/fleet.md",
        r"Goodput ([\d.]+) against ([\d.]+) \(16\) and ([\d.]+) against ([\d.]+) \(64\)",
        "experiments/fleet-spot.json",
        [("methods", f"{row}_{k}", "goodput") for k in (16, 64) for row in ("quorum", "quorum_no_partial")],
        1,
        3,
    ),
    (
        "findings/fleet.md",
        r"not the target sooner\*\* \((\d+) against (\d+) s at 16, (\d+) against (\d+) s at 64\)",
        "experiments/fleet-spot.json",
        [
            ("methods", f"{row}_{k}", "sim_seconds_to_target")
            for k in (16, 64)
            for row in ("quorum", "quorum_no_partial")
        ],
        1,
        0,
    ),
    (
        "findings/fleet.md",
        r"`quorum` ([\d.]+) against `quorum_mean`'s ([\d.]+) \(16\)\s+and ([\d.]+) against ([\d.]+) \(64\)",
        "experiments/fleet-rda-default.json",
        [("methods", f"{row}_{k}", "final_eval_loss") for k in (16, 64) for row in ("quorum", "quorum_mean")],
        1,
        4,
    ),
    (
        "findings/fleet.md",
        r"`sync_dylu_radial` (\d+) / (\d+) s against `sync_dylu`'s\s+(\d+) / (\d+)",
        "experiments/fleet-rda-default.json",
        [
            ("methods", f"{row}_{k}", "sim_seconds_to_target")
            for row in ("sync_dylu_radial", "sync_dylu")
            for k in (16, 64)
        ],
        1,
        0,
    ),
    (
        "findings/datapath.md",
        r"S = 2 and 4 in the published run: ([\d.]+) and ([\d.]+) GB/s",
        "datapath.json",
        [("methods", "coordinator_s2", "gbps"), ("methods", "coordinator_s4", "gbps")],
        1,
        1,
    ),
    (
        "findings/datapath.md",
        r"default H in the published run: ([\d.]+) %\s+\(S = 1;.*?and ([\d.]+) % \(S = 2",
        "datapath.json",
        [("methods", "sync_s1", "overhead_fraction"), ("methods", "sync_s2", "overhead_fraction")],
        100,
        1,
    ),
    (
        "findings/overlap.md",
        r"over 36 rounds `sync` \*\*([\d.]+)×\*\* compute-only.*?\*\*`overlap` ([\d.]+)×\*\* and\s+"
        r"\*\*`overlap_eager` ([\d.]+)×\*\*",
        "overlap.json",
        [("methods", m, "wall_vs_compute_only_long") for m in ("sync", "overlap", "overlap_eager")],
        1,
        3,
    ),
    (
        "findings/streaming.md",
        r"DiLoCo over the link \*\*([\d.]+)×\*\* compute-only.*?\*\*FP4 P=4\s+([\d.]+)×\*\*",
        "streaming.json",
        [("methods", m, "wall_vs_compute_only") for m in ("diloco", "streaming_p4_fp4")],
        1,
        2,
    ),
    (
        "findings/compression.md",
        r"ends at \*\*([\d.]+) \(3 seeds\) against `diloco`'s ([\d.]+):",
        "compression.json",
        [("methods", "sparse", "final_eval_loss"), ("methods", "diloco", "final_eval_loss")],
        1,
        4,
    ),
    (
        "findings/compression.md",
        r"`sparse` moves ([\d.]+)× fewer bytes than `diloco`, not ([\d.]+)×",
        "compression.json",
        [
            ("bytes_vs_diloco_at_shipped_default", "sparse"),
            ("checks", "sparse_50x_fewer_bytes_than_diloco_fp32", "value"),
        ],
        1,
        1,
    ),
    (
        "findings/compression.md",
        r"`streaming_p4_fp4` ([\d.]+) at [\d.]+× fewer bytes",
        "compression.json",
        [("methods", "streaming_p4_fp4", "final_eval_loss")],
        1,
        4,
    ),
    (
        "findings/compression.md",
        r"`streaming_p4_fp4` [\d.]+ at [\d.]+× fewer bytes \(([\d.]+)× at the\s+shipped default",
        "compression.json",
        [("bytes_vs_diloco_at_shipped_default", "streaming_p4_fp4")],
        1,
        1,
    ),
    (
        "findings/overlap.md",
        r"`sync` \(Nesterov, lr 1.0\) \*\*([\d.]+)\*\*; `overlap` \(momentum\s+0.5, adaptive gap penalty, clip 1, "
        r"best lr 0.7\) ([\d.]+) .*?`overlap_eager`\s+\(lr 1.0\) ([\d.]+)",
        "overlap.json",
        [("methods", m, "final_eval_loss") for m in ("sync", "overlap", "overlap_eager")],
        1,
        4,
    ),
]


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f[0]}:{f[2]}:{f[3][0][1]}")
def test_the_findings_figures_are_their_json(figure: Figure):
    page, pattern, report, paths, scale, decimals = figure
    quoted = re.search(pattern, (DOCS / page).read_text(), re.S)
    assert quoted is not None, f"{page} no longer quotes {pattern!r}"
    data = json.loads((DOCS / report).read_text())
    for text, path in zip(quoted.groups(), paths):
        value = data
        for key in path:
            value = value[key]
        assert float(text.replace(",", "")) == round(value * scale, decimals), (page, path, text, value)


def test_the_control_plane_page_lists_exactly_the_apps_routes():
    from archipelago.api.app import create_app
    from tests.fake_handle import FakeRun

    app = create_app(FakeRun(), "token")
    routes = {f"{method.upper()} {path}" for path, ops in app.openapi()["paths"].items() for method in ops} | {
        "GET /"
    }  # the dashboard, left out of the schema on purpose
    text = (DOCS / "control-plane.md").read_text()
    documented = {m.group(1) for m in re.finditer(r"^\| `((?:GET|POST|PUT|PATCH|DELETE) /[^` ?]*)", text, re.M)}
    assert documented == routes, (sorted(routes - documented), sorted(documented - routes))


def test_the_elasticity_page_names_every_event_kind():
    from archipelago.orchestrator.engine.types import Event

    text = (DOCS / "elasticity.md").read_text()
    assert not [e.value for e in Event if f"`{e.value}`" not in text]


def _example_task_module() -> types.ModuleType:
    text = (DOCS / "tasks.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code, "tasks.md has no python example"
    module = types.ModuleType("docs_task_example")
    exec(compile(code.group(1), "docs/tasks.md", "exec"), module.__dict__)
    return module


def test_the_task_example_in_the_docs_trains(tmp_path, monkeypatch):
    from archipelago.workers.tasks.task import Task, load_task
    from tests.helpers import in_process_engine

    monkeypatch.setitem(sys.modules, "docs_task_example", _example_task_module())
    assert isinstance(load_task("docs_task_example:make_task", {"dim": 4}), Task)
    with pytest.raises(ConfigError, match=r"task\.kwargs\.dim"):
        load_config(None, ["task.factory=docs_task_example:make_task", "task.kwargs.dim=0"])
    cfg = load_config(
        None,
        [
            "task.factory=docs_task_example:make_task",
            "warm_start.steps=0",
            "islands.count=2",
            "rounds=4",
            "inner_steps=10",
            "inner.lr=0.05",
            "inner.warmup_steps=0",
            f"out_dir={tmp_path}",
        ],
    )
    engine, _ = in_process_engine(cfg)
    summary = engine.execute()
    assert summary["final_eval_loss"] < 0.5 * summary["initial_eval_loss"], summary
