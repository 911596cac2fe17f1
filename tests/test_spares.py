"""Hot spares (`elastic.spares`): placed and built beside the target, given no work; a
failed, hung or preempted island's place goes to one at once, at the run's place in the lr
schedule, and a new spare is placed behind it — each batch still trained exactly once."""

from __future__ import annotations

import math

import pytest

from archipelago.orchestrator.bench.simulation.chaos import Strike, TimedFault
from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind, InProcessPool
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.commands import Drain, Preempt, Refused
from archipelago.orchestrator.engine.fleet.fleet import FailurePolicy, Retire, ScalingPolicy
from archipelago.orchestrator.engine.outcomes import Place, Promote, Release, StartDrain
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.orchestrator.engine.state.membership import Membership
from archipelago.orchestrator.engine.types import IslandState
from archipelago.workers.runtime.island import Island
from archipelago.workers.runtime.optim import join_factor
from tests.engine_scenarios import CENTERS, check_exactly_once, check_rounds_recorded, drive, scenario_cfg
from tests.helpers import events, in_process_engine

MODES = ["diloco", "sync_dylu", "overlap", "async", "quorum", "streaming", "streaming_quorum"]


def _members(target: int, states: dict[int, IslandState], pending: tuple[int, ...] = ()) -> Membership:
    m = Membership(target)
    for i, state in states.items():
        m.add(i, f"n{i}", state=state)
    m.pending.update({i: 0.0 for i in pending})
    return m


def test_the_scaling_policy_promotes_spares_into_a_short_target_and_places_new_spares_behind():
    T, S = IslandState.TRAINING, IslandState.SPARE
    policy = ScalingPolicy(abandon=False, spares=2)
    # island 1 is gone: spare 3 (the lowest) takes its place, a new spare is placed behind
    m = _members(3, {0: T, 2: T, 3: S, 4: S})
    assert policy.decide(m, busy=set()) == [Promote(island=3), Place(island=5)]
    # one placement already coming makes up the spare: nothing more is placed
    m = _members(3, {0: T, 2: T, 3: S, 4: S}, pending=(5,))
    assert policy.decide(m, busy=set()) == [Promote(island=3)]
    # the target lowered by two: the spares beyond two go first (highest index), then live islands drain
    m = _members(2, {0: T, 1: T, 2: T, 3: S, 4: S, 5: S})
    assert policy.decide(m, busy=set()) == [
        Release(island=5, state=IslandState.DRAINED),
        StartDrain(island=2),
        Release(island=2, state=IslandState.DRAINED),
    ]
    # without spares, the policy is what it was: a shortfall places, a surplus drains
    bare = ScalingPolicy(abandon=False, spares=0)
    assert bare.decide(_members(3, {0: T, 2: T}), busy=set()) == [Place(island=3)]
    assert bare.decide(_members(1, {0: T, 1: T}), busy={1}) == [StartDrain(island=1)]
    # a spare that dies held no place and no work: released, the target kept, no restart halt
    retire = FailurePolicy(replace_dead=False, restart_s=60.0).decide(S, IslandState.DEAD)
    assert retire == Retire(state=IslandState.DEAD, replace=True)


class _Timed(InProcessPool):
    """Remembers when (virtual clock) each island was first given work."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first_work: dict[int, float] = {}

    def dispatch(self, order, params, changes=()) -> None:
        self.first_work.setdefault(order.island, self.t)
        super().dispatch(order, params, changes)


def _engine(cfg, **pool):
    from archipelago.orchestrator.engine.build import build_engine

    p = _Timed(cfg, **pool)
    return build_engine(cfg, p, "local"), p


@pytest.mark.parametrize("mode", MODES)
def test_a_crash_a_hang_and_a_preemption_hand_their_places_to_spares_at_once_in_every_mode(tmp_path, mode):
    """Placements take 30 simulated s (training starts then); spares take the places of the
    preempted and the crashed island at once (and of the hung one once it is declared; one
    seen late first keeps its place through the grace). Each batch is trained once, every
    round recorded, and a new spare is asked for behind each (heartbeats on, as shipped)."""
    chaos = [
        TimedFault(at=32.5, kind=Strike.PREEMPT, notice=0.5),
        TimedFault(at=36.5, kind=Strike.CRASH),
        TimedFault(at=41.5, kind=Strike.HANG),
    ]
    cfg = scenario_cfg(
        tmp_path, mode, "rounds=12", "elastic.spares=3", "elastic.placement_timeout_s=500", heartbeats=True
    )
    engine, _ = _engine(cfg, step_s=1.0, chaos=chaos, chaos_seed=3, join_s=30.0)
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    check_rounds_recorded(cfg, engine.summary)
    log = events(cfg.out_dir)
    promoted = [e["island"] for e in log if e["kind"] == "promoted"]
    released = [e["island"] for e in log if e["kind"] == "released"]
    # every island released (the preempted, the crashed, the hung once declared) handed its
    # place to a spare; a hung island seen late first (the streaming modes: its deadline
    # comes before the floor) keeps its place through the grace, past the run's end
    assert len(promoted) == len(released) and len(released) in (2, 3), [(e["kind"], e.get("island")) for e in log]
    assert len(released) == 3 or any(e["kind"] == "late" for e in log), [(e["kind"], e.get("island")) for e in log]
    assert sum(engine.summary["islands"][str(i)]["rounds_contributed"] for i in promoted) >= 1
    # no place waited for a placement: each promotion asked for a spare behind it, nothing more
    after = [e["kind"] for e in log[next(n for n, e in enumerate(log) if e["kind"] == "promoted") :]]
    assert after.count("requested") == len(promoted) and all(
        after[n + 1] == "requested" for n, kind in enumerate(after) if kind == "promoted"
    ), after
    standing = [i for i, s in engine.summary["islands"].items() if s["state"] == "spare"]
    assert all(engine.summary["islands"][i]["rounds_contributed"] == 0 for i in standing)


def test_a_spare_starts_training_at_the_failure_not_after_a_placement(tmp_path):
    """The same crash with and without a spare: the replacement's first work comes 30 s
    (its placement) later without one; with one, at the crash."""
    starts = {}
    for spares in (0, 1):
        cfg = scenario_cfg(
            tmp_path, "quorum", "rounds=20", f"elastic.spares={spares}", "elastic.placement_timeout_s=500"
        )
        engine, pool = _engine(cfg, step_s=1.0, faults=[Fault(FaultKind.CRASH, 1, order=2)], join_s=30.0)
        drive(engine)
        check_exactly_once(cfg, engine.summary)
        crash = next(e for e in events(cfg.out_dir) if e["kind"] == "crash")
        assert crash["island"] == 1
        starts[spares] = pool.first_work[3]  # the replacement (0) or the spare (1): index 3 either way
    assert starts[0] - starts[1] == pytest.approx(30.0, abs=2.0), starts


def test_a_spare_can_be_preempted_but_not_drained(tmp_path):
    """A spare whose node is reclaimed leaves and another is placed behind it (the target
    untouched); draining one would lower the target for an island that has no place in it."""
    cfg = scenario_cfg(tmp_path, "diloco", "elastic.spares=1", "rounds=4")
    engine, _ = in_process_engine(cfg, step_s=1.0)

    def act(e) -> None:
        assert isinstance(e.submit(Drain(island=3)), Refused)
        assert not isinstance(e.submit(Preempt(island=3)), Refused)

    drive(engine, at={1: act})
    check_exactly_once(cfg, engine.summary)
    islands = engine.summary["islands"]
    assert islands["3"]["state"] == "drained" and islands["4"]["state"] == "spare"
    assert engine.members.target == 3 and islands["3"]["rounds_contributed"] == 0


def test_a_restart_policy_with_a_spare_still_trains_each_batch_once(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco", "elastic.spares=1", "simulation.restart_s=5")
    engine, _ = in_process_engine(cfg, step_s=1.0, faults=[Fault(FaultKind.CRASH, 1, order=2)], join_s=3.0)
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    check_rounds_recorded(cfg, engine.summary)
    kinds = [e["kind"] for e in events(cfg.out_dir)]
    assert kinds.index("promoted") > kinds.index("crash") and "restart" in kinds


def _lr(island: Island) -> float:
    return island.optimizer.param_groups[0]["lr"]


def test_an_island_starting_its_first_work_past_where_it_was_placed_takes_the_runs_lr_and_rewarms():
    """Its lr is the run's schedule at the step its first work names, ramped over its own
    first steps (a promoted spare, a joiner). Before, an island placed at step S that was
    told step G ran at the schedule's S + G (a joiner of mode async, every island after a
    warm start), and a spare placed at step 0 never re-warmed."""
    cfg = load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_recording",
            "task.kwargs.record=lr-schedule",
            f"task.kwargs.centers={CENTERS}",
            "inner.optimizer=sgd",
            "inner.lr=1.0",
            "inner.warmup_steps=10",
            "inner.schedule=cosine",
            "rounds=10",
            "inner_steps=10",
            "elastic.join_rewarmup_steps=4",
        ],
    )
    inner, total = cfg.inner, cfg.schedule_steps
    for placed, told in ((0, 60), (30, 30), (30, 45)):
        island = Island(island_spec(cfg, 0, placed))
        island._seek_schedule(told)
        assert _lr(island) == pytest.approx(join_factor(0, told, inner, total, 4)), (placed, told)
        island.inner_steps_done = 3  # later works seek within the island's own ramp
        island._seek_schedule(told + 3)
        assert _lr(island) == pytest.approx(join_factor(3, told, inner, total, 4)), (placed, told)
    fresh = Island(island_spec(cfg, 0, 0))  # an island of the run's start is untouched
    fresh._seek_schedule(0)
    assert _lr(fresh) == pytest.approx(0.1) and not math.isclose(0.1, join_factor(0, 60, inner, total, 4))


class _Downloads(InProcessPool):
    """Remembers, per island, whether each work came with the whole parameters."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.whole: dict[int, list[bool]] = {}

    def dispatch(self, order, params, changes=()) -> None:
        self.whole.setdefault(order.island, []).append(params is not None)
        super().dispatch(order, params, changes)


@pytest.mark.parametrize("mode", ["diloco", "streaming"])
def test_where_islands_follow_a_copy_a_spare_is_kept_current_and_downloads_only_changes_when_promoted(tmp_path, mode):
    """With a compressed downlink (and in streaming) islands get changes, not versions: a
    spare takes each version's change as it comes (counted in its bytes), so its first
    work after a promotion carries no whole copy, and the run still trains each batch once
    and reaches the loss of the same run without the spare."""
    from archipelago.orchestrator.engine.build import build_engine

    finals = {}
    for spares in (0, 1):
        cfg = scenario_cfg(tmp_path, mode, "compression.downlink=int8", f"elastic.spares={spares}", "rounds=8")
        pool = _Downloads(cfg, step_s=1.0, faults=[Fault(FaultKind.CRASH, 1, order=4)])
        engine = build_engine(cfg, pool, "local")
        drive(engine)
        check_exactly_once(cfg, engine.summary)
        finals[spares] = engine.summary["final_eval_loss"]
        initial = engine.summary["initial_eval_loss"]
        if spares:
            assert [e["island"] for e in events(cfg.out_dir) if e["kind"] == "promoted"] == [3]
            assert pool.whole[3] and not pool.whole[3][0], pool.whole  # its first work: changes only
            assert engine.summary["islands"]["4"]["bytes_received"] > 0  # the new spare, kept current meanwhile
    # at least 95% of the improvement the run without the spare made (measured: 1.09x in
    # diloco, 1.05x in streaming: the spare's island trained on where the crashed one stopped)
    assert math.isfinite(finals[1]) and initial - finals[1] >= 0.95 * (initial - finals[0]), (initial, finals)
