"""`head`: the head's round on real Ray across nodes, phase by phase, beside the plan's
prediction of it (`orchestrator/plan/head.py`).

Each row is one run of `archipelago run`'s code (`runtime.driver.run`) on a
`ray.cluster_utils.Cluster` on this machine: the head node takes no work (the driver and
the coordinator, pinned there, as on KubeRay), each island has a node of its own (one CPU),
and each slice of a sliced coordinator a node of its own (no CPU, one `archipelago_slice`:
the manifests' slices group), from which it also writes its part of each checkpoint. The
model is a Llama built from its config (the Hugging Face task; this machine's Python
source as text, a trained tokenizer)
at the row's size, trained in `diloco` mode with a checkpoint every `CHECKPOINT_EVERY`
rounds and an evaluation every round on the coordinator.

Per row, from the run's own records, the first `WARM_ROUNDS` left out (the islands build
their models and download the whole vector, the outer step's kernel compiles and its spare
buffers are first touched): the round's seconds; the islands' compute in it
(the slowest island's); the coordinator's parts (`coordinator_seconds`: wait, step,
publish, dispatch, evaluate, record, checkpoint — the last the fence before a step while
a checkpoint was still being written); the checkpoint writes' own seconds (their events);
the bytes through the head (what every island sent and received, per round; the last
round's version goes to no island, so its bytes are left out).

Beside each, the plan's: `plan_run(cfg, link_gbps=L, step_s=S)` with L the rate Ray's
object store moves a 256 MB object between this machine's nodes (a probe, both ways: on
one host that is loopback through Ray's object manager, not a network card — said in the
report) and S the islands' measured seconds per inner step; its round is the islands'
compute plus the head's phases (fan-in, outer step, fan-out, the checkpoint's share).

Checks: each row's measured ÷ planned round seconds within 0.75–1.33, the head's bytes
per round equal to the plan's to 5 %, and at 100 M parameters a round with a checkpoint
at most 1.1× a round without one (`checkpoint_check`) — on the rows whose head has a core
of its own (one island): on this 2-core machine every node shares the same two cores, and
with two islands the write on the head slows the islands' compute, which a head on a
machine of its own does not. The checkpoint's cost is what it adds to a run against the
same run without checkpoints: the islands write their inner states, and the head its
checkpoint, beside the next round, and a write may end in the round after; the split of
each row's rounds into those a write began in and the others, with their compute and the
head's own time, is in the report as well.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.report import BenchResult, Panel, checks_table, md_table, targets_met

CHECKPOINT_EVERY = 2
SLICE_RESOURCE = "archipelago_slice"  # what the manifests' slices group offers, one a node
WARM_ROUNDS = 2
PROBE_BYTES = 256 * 2**20
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    islands: int = 2
    slices: int = 1
    codec: str = "none"  # both ways (compression.codec and compression.downlink)
    inner_steps: int = 4
    rounds: int = 7
    checkpoints: bool = True  # every `CHECKPOINT_EVERY` rounds, or none (the checkpoint's cost is against such a run)

    def config(self, out: Path) -> dict[str, Any]:
        """The run's config (what `archipelago run --config` would read)."""
        return {
            "mode": "diloco",
            "seed": 0,
            "task": {
                "factory": "archipelago.workers.tasks.hf_task:make_task",
                "kwargs": {
                    "source": "stdlib",
                    "cache_dir": str(out / "corpus"),
                    "model_config": {
                        "model_type": "llama",
                        "vocab_size": self.vocab,
                        "hidden_size": self.hidden,
                        "intermediate_size": self.intermediate,
                        "num_hidden_layers": self.layers,
                        "num_attention_heads": self.heads,
                        "num_key_value_heads": self.kv_heads,
                        "tie_word_embeddings": True,
                    },
                    "context": 64,
                    "batch_size": 2,
                    "eval_batches": 1,
                },
            },
            "inner": {"precision": "fp32", "micro_batches": 1},
            "warm_start": {"steps": 0},
            "islands": {"count": self.islands, "cpus": 1, "threads": 1},
            "coordinator": {
                "shards": self.slices,
                "slice_resource": SLICE_RESOURCE if self.slices > 1 else None,
            },
            "compression": {"codec": self.codec, "downlink": self.codec},
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "round_timeout_s": 600,
            "eval_every": 1,
            "checkpoint": {
                "every_rounds": CHECKPOINT_EVERY if self.checkpoints else 0,
                "path": str(out / "checkpoints"),
            },
            "out_dir": str(out / "run"),
            "api": {"enabled": False},
        }


ROWS = (
    Row(name="25m", hidden=512, layers=7, intermediate=1408, heads=8, kv_heads=8, vocab=8192),
    Row(name="25m-int4", hidden=512, layers=7, intermediate=1408, heads=8, kv_heads=8, vocab=8192, codec="int4"),
    Row(name="25m-2slices", hidden=512, layers=7, intermediate=1408, heads=8, kv_heads=8, vocab=8192, slices=2),
    Row(name="100m", hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, vocab=32000),
    # one island: the head keeps a core of its own, as on a cluster, where its checkpoint's
    # write takes no island's compute (on this 2-core machine two islands leave it none);
    # the same run twice, with checkpoints and without, over more rounds: a checkpoint's cost
    # is the difference of their rounds (a write may end in the round after the one it began in)
    Row(
        name="100m-1island", hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, vocab=32000,
        islands=1, rounds=12,
    ),
    Row(
        name="100m-1island-nockpt", hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, vocab=32000,
        islands=1, rounds=12, checkpoints=False,
    ),
)  # fmt: skip
CHECKPOINT_ROW, PLAIN_ROW = "100m-1island", "100m-1island-nockpt"  # the checkpoint's cost: the first against the second
QUICK_ROWS = (
    Row(name="2m", hidden=128, layers=2, intermediate=384, heads=4, kv_heads=4, vocab=4096, inner_steps=2, rounds=5),
)


def probe_link_gbps() -> dict[str, float]:
    """Gbit/s at which Ray's object store moves `PROBE_BYTES` from the head node (this
    driver) to an island's node and back (the slower way of two runs each)."""
    import numpy as np
    import ray

    @ray.remote(num_cpus=1)
    def pull(box: list) -> float:
        t0 = time.perf_counter()
        ray.get(box[0])
        return time.perf_counter() - t0

    @ray.remote(num_cpus=1)
    def make() -> Any:
        return np.ones(PROBE_BYTES // 4, np.float32)

    down, up = [], []
    for _ in range(2):
        ref = ray.put(np.ones(PROBE_BYTES // 4, np.float32))
        down.append(ray.get(pull.remote([ref])))
        del ref
        made = make.remote()
        ray.wait([made], fetch_local=False)
        t0 = time.perf_counter()
        ray.get(made)
        up.append(time.perf_counter() - t0)
        del made
    rate = {"down": PROBE_BYTES * 8 / max(down) / 1e9, "up": PROBE_BYTES * 8 / max(up) / 1e9}
    return {**rate, "gbps": min(rate.values())}


def codec_rates(numel: int = 25_000_000, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Seconds per value to encode and to decode a pseudo-gradient-like vector (normal, σ
    1e-3) of `numel` values, by each value codec and a top-k chain, on one thread here: the
    head's prices of a compressed uplink (decoded per island) and a lossy downlink (encoded
    once a version) in the plan (`plan/head.py`'s tables, which quote these)."""
    import numpy as np
    import torch

    from archipelago.orchestrator.plan.head import TOPK
    from archipelago.workers.wire.compress import decode, encode

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = (np.random.default_rng(0).standard_normal(numel) * 1e-3).astype(np.float32)
        rates: dict[str, dict[str, float]] = {"decode": {}, "encode": {}}
        for name, spec in [(c, c) for c in ("bf16", "int8", "int4", "int2", "fp4")] + [(TOPK, "topk:0.1+int4")]:
            best_e = best_d = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                payload = encode(x, spec)
                best_e = min(best_e, time.perf_counter() - t0)
                t0 = time.perf_counter()
                decode(payload)
                best_d = min(best_d, time.perf_counter() - t0)
            rates["encode"][name], rates["decode"][name] = best_e / numel, best_d / numel
        return rates
    finally:
        torch.set_num_threads(threads)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def measured_rounds(run_dir: Path, row: Row) -> dict[str, Any]:
    """Per round after the warm ones: its seconds, the slowest island's compute in it, the
    coordinator's parts, the head's bytes (None in the last round, which sends no version
    out); and the checkpoint writes' seconds."""
    records = _records(run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    rounds = []
    for before, r in list(itertools.pairwise(records))[WARM_ROUNDS - 1 :]:
        compute = max(
            r["island_compute_seconds"][i] - before["island_compute_seconds"].get(i, 0.0)
            for i in r["island_compute_seconds"]
        )
        sent = r["bytes_sent"] - before["bytes_sent"]
        received = r["bytes_received"] - before["bytes_received"]
        rounds.append(
            {
                "round": r["round"],
                "seconds": r["round_seconds"],
                "compute": compute,
                "parts": r["coordinator_seconds"],
                "head_bytes": None if r is records[-1] else sent + received,
                # a checkpoint taken after round r - 1 is written while round r trains
                "writing": row.checkpoints and (r["round"] - 1) % CHECKPOINT_EVERY == 0,
            }
        )
    writes = [e["seconds"] for e in events if e["kind"] == "checkpoint" and "seconds" in e]
    return {"rounds": rounds, "checkpoint_writes": writes, "inner_steps": row.inner_steps}


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def summarise(row: Row, measured: dict[str, Any], planned: dict[str, Any], params: int) -> dict[str, Any]:
    rounds = measured["rounds"]
    parts = {k: _mean([r["parts"].get(k, 0.0) for r in rounds]) for k in rounds[0]["parts"]}
    compute = _mean([r["compute"] for r in rounds])
    seconds = _mean([r["seconds"] for r in rounds])
    head = planned["head"]
    planned_round = compute + head["seconds_per_round"]
    head_bytes = _mean([r["head_bytes"] for r in rounds if r["head_bytes"] is not None])
    writing = [r["seconds"] for r in rounds if r["writing"]]
    plain = [r["seconds"] for r in rounds if not r["writing"]]
    # where a checkpoint round's extra time went: the islands' compute (on this machine the
    # write shares the islands' cores), or the head's own (the fence, the transfers)
    split = {
        key: (_mean([of(r) for r in rounds if r["writing"]]), _mean([of(r) for r in rounds if not r["writing"]]))
        for key, of in (("compute", lambda r: r["compute"]), ("head", lambda r: r["seconds"] - r["compute"]))
    }
    return {
        "params": params,
        "islands": row.islands,
        "slices": row.slices,
        "codec": row.codec,
        "inner_steps": row.inner_steps,
        "rounds_measured": len(rounds),
        "phases": {
            "compute": compute,
            **parts,
            "checkpoint_write": _mean(measured["checkpoint_writes"]),
        },
        "planned_phases": head["phases"],
        "measured_seconds": seconds,
        "planned_seconds": planned_round,
        "ratio": seconds / planned_round,
        "head_seconds": seconds - compute,
        "planned_head_seconds": head["seconds_per_round"],
        "head_bytes": head_bytes,
        "planned_head_bytes": head["bytes_per_round"],
        "bytes_ratio": head_bytes / head["bytes_per_round"],
        "checkpoint_round_seconds": _mean(writing),
        "plain_round_seconds": _mean(plain),
        "checkpoint_round_ratio": _mean(writing) / _mean(plain) if writing and plain else None,
        "checkpoint_round_split": {k: {"writing": w, "plain": p} for k, (w, p) in split.items()},
        "step_s": compute / row.inner_steps,
        "rounds": rounds,
    }


def run_row(row: Row, work: Path, link_gbps: float) -> dict[str, Any]:
    """One row's run on the cluster this process is connected to, and the plan beside it."""
    from archipelago.orchestrator.config_load import validate_config
    from archipelago.orchestrator.plan.planner import plan_run
    from archipelago.orchestrator.runtime.driver import run

    out = work / row.name
    cfg = validate_config(row.config(out))
    run(cfg, show_progress=False, run_id=f"head-{row.name}")
    measured = measured_rounds(Path(cfg.out_dir), row)
    step_s = _mean([r["compute"] for r in measured["rounds"]]) / row.inner_steps
    plan = plan_run(cfg, link_gbps=link_gbps, step_s=step_s)
    return summarise(row, measured, plan.as_dict(), plan.model.params)


def _cluster(rows: tuple[Row, ...]) -> Any:
    """The head node (no CPUs: nothing but the driver and the coordinator runs there), a
    node of one CPU per island of the widest row and a slice node per slice of the most
    sliced, each with an object store large enough for a round's objects."""
    from ray.cluster_utils import Cluster

    store = 2 * GIB
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": store})
    for _ in range(max(r.islands for r in rows)):
        cluster.add_node(num_cpus=1, object_store_memory=store)
    for _ in range(max((r.slices for r in rows if r.slices > 1), default=0)):
        cluster.add_node(num_cpus=0, resources={SLICE_RESOURCE: 1}, object_store_memory=store)
    return cluster


def head(quick: bool, work: Path) -> BenchResult:
    import ray

    from archipelago.orchestrator.runtime.driver import on_pythonpath

    rows = QUICK_ROWS if quick else ROWS
    work.mkdir(parents=True, exist_ok=True)
    rates = codec_rates(2_000_000 if quick else 25_000_000)  # before any process of a run shares the cores
    ray.shutdown()
    cluster = _cluster(rows)
    try:
        with on_pythonpath(str(Path(__file__).resolve().parents[2])):
            ray.init(address=cluster.address, log_to_driver=False)
        link = probe_link_gbps()
        methods = {row.name: run_row(row, work, link["gbps"]) for row in rows}
    finally:
        ray.shutdown()
        cluster.shutdown()
    checks = {
        **{
            f"{name}: measured / planned round in 0.75-1.33": {
                "value": m["ratio"],
                "ok": 0.75 <= m["ratio"] <= 1.33,
            }
            for name, m in methods.items()
        },
        **{
            f"{name}: head bytes / planned within 5%": {
                "value": m["bytes_ratio"],
                "ok": abs(m["bytes_ratio"] - 1) <= 0.05,
            }
            for name, m in methods.items()
        },
        **checkpoint_check(methods),
    }
    return BenchResult(
        scenario="head",
        quick=quick,
        methods=methods,
        summary=f"head: {targets_met(checks)}; link {link['gbps']:.1f} Gbit/s (loopback through Ray's object manager)",
        markdown=_markdown(methods, link, checks, rates),
        panels=[_panel(methods)],
        extra={"checks": checks, "link": link, "codec_rates": rates, "rows": _rows(rows, methods)},
    )


def _rows(rows: tuple[Row, ...], methods: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row as it was asked for beside what it measured and what its plan said (`params`,
    `phases`, `measured_seconds`, `planned_seconds`, `head_bytes`, `planned_head_bytes` …), one
    object a row for a reader of the JSON; `rounds` is the count asked for, the rounds one by one
    stay under `methods`."""
    return [{**asdict(r), **{k: v for k, v in methods[r.name].items() if k != "rounds"}} for r in rows]


def checkpoint_check(methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A round with a checkpoint at most 1.1× a round without: the round of the run without
    checkpoints plus what checkpoints added to the other run's rounds, per checkpoint (the
    whole difference, whichever round the writes ended in), over that round. The quick rows
    have no such pair: nothing is checked."""
    if CHECKPOINT_ROW not in methods or PLAIN_ROW not in methods:
        return {}
    plain = methods[PLAIN_ROW]["measured_seconds"]
    extra = (methods[CHECKPOINT_ROW]["measured_seconds"] - plain) * CHECKPOINT_EVERY
    ratio = (plain + extra) / plain
    return {
        f"{CHECKPOINT_ROW}: a round with a checkpoint written <= 1.1x one without (against {PLAIN_ROW})": {
            "value": ratio,
            "ok": ratio <= 1.1,
        }
    }


def _panel(methods: dict[str, dict[str, Any]]) -> Panel:
    """Measured against planned round seconds, a point per row (x: the row's parameters)."""
    return Panel(
        x_label="parameters",
        y_label="seconds per round",
        curves={
            "measured": [(m["params"], m["measured_seconds"]) for m in methods.values()],
            "planned": [(m["params"], m["planned_seconds"]) for m in methods.values()],
        },
        log_x=True,
    )


def _checkpoint_cell(m: dict[str, Any]) -> str:
    if m["checkpoint_round_ratio"] is None:
        return "n/a"
    c, h = m["checkpoint_round_split"]["compute"], m["checkpoint_round_split"]["head"]
    return (
        f"{m['checkpoint_round_ratio']:.2f} (compute {c['writing']:.2f} / {c['plain']:.2f}, "
        f"head {h['writing']:.2f} / {h['plain']:.2f})"
    )


def _markdown(
    methods: dict[str, dict[str, Any]],
    link: dict[str, float],
    checks: dict[str, dict[str, Any]],
    rates: dict[str, dict[str, float]],
) -> str:
    rows = []
    for name, m in methods.items():
        p, q = m["phases"], m["planned_phases"]
        rows.append(
            [
                name,
                f"{m['params'] / 1e6:.1f} M",
                str(m["islands"]),
                str(m["slices"]),
                m["codec"],
                f"{m['measured_seconds']:.2f}",
                f"{m['planned_seconds']:.2f}",
                f"{m['ratio']:.2f}",
                f"{p['compute']:.2f}",
                f"{m['head_seconds']:.2f} / {m['planned_head_seconds']:.2f}",
                f"{p.get('step', 0):.3f} / {q['outer_step'] + q['codec']:.3f}",
                f"{p['checkpoint_write']:.2f} ({p.get('checkpoint', 0):.2f} waited)",
                f"{m['head_bytes'] / 1e6:,.1f} / {m['planned_head_bytes'] / 1e6:,.1f}",
                _checkpoint_cell(m),
            ]
        )
    table = md_table(
        [
            "row",
            "params",
            "islands",
            "slices",
            "codec",
            "round s",
            "planned s",
            "ratio",
            "compute s",
            "head s (measured / planned)",
            "outer step s (measured / planned, with the codec's)",
            "checkpoint write s",
            "head MB a round (measured / planned)",
            "checkpoint round / plain (compute s, head s: writing / plain)",
        ],
        rows,
    )
    return "\n\n".join(
        [
            f"A `ray.cluster_utils.Cluster` on this machine: the head node runs the driver and the "
            f"coordinator only, each island has a node of one CPU, each coordinator slice a slice node (no CPU, "
            f"one `{SLICE_RESOURCE}`). The link between nodes was probed at "
            f"{link['down']:.1f} Gbit/s head to island and {link['up']:.1f} back (a 256 MB object through "
            f"Ray's object store; on one host that is loopback, not a network card) and the plan priced at "
            f"{link['gbps']:.1f}. The plan's round is the islands' measured compute plus its head phases "
            "(fan-in, outer step, fan-out, the checkpoint's share); evaluation on the coordinator overlaps "
            f"the islands' compute in `diloco` and is not priced. The first {WARM_ROUNDS} rounds are warm-up and left out.",
            table,
            checks_table(checks),
            "The codecs' prices on the head (one thread, seconds per value, ns shown; the plan's "
            "`DECODE_S_PER_VALUE`/`ENCODE_S_PER_VALUE` quote them):",
            md_table(
                ["codec", "decode ns/value (per island)", "encode ns/value (once a version)"],
                [[c, f"{rates['decode'][c] * 1e9:.2f}", f"{rates['encode'][c] * 1e9:.2f}"] for c in rates["decode"]],
            ),
        ]
    )
