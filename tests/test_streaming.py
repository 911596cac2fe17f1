"""Streaming DiLoCo and the downlink, without Ray: fragments, the staggered schedule, the
published copy islands and coordinator share, bytes per direction, and the limits of
the config. (Membership changes and faults with fragments in flight run in
test_engine.py, where the fault tests are parametrised over the modes, streaming too.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import ConfigError
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.workers.runtime.island import Island
from archipelago.workers.runtime.rounds import EagerSteps
from archipelago.workers.wire.compress import encode
from archipelago.workers.wire.fragments import fragment_model
from archipelago.workers.wire.messages import WorkKind, WorkOrder
from archipelago.workers.wire.sync import Change, ChangeOutOfOrder
from tests.helpers import NO_WARM, TINY_LM, in_process_engine, load_scenario
from tests.toy_tasks import SplitPoint

QUADRATIC = [
    "task.factory=tests.toy_tasks:make_quadratic",
    "task.kwargs.centers=[[1.0,0.0,2.0,-1.0],[-0.5,2.0,0.0,1.0]]",
    "task.kwargs.split=true",
    NO_WARM,
    "islands.count=2",
    "rounds=5",
    "inner_steps=4",
    "inner.optimizer=sgd",
    "inner.lr=0.1",
    "inner.warmup_steps=0",
    "inner.grad_clip=null",
    "checkpoint.every_rounds=0",
]


def _cfg(*overrides: str, base: list[str] = QUADRATIC) -> RunConfig:
    return load_scenario([*base, *overrides])


def _gpt(*overrides: str) -> RunConfig:
    return _cfg("task.kwargs.n_layers=4", "rounds=3", "inner_steps=8", *overrides, base=[*TINY_LM, "islands.count=2"])


# -- fragments ----------------------------------------------------------------------------------


class _Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.head = nn.Linear(8, 3)


def test_fragments_stride_over_blocks_and_pour_the_rest_evenly():
    model = _Stack(4)
    f = fragment_model(model, 2)
    offsets, at = {}, 0
    for name, p in model.named_parameters():
        offsets[name] = (at, at + p.numel())
        at += p.numel()
    assert np.array_equal(np.sort(np.concatenate(f.index)), np.arange(at))  # every position once
    for b in range(4):  # block b in fragment b mod 2
        lo, hi = offsets[f"blocks.{b}.weight"]
        assert np.isin(np.arange(lo, hi), f.index[b % 2]).all()
    assert abs(f.size(0) - f.size(1)) <= 1  # the embedding and head split to balance them


def test_too_many_fragments_for_the_model_is_a_clear_error():
    with pytest.raises(ValueError, match="fill only 2 fragments"):
        fragment_model(SplitPoint(2, torch.float64), 3)


# -- exactness --------------------------------------------------------------------------------------


def _final(cfg: RunConfig) -> torch.Tensor:
    engine, _ = in_process_engine(cfg)
    engine.execute()
    return engine.flat.data.clone()


def test_one_fragment_without_overlap_or_merge_is_diloco_exactly():
    """P = 1, τ = 0, α = 0: one fragment replaced at every outer step is DiLoCo, to the bit."""
    diloco = _final(_cfg("mode=diloco"))
    streaming = _final(_cfg("mode=streaming", "mode.fragments=1", "mode.tau=0", "mode.alpha=0"))
    assert torch.equal(diloco, streaming)


def test_the_schedule_staggers_fragments_and_each_is_stepped_every_round():
    cfg = _cfg("mode=streaming", "mode.fragments=2", "inner_steps=8", "mode.tau=1")
    engine, pool = in_process_engine(cfg)
    summary = engine.execute()
    # segment t sends fragment (t - 1) mod 2, H/P = 4 steps each, Δ taken τ = 1 step early
    for island in (0, 1):
        orders = [o for o in pool.dispatched if o.island == island]
        assert [o.fragment for o in orders] == [t % 2 for t in range(10)]
        assert all(o.steps == 4 and o.send_after == 3 for o in orders)
    assert summary["outer_steps"] == 10 and summary["rounds_done"] == 5
    assert {k: v["applied"] for k, v in summary["fragments"].items()} == {"0": 10, "1": 10}
    assert all(v["staleness_max"] == 0 for v in summary["fragments"].values())


@pytest.mark.parametrize(("tau", "hidden"), [(0, False), (3, True)])
def test_tau_steps_hide_a_fragment_exchange_on_the_run_s_clock(tau, hidden):
    """Segments of 4 one-second steps (virtual clock) over a link of 1.5 s each way: with
    τ = 0 every segment waits 3 s for its exchange; with τ = 3 the pseudo-gradient leaves
    after the segment's first step and the merged fragment is back as it ends."""
    cfg = _cfg(
        "mode=streaming",
        "mode.fragments=2",
        "inner_steps=8",
        f"mode.tau={tau}",
        "simulation.link.latency_ms=1500",
        "simulation.link.bandwidth_gbps=1000",
    )
    engine, _ = in_process_engine(cfg)
    summary = engine.execute()
    compute = 10 * 4  # 10 segments of 4 steps
    if hidden:  # only the first download of the model shows
        assert summary["clock_seconds"] == pytest.approx(compute + 1.5)
    else:
        assert summary["clock_seconds"] == pytest.approx(compute + 10 * 3.0)


def _copies(engine) -> dict[int, torch.Tensor]:
    """The coordinator's published copy after every change (keyed by version)."""
    copies = {0: engine.publisher.downlink.copy.clone()}
    step = engine.publisher.downlink.step

    def recording(version, params, fragment):
        change = step(version, params, fragment)
        copies[version] = engine.publisher.downlink.copy.clone()
        return change

    engine.publisher.downlink.step = recording
    return copies


QUORUM_FRAGMENTS = ["mode=streaming", "mode.pacing=quorum", "mode.quorum=1", "mode.dylu=false"]


@pytest.mark.parametrize(
    "mode",
    [["mode=streaming"], ["mode=diloco"], ["mode=overlap"], [*QUORUM_FRAGMENTS, "simulation.slowdown=[1,3]"]],
    ids=["streaming", "diloco", "overlap", "streaming_quorum"],
)
def test_islands_hold_exactly_the_coordinators_published_copy_under_a_lossy_downlink(mode):
    cfg = _gpt(*mode, "compression.codec=int4", "compression.downlink=int4")
    engine, pool = in_process_engine(cfg)
    copies = _copies(engine)
    summary = engine.execute()
    assert summary["state"] == "finished"
    for island in pool.islands.values():
        assert island.held is not None and island.held >= summary["outer_steps"] - 2
        assert torch.equal(island.copy, copies[island.held])  # bit for bit: never drift
    # the copy follows the outer parameters to within what int4 rounds away
    gap = (copies[summary["outer_steps"]] - engine.flat.data).abs().max()
    assert 0 < gap < 0.05 * engine.flat.data.abs().max()


def test_a_lossless_streaming_copy_is_the_outer_parameters():
    cfg = _gpt("mode=streaming")
    engine, _ = in_process_engine(cfg)
    engine.execute()
    assert torch.equal(engine.publisher.downlink.copy, engine.flat.data)


@pytest.mark.parametrize(
    ("mode", "every_version"),
    [
        (["mode=streaming"], False),
        (["mode=diloco", "compression.downlink=int4"], False),
        (["mode=diloco"], True),
        (["mode=overlap", "compression.downlink=int4"], True),
    ],
    ids=["streaming", "lossy_downlink", "full_downlink", "lagged"],
)
def test_the_full_copy_is_put_only_when_an_island_needs_it(mode, every_version, monkeypatch):
    engine, pool = in_process_engine(_gpt(*mode))
    put: list[int] = []
    publish = pool.publish
    monkeypatch.setattr(pool, "publish", lambda version, params: put.append(version) or publish(version, params))
    summary = engine.execute()
    assert summary["state"] == "finished"
    if every_version:  # islands take the full parameters, or a lagged round may start from the one before
        assert put == list(range(summary["outer_steps"] + 1))
    else:  # islands follow the copy by changes: only their first download needs it whole
        assert put == [0]
    # the publisher holds the current version only, and the one before only under a lag
    held = sorted(engine.publisher.refs)
    assert held == ([summary["outer_steps"] - 1, summary["outer_steps"]] if "mode=overlap" in mode else held[-1:])


def test_each_change_is_shared_once_however_many_islands_take_it(monkeypatch):
    engine, pool = in_process_engine(_gpt("mode=streaming", "islands.count=3"))
    shared: list[int] = []
    share = pool.share
    monkeypatch.setattr(pool, "share", lambda change: shared.append(change.version) or share(change))
    summary = engine.execute()
    assert shared == list(range(1, summary["outer_steps"] + 1))  # one per version, not one per island
    taken = [c for order in pool.dispatched for c in order.changes]
    assert len(taken) > len(shared) and {c.version for c in taken} <= set(shared)


def test_an_island_refuses_a_change_it_already_applied_or_one_that_skips():
    cfg = _gpt("mode=streaming", "compression.downlink=int8", "mode.tau=0")
    island = Island(island_spec(cfg, 0))
    params = island.flat.numpy()
    part = encode(np.full(island.fragments.size(0), 0.01, np.float32), "int8", 64)
    change = Change(version=1, fragment=0, payload=part, absolute=False)
    with pytest.raises(ChangeOutOfOrder, match="holds no copy"):  # a change needs a copy to change
        island.run(
            WorkOrder(
                island=0,
                ticket=0,
                version=1,
                kind=WorkKind.TRAIN,
                steps=2,
                shards={0: 0},
                fragment=0,
                changes=(change,),
            ),
            None,
        )
    island.run(
        WorkOrder(island=0, ticket=0, version=0, kind=WorkKind.TRAIN, steps=2, shards={0: 0}, fragment=0), params
    )
    island.run(
        WorkOrder(
            island=0, ticket=1, version=1, kind=WorkKind.TRAIN, steps=2, shards={0: 2}, fragment=1, changes=(change,)
        ),
        None,
    )
    before = island.copy.clone()
    with pytest.raises(ChangeOutOfOrder):  # version 1 again: it would be applied twice
        island.run(
            WorkOrder(
                island=0,
                ticket=2,
                version=1,
                kind=WorkKind.TRAIN,
                steps=2,
                shards={0: 4},
                fragment=1,
                changes=(change,),
            ),
            None,
        )
    with pytest.raises(ChangeOutOfOrder):  # version 3 from 1: version 2 would be skipped
        island.run(
            WorkOrder(
                island=0,
                ticket=2,
                version=3,
                kind=WorkKind.TRAIN,
                steps=2,
                shards={0: 4},
                changes=(Change(version=3, fragment=0, payload=part, absolute=False),),
            ),
            None,
        )
    assert torch.equal(island.copy, before)


# -- bytes ------------------------------------------------------------------------------------------


def test_streaming_moves_a_fragment_at_a_time_and_4_bits_both_ways():
    diloco = in_process_engine(_gpt("mode=diloco"))[0].execute()
    fp32 = in_process_engine(_gpt("mode=streaming"))[0].execute()
    fp4 = in_process_engine(_gpt("mode=streaming", "compression.codec=int4", "compression.downlink=int4"))[0].execute()
    numel = diloco["num_params"]
    assert diloco["peak_exchange_bytes"] == 2 * 4 * numel  # the model up and down
    assert fp32["peak_exchange_bytes"] <= diloco["peak_exchange_bytes"] / 4 * 1.01  # balanced fragments
    assert fp32["bytes_sent"] == diloco["bytes_sent"]  # P fragments a round: the model once
    assert fp4["peak_exchange_bytes"] < diloco["peak_exchange_bytes"] / 4 / 7
    assert fp4["bytes_sent"] < diloco["bytes_sent"] / 7
    # received: the first full download (a bootstrap) plus 4-bit changes
    assert fp4["bytes_received"] < 2 * 4 * numel + diloco["bytes_received"] / 7
    for s in (diloco, fp32, fp4):
        assert s["final_eval_loss"] < s["initial_eval_loss"]


# -- bad updates and config -----------------------------------------------------------------------


def test_a_nan_fragment_is_rejected_and_its_fragment_untouched():
    cfg = _cfg("mode=streaming", "mode.fragments=2", "mode.tau=0", "robust.quarantine_after=5")
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.NAN, i, order=3) for i in (0, 1)])
    engine.start()
    while engine.run.closes < 2:
        engine.step()
    before = engine.flat.data.clone()
    while engine.run.closes < 3:  # segment 3 (fragment 0): both updates NaN
        engine.step()
    assert torch.equal(engine.flat.data, before) and engine.run.version == 2
    while engine.step():
        pass
    assert torch.isfinite(engine.flat.data).all() and engine.summary["state"] == "finished"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mode=streaming", "inner_steps=10", "mode.fragments=4"], "multiple of mode.fragments"),
        (["mode=streaming", "inner_steps=8", "mode.fragments=4", "mode.tau=2"], "shorter than a segment"),
        (["mode=streaming", "coordinator.shards=2"], "coordinator.shards = 1"),
        (["mode=ddp", "compression.downlink=int8"], "DiLoCo-family mode"),
        (["compression.downlink=int3"], r"(?s)compression\.downlink.*unknown codec .int3."),
    ],
)
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)


# -- eager updates (overlap) -------------------------------------------------------------------------


def test_eager_overlap_starts_each_lagged_round_from_the_islands_own_update():
    cfg = _gpt("mode=overlap", "mode.eager=true", "mode.clip=0.001", "rounds=4")
    engine, pool = in_process_engine(cfg)
    summary = engine.execute()
    # rounds 1 and 2 start from versions 0 and 1 (nothing in flight), rounds 3 and 4 lag
    for island in (0, 1):
        assert [o.eager for o in pool.dispatched if o.island == island] == [False, False, True, True]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    # the start of an eager round: the lagged version moved by lr x clip(Λ Δ_own)
    island = Island(island_spec(cfg, 0))
    params = island.flat.numpy()
    island.run(WorkOrder(island=0, ticket=0, version=0, kind=WorkKind.TRAIN, steps=3, shards={0: 0}), params)
    assert isinstance(island.rounds, EagerSteps) and island.rounds.last_delta is not None
    own = island.rounds.last_delta.clone()
    island.run(
        WorkOrder(island=0, ticket=1, version=0, kind=WorkKind.TRAIN, steps=3, shards={0: 3}, eager=True), params
    )
    lr, clip = cfg.mode.lr, cfg.mode.clip
    expected = torch.from_numpy(params) - lr * own.clamp(-clip, clip)
    assert torch.allclose(island.start, expected, atol=1e-7) and (own.abs() > clip).any()


def test_a_live_change_of_h_must_keep_whole_segments():
    from archipelago.orchestrator.engine.commands import SettingsUpdate
    from archipelago.orchestrator.engine.policies import check_settings

    cfg = _cfg("mode=streaming", "mode.fragments=4", "inner_steps=8")
    with pytest.raises(ValueError, match=r"multiple of mode\.fragments = 4"):
        check_settings(cfg, SettingsUpdate(inner_steps=10), 3)
    check_settings(cfg, SettingsUpdate(inner_steps=12, outer_lr=0.5), 3)
    check_settings(_cfg("mode=diloco"), SettingsUpdate(inner_steps=10), 3)


def test_a_full_version_is_copied_into_the_buffer_the_island_holds():
    """Each full version (a joining island, a restart, one too far behind for changes) lands
    in the copy the island already holds: no new buffer a version, and on a GPU one
    host-to-device copy rather than a copy to the device and a second one there."""
    cfg = _gpt("mode=diloco", "compression.downlink=int4")
    island = Island(island_spec(cfg, 0))
    first = island.flat.numpy().copy()
    island.run(WorkOrder(island=0, ticket=0, version=0, kind=WorkKind.TRAIN, steps=1, shards={0: 0}), first)
    held = island.copy.data_ptr()
    second = first + np.float32(0.5)
    second.setflags(write=False)  # as Ray's object store hands it over
    island.run(WorkOrder(island=0, ticket=1, version=3, kind=WorkKind.TRAIN, steps=1, shards={0: 1}), second)
    assert island.copy.data_ptr() == held and island.held == 3
    assert np.array_equal(island.copy.numpy(), second)  # the version itself, not a view that moves
