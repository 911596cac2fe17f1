"""`streaming`: Streaming DiLoCo (Douillard et al. 2025) against DiLoCo, done the papers'
way (every row continues one warm start per seed, as in `quality`) under a simulated link
on which one full-model exchange (fp32 parameters down + pseudo-gradient up) takes one
round of compute (as in `overlap`).

Rows: `diloco` (fp32 both ways), `streaming_p2`, `streaming_p4` (fp32), `streaming_p4_fp4`
(FP4, E2M1 with one scale per 512 values, both ways), `diloco_int8` (int8 both ways), `overlap` (CO2) and `overlap_eager`
(CO2 with eager updates), `compute_only` (the `streaming_p4_fp4` run with no link),
`ddp_k` (data-parallel, for its bytes), and the peer `torchft_streaming_p4` when torchft
is installed. The headline rows (`diloco`, `streaming_p4_fp4`, `compute_only`) run
`SEEDS` seeds; their wall times are medians over the seeds. With the peer, one more run
(`TIMED`: the peer's work, no link, evaluated only at the end as the peer is) is set
beside it, wall against wall, with where a round's time goes (`bench/overhead.py`): the
pair is run `WALL_REPEATS` times, back to back, and the check is the median ratio.

The link is calibrated from `compute_only`, which runs first: bandwidth = 2 · fp32
parameter bytes · 8 / (its compute seconds per round).

Every row's islands load version 0 (the warm start) from storage and check its hash
(`islands.build_version0`), as the peer's replicas load it from disk, so the bytes are the
exchanges; the ratios at the shipped default, where each island downloads the model once
in fp32, are reported beside them (`bytes_vs_diloco_at_shipped_default`).
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.overhead import breakdown_table, round_breakdown
from archipelago.orchestrator.bench.quality_rows import MODEL
from archipelago.orchestrator.bench.report import (
    BenchResult,
    Panel,
    checks_table,
    eval_curve,
    link_applied,
    md_table,
    targets_met,
)
from archipelago.orchestrator.bench.runner import continue_warm, one_ray, real_link, run_methods, train_warm_start

log = logging.getLogger(__name__)

H = 100
K = 2  # no more islands than this machine's cores: compute is not contended, so wall time means something
WARM = 200
SEEDS = (0, 1, 2)
HEADLINE = ("diloco", "streaming_p4_fp4", "compute_only")
OUTER_LRS = (0.7, 1.0, 1.3)  # the headline rows each run at their best (seed 0), as the papers tune the outer step
# 4 blocks: 4 equal fragments; islands load version 0 (the warm start) from storage and check
# its hash instead of downloading it, as the peer's replicas load it from disk
BASE = [*MODEL, "task.kwargs.n_layers=4", f"ray.num_cpus={K}", "islands.build_version0=true"]
FP4 = ["compression.codec=fp4", "compression.downlink=fp4"]  # E2M1; chunk 512 (the default): one scale per 512
INT8 = ["compression.codec=int8", "compression.downlink=int8"]
TIMED = "streaming_p4_no_link_eval_at_end"  # the peer's work, timed as the peer is
WALL_REPEATS = 3  # pairs of (peer, ours) on that work, alternated
PEER = "torchft_streaming_p4"
CO2 = ["mode=overlap", "mode.lr=0.7", "mode.momentum=0.0", "mode.eager=false"]


def fragmented(p: int) -> list[str]:
    """Streaming with the product's defaults (tau a fifth of a segment, alpha 0)."""
    return ["mode=streaming", f"mode.fragments={p}"]


def methods(link: list[str], lr_diloco: float, lr_streaming: float) -> dict[str, tuple[str, list[str]]]:
    """Every row but `compute_only` (which calibrates `link`) and the peer; the DiLoCo and
    streaming rows at their tuned outer lr (Nesterov, momentum 0.9)."""
    d, s = [f"outer.lr={lr_diloco}"], [f"outer.lr={lr_streaming}"]
    return {
        "diloco": (f"DiLoCo, fp32 both ways, outer lr {lr_diloco}", ["mode=diloco", *d, *link]),
        "streaming_p2": ("Streaming DiLoCo P=2, tau 10, fp32", [*fragmented(2), *s, *link]),
        "streaming_p4": ("Streaming DiLoCo P=4, tau 5, fp32", [*fragmented(4), *s, *link]),
        "streaming_p4_fp4": (
            f"Streaming DiLoCo P=4, tau 5, FP4 (E2M1) both ways, outer lr {lr_streaming}",
            [*fragmented(4), *FP4, *s, *link],
        ),
        "diloco_int8": ("DiLoCo, int8 both ways", ["mode=diloco", *INT8, *d, *link]),
        "overlap": ("CO2 overlap (alpha 0.7), one-round lag", [*CO2, *link]),
        "overlap_eager": ("CO2 overlap with eager updates (Kale et al. 2025)", [*CO2, "mode.eager=true", *link]),
        "ddp_k": ("data-parallel, 2 islands = 2x batch, every step (no link: its bytes)", ["mode=ddp"]),
    }


def common(rounds: int, seed: int, warm: Path) -> list[str]:
    """The overrides every row shares: K islands, H, the rounds, the seed and its warm start."""
    return [f"islands.count={K}", f"inner_steps={H}", f"rounds={rounds}", f"seed={seed}", *continue_warm(WARM, warm)]


def warm_starts(base: list[str], rounds: int, seeds: tuple[int, ...], work: Path) -> dict[int, Path]:
    """One warm start per seed (this scenario's K islands, H and rounds), trained once."""
    warm_base = [*base, f"islands.count={K}", f"inner_steps={H}", f"rounds={rounds}"]
    return {s: train_warm_start(warm_base, s, WARM, work / f"warm@s{s}") for s in seeds}


def warm_runs(
    base: list[str],
    folder: str,
    desc: str,
    overrides: list[str],
    rounds: int,
    warm: dict[int, Path],
    seeds: tuple[int, ...],
    work: Path,
) -> list[dict[str, Any]]:
    """Runs `folder@s<seed>`, each continuing its seed's warm start (a finished one of the
    same config is reused)."""
    table = {f"{folder}@s{s}": (desc, [*common(rounds, s, warm[s]), *overrides]) for s in seeds}
    runs = run_methods(base, table, work)
    return [runs[f"{folder}@s{s}"] for s in seeds]


def _run(
    folder: str, desc: str, overrides: list[str], rounds: int, warm: dict[int, Path], seeds: tuple[int, ...], work: Path
) -> list[dict[str, Any]]:
    return warm_runs(BASE, folder, desc, overrides, rounds, warm, seeds, work)


def _tune(key: str, overrides: list[str], rounds: int, warm: dict[int, Path], work: Path) -> dict[float, float]:
    """Seed 0 of `key` at every outer lr: lr -> final eval loss."""
    return {
        lr: _run(f"{key}_lr{lr}", key, [*overrides, f"outer.lr={lr}"], rounds, warm, (0,), work)[0]["final_eval_loss"]
        for lr in OUTER_LRS
    }


def streaming(quick: bool, work: Path) -> BenchResult:
    with one_ray(K):
        return _streaming(quick, work)


def _streaming(quick: bool, work: Path) -> BenchResult:
    rounds = 3 if quick else 8
    seeds = (0,) if quick else SEEDS
    warm = warm_starts(BASE, rounds, seeds, work)
    bandwidth, compute_per_round = _calibrate(rounds, warm, work)
    link = real_link(bandwidth)
    sweep = {
        "diloco": _tune("diloco", ["mode=diloco", *link], rounds, warm, work),
        "streaming_p4_fp4": _tune("streaming_p4_fp4", [*fragmented(4), *FP4, *link], rounds, warm, work),
    }
    best = {key: min(losses, key=losses.__getitem__) for key, losses in sweep.items()}
    table = methods(link, best["diloco"], best["streaming_p4_fp4"])
    table["compute_only"] = (
        "the streaming_p4_fp4 run with no link (compute only)",
        [*fragmented(4), *FP4, f"outer.lr={best['streaming_p4_fp4']}"],
    )
    folders = {name: name for name in table}
    folders.update({key: f"{key}_lr{lr}" for key, lr in best.items()})  # seed 0 is the sweep's run
    runs = {
        name: _run(folders[name], desc, overrides, rounds, warm, seeds if name in HEADLINE else seeds[:1], work)
        for name, (desc, overrides) in table.items()
    }
    results = {name: _result(table[name], summaries) for name, summaries in runs.items()}
    breakdown, peer, ratios = _against_peer(quick, rounds, warm, seeds, best["streaming_p4_fp4"], work)
    if peer is not None:
        results[PEER] = peer
    compute_only = results["compute_only"]["wall_seconds"]
    for r in results.values():
        r["wall_vs_compute_only"] = r["wall_seconds"] / compute_only
    checks = _checks(results)
    if ratios:
        ratio = statistics.median(ratios)
        checks[f"no_link_wall_le_torchft (same work, same evaluation; median of {len(ratios)} alternations)"] = {
            "value": ratio,
            "ok": ratio <= 1.0,
        }
    r = results
    line = (
        f"streaming: P=4 fp4 {r['streaming_p4_fp4']['final_eval_loss']:.4f} vs DiLoCo {r['diloco']['final_eval_loss']:.4f} "
        f"(means of {len(seeds)} seeds), {r['diloco']['bytes_communicated'] / r['streaming_p4_fp4']['bytes_communicated']:.1f}x "
        f"fewer bytes, peak {r['diloco']['peak_exchange_bytes'] / r['streaming_p4_fp4']['peak_exchange_bytes']:.1f}x lower, "
        f"wall {r['streaming_p4_fp4']['wall_vs_compute_only']:.2f}x compute-only; {targets_met(checks)}"
    )
    first = {name: work / f"{folders[name]}@s{seeds[0]}" for name in runs}
    curves = {name: eval_curve(first[name], runs[name][0], "tokens_total") for name in runs if name != "ddp_k"}
    walls = {name: eval_curve(first[name], runs[name][0], "train_seconds") for name in runs}
    return BenchResult(
        "streaming",
        quick,
        results,
        line,
        _markdown(results, checks, rounds, seeds, bandwidth, compute_per_round, sweep, breakdown, ratios),
        [Panel("tokens (after the warm start)", curves), Panel("train seconds (wall-clock)", walls)],
        extra={
            "checks": checks,
            "outer_lr_sweep": {k: {str(lr): v for lr, v in losses.items()} for k, losses in sweep.items()},
            "link_bandwidth_gbps": bandwidth,
            "compute_seconds_per_round": compute_per_round,
            "warm_start": {"steps": WARM, "mode": "ddp", "islands": K},
            "round_breakdown": breakdown,
            "no_link_wall_vs_torchft_runs": ratios,  # ours ÷ the peer's, each pair run back to back
            # DiLoCo's bytes ÷ each row's with the k fp32 first downloads of the shipped default added
            "bytes_vs_diloco_at_shipped_default": shipped_default_ratios(results, first_downloads(results)),
        },
    )


def _calibrate(rounds: int, warm: dict[int, Path], work: Path) -> tuple[float, float]:
    """The link's bandwidth (Gb/s) and the compute's seconds per round, from the streaming
    run with no link: a full exchange (down and up) takes one round's compute."""
    calibration = _run("calibration", "", [*fragmented(4), *FP4], rounds, warm, (0,), work)[0]
    compute_per_round = calibration["compute_seconds"] / rounds
    params_bytes = calibration["num_params"] * 4
    return 2 * params_bytes * 8 / (compute_per_round * 1e9), compute_per_round


def _against_peer(
    quick: bool, rounds: int, warm: dict[int, Path], seeds: tuple[int, ...], lr: float, work: Path
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[float]]:
    """The peer's work with no link, evaluating once at the end as the peer does: ours and
    the peer's alternated `WALL_REPEATS` times (one pair swings by ±5 %). The round
    breakdown and the peer's row of the pair of the median ratio, and every pair's ratio
    (ours ÷ the peer's wall); none without the peer."""
    timed = [*fragmented(4), f"outer.lr={lr}", f"eval_every={rounds}"]
    pairs = []
    for rep in range(1 if quick else WALL_REPEATS):
        peer = _peer(rounds, warm, seeds[:1], lr)
        if peer is None:
            break
        folder = TIMED if rep == 0 else f"{TIMED}_r{rep}"
        ours = _run(folder, "streaming_p4 with no link, evaluated at the end only", timed, rounds, warm, (0,), work)
        pairs.append((round_breakdown(ours[0], peer, rounds), peer))
    if not pairs:
        return None, None, []
    ratios = [b["archipelago"]["wall"] / b["peer"]["wall"] for b, _ in pairs]
    breakdown, peer = pairs[sorted(range(len(pairs)), key=ratios.__getitem__)[len(pairs) // 2]]
    return breakdown, peer, ratios


def _result(described: tuple[str, list[str]], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    desc, overrides = described
    losses = [s["final_eval_loss"] for s in summaries]
    walls = [s["train_seconds"] for s in summaries]
    first = summaries[0]
    return {
        "description": desc,
        "overrides": overrides,
        "final_eval_loss": statistics.fmean(losses),
        "final_eval_loss_seeds": losses,
        "final_eval_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "wall_seconds": statistics.median(walls),
        "wall_seconds_runs": walls,
        **{
            k: first[k]
            for k in (
                "bytes_communicated",
                "bytes_sent",
                "bytes_received",
                "peak_exchange_bytes",
                "bytes_bootstrap",
                "num_params",
                "compute_seconds",
                "idle_fraction",
                "outer_steps",
                "tokens",
            )
        },
    }


def _peer(rounds: int, warm: dict[int, Path], seeds: tuple[int, ...], lr: float) -> dict[str, Any] | None:
    """torchft's Streaming DiLoCo with the `streaming_p4` settings; None, logged, when
    torchft is not installed."""
    try:
        from archipelago.orchestrator.bench.peer import torchft_diloco
    except ImportError as err:
        log.warning("peer row skipped: %s (pip install -e 'orchestrator/bench[peer]')", err)
        return None
    overrides = [f"islands.count={K}", f"inner_steps={H}", f"rounds={rounds}", *fragmented(4), f"outer.lr={lr}"]
    peer = torchft_diloco(BASE, overrides, K, warm, seeds, WARM)
    half = peer["bytes_communicated"] // 2  # a ring all-reduce: as much in as out
    return {
        **peer,
        "bytes_bootstrap": 0,  # its replicas load the warm start from disk
        "bytes_sent": half,
        "bytes_received": half,
        "peak_exchange_bytes": None,  # not measured: torchft does not report it
        "wall_seconds": peer["train_seconds"],
        "wall_seconds_runs": [peer["train_seconds"]],
    }


def first_downloads(r: dict[str, dict[str, Any]]) -> int:
    """The bytes of the shipped default's first downloads: each of the K islands the model in fp32."""
    return K * 4 * r["diloco"]["num_params"]


def shipped_default_ratios(r: dict[str, dict[str, Any]], download: int) -> dict[str, float]:
    """DiLoCo's bytes ÷ each of our rows' had every island downloaded version 0 in fp32
    (the shipped `islands.build_version0: false`): `download` more bytes in every row.
    Not the peer's: its replicas load the warm start from disk whatever our default."""
    base = r["diloco"]["bytes_communicated"] + download
    return {name: base / (m["bytes_communicated"] + download) for name, m in r.items() if name not in ("diloco", PEER)}


def _pct(a: float, b: float) -> float:
    return 100 * (a / b - 1)


def _checks(r: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    d, s4 = r["diloco"], r["streaming_p4_fp4"]
    int8, ddp = r["diloco_int8"], r["ddp_k"]
    applied, link = link_applied(d["wall_vs_compute_only"], 1.0)  # one fp32 exchange takes a round
    checks = {
        applied: link,
        "streaming_p4_fp4_within_1pct_of_diloco": {
            "value": _pct(s4["final_eval_loss"], d["final_eval_loss"]),
            "ok": s4["final_eval_loss"] <= 1.01 * d["final_eval_loss"],
        },
        "peak_exchange_le_1/P_of_diloco (fp32, P=4)": {
            "value": r["streaming_p4"]["peak_exchange_bytes"] / d["peak_exchange_bytes"],
            "ok": r["streaming_p4"]["peak_exchange_bytes"] <= d["peak_exchange_bytes"] / 4,
        },
        "fp4_total_bytes_ge_7x_fewer_than_diloco": {
            "value": d["bytes_communicated"] / s4["bytes_communicated"],
            "ok": d["bytes_communicated"] >= 7 * s4["bytes_communicated"],
        },
        "fp4_total_bytes_ge_300x_fewer_than_ddp": {
            "value": ddp["bytes_communicated"] / s4["bytes_communicated"],
            "ok": ddp["bytes_communicated"] >= 300 * s4["bytes_communicated"],
        },
        "fp4_wall_le_1.05x_compute_only": {
            "value": s4["wall_vs_compute_only"],
            "ok": s4["wall_vs_compute_only"] <= 1.05 and link["ok"],
        },
        "int8_both_ways_bytes_ge_3.5x_fewer": {
            "value": d["bytes_communicated"] / int8["bytes_communicated"],
            "ok": d["bytes_communicated"] >= 3.5 * int8["bytes_communicated"],
        },
        "int8_loss_within_1pct": {
            "value": _pct(int8["final_eval_loss"], d["final_eval_loss"]),
            "ok": int8["final_eval_loss"] <= 1.01 * d["final_eval_loss"],
        },
        "eager_beats_co2_lag": {
            "value": r["overlap_eager"]["final_eval_loss"] - r["overlap"]["final_eval_loss"],
            "ok": r["overlap_eager"]["final_eval_loss"] < r["overlap"]["final_eval_loss"],
        },
    }
    peer = r.get(PEER)
    if peer is not None:
        gap = _pct(peer["final_eval_loss"], r["streaming_p4"]["final_eval_loss"])
        checks["torchft_streaming_within_1pct_of_ours"] = {"value": gap, "ok": abs(gap) <= 1.0}
    return checks


def _table(r: dict[str, dict[str, Any]]) -> str:
    """One row per method: its loss over the seeds, its bytes against DiLoCo's, its wall."""

    def loss(m: dict[str, Any]) -> str:
        n = len(m["final_eval_loss_seeds"])
        return f"{m['final_eval_loss']:.4f}" + (f" ± {m['final_eval_loss_std']:.4f} ({n})" if n > 1 else "")

    d = r["diloco"]
    rows = [
        [
            f"`{name}`",
            m["description"],
            loss(m),
            f"{_pct(m['final_eval_loss'], d['final_eval_loss']):+.2f}%",
            f"{m['bytes_sent'] / 1e6:.2f}",
            f"{m['bytes_received'] / 1e6:.2f}",
            f"{d['bytes_communicated'] / m['bytes_communicated']:.1f}×",
            f"{m['peak_exchange_bytes'] / 1e6:.3f}" if m.get("peak_exchange_bytes") is not None else "",
            f"{m['wall_seconds']:.1f}",
            f"{m['wall_vs_compute_only']:.2f}×",
        ]
        for name, m in r.items()
    ]
    header = [
        "method",
        "what",
        "final eval loss (mean ± sd, seeds)",
        "vs diloco",
        "MB sent",
        "MB received",
        "diloco bytes / bytes",
        "peak MB per exchange",
        "wall s",
        "vs compute-only",
    ]
    return md_table(header, rows)


def _context(
    r: dict[str, dict[str, Any]],
    sweep: dict[str, dict[float, float]],
    breakdown: dict[str, dict[str, float]] | None,
    ratios: list[float],
) -> str:
    """What the table's bytes leave out (the first downloads), the lr grid, and the walls
    beside the peer's."""
    download = first_downloads(r)  # the k fp32 first downloads of the shipped default
    shipped = shipped_default_ratios(r, download)
    context = (
        f"\n\nEvery row's islands load version 0 (the warm start) from storage and check its hash "
        f"(`islands.build_version0`), as the peer's replicas load it from disk: bytes at the start "
        f"{max(m.get('bytes_bootstrap') or 0 for m in r.values())} in every row, so the bytes above are the "
        f"exchanges. At the shipped default (`build_version0: false`) each island downloads the model once in fp32, "
        f"{download / 1e6:.2f} MB in all, the same in every row: then `streaming_p4_fp4` moves "
        f"{shipped['streaming_p4_fp4']:.1f}× fewer bytes than DiLoCo and `diloco_int8` "
        f"{shipped['diloco_int8']:.2f}× (computed: the bytes above plus those downloads). The download's share "
        f"shrinks as a run gets longer."
    )
    tuned = "; ".join(
        f"`{key}` " + ", ".join(f"lr {lr}: {loss:.4f}" for lr, loss in losses.items()) for key, losses in sweep.items()
    )
    context += f"\n\nOuter Nesterov lr (momentum 0.9) tried on seed 0, the best kept for every seed: {tuned}."
    if breakdown is not None:
        context += (
            f"\n\nThe walls side by side on the peer's work (`streaming_p4`, seed 0, no link; `{TIMED}` is ours "
            "evaluating only at the end, as the peer does; the rows above evaluate every round, on the same two "
            f"cores the islands train on). Ours ÷ torchft's wall, each pair run back to back, {len(ratios)} "
            f"pairs: {', '.join(f'{r:.3f}×' for r in ratios)}; the pair of the median, and the peer row "
            "above, is this one. Where a round's time goes:\n\n" + breakdown_table(breakdown, "torchft")
        )
    return context


def _markdown(
    r: dict[str, dict[str, Any]],
    checks: dict[str, dict[str, Any]],
    rounds: int,
    seeds: tuple[int, ...],
    bandwidth: float,
    compute: float,
    sweep: dict[str, dict[float, float]],
    breakdown: dict[str, dict[str, float]] | None,
    ratios: list[float],
) -> str:
    return (
        f"GPT d=64, 4 layers, context 64, batch 16 per island, {K} islands (no more than this machine's cores), "
        f"H = {H}, {rounds} rounds after a shared warm start ({WARM} data-parallel steps) per seed; headline rows "
        f"run seeds {list(seeds)}. Simulated link {bandwidth * 1000:.2f} Mbit/s: one fp32 full-model exchange "
        f"(parameters down + pseudo-gradient up) takes one round of compute ({compute:.1f} s). Bytes per island "
        f"link, both directions (nothing downloaded at the start: below). Peak: the most "
        f"bytes one island moved for one piece of work (what it received for it plus what it sent).\n\n"
        + _table(r)
        + _context(r, sweep, breakdown, ratios)
        + "\n\n"
        + checks_table(checks)
    )
