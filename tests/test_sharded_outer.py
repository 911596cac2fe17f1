"""A coordinator split into S shards computes exactly what one coordinator computes, for
every outer rule (float64, in-process shards; the Ray path is in test_sharded_ray.py)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from orchestrator.aggregate import Contribution
from orchestrator.config_load import load_config
from orchestrator.outer_shard import LocalShards
from workers.flat import slice_bounds
from orchestrator.overlap_server import start_version
from orchestrator.robust import NormGuard
from orchestrator.servers import build_server
from orchestrator.sharded_server import ShardedServer
from workers.compress import decode, encode

NUMEL, CHUNK = 5000, 256

RULES = {
    "diloco nesterov": ["mode=diloco"],
    "diloco sgd": ["mode=diloco", "outer.optimizer=sgd"],
    "diloco adam": ["mode=diloco", "outer.optimizer=adam", "outer.lr=0.01"],
    "diloco drop": ["mode=diloco", "outer.drop_prob=0.3"],
    "async delayed nesterov": ["mode=async", "asynchronous.c=0.2"],
    "async naive": ["mode=async", "asynchronous.rule=naive"],
    "async downweight": ["mode=async", "asynchronous.max_staleness=1", "asynchronous.stale_policy=downweight"],
    "async reject": ["mode=async", "asynchronous.max_staleness=1"],
    "overlap constant": ["mode=overlap", "overlap.momentum=0.5", "overlap.penalty_p=2", "overlap.clip=0.05"],
    "overlap adaptive": ["mode=overlap", "overlap.momentum=0.5", "overlap.penalty=adaptive"],
}


def _cfg(overrides):
    return load_config(None, [*overrides, "islands.count=3", f"compression.chunk={CHUNK}"])


def _contributions(rng, version_of, rnd, bounds):
    """Three islands' Δ for one round, one of them NaN (round 2) or 50× too large (round 4)."""
    out = []
    for i in range(3):
        delta = rng.normal(0, 0.01, NUMEL)
        if rnd == 2 and i == 1:
            delta[17] = np.nan
        if rnd == 4 and i == 2:
            delta *= 50
        whole = Contribution(i, version_of(i), decode(encode(delta)), float(10 + i))
        slices = [encode(delta[lo:hi], "none", CHUNK) for lo, hi in bounds]
        out.append((whole, Contribution(i, version_of(i), slices, float(10 + i))))
    return out


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("shards", [1, 3])
def test_sharded_outer_step_equals_one_coordinator(rule, shards):
    cfg = _cfg(RULES[rule])
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    single = build_server(cfg, init.clone(), NormGuard(cfg.robust))
    bounds = slice_bounds(NUMEL, shards, CHUNK)
    flat = init.clone()
    sharded = ShardedServer(cfg, flat, bounds, LocalShards(cfg, flat.numpy(), bounds), NormGuard(cfg.robust))
    rng = np.random.default_rng(1)
    reasons: list[str] = []
    for rnd in range(1, 9):
        if cfg.mode == "async":  # arrivals from versions a few steps back, so staleness varies
            pairs = _contributions(rng, lambda i: max(0, single.version - i), rnd, bounds)
            for whole, part in pairs:
                a, b = single.submit(whole), sharded.submit(part)
                assert a == b
                reasons += [a.reason] if a.reason else []
        elif cfg.mode == "overlap":
            v = start_version(rnd, 0)
            pairs = _contributions(rng, lambda i: v, rnd, bounds)
            a = single.close_round(rnd, [w for w, _ in pairs])
            b = sharded.close_round(rnd, [p for _, p in pairs])
            assert (a.accepted, a.rejected, a.version) == (b.accepted, b.rejected, b.version)
            assert sharded.last_gap == pytest.approx(single.last_gap, rel=1e-12)
            reasons += a.rejected.values()
        else:
            pairs = _contributions(rng, lambda i: single.version, rnd, bounds)
            a, b = single.close_round([w for w, _ in pairs]), sharded.close_round([p for _, p in pairs])
            assert (a.accepted, a.rejected, a.dropped, a.version) == (b.accepted, b.rejected, b.dropped, b.version)
            reasons += a.rejected.values()
        sharded.refresh()
        tol = 1e-12 if rule == "overlap adaptive" else 0.0  # Λ's norms are summed per shard
        assert torch.allclose(flat, single.param.detach(), rtol=0, atol=tol), rule
    assert sharded.version == single.version and sharded.lr() == pytest.approx(single.lr())
    assert any("non-finite" in r for r in reasons) and any("median" in r for r in reasons), reasons


def test_shard_state_round_trips_through_a_checkpoint():
    cfg = _cfg(RULES["diloco nesterov"])
    bounds = slice_bounds(NUMEL, 2, CHUNK)
    flat = torch.randn(NUMEL, dtype=torch.float64)
    server = ShardedServer(cfg, flat, bounds, LocalShards(cfg, flat.numpy(), bounds), None)
    rng = np.random.default_rng(0)
    for rnd in range(3):
        server.close_round([p for _, p in _contributions(rng, lambda i: server.version, 1, bounds)])
    server.refresh()
    state, saved = copy.deepcopy(server.state_dict()), flat.clone()  # as torch.save would
    flat2 = saved.clone()
    other = ShardedServer(cfg, flat2, bounds, LocalShards(cfg, torch.zeros(NUMEL, dtype=torch.float64).numpy(),
                                                          bounds), None)
    other.load_state_dict(state)
    pairs = _contributions(rng, lambda i: 3, 1, bounds)
    server.close_round([p for _, p in pairs])
    other.close_round([p for _, p in pairs])
    server.refresh()
    other.refresh()
    assert other.version == 4 and torch.equal(flat, flat2)


def test_slices_align_to_codec_chunks_and_cover_the_vector():
    for numel, s in ((5000, 3), (100, 4), (4096 * 7 + 5, 2)):
        bounds = slice_bounds(numel, s, 256)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
        assert all(lo % 256 == 0 for lo, _ in bounds)
