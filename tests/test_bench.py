"""Benchmark plumbing: results are written as JSON, PNG and Markdown (plus the docs index),
and every scenario's rows are valid configs of the protocol it states."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from archipelago.orchestrator.bench.quality_rows import MODEL
from archipelago.orchestrator.bench.registry import available
from archipelago.orchestrator.bench.report import BenchResult, Panel, draw, write_docs_index, write_result
from archipelago.orchestrator.bench.simulation.config import load_simulated
from archipelago.orchestrator.cli import main
from archipelago.orchestrator.config_load import load_config
from tests.helpers import NO_WARM, run_tokens


def test_report_files_and_docs_index(tmp_path):
    result = BenchResult(
        "demo",
        True,
        {"a": {"final_eval_loss": 1.0}},
        "demo: ok",
        "| x |\n| - |",
        [Panel("tokens", {"a": [(0, 2.0), (10, 1.0)]})],
    )
    write_result(result, tmp_path)
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["methods"]["a"]["final_eval_loss"] == 1.0 and data["machine"]["cpus"]
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "architecture.md").write_text("# Architecture\n")  # another docs page: not a report
    write_docs_index(tmp_path, ["demo", "absent"])
    index = (tmp_path / "benchmarks.md").read_text()
    assert "## demo" in index and "demo.png" in index and "# Architecture" not in index


def test_a_plot_gives_each_method_one_colour_across_panels_and_draws_references_as_references(tmp_path):
    """Before: colours came from each panel's own cycle (a method absent from one panel
    shifted every colour after it; the eleventh method took the first's), constants were
    plotted as data lines, and an integer axis had fractional ticks."""
    methods_ = [f"m{i}" for i in range(12)]
    tokens = Panel("tokens", {m: [(0, 5.0), (10, 2.0 + i / 100), (20, 1.9 + i / 100)] for i, m in enumerate(methods_)})
    tokens.zoom_from = 10  # the warm start's drop from 5.0 must not squash the comparison
    walls = Panel(
        "S", {m: [(1, 1.0 + i), (2, 2.0 + i)] for i, m in enumerate(methods_[1:])}, references={"memcpy": 9.5}
    )
    result = BenchResult("demo", False, {}, "", "", [tokens, walls])
    fig = draw(result)
    left, right = fig.axes[:2]
    colour = {line.get_label(): (line.get_color(), line.get_linestyle()) for line in left.get_lines()}
    assert len(set(colour.values())) == 12  # no two methods alike
    for line in right.get_lines():
        if line.get_label() in colour:
            assert (line.get_color(), line.get_linestyle()) == colour[line.get_label()]
    reference = next(line for line in right.get_lines() if line.get_label() == "memcpy (reference)")
    assert set(reference.get_ydata()) == {9.5} and reference.get_linestyle() == "--"
    assert all(float(t).is_integer() for t in right.get_xticks())
    low, high = left.get_ylim()
    assert low > 1.8 and high < 2.2
    write_result(result, tmp_path)  # the JSON keeps the panels: the plot can be drawn again without a run
    (tmp_path / "demo.png").unlink()
    assert main(["bench", "quality", "--replot", "--out", str(tmp_path)]) == 2  # no quality.json there
    (tmp_path / "demo.json").rename(tmp_path / "quality.json")
    assert main(["bench", "quality", "--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "quality.png").read_bytes()[:4] == b"\x89PNG"


def test_startup_rows_are_valid_configs_that_reach_an_outer_step_quickly():
    from archipelago.orchestrator.bench.startup import COUNTS, DEFAULT

    default = load_config(None, DEFAULT)
    assert default.warm_steps > 0 and default.rounds == 1  # the default's fork is part of its start-up
    assert default.islands.count == load_config(None, []).islands.count
    for k in COUNTS:
        cfg = load_config(None, [f"islands.count={k}", "warm_start.steps=0", "rounds=1", "inner_steps=5"])
        assert cfg.islands.count == k and cfg.warm_steps == 0


def test_unknown_scenario_is_a_clear_error(capsys):
    assert "quality" in available()
    assert main(["bench", "nope", "--out", "unused"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_the_gpu_check_without_cuda_runs_nothing_and_says_what_it_did_not_measure(tmp_path):
    """`bench gpu` without CUDA: every part not measured and every GPU figure null (no CPU
    figure stands in for one), the report written at once and naming its commit."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: `archipelago bench gpu` measures it for real")
    assert main(["bench", "gpu", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["island_vs_bare_loop"] == {"cuda": None} and report["mfu_124m"] is None
    assert report["methods"] == {} and report["peak_flops_datasheet"] is None
    assert report["bench_seconds"] < 60 and report["plan_accelerator_check"] is None
    assert set(report["parts"]) >= {"peak", "bareloop", "plan", "ray", "gpt2_124m_1gpu"}
    assert all(p["seconds"] is None and p["status"].startswith("not measured") for p in report["parts"].values())
    assert len(report["machine"]["commit"]) == 40 and isinstance(report["machine"]["clean"], bool)
    assert "not measured" in (tmp_path / "gpu.md").read_text()


def test_the_gpu_dry_run_plans_every_part_within_the_budget(capsys):
    from archipelago.orchestrator.bench.gpu import TOTAL_BUDGET_S, plan_parts

    assert main(["bench", "gpu", "--dry-run", "--out", "unused"]) == 0
    out = capsys.readouterr().out
    parts = plan_parts(quick=False, gpus=1, peak=989e12)
    for part in parts:
        assert part.name in out and 0 < part.expected_s <= part.budget_s, part
    assert sum(p.expected_s for p in parts) <= TOTAL_BUDGET_S < sum(p.budget_s for p in parts) + 1
    # a larger model's run is expected to take longer, and a slower device longer still
    by = {p.name: p.expected_s for p in parts}
    assert by["llama_4x0.2gpu"] > by["gpt_4x0.2gpu"]
    slower = {p.name: p.expected_s for p in plan_parts(quick=False, gpus=1, peak=121e12)}
    assert all(slower[k] > by[k] for k in ("bareloop", "gpt2_124m_1gpu", "gpt_4x0.2gpu"))
    assert main(["bench", "fleet", "--dry-run", "--out", "unused"]) == 2  # gpu only


def test_the_profile_part_names_where_an_islands_step_goes(corpus_cache):
    """On the CPU (the scenario runs it on CUDA): a tiny Llama island's step, timed and
    profiled through the island's own code; the chunked loss's head is found and its share
    of the time is a part of the whole; the report's table lists the operations."""
    from archipelago.orchestrator.bench.gpu_profile import profile_island, profile_md

    got = profile_island(
        load_config(
            None,
            [
                NO_WARM,
                "task.factory=archipelago.workers.tasks.hf_task:make_task",
                "task.kwargs.preset=tiny-llama",
                "task.kwargs.context=32",
                "task.kwargs.batch_size=8",
                "task.kwargs.train_loss_tokens=64",  # four chunks a step
                f"task.kwargs.cache_dir={corpus_cache}",
            ],
        ),
        warmup=1,
        steps=2,
    )
    assert got["device"] == "cpu" and got["steps"] == 2 and got["step_s"] > 0 and got["device_s_per_step"] > 0
    assert 0 < got["head_share"] < 1, got
    names = [t["name"] for t in got["top"]]
    assert names and len(names) <= 12 and all(t["ms_per_step"] > 0 for t in got["top"])
    text = profile_md(got)
    assert "the loss's head" in text and names[0] in text
    assert profile_md(None) == "Not profiled."


def test_a_gpu_part_is_held_to_its_budget_and_the_total_and_a_failure_is_reported(monkeypatch):
    from archipelago.orchestrator.bench import gpu

    parts = gpu._Parts(
        [
            gpu.Part(name="ok", description="", budget_s=5.0, expected_s=1.0),
            gpu.Part(name="broken", description="", budget_s=5.0, expected_s=1.0),
            gpu.Part(name="too_long", description="", budget_s=1e6, expected_s=1e6),
        ]
    )
    budgets = []
    assert parts.run("ok", lambda budget: budgets.append(budget) or 7) == 7
    assert parts.run("broken", lambda _: 1 / 0) is None
    assert parts.run("too_long", lambda _: pytest.fail("a part past the total must not run")) is None
    assert budgets == [5.0]
    assert parts.outcomes["ok"]["status"] == "measured" and parts.outcomes["ok"]["seconds"] >= 0
    assert parts.outcomes["broken"]["status"].startswith("failed: ZeroDivisionError")
    assert parts.outcomes["too_long"]["status"].startswith("skipped") and parts.outcomes["too_long"]["seconds"] is None


def test_the_steady_rates_leave_out_the_first_round(tmp_path):
    """Over the rounds after the first: the wall's rate, and the islands' own (the mean
    island's seconds in each round, from the cumulative seconds the records hold)."""
    from archipelago.orchestrator.bench.gpu import steady_rates

    records = [
        {"round": 1, "tokens": 1000, "round_seconds": 10.0, "island_compute_seconds": {"0": 9.0, "1": 9.0}},
        {"round": 2, "tokens": 1000, "round_seconds": 1.0, "island_compute_seconds": {"0": 9.5, "1": 9.5}},
        {"round": 3, "tokens": 1000, "round_seconds": 1.0, "island_compute_seconds": {"0": 10.0, "1": 10.0}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rates = steady_rates(str(tmp_path))
    assert rates["tokens_per_s"] == 1000.0 and rates["island_tokens_per_s"] == 2000.0 and rates["rounds"] == 2
    assert rates["island_round_seconds"] == [9.0, 0.5, 0.5] and rates["round_seconds"] == [10.0, 1.0, 1.0]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    assert steady_rates(str(tmp_path))["tokens_per_s"] is None


def test_gpu_parts_are_named_or_refused(tmp_path, capsys):
    assert main(["bench", "gpu", "--parts", "bareloop,nope", "--out", str(tmp_path)]) == 2
    assert "unknown: ['nope']" in capsys.readouterr().err
    assert main(["bench", "fleet", "--parts", "bareloop", "--out", str(tmp_path)]) == 2
    assert main(["bench", "gpu", "--quick", "--parts", "bareloop,gpt2_124m_1gpu", "--out", str(tmp_path)]) == 0
    parts = json.loads((tmp_path / "gpu.json").read_text())["parts"]
    assert parts["bareloop"]["status"].startswith("not measured")  # no CUDA here: nothing runs either way
    # a device script's share of a lease: the whole budget, gpu's only
    assert main(["bench", "gpu", "--quick", "--budget", "330", "--parts", "reference", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "gpu.json").read_text())["total_budget_s"] == 330
    assert main(["bench", "fleet", "--budget", "330", "--out", str(tmp_path)]) == 2
    from archipelago.orchestrator.bench import gpu

    short = gpu._Parts([gpu.Part(name="long", description="", budget_s=60.0, expected_s=40.0)], total_s=30.0)
    assert short.run("long", lambda _: pytest.fail("past the --budget: skipped")) is None


def test_the_gpu_lease_script_runs_known_parts_expected_within_its_budget_and_six_minutes():
    """orchestrator/bench/gpu_lease.sh, a lease's one call: every part it names exists, the
    parts are expected within its budget on an H100 (the slower of the two lent kinds), every
    step that can take time runs under `timeout` with the limits the script sets, and those
    limits add up: the whole script within six minutes even with the install at its limit,
    and the bench's whole budget where no install was needed, all read from the script."""
    import re
    from pathlib import Path

    from archipelago.orchestrator.bench.gpu import part_names, plan_parts

    script = (Path(__file__).parents[1] / "orchestrator/bench/gpu_lease.sh").read_text()
    parts = re.search(r"^PARTS=(\S+)$", script, re.M).group(1).split(",")
    limits = {k: int(v) for k, v in re.findall(r"^([A-Z_]+_S)=(\d+)\b", script, re.M)}
    limits["BUDGET_S"] = int(re.search(r"^BUDGET_S=\$\{BUDGET_S:-(\d+)\}$", script, re.M).group(1))
    total, check, install, tests, summary, kill, grace, budget = (
        limits[k] for k in ("TOTAL_S", "CHECK_S", "INSTALL_S", "TESTS_S", "SUMMARY_S", "KILL_S", "GRACE_S", "BUDGET_S")
    )
    assert set(parts) <= set(part_names()) and {"reference", "gpt2_124m_1gpu", "bareloop"} <= set(parts)
    expected = sum(p.expected_s for p in plan_parts(quick=False, gpus=1, peak=989e12) if p.name in parts)
    assert expected <= budget and total <= 6 * 60, (expected, budget, total)

    # every command that can take time runs `within` a limit (timeout's TERM, then KILL_S later)
    assert re.search(r'^within\(\) \{ timeout -k "\$KILL_S" "\$@"; \}', script, re.M)
    bare = [
        line for line in script.splitlines() if re.match(r"\s*(?:if !\s*)?(?:python|archipelago|pytest|pip)\b", line)
    ]
    assert not bare, bare
    within = re.findall(r'within "\$(\w+)" (\S+)', script)
    steps = [("CHECK_S", "python"), ("INSTALL_S", "python"), ("INSTALL_S", "python"), ("bench_s", "archipelago")]
    assert sorted(within) == sorted([*steps, ("TESTS_S", "python"), ("SUMMARY_S", "python")]), within
    assert len(re.findall(r"^\s*check$", script, re.M)) == 2  # the check, and again after an install

    # the bench's limit, as the script computes it from the seconds spent before it
    formula = re.search(r"^bench_s=\$\(\((.+)\)\)$", script, re.M).group(1)

    def bench_limit(spent: int) -> int:
        return eval(formula, {}, {**limits, "SECONDS": spent, "started": 0})

    worst = 2 * (check + kill) + install + kill  # checked, installed, checked again: each at its limit
    assert worst + bench_limit(worst) + kill + tests + kill + summary + kill <= total, (worst, bench_limit(worst))
    assert bench_limit(check + kill) - grace >= budget  # no install: the whole budget, and its grace
    assert bench_limit(worst) - grace > 0  # an install at its limit still leaves the bench some time


def test_mfu_is_against_the_datasheet_peak_of_the_device_named():
    from archipelago.orchestrator.bench.gpu import datasheet_bf16_flops

    assert datasheet_bf16_flops("NVIDIA H200") == datasheet_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert datasheet_bf16_flops("NVIDIA H100 PCIe") == 756e12  # not the SXM part's
    assert datasheet_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert datasheet_bf16_flops("NVIDIA L4") == 121e12 and datasheet_bf16_flops("NVIDIA L40S") == 362e12
    assert datasheet_bf16_flops("Some New GPU") is None  # then the measured peak, said in the report


def test_every_gpu_check_row_is_a_valid_config():
    from archipelago.orchestrator.bench.gpu import base_overrides, rows
    from archipelago.workers.tasks.task import load_task

    table = rows(quick=False, gpus=2)
    assert set(table) == {"gpt2_124m_1gpu", "gpt_4x0.2gpu", "llama_4x0.2gpu", "llama_1x2workers"}
    assert set(rows(quick=False, gpus=1)) == set(table) - {"llama_1x2workers"}
    for row in table.values():
        cfg = load_config(None, [*base_overrides(False), *row.overrides])
        assert cfg.inner.precision.value == "bf16" and cfg.evaluation.where.value == "actor"
        assert row.islands * cfg.islands.gpus * cfg.islands.workers + cfg.evaluation.gpus <= row.devices
        load_task(cfg.task.factory, cfg.task.kwargs)  # the task validates its kwargs (nothing downloads)


def test_hetero_methods_share_one_budget_and_time_to_reach():
    from archipelago.orchestrator.bench.hetero import methods as hetero_methods
    from archipelago.orchestrator.bench.hetero import time_to_reach

    table = hetero_methods(4)
    assert set(table) == {"sync", "sync_dylu", "naive_async", "dn_dylu", "quorum", "streaming_quorum"}
    budgets = {name: run_tokens(load_simulated(None, [*MODEL, *ov])[0]) for name, (_, ov) in table.items()}
    assert len(set(budgets.values())) == 1
    assert time_to_reach([(0, 5.0), (10, 3.0), (20, 1.0)], 2.0) == 15.0
    assert time_to_reach([(0, 5.0), (10, 3.0)], 2.0) is None


def test_a_finished_run_of_the_same_config_is_reused_and_no_other(tmp_path):
    """A scenario run again into its folder (after an interruption) reuses finished runs."""
    from archipelago.orchestrator.bench.runner import finished
    from archipelago.orchestrator.config_load import dump_config

    streaming = ["mode=streaming", "inner_steps=48", "rounds=2"]  # its section's `pacing` plays a new setting
    cfg = load_config(None, [*MODEL, *streaming, f"out_dir={tmp_path / 'a'}"])
    out = tmp_path / "a"
    out.mkdir()
    (out / "config.yaml").write_text(dump_config(cfg))
    assert finished(cfg) is None  # no summary: it did not finish
    (out / "summary.json").write_text(json.dumps({"state": "finished", "final_eval_loss": 1.5}))
    assert finished(cfg) == {"state": "finished", "final_eval_loss": 1.5}
    assert finished(cfg.model_copy(update={"rounds": 3})) is None  # another config is run afresh
    # a setting added since the run (absent from its file) counts at its default, and only then
    written = dump_config(cfg)
    assert "pacing: barrier" in written
    (out / "config.yaml").write_text(written.replace("  pacing: barrier\n", ""))
    assert finished(cfg) is not None
    assert finished(load_config(None, [*MODEL, *streaming, "mode.pacing=quorum", f"out_dir={out}"])) is None
    (out / "config.yaml").write_text(written.replace("  pacing: barrier\n", "  pacing: barrier\n  gone: 1\n"))
    assert finished(cfg) is None  # a setting since removed: not the same run
    (out / "config.yaml").write_text(written)
    (out / "summary.json").write_text(json.dumps({"state": "stopped"}))
    assert finished(cfg) is None
    # a run of this config that starts over an earlier run's outputs, and is interrupted
    (out / "summary.json").write_text(json.dumps({"state": "finished", "final_eval_loss": 1.5}))
    from archipelago.orchestrator.engine.state.records import Recorder

    Recorder(out, cfg)
    assert finished(cfg) is None


def test_a_simulated_run_priced_at_other_rates_is_not_reused(tmp_path, monkeypatch):
    """The network's rates are code, not config: a finished simulated run is reused only if
    it was charged what the network charges its config now — one recorded before the codecs'
    decoding was priced still stands for fp32 both ways, not for int4."""
    from archipelago.orchestrator.bench.runner import PRICES_FILE, finished, record_simulation
    from archipelago.orchestrator.bench.simulation.config import SimulationConfig
    from archipelago.orchestrator.config_load import dump_config
    from archipelago.orchestrator.plan import head as head_prices

    sim = SimulationConfig(nominal_params=10**9, price_head=True)
    for codec in ("none", "int4"):
        out = tmp_path / codec
        cfg = load_config(None, [*MODEL, f"compression.codec={codec}", f"out_dir={out}"])
        out.mkdir()
        (out / "config.yaml").write_text(dump_config(cfg))
        record_simulation(cfg, sim)
        (out / "summary.json").write_text(json.dumps({"state": "finished"}))
        assert finished(cfg, sim) is not None
        (out / PRICES_FILE).unlink()  # a run recorded before the prices were
        assert (finished(cfg, sim) is not None) == (codec == "none")
    out = tmp_path / "none"
    cfg = load_config(None, [*MODEL, f"out_dir={out}"])
    record_simulation(cfg, sim)
    monkeypatch.setitem(head_prices.STEP_S_PER_VALUE, "mean", 2 * head_prices.STEP_S_PER_VALUE["mean"])
    assert finished(cfg, sim) is None  # the step re-measured: every run charged the old rate is run again


def test_streaming_rows_are_the_issue_s_and_share_one_token_budget():
    from pathlib import Path

    from archipelago.orchestrator.bench.streaming import BASE, H, K, common, methods

    table = methods(["simulation.link.bandwidth_gbps=0.01", "simulation.link.latency_ms=0"], 0.7, 1.0)
    assert set(table) | {"compute_only"} == {
        "diloco",
        "streaming_p2",
        "streaming_p4",
        "streaming_p4_fp4",
        "diloco_int8",
        "overlap",
        "overlap_eager",
        "ddp_k",
        "compute_only",
    }
    loaded = {n: load_simulated(None, [*BASE, *common(3, 0, Path(".")), *ov]) for n, (_, ov) in table.items()}
    configs = {n: cfg for n, (cfg, _) in loaded.items()}
    assert len({run_tokens(c) for c in configs.values()}) == 1  # every method sees the same tokens
    s4 = configs["streaming_p4_fp4"]
    assert s4.mode.fragments == 4 and s4.compression.codec == s4.compression.downlink == "fp4"
    assert s4.outer.lr == 1.0 and configs["diloco"].outer.lr == configs["diloco_int8"].outer.lr == 0.7
    assert configs["diloco_int8"].compression.downlink == "int8" and configs["overlap_eager"].mode.eager
    assert loaded["ddp_k"][1].link.bandwidth_gbps is None and s4.inner_steps == H and s4.islands.count == K
    assert all(c.islands.build_version0 for c in configs.values())  # loaded from storage, as the peer's replicas


def test_an_earlier_run_of_another_config_is_removed_not_resumed(tmp_path):
    """Its checkpoint would be resumed as the new run's (a finished one ends at once with
    its clock at zero); an interrupted run of the same config is kept to resume, unless its
    clock is simulated."""
    from archipelago.orchestrator.bench.runner import fresh, record_simulation, same_config
    from archipelago.orchestrator.bench.simulation.config import SimulationConfig
    from archipelago.orchestrator.config_load import dump_config

    streaming = ["mode=streaming", "inner_steps=48", "rounds=2"]  # its section's `pacing` plays a new setting
    cfg = load_config(None, [*MODEL, *streaming, f"out_dir={tmp_path / 'a'}"])
    out = tmp_path / "a"
    (out / "checkpoint").mkdir(parents=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    fresh(cfg)
    assert (out / "checkpoint").exists()  # the same config: resumed
    fresh(cfg.model_copy(update={"rounds": 3}))
    assert not out.exists()
    fresh(cfg)  # nothing there: nothing to do
    sim = SimulationConfig(virtual_step_s=0.5)
    (out / "checkpoint").mkdir(parents=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    record_simulation(cfg, sim)
    assert same_config(out, cfg, sim) and not same_config(out, cfg) and not same_config(out, cfg, SimulationConfig())
    fresh(cfg, sim)  # the same config and fleet, but its resumed clock would restart at zero
    assert not out.exists()


def test_overlap_rows_tune_every_method_on_one_grid_over_a_link_that_leaves_slack(tmp_path):
    from pathlib import Path

    from archipelago.orchestrator.bench.overlap import LRS, TUNED, bandwidth_for, grid_table, steady_compute_seconds

    # the link: one fp32 exchange (down + up) of 1e6 parameters in 0.8 of 2 seconds, the
    # islands' median computation per round in compute-only (records carry it so far; the
    # first rounds warm up, and the islands' mean is taken per round)
    so_far = [(5.6, 5.0), (7.8, 7.2), (9.8, 9.0), (11.6, 11.0), (13.8, 12.8)]  # per round: 5.3, 2.2, 1.9, 1.9, 2.0
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"island_compute_seconds": {"0": a, "1": b}}) + "\n" for a, b in so_far)
    )
    assert steady_compute_seconds(tmp_path) == pytest.approx(2.0)
    bw = bandwidth_for(1_000_000, 2.0)
    assert 2 * 4e6 * 8 / (bw * 1e9) == pytest.approx(1.6)
    table = grid_table(12, Path("."), bw)
    loaded = {n: load_simulated(None, [*MODEL, *ov]) for n, (_, ov) in table.items()}
    configs = {n: cfg for n, (cfg, _) in loaded.items()}
    assert set(configs) == {f"{n}@lr{lr:g}" for n in TUNED for lr in LRS}
    for lr in LRS:
        sync, co2, eager = (configs[f"{n}@lr{lr:g}"] for n in ("sync", "overlap", "overlap_eager"))
        assert sync.mode.name.value == "diloco" and sync.outer.optimizer == "nesterov" and sync.outer.lr == lr
        for c in (co2, eager):  # CO2 the paper's way: momentum kept stable by the penalty and the clip
            assert c.mode.name.value == "overlap" and c.mode.lr == lr and c.mode.momentum > 0
            assert c.mode.penalty == "adaptive" and c.mode.clip is not None
        assert eager.mode.eager and not co2.mode.eager
        links = [loaded[f"{n}@lr{lr:g}"][1].link.bandwidth_gbps for n in ("sync", "overlap")]
        assert links == pytest.approx([bw, bw], rel=1e-5)


def test_a_benchmark_without_matplotlib_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    import sys

    from archipelago.orchestrator.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the bench's dependencies were not installed
    assert main(["bench", "overlap", "--quick", "--out", str(tmp_path)]) == 2
    assert "pip install -e orchestrator/bench" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_a_round_breakdown_leaves_the_final_evaluation_out_and_adds_up():
    from archipelago.orchestrator.bench.overhead import breakdown_table, round_breakdown

    parts = {"wait": 28.0, "step": 0.8, "publish": 0.1, "dispatch": 0.2, "evaluate": 0.5, "record": 0.4}
    parts["evaluate"] = 0.8  # the start's evaluation (0.3 s, while the first work trains) and the final one
    ours = {
        "train_seconds": 31.5,
        "compute_seconds": 28.0,
        "coordinator_seconds": parts,
        "startup": {"first_eval_s": 0.3},
    }
    peer = {"train_seconds": 32.0, "islands_alone_seconds": 26.0}
    b = round_breakdown(ours, peer, rounds=8)
    a, p = b["archipelago"], b["peer"]
    assert a["wall"] == pytest.approx(31.0 / 8)  # the final evaluation is not the loop's
    assert a["islands_computing"] + a["islands_not_computing"] == pytest.approx(a["wall"])
    assert p["islands_not_computing"] == pytest.approx(6.0 / 8)
    assert sum(v for k, v in a.items() if k.startswith("coordinator_")) <= a["wall"]
    assert "coordinator_evaluate" not in a
    table = breakdown_table(b, "torchft")
    assert "| wall (the final evaluation left out) | 3.875 | 4.000 |" in table
    assert "| coordinator: waiting for results (idle) | 3.500 | – |" in table


def test_the_peer_baseline_is_a_lower_bound_of_k_replicas_on_the_cores():
    from archipelago.orchestrator.bench.overhead import lower_bound

    assert lower_bound(10.0, k=4, threads=1, cores=2) == 20.0  # 4 single-thread replicas on 2 cores
    assert lower_bound(10.0, k=2, threads=1, cores=2) == 10.0  # one core each: as fast as one alone
    assert lower_bound(10.0, k=2, threads=1, cores=16) == 10.0  # idle cores do not make one faster


def test_warmstart_rows_differ_only_in_the_warm_start_mode_and_the_fewest_bytes_baseline_wins(tmp_path):
    from archipelago.orchestrator.bench.warmstart import _cumulative_bytes, fewest, row_name, rows
    from archipelago.orchestrator.config import WarmStartMode

    configs = {name: load_config(None, ov).model_dump(mode="json") for name, (_, ov) in rows().items()}
    assert {c["warm_start"].pop("mode") for c in configs.values()} == {m.value for m in WarmStartMode}
    for c in configs.values():
        c["warm_start"].pop("inner_steps")
    assert all(c == configs["default_warm_ddp"] for c in configs.values())  # nothing else differs
    shipped = load_config(None, []).warm_start
    assert row_name(shipped.mode, shipped.inner_steps) in configs  # the shipped default is a row
    assert fewest({"a": 300.0, "b": None, "c": 200.0}) == "c"
    assert fewest({"a": None}) is None
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"eval_loss": None, "bytes_sent": 10, "bytes_received": 30},
        {"eval_loss": 2.0, "bytes_sent": 20, "bytes_received": 60},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # bytes are cumulative in the records; a continued run starts where its warm start ended
    assert _cumulative_bytes(run, {"initial_eval_loss": 3.0}, offset=5) == [(5.0, 3.0), (85.0, 2.0)]


def test_data_rows_generate_prepare_and_read_a_corpus_by_position(tmp_path):
    from archipelago.orchestrator.bench.data import _prepared, _sets, generate, probe_island, probe_reads

    files = generate(tmp_path / "text", 2_000_000, seed=0)
    assert sum(len(t) for f in files for t in pq.read_table(f).column("text").to_pylist()) == 2_000_000
    stats = _prepared(tmp_path / "text", tmp_path / "prepared")
    assert 1_950_000 < stats["tokens"] < 2_000_000 and stats["prepare_tokens_per_s"] > 0
    assert _prepared(tmp_path / "text", tmp_path / "prepared") == stats  # prepared once, its timing kept
    for kind, where in (("prepared", tmp_path / "prepared"), ("parquet", tmp_path / "text")):
        load_config(None, _sets(kind, where))  # each row is a valid run config
        reads = probe_reads(kind, str(where))
        assert reads["batches_per_epoch"] > 20 and 0 < reads["first_batch_seconds_at_end"] < 30
        assert reads["loader_tokens_per_s"] > 0
    island = probe_island("prepared", str(tmp_path / "prepared"), steps=2)
    assert island["train_tokens_per_s"] > 0 and island["island_rss_mb"] > 100


def test_compression_rows_are_the_issue_s_and_valid_configs(tmp_path):
    from archipelago.orchestrator.bench.compression import BASE, OUTER_LRS, rows

    table = rows()
    assert set(table) == {"diloco", "streaming_p4_fp4", "sparse", "sparse_muon"}
    for _, overrides in table.values():
        cfg = load_config(
            None, [*BASE, *overrides, f"outer.lr={OUTER_LRS[0]}", "warm_start.steps=0", "inner_steps=100"]
        )
        assert cfg.islands.build_version0  # nothing downloaded at the start, in every row
    sparse = load_config(None, [*BASE, *table["sparse"][1], "warm_start.steps=0", "inner_steps=100"])
    assert sparse.compression.codec == sparse.compression.downlink == "topk:0.02+int2"
    assert sparse.compression.error_feedback and sparse.outer.optimizer == "sparseloco"
    assert sparse.mode.fragments == 4
    muon = load_config(None, [*BASE, *table["sparse_muon"][1], "warm_start.steps=0", "inner_steps=100"])
    assert muon.inner.optimizer == "muon" and muon.compression == sparse.compression
    from archipelago.orchestrator.bench.compression import ablations

    changed = {  # each ablation changes one thing of `sparse`
        k: load_config(None, [*BASE, *o, "warm_start.steps=0", "inner_steps=100"])
        for k, (_, o) in ablations(1.0).items()
    }
    assert changed["sparse_fp32_downlink"].compression.downlink == "none"
    assert (
        changed["sparse_unfragmented"].mode.name.value == "diloco"
        and changed["sparse_unfragmented"].compression == sparse.compression
    )
    assert changed["sparse_topk10"].compression.codec == "topk:0.1+int2"
    dense = changed["sparse_dense_int2"].compression
    assert dense.codec == dense.downlink == "topk:1.0+int2" and dense.error_feedback
    assert (
        changed["sparse_nesterov"].outer.optimizer == "nesterov"
        and changed["sparse_nesterov"].compression.feedback_decay == 1.0
    )


def _report(out, name: str, **machine) -> None:
    result = BenchResult(name, True, {"a": {"final_eval_loss": 1.0}}, f"{name}: ok", "| x |\n| - |", [])
    write_result(result, out)
    data = json.loads((out / f"{name}.json").read_text())
    data["machine"].update(machine)
    (out / f"{name}.json").write_text(json.dumps(data))


def test_a_bench_writes_to_out_only_and_publish_copies_clean_reports_into_the_docs(tmp_path, capsys):
    """`bench <scenario>` has no way to write into docs/; `bench publish` copies reports
    that name a commit measured from a clean tree, all or none, and rebuilds the index."""
    from archipelago.orchestrator.bench.registry import publish
    from archipelago.orchestrator.cli import main

    out, docs = tmp_path / "out", tmp_path / "docs"
    _report(out, "startup", commit="a" * 40, clean=True)
    _report(out, "data", commit="b" * 40, clean=False)
    with pytest.raises(ValueError, match=r"data: measured at bbbbbbbbbbbb with uncommitted changes"):
        publish(out, docs)
    assert not docs.exists()  # nothing copied when one report is refused
    assert main(["bench", "publish", "startup", "--out", str(out), "--docs", str(docs)]) == 0
    assert sorted(p.name for p in docs.iterdir()) == ["benchmarks.md", "startup.json", "startup.md", "startup.png"]
    assert "## startup" in (docs / "benchmarks.md").read_text()
    assert publish(out, docs, ["data"], dirty_ok=True) == ["data"]
    _report(out, "hetero", commit=None, clean=None)
    assert main(["bench", "publish", "hetero", "--out", str(out), "--docs", str(docs)]) == 2
    assert "hetero: the report names no commit" in capsys.readouterr().err
    assert main(["bench", "startup", "extra"]) == 2  # only publish takes several


def test_a_wall_check_over_a_link_that_was_never_applied_is_not_met():
    """The overlap and streaming walls are compared with compute-only's over a simulated
    link; where the link cost the synchronous row nothing (a run on the virtual clock, whose
    real wall holds no link: sync 0.98x compute-only), `<= 1.05x` would hold by construction.
    The link check fails there and passes where the link delayed the exchange (1.64x)."""
    from archipelago.orchestrator.bench.report import link_applied

    name, free = link_applied(0.98, 0.8)
    assert name.startswith("link_applied") and free == {"value": 0.98, "ok": False}
    assert link_applied(1.64, 0.8)[1]["ok"] and not link_applied(1.45, 1.0)[1]["ok"]
