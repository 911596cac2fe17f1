"""`archipelago plan`: each process's peak and each link's bytes, checked against the
cluster a run ships for, offline; every shipped config planned against its cluster and
rehearsed at its real shapes on this CPU, each process's measured peak within 25 % of
the plan's (`orchestrator/plan/rehearse.py`)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from archipelago.orchestrator.cli import main
from archipelago.orchestrator.config_load import dump_config, load_config
from archipelago.orchestrator.plan.cluster import ClusterError, from_manifest, quantity

REPO = Path(__file__).resolve().parents[1]
LLAMA = str(REPO / "k8s" / "hf-llama-config.yaml")
CLUSTER = str(REPO / "k8s" / "raycluster.yaml")


def _plan(capsys, tmp_path, *argv: str) -> tuple[int, list[str], dict]:
    """Exit status, stdout's lines (then stderr's) and the JSON report of `archipelago plan`."""
    out = tmp_path / "plan.json"
    code = main(["plan", *argv, "--json", str(out)])
    printed = capsys.readouterr()
    lines = printed.out.splitlines() + printed.err.splitlines()
    return code, lines, json.loads(out.read_text()) if out.exists() else {}


def test_quantities_and_manifests_read_as_kubernetes_does():
    assert quantity("16Gi") == 16 * 2**30 and quantity("512Mi") == 512 * 2**20 and quantity("32G") == 32 * 10**9
    with pytest.raises(ClusterError):
        quantity("lots")
    a, b = from_manifest(CLUSTER), from_manifest(REPO / "k8s" / "job" / "rayjob.yaml")
    assert a.head == b.head and a.workers == b.workers  # the RayJob carries the same cluster
    assert a.head.memory == 16 * 2**30 and not a.head.hosts_islands  # num-cpus 0: no island on the head
    gpu, slices = a.workers
    assert gpu.gpus == 1 and gpu.memory == 26 * 2**30 and gpu.accelerator_memory == 80 * 2**30 and gpu.count == 8
    # the coordinator slices' nodes: one archipelago_slice each, no CPU for Ray to place an island on
    assert slices.name == "slices" and slices.resources == {"archipelago_slice": 1.0} and slices.count == 8
    assert not slices.hosts_islands and a.island_node(1) == gpu and a.offering("archipelago_slice") == [slices]


def test_the_flagship_config_fits_the_cluster_it_ships_for(capsys, tmp_path):
    code, lines, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA)
    assert code == 0, lines
    processes = {(p["process"], p["memory"]) for p in report["processes"]}
    assert processes == {
        ("coordinator", "host"),
        ("coordinator's objects", "object store"),  # the head's Ray object store, sized in the manifest
        ("island worker", "accelerator"),
        ("island worker", "host"),
        ("evaluator", "accelerator"),
        ("evaluator", "host"),
    }
    assert len([line for line in lines if "needs" in line]) == len(report["processes"])  # one line per process
    assert report["model"]["params"] == 114_114_048  # 120 M Llama, GPT-2's vocabulary
    coordinator = next(p for p in report["processes"] if p["process"] == "coordinator")
    assert "evaluation" not in coordinator["parts"]  # the head only records the result
    evaluator = next(p for p in report["processes"] if p == p and p["process"] == "evaluator")
    assert evaluator["total"] < 4 * 2**30  # 64 x 1024 tokens, 50,257-token vocabulary, in bounded memory
    # the worker pods' drain on a SIGTERM (k8s/raycluster.yaml): what a noticed island's result needs
    preemption = report["preemption"]
    assert preemption["drain_s"] == 25 and preemption["margin_s"] == 0.5
    assert preemption["up_bytes"] == report["link"]["up_bytes"]
    assert preemption["gbps"] == pytest.approx(report["link"]["up_bytes"] * 8 / 24.5 / 1e9)
    assert any(line.startswith("preemption: a SIGTERM drains an island's node for 25 s") for line in lines), lines


SCALED = [  # the flagship's Llama at 975 M parameters (hidden 2,048, 16 layers), 16 islands, H = 100
    *("--set", "task.kwargs.model_config.hidden_size=2048"),
    *("--set", "task.kwargs.model_config.intermediate_size=7168"),
    *("--set", "task.kwargs.model_config.num_hidden_layers=16"),
    *("--set", "task.kwargs.model_config.num_attention_heads=16"),
    *("--set", "islands.count=16", "--set", "inner_steps=100"),
]


def test_coordinator_slices_on_nodes_of_their_own_are_each_checked_against_that_node(capsys, tmp_path):
    """`coordinator.slice_resource`: each slice on a node of the group offering it, its memory
    and its object store checked there (not "any node", unchecked); more slices than the
    group has nodes, or a resource no node offers, refused naming the setting. At ≈ 1 B
    parameters, 16 islands, H = 100 of 1 s at 100 Gbit/s, one coordinator's share is over
    0.10 and the plan names the slices that fit it; with them it fits, and that is what the
    flagship as shipped (`coordinator.shards: auto`) runs with on the cluster it ships for."""
    link = ["--link-gbps", "100", "--step-s", "1"]
    one = [*SCALED, "--set", "coordinator.shards=1"]
    _, lines, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *one, *link)
    assert report["model"]["params"] == 975_409_152 and report["head"]["share"] > 0.10
    (fix,) = [f for f in report["head"]["to_fit"] if f.startswith("coordinator.shards >= ")]
    need = int(fix.split(">= ")[1].split(",")[0])
    assert "coordinator.slice_resource: archipelago_slice" in fix and any(fix in line for line in lines), lines
    sliced = [*SCALED, "--set", f"coordinator.shards={need}", "--set", "coordinator.slice_resource=archipelago_slice"]
    _, _, fits = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *sliced, *link)
    assert fits["head"]["share"] <= 0.10 and fits["head"]["to_fit"] == []
    _, lines, shipped = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *SCALED, *link)
    assert shipped["slices"]["shards"] == shipped["head"]["slices"] == need and shipped["head"] == fits["head"]
    assert any(line.startswith(f"slices: auto chose coordinator.shards {need}, the fewest") for line in lines)
    sliced = [*SCALED, "--set", "coordinator.shards=4", "--set", "coordinator.slice_resource=archipelago_slice"]
    _, _, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *sliced)
    needs = {(p["process"], p["memory"]): p for p in report["processes"]}
    host, store = needs["coordinator slice", "host"], needs["coordinator slice's objects", "object store"]
    assert host["node"] == store["node"] == "slices" and host["count"] == 4
    assert host["available"] == 64 * 2**30 and host["fits"] and store["available"] == 24 * 2**30 and store["fits"]
    per = 4 * report["model"]["params"] // 4
    assert host["parts"]["parameters"] == per and store["parts"]["arriving"] == host["parts"]["arriving"]
    assert not any("slice" in p for p in report["problems"]), report["problems"]
    code, _, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *sliced, "--set", "coordinator.shards=9")
    assert code == 2 and any(
        "coordinator.shards = 9" in p and "offers at most 8: slices (8 nodes of 1)" in p for p in report["problems"]
    ), report["problems"]
    code, _, report = _plan(capsys, tmp_path, LLAMA, *sliced)  # this machine offers no archipelago_slice
    assert code == 2 and any(
        p.startswith("coordinator.slice_resource = archipelago_slice: no node of this machine")
        for p in report["problems"]
    ), report["problems"]


def test_a_cluster_that_does_not_say_how_its_nodes_drain_plans_no_preemption(capsys, tmp_path):
    manifest = tmp_path / "cluster.yaml"
    manifest.write_text(Path(CLUSTER).read_text().replace("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "UNRELATED"))
    code, lines, report = _plan(capsys, tmp_path, "--cluster", str(manifest), LLAMA)
    assert code == 0 and report["preemption"] is None and not [line for line in lines if "preemption" in line]


def test_the_flagship_config_as_it_shipped_is_refused_naming_why(capsys, tmp_path):
    """As it shipped: a data-parallel warm start through the CPU head, and the coordinator
    evaluating a whole 64-row batch's logits at once (what its loss did before it was
    chunked), which the plan refuses naming the head's memory."""
    code, _, report = _plan(
        capsys,
        tmp_path,
        "--cluster",
        CLUSTER,
        LLAMA,
        "--set",
        "warm_start.mode=ddp",
        "--set",
        "evaluation.where=coordinator",
        "--set",
        "task.kwargs.eval_rows=64",
        "--set",
        "task.kwargs.eval_loss_tokens=65536",
    )
    assert code == 2
    problems = report["problems"]
    assert any("warm_start.mode ddp" in p and "coordinator" in p for p in problems), problems
    assert any(p.startswith("coordinator needs") and "on head, which has 16.00 GiB" in p for p in problems), problems


def test_a_vocabulary_neither_stated_nor_cached_is_asked_for(capsys, tmp_path):
    code, lines, _ = _plan(capsys, tmp_path, LLAMA, "--set", "task.kwargs.model_config.vocab_size=null")
    assert code == 2
    assert any("cannot plan" in line and "model_config.vocab_size" in line for line in lines), lines


def test_a_gpu_island_that_does_not_fit_its_accelerator_is_refused_by_how_much(capsys, tmp_path):
    code, _, report = _plan(
        capsys,
        tmp_path,
        "--cluster",
        CLUSTER,
        LLAMA,
        "--set",
        "inner.micro_batches=1",
        "--set",
        "task.kwargs.batch_size=256",
    )
    assert code == 2
    (problem,) = [p for p in report["problems"] if p.startswith("island worker")]
    assert "accelerator memory on gpu, which has 80.00 GiB" in problem and "GiB over" in problem


@pytest.mark.timeout(600)  # the 120 M Llama's three processes, each built and run at its real shapes on 2 cores
@pytest.mark.alone  # fresh interpreters of several GiB each: never beside a Ray test
@pytest.mark.parametrize(
    "name,argv,cluster",
    [
        ("default", [], None),
        (
            "tiny-llama",
            [
                "--set",
                "task.factory=archipelago.workers.tasks.hf_task:make_task",
                "--set",
                "task.kwargs.preset=tiny-llama",
            ],
            None,
        ),
        (
            "run-config",
            [str(REPO / "k8s" / "config" / "run-config.yaml")],
            CLUSTER,
        ),  # the default's model: planned only
        # the real 120 M architecture, vocabulary, context, precision (bf16) and micro-batch (16
        # rows), rehearsed as they are; C4 and GPT-2's tokenizer replaced by the stdlib corpus and
        # a trained tokenizer (ids below the vocabulary). One micro-batch of 16 rows a step
        # instead of the shipped 4: the island's peak is one micro-batch's (gradients accumulate
        # in place), and the evaluation set (a batch's rows) a quarter
        (
            "llama-120m",
            [
                LLAMA,
                "--set",
                "task.kwargs.source=stdlib",
                "--set",
                "task.kwargs.tokenizer=null",
                "--set",
                "task.kwargs.batch_size=16",
                "--set",
                "inner.micro_batches=1",
                "--set",
                "task.kwargs.eval_batches=1",
                "--set",
                "islands.threads=2",
                "--set",
                "evaluation.cpus=2",
            ],
            CLUSTER,
        ),
    ],
)
def test_every_shipped_config_is_planned_and_rehearsed_at_its_shapes(
    capsys, tmp_path, corpus_cache, name, argv, cluster
):
    common = [
        "--set",
        f"task.kwargs.cache_dir={corpus_cache}",
        "--set",
        "inner_steps=1",  # one step: the optimizer's state and every buffer exist by its end
        "--set",
        "rounds=1",
        "--set",
        "warm_start.steps=0",
    ]
    if cluster is not None:  # it fits the cluster it ships for
        code, lines, _ = _plan(capsys, tmp_path, "--cluster", cluster, *argv, *common)
        assert code == 0, lines
    if name == "run-config":  # the default run's model and shapes, rehearsed in that row
        return
    code, lines, report = _plan(capsys, tmp_path, "--rehearse", *argv, *common)
    rehearsed = {r["role"]: r for r in report["rehearsal"]}
    assert {"island", "coordinator"} <= set(rehearsed), lines
    for role, r in rehearsed.items():
        assert 0.75 <= r["ratio"] <= 1.25, (name, role, r)
    if cluster is None:  # a config for this machine fits it (one for a cluster is checked against that)
        assert code == 0, lines


@pytest.mark.ray
@pytest.mark.preflight
def test_a_run_that_cannot_fit_this_machine_is_refused_before_anything_starts(capsys, tmp_path, corpus_cache):
    """A 13 B-parameter GPT on this machine: `archipelago run` exits 2 naming what does not
    fit, and no actor was started (the model was measured under fake tensors, never built)."""
    import ray

    ray.shutdown()  # the command starts its own private instance
    code = main(
        [
            "run",
            "--set",
            f"task.kwargs.cache_dir={corpus_cache}",
            "--set",
            "task.kwargs.d_model=8192",
            "--set",
            "task.kwargs.n_layers=16",
            "--set",
            "task.kwargs.n_heads=64",
            "--set",
            "warm_start.steps=0",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "does not fit" in err and "host memory on this machine" in err and "GiB over" in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert not ray.is_initialized()


def test_a_cached_measurement_plans_without_importing_torch(tmp_path, corpus_cache):
    """The run's preflight reads a config's measurement from the cache: the command's
    start-up imports no torch for it (`bench startup`)."""
    import subprocess
    import sys

    code = f"""
import os, sys
os.environ["ARCHIPELAGO_CACHE"] = {str(tmp_path)!r}
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.plan.preflight import preflight
cfg = load_config(None, ["task.kwargs.cache_dir={corpus_cache}"])
preflight(cfg, on_ray_cluster=False)
print("torch" in sys.modules)
"""
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert first.stdout.split() == ["True"], first.stderr[-2000:]  # measured (and cached)
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert again.stdout.split() == ["False"], again.stderr[-2000:]
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1


def flagship_head(**changes: Any) -> Any:
    """The head of 1 B parameters, 16 islands, H = 100 steps of 1 s at 100 Gbit/s, fp32 both
    ways, the mean merge and a checkpoint every 2 rounds; `changes` to any of them."""
    from archipelago.orchestrator.plan.head import HeadLoad

    fields: dict[str, Any] = dict(
        params=10**9,
        islands=16,
        slices=1,
        link_gbps=100,
        step_s=1.0,
        inner_steps=100,
        up_bytes=4 * 10**9,
        down_bytes=4 * 10**9,
        merge="mean",
        uplink="none",
        downlink="none",
        state_values=1,
        checkpoint_every=2,
    )
    return HeadLoad(**(fields | changes))


def test_the_heads_share_of_a_round_is_priced_phase_by_phase_at_1b_parameters_and_16_islands():
    """1 B parameters, 16 islands, H = 100 steps of 1 s, 100 Gbit/s, the flagship's other
    settings (fp32 both ways, the mean merge, a checkpoint every 2 rounds): 64 GB in and 64
    GB out through one card take 5.12 s each way; the step over 16 updates 4.8 s at the
    measured rate; the checkpoint's 8 GB (parameters, momentum) 27.5 s every 2 rounds. The
    share is over 0.10, and the plan names the fixes: a codec, or enough slices (on nodes of
    their own they split the bytes, the step and the checkpoint, each writing its part)."""
    from archipelago.orchestrator.plan.head import CHECKPOINT_BYTES_PER_S

    load = flagship_head()
    phases = load.phases
    assert load.bytes_per_round == 128 * 10**9
    assert phases["fan_in"] == pytest.approx(5.12) and phases["fan_out"] == pytest.approx(5.12)
    assert phases["outer_step"] == pytest.approx(0.06 / 200e6 * 16e9)  # 8 x 25 M in 0.06 s, scaled
    assert phases["checkpoint"] == pytest.approx(8e9 / CHECKPOINT_BYTES_PER_S / 2)
    assert phases["codec"] == 0.0  # fp32 both ways: nothing to decode or encode
    assert load.round_seconds == 100 and load.share == pytest.approx(sum(phases.values()) / 100)
    codec, slices = load.to_fit()
    assert "the bytes take 10.2 s of the 10.0-s budget" in codec
    # slices on nodes of their own split everything, the checkpoint too: each writes its part
    sliced = dataclasses.replace(load, slices=4)
    assert sliced.phases["checkpoint"] == pytest.approx(8e9 / CHECKPOINT_BYTES_PER_S / 4 / 2)
    assert sliced.phases["fan_in"] == pytest.approx(5.12 / 4) and sliced.share == pytest.approx(load.share / 4)
    shards = int(slices.split(">= ")[1].split(",")[0])
    assert dataclasses.replace(load, slices=shards).share <= 0.10 < dataclasses.replace(load, slices=shards - 1).share
    # int4 both ways (0.53 bytes a value, with its scales): the bytes no longer dominate, but the
    # head decodes 16 updates (1.71 ns a value each) and encodes the downlink's change (3.35 ns)
    # every step: 30.7 s, six times the fp32 mean's step — more slices than fp32 would need
    small = dataclasses.replace(load, up_bytes=530_000_000, down_bytes=530_000_000, uplink="int4", downlink="int4")
    assert small.phases["codec"] == pytest.approx(16e9 * 1.71e-9 + 1e9 * 3.35e-9)
    (fix,) = small.to_fit()
    assert int(fix.split(">= ")[1].split(",")[0]) > shards
    assert dataclasses.replace(load, inner_steps=1000).to_fit() == []  # H = 1,000: it fits as it is

    # slices keep their parts of the islands' copy: a lossy downlink's bytes split over them
    # too, so at 10 Gbit/s int8 down needs 9 slices where exact needs 13 (at 100 both 3: there
    # the encoding costs what the card saves); a mode that steps on one coordinator
    # (streaming's fragments) is told no slices at all
    def need(head: Any) -> int:
        (fix,) = [f for f in head.to_fit() if f.startswith("coordinator.shards >= ")]
        return int(fix.split(">= ")[1].split(",")[0])

    lossy = dataclasses.replace(load, down_bytes=1_030_000_000, downlink="int8")
    assert need(lossy) == need(load) == shards
    ten = {"link_gbps": 10}
    assert (need(dataclasses.replace(lossy, **ten)), need(dataclasses.replace(load, **ten))) == (9, 13)
    (_, fix) = dataclasses.replace(load, sliceable=False).to_fit()
    assert "coordinator.shards" not in fix and "no slices" in fix
    # 1 Gbit/s, H = 20: even the most slices a config takes leave the head over its share
    (_, fix) = dataclasses.replace(load, link_gbps=1, inner_steps=20).to_fit()
    assert fix.startswith("no number of slices fits: it would take ") and "256" in fix


def test_the_plan_says_what_to_set_when_a_transfer_outlasts_rays_pull_retry_or_the_hang_floor():
    """1 B parameters to 16 islands through a 10 Gbit/s head: 64 GB each way take 51 s — past
    Ray's 10-s pull retry (the plan names the head's setting, sized from the transfer) and,
    at a 30-s floor, past the hang floor. At 100 Gbit/s (5.1 s) it says nothing."""
    load = flagship_head(link_gbps=10, checkpoint_every=0, hang_floor_s=30.0)
    retry, floor = load.slow_transfers()
    assert "up to 51 s" in retry and "object_manager_pull_timeout_ms" in retry and "300000" in retry
    assert "past elastic.hang_floor_s (30 s)" in floor
    assert retry in load.lines() and floor in load.lines()
    assert dataclasses.replace(load, link_gbps=100).slow_transfers() == []
    assert dataclasses.replace(load, hang_floor_s=60.0).slow_transfers() == [retry]


def test_an_average_warm_start_through_the_head_is_priced_and_refused_once_the_head_sets_its_pace():
    """1 B parameters on 16 islands, 2,000 warm steps of 1 s averaged every 25: 80 averages
    of 64 GB in and out, 10.24 TB through the card. At 100 Gbit/s each average takes the
    head 5.12 s in (the way out overlaps) and 4.8 s of mean: 794 s against 2,000 s of
    compute, over the 0.10 target but the islands still set the pace; at 10 Gbit/s the head
    would (share 2.2): refused, naming the ways out. On the run's 8 coordinator slices each
    card and mean takes an eighth: 0.28, the islands set the pace again."""
    from archipelago.orchestrator.plan.head import DECODE_S_PER_VALUE, WarmLoad

    warm = WarmLoad(
        params=10**9,
        islands=16,
        slices=1,
        uplink="none",
        up_bytes=4 * 10**9,
        link_gbps=100,
        step_s=1.0,
        steps=2000,
        averages=80,
    )
    assert warm.bytes == 2 * 16 * 80 * 4 * 10**9
    assert warm.seconds == pytest.approx(80 * (5.12 + 0.06 / 200e6 * 16e9))
    assert warm.share == pytest.approx(warm.seconds / 2000) and warm.refusal() is None
    assert "OVER 0.10" in warm.lines()[0] and "through the head" in warm.lines()[0] and "init_from" in warm.lines()[1]
    slow = dataclasses.replace(warm, link_gbps=10)
    assert slow.share == pytest.approx(80 * (51.2 + 4.8) / 2000)
    assert "init_from" in slow.refusal() and "coordinator slices" in slow.refusal()
    sliced = dataclasses.replace(slow, slices=8)
    assert sliced.bytes == slow.bytes and sliced.share == pytest.approx(slow.share / 8) and sliced.refusal() is None
    assert "through the 8 coordinator slices" in sliced.lines()[0]
    # islands sending int8 (the run's codec): a quarter of the bytes in, fp32 still out,
    # which now sets the card's time; decoding 16 updates is added to the mean
    int8 = dataclasses.replace(warm, uplink="int8", up_bytes=10**9 + 4 * 10**9 // 512)
    assert int8.bytes == 16 * 80 * (int8.up_bytes + 4 * 10**9)
    decode = DECODE_S_PER_VALUE["int8"] * 10**9 * 16
    assert int8.seconds == pytest.approx(warm.seconds + 80 * decode) and "up in int8, down fp32" in int8.lines()[0]


def test_the_plan_states_the_heads_share_at_the_link_and_step_given(capsys, tmp_path):
    """`--link-gbps` and `--step-s` price the head's round; the manifest's head annotation
    is the default link; the bytes are the link's per island times the islands."""
    code, lines, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, "--link-gbps", "10", "--step-s", "0.5", LLAMA)
    assert code == 0, lines
    head, link = report["head"], report["link"]
    assert head["link_gbps"] == 10 and head["step_s"] == 0.5 and head["islands"] == 4
    assert head["bytes_per_round"] == 4 * (link["up_bytes"] + link["down_bytes"])
    assert head["phases"]["fan_in"] == pytest.approx(4 * link["up_bytes"] * 8 / 10e9)
    assert head["round_seconds"] == 500 * 0.5 and head["share"] == pytest.approx(head["seconds_per_round"] / 250)
    assert any(line.startswith("head: ") and "share" in line for line in lines), lines
    warm = report["warm_start"]  # the Llama's average warm start: 4 islands' parameters every 25 steps
    params, averages = report["model"]["params"], math.ceil(2000 / 25)  # up in the run's codec, down in fp32
    assert warm["bytes"] == 4 * averages * (report["link"]["up_bytes"] + 4 * params) and warm["share"] < 1
    # over a link slow enough that the head would set the warm start's pace: refused, exit 2
    code, lines, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, "--link-gbps", "0.5", LLAMA)
    assert code == 2 and any("the average warm start would keep the head busy" in p for p in report["problems"])
    with pytest.raises(SystemExit) as refused:  # a link of no speed is refused by the flag
        main(["plan", "--link-gbps", "0", LLAMA])
    assert refused.value.code == 2


def test_a_head_link_annotation_that_is_not_a_speed_is_refused(tmp_path):
    import yaml

    bad = tmp_path / "cluster.yaml"
    docs = list(yaml.safe_load_all(Path(CLUSTER).read_text()))
    doc = next(d for d in docs if isinstance(d, dict) and d.get("kind") == "RayCluster")
    template = doc["spec"]["headGroupSpec"]["template"]
    template.setdefault("metadata", {}).setdefault("annotations", {})["archipelago.io/link-gbps"] = "fast"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(ClusterError, match="link-gbps"):
        from_manifest(bad)
    template["metadata"]["annotations"]["archipelago.io/link-gbps"] = "25"
    bad.write_text(yaml.safe_dump(doc))
    assert from_manifest(bad).link_gbps == 25


def test_the_heads_object_store_is_checked_against_what_the_coordinator_keeps_in_it(capsys, tmp_path):
    """The published version and every island's pseudo-gradient pulled in before a step
    live in the head's Ray object store: the manifest's `object-store-memory` (else Ray's
    30 % of the pod's memory) must hold them, or Ray spills them to disk. The Llama's 4
    islands (int8 pseudo-gradients: its codecs are `auto`, the head's link 10 Gbit/s) fit
    the shipped 6 GiB; a 512-MiB store is refused, exit 2."""
    import yaml

    code, lines, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA)
    assert code == 0, lines
    (objects,) = [p for p in report["processes"] if p["memory"] == "object store"]
    params = report["model"]["params"]
    assert objects["available"] == 6 * 2**30 and objects["parts"]["published"] == 4 * params
    assert report["codecs"]["codec"] == "int8" and report["link"]["up_bytes"] == pytest.approx(params, rel=0.01)
    assert objects["parts"]["arriving"] == pytest.approx(4 * report["link"]["up_bytes"], rel=0.01) and objects["fits"]
    assert from_manifest(CLUSTER).head.object_store == 6 * 2**30
    docs = list(yaml.safe_load_all(Path(CLUSTER).read_text()))
    doc = next(d for d in docs if isinstance(d, dict) and d.get("kind") == "RayCluster")
    doc["spec"]["headGroupSpec"]["rayStartParams"]["object-store-memory"] = str(2**29)
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(doc))
    code, lines, report = _plan(capsys, tmp_path, "--cluster", str(small), LLAMA)
    assert code == 2 and any(p.startswith("coordinator's objects needs") for p in report["problems"]), report
    del doc["spec"]["headGroupSpec"]["rayStartParams"]["object-store-memory"]  # Ray's default share
    small.write_text(yaml.safe_dump(doc))
    assert from_manifest(small).head.object_store_bytes == int(0.3 * 16 * 2**30)


def test_codecs_left_auto_are_chosen_by_the_heads_seconds_at_the_link(capsys, tmp_path):
    """`compression.codec` and `.downlink: auto` on the flagship scaled to ≈ 1 B parameters,
    16 islands, H = 100: the plan prices the head's round with each candidate and trains
    with the cheaper. At 1 and 10 Gbit/s the card sets the pace and int8 both ways wins (a
    quarter of the bytes, and their decoding costs less than the card saved); at 100 Gbit/s
    decoding 16 updates costs the head more than the card saves, and fp32 stays. Everything
    else is planned with the codecs chosen (the link's bytes, the share)."""
    one = ["--set", "coordinator.shards=1"]  # one coordinator: its islands hold the copy a lossy downlink changes
    auto = [*SCALED, *one, "--set", "compression.codec=auto", "--set", "compression.downlink=auto", "--step-s", "1"]
    chosen = {}
    for gbps in ("1", "10", "100"):
        _, lines, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *auto, "--link-gbps", gbps)
        codecs = report["codecs"]
        chosen[gbps] = (codecs["codec"], codecs["downlink"])
        assert set(codecs["seconds"]) == {"none/none", "int8/int8"} and codecs["link_gbps"] == float(gbps)
        best = min(codecs["seconds"], key=codecs["seconds"].get)
        assert best == f"{codecs['codec']}/{codecs['downlink']}"
        assert report["head"]["seconds_per_round"] == pytest.approx(codecs["seconds"][best])
        assert any(line.startswith(f"codecs: auto chose codec {codecs['codec']}") for line in lines), lines
        per_value = report["link"]["up_bytes"] / report["model"]["params"]
        assert per_value == (4.0 if codecs["codec"] == "none" else pytest.approx(1 + 4 / 512, rel=1e-3))
    assert chosen == {"1": ("int8", "int8"), "10": ("int8", "int8"), "100": ("none", "none")}
    # at 10 Gbit/s int8 takes the head's share from 1.18 to 0.65 (the step and the checkpoint stay)
    exact = ["--set", "compression.codec=none", "--set", "compression.downlink=none"]
    _, _, fp32 = _plan(
        capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *SCALED, *one, *exact, "--step-s", "1", "--link-gbps", "10"
    )
    assert fp32["codecs"] is None
    _, _, picked = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *auto, "--link-gbps", "10")
    assert picked["head"]["share"] < 0.6 * fp32["head"]["share"]


def test_auto_codecs_stay_exact_where_no_codec_was_measured_or_no_copy_is_held():
    """Mode ddp's gradients stay exact (no codec was measured lossless on them); coordinator
    slices keep their parts of the islands' copy, so both ways may be int8 there too; a
    codec the user named is kept."""
    from archipelago.orchestrator.config_load import load_config
    from archipelago.orchestrator.plan.head import choose_codecs

    def choice(*sets: str) -> tuple[str, str]:
        cfg = load_config(None, ["compression.codec=auto", "compression.downlink=auto", *sets])
        picked = choose_codecs(cfg, 10**9, link_gbps=1.0, step_s=1.0)
        assert picked is not None and "auto" not in (picked.apply(cfg).compression.codec, picked.downlink)
        return picked.codec, picked.downlink

    assert choice() == ("int8", "int8")
    assert choice("mode=ddp", "warm_start.steps=0") == ("none", "none")
    assert choice("coordinator.shards=2") == ("int8", "int8")  # each slice keeps its part of the copy
    cfg = load_config(None, ["compression.codec=int4", "compression.downlink=auto"])
    picked = choose_codecs(cfg, 10**9, link_gbps=1.0, step_s=1.0)
    assert picked is not None and (picked.codec, picked.downlink) == ("int4", "int8")
    assert choose_codecs(load_config(None, []), 10**9, link_gbps=1.0, step_s=1.0) is None  # nothing left to it


def test_auto_codecs_need_the_plan_and_no_codec_is_built_by_that_name(tmp_path):
    from archipelago.orchestrator.config_load import ConfigError, load_config
    from archipelago.workers.wire.spec import CodecSpecError, parse_codec

    with pytest.raises(ConfigError, match="needs preflight = true"):
        load_config(None, ["compression.codec=auto", "preflight=false"])
    with pytest.raises(CodecSpecError, match="a choice the run's plan makes at launch"):
        parse_codec("auto")
    assert not load_config(None, ["compression.downlink=auto"]).tracks_copy  # until the plan says int8


def test_slices_left_auto_are_the_fewest_that_fit_of_the_slice_nodes_offered(capsys, tmp_path):
    """`coordinator.shards: auto` (the flagship as shipped) at ≈ 1 B parameters, 16 islands,
    H = 100 of 1 s at 100 Gbit/s: on a cluster whose slices group has 2 nodes at most, both
    (no count fits, and more cards are less share); on this machine, which offers no slice
    node, one coordinator, its share over and the line saying what it would take; in a mode
    that steps on one coordinator, or with a lossy downlink named, one coordinator untried.
    Left auto, it needs a slice resource to count nodes by and the plan to choose it; nothing
    steps on it before the plan has."""
    from archipelago.orchestrator.config_load import ConfigError

    link = ["--link-gbps", "100", "--step-s", "1"]
    doc = yaml.safe_load(Path(CLUSTER).read_text())
    (group,) = [g for g in doc["spec"]["workerGroupSpecs"] if g["groupName"] == "slices"]
    group["maxReplicas"] = 2
    two = tmp_path / "two-slices.yaml"
    two.write_text(yaml.safe_dump(doc))
    with pytest.raises(ClusterError, match=r"the head states 8 slice nodes .* keep the annotation equal"):
        from_manifest(two)  # the head's annotation must follow the group's maxReplicas
    doc["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]["archipelago.io/slice-nodes"] = "2"
    two.write_text(yaml.safe_dump(doc))
    _, lines, report = _plan(capsys, tmp_path, "--cluster", str(two), LLAMA, *SCALED, *link)
    assert report["slices"]["shards"] == report["head"]["slices"] == 2 and report["slices"]["offered"] == 2
    assert report["head"]["share"] > 0.10 and report["slices"]["shares"]["2"] == pytest.approx(report["head"]["share"])
    assert any("none is within a share of 0.10, so all 2" in line for line in lines), lines
    _, lines, here = _plan(capsys, tmp_path, LLAMA, *SCALED, *link)
    assert here["slices"]["shards"] == 1 and "offers 0 nodes of archipelago_slice" in here["slices"]["why"]
    assert here["head"]["share"] > 0.10 and any(f.startswith("coordinator.shards >= 3") for f in here["head"]["to_fit"])
    _, _, one = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *SCALED, *link, "--set", "mode=streaming")
    assert one["slices"]["shards"] == 1 and "steps on one coordinator" in one["slices"]["why"], one["slices"]
    with pytest.raises(
        ConfigError, match=r"coordinator.shards auto places each slice .* set coordinator.slice_resource"
    ):
        load_config(None, ["coordinator.shards=auto"])
    with pytest.raises(ConfigError, match=r"coordinator.shards auto is chosen by the run's plan .* preflight = true"):
        load_config(None, ["coordinator.shards=auto", "coordinator.slice_resource=s", "preflight=false"])
    cfg = load_config(None, ["coordinator.shards=auto", "coordinator.slice_resource=s"])
    with pytest.raises(ValueError, match="chosen by the run's plan at launch"):
        _ = cfg.coordinator.slices


def test_a_continued_run_keeps_the_slices_its_first_launch_chose(tmp_path):
    """A checkpoint's outer state is split by the slices it was written with: continuing
    the run, `auto` takes the number its first launch recorded in config.yaml, not a new
    choice on a cluster that may have changed."""
    from archipelago.orchestrator.runtime.driver import resumed_slices

    cfg = load_config(None, ["coordinator.shards=auto", "coordinator.slice_resource=s", f"out_dir={tmp_path}"])
    assert resumed_slices(cfg) is cfg  # nothing recorded yet: the plan chooses
    (tmp_path / "config.yaml").write_text(
        dump_config(cfg.model_copy(update={"coordinator": cfg.coordinator.model_copy(update={"shards": 3})}))
    )
    assert resumed_slices(cfg).coordinator.slices == 3
    named = load_config(None, ["coordinator.shards=2", f"out_dir={tmp_path}"])
    assert resumed_slices(named) is named  # a number the user gave is theirs


@pytest.mark.ray
@pytest.mark.preflight
def test_a_run_over_a_slow_stated_link_trains_with_the_codecs_its_plan_chose(tmp_path, corpus_cache, monkeypatch):
    """The head's pod states its link (`ARCHIPELAGO_LINK_GBPS`, from the manifest's annotation):
    over 10 Mbit/s the run's own plan picks int8 both ways for `auto`, the run trains with it
    (the islands' bytes a quarter of fp32's) and its config.yaml records what it trained with;
    an unreadable stated link is refused before anything starts (exit 2)."""
    import ray

    from tests.helpers import tiny_lm_config

    ray.shutdown()
    monkeypatch.setenv("ARCHIPELAGO_LINK_GBPS", "0.01")
    out = tmp_path / "out"
    cfg = tiny_lm_config(
        out,
        corpus_cache,
        "preflight=true",
        "compression.codec=auto",
        "compression.downlink=auto",
        "islands.count=2",
        "ray.num_cpus=2",
        "rounds=2",
        "inner_steps=10",
    )
    from archipelago.orchestrator.runtime.driver import run

    summary = run(cfg, show_progress=False)
    recorded = (out / "config.yaml").read_text()
    assert "codec: int8" in recorded and "downlink: int8" in recorded and "auto" not in recorded
    params = summary["num_params"]
    # 2 islands x 2 rounds sent ≈ 1 byte a value (fp32: 4); what they received past their first
    # whole copy (`bytes_bootstrap`) are int8 changes of it
    assert summary["bytes_sent"] < 1.1 * 4 * params
    assert summary["bytes_received"] - summary["bytes_bootstrap"] < 1.1 * 4 * params
    monkeypatch.setenv("ARCHIPELAGO_LINK_GBPS", "fast")
    code = main(
        [
            "run",
            "--set",
            f"task.kwargs.cache_dir={corpus_cache}",
            "--set",
            "compression.codec=auto",
            "--out",
            str(tmp_path / "refused"),
        ]
    )
    assert code == 2


def test_the_rehearsals_processes_run_with_the_allocators_mmap_threshold_fixed(monkeypatch):
    """Each rehearsed process gets `ALLOCATOR_ENV` added to its environment: with glibc's
    adaptive threshold a peak depended on timing (the flagship's island 6.27 and 6.59 GiB at
    the same 4 rows), with it fixed the same to the MB (docs/operations.md)."""
    from archipelago.orchestrator.plan import rehearse
    from archipelago.orchestrator.plan.fresh import Fresh

    assert rehearse.ALLOCATOR_ENV == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    started: list[dict] = []

    class Recorded(Fresh):
        def __init__(self, module, *args, **kwargs):
            started.append(kwargs["env"])
            super().__init__("tests.env_probe", *rehearse.ALLOCATOR_ENV, env=kwargs["env"])

    monkeypatch.setattr(rehearse, "Fresh", Recorded)  # the process started is a probe of its environment
    got = rehearse.rehearse_role(load_config(None, []), "island").result()
    assert started == [rehearse.ALLOCATOR_ENV] and got == rehearse.ALLOCATOR_ENV


def test_a_micro_batch_is_read_off_the_line_through_two_and_the_flag_is_checked(capsys, tmp_path):
    from archipelago.orchestrator.plan.planner import at_rows, micro_batch_rows
    from archipelago.orchestrator.plan.rehearse import on_the_line

    assert on_the_line({4: 6 * 2**30, 6: 7 * 2**30}, 16) == 12 * 2**30
    assert on_the_line({6: 7 * 2**30, 4: 6 * 2**30}, 4) == 6 * 2**30  # either order
    cfg = load_config(LLAMA, [])
    assert micro_batch_rows(cfg) == 16 and micro_batch_rows(at_rows(cfg, 4)) == 4
    assert at_rows(cfg, 4).inner.micro_batches == 1 and at_rows(cfg, 4).inner.precision == cfg.inner.precision
    code, lines, _ = _plan(capsys, tmp_path, "--rehearse-rows", "4,6", LLAMA)
    assert code == 2 and any("give --rehearse with it" in line for line in lines)
    for bad in ("4", "4,4", "0,2", "a,b"):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", "--rehearse", "--rehearse-rows", bad, LLAMA])
        assert exit_.value.code == 2


def test_an_islands_inner_state_snapshot_is_counted_where_its_run_keeps_it(capsys, tmp_path):
    """An island saving its inner state holds a copy of it on the host while it is written
    beside the next round (`inner_state.StateWrites`): the Llama's AdamW moments, twice its
    parameters in fp32, on its GPU node's host; nothing where the run keeps no island state."""

    def host_parts(*extra: str) -> tuple[dict, int]:
        code, lines, report = _plan(capsys, tmp_path, "--cluster", CLUSTER, LLAMA, *extra)
        assert code == 0, lines
        (island,) = [p for p in report["processes"] if p["process"] == "island worker" and p["memory"] == "host"]
        return island["parts"], report["model"]["params"]

    parts, params = host_parts()
    assert parts["inner state snapshot"] == pytest.approx(2 * 4 * params, rel=0.01)
    assert "inner state snapshot" not in host_parts("--set", "checkpoint.island_state=false")[0]


def test_the_plan_picks_the_rows_a_step_that_fill_an_islands_share_of_its_gpu(tmp_path):
    """`bench gpu`'s 124 M island trains the rows a step the plan fits in its GPU (llm.c's
    64 rows of 1,024 tokens on an 80-GB card, not a CPU config's 16): the largest power of two
    whose planned accelerator peak is within `DEVICE_FILL` of the island's share, guessed off
    one measurement (activations grow with the rows) and measured at the guess; none fitting
    is a typed refusal."""
    from archipelago.orchestrator.plan.cache import model_memory
    from archipelago.orchestrator.plan.cluster import Cluster, NodeKind
    from archipelago.orchestrator.plan.planner import (
        DEVICE_FILL,
        NothingFits,
        at_rows,
        island_accelerator_bytes,
        make_plan,
        rows_that_fill,
    )

    small = ["task.kwargs.d_model=64", "task.kwargs.n_layers=2", "task.kwargs.n_heads=2", "task.kwargs.context=128"]
    cfg = load_config(
        None, [*small, f"task.kwargs.cache_dir={tmp_path}", "islands.gpus=0.5", "task.kwargs.batch_size=8"]
    )

    def gpu(memory: int) -> Cluster:
        node = NodeKind(name="gpu node", memory=64 * 2**30, cpus=8, gpus=1, accelerator_memory=memory)
        return Cluster(source="a test's", head=node, workers=())

    huge = rows_that_fill(cfg, gpu(2**40), most=64)
    assert huge[0] == 64  # as many as asked for, where memory is no limit
    rows, planned = rows_that_fill(cfg, gpu(int(huge[1] / 2 / DEVICE_FILL / 0.5)))  # half of 64 rows' peak
    assert 8 <= rows < 64 and planned <= huge[1] / 2
    measured = island_accelerator_bytes(make_plan(at_rows(cfg, rows), model_memory(at_rows(cfg, rows)), gpu(2**40)))
    assert planned == measured  # the rows it chose, measured: what it says they hold
    with pytest.raises(NothingFits):
        rows_that_fill(cfg, gpu(2**20))
    with pytest.raises(NothingFits, match="no accelerator"):
        rows_that_fill(load_config(None, small), gpu(2**40))  # a CPU island
