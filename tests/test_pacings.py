"""The pacings' registry: one row per pacing, the row each mode's config selects, and each
row's declarations true of the pacing it builds."""

from __future__ import annotations

import pytest

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.commands import SettingsUpdate
from archipelago.orchestrator.engine.pacing.arrivals import PerArrival
from archipelago.orchestrator.engine.pacing.base import Barrier, FragmentSchedule, OneRoundLag
from archipelago.orchestrator.engine.pacing.quorum import Quorum
from archipelago.orchestrator.engine.pacing.registry import PACINGS, QUORUM_SETTINGS, pacing_of
from archipelago.orchestrator.engine.policies import build_policies, check_settings
from archipelago.orchestrator.engine.step.admission import BoundedStaleness, ExactVersion
from archipelago.orchestrator.modes import PacingKind

SETS = {
    PacingKind.BARRIER: (["mode=diloco"], Barrier),
    PacingKind.DYLU_BARRIER: (["mode=diloco", "mode.dylu=true"], Quorum),
    PacingKind.GRADIENTS: (["mode=ddp"], Barrier),
    PacingKind.PER_ARRIVAL: (["mode=async", "mode.rule=naive"], PerArrival),
    PacingKind.QUORUM: (["mode=async"], Quorum),
    PacingKind.ONE_ROUND_LAG: (["mode=overlap"], OneRoundLag),
    PacingKind.FRAGMENTS: (["mode=streaming", "inner_steps=48"], FragmentSchedule),
    PacingKind.FRAGMENT_QUORUM: (["mode=streaming", "inner_steps=48", "mode.pacing=quorum"], Quorum),
}


def test_every_pacing_has_one_row():
    assert set(PACINGS) == set(PacingKind) == set(SETS)


@pytest.mark.parametrize("kind", list(PacingKind))
def test_each_config_selects_its_row_and_the_row_declares_what_its_pacing_does(kind):
    sets, cls = SETS[kind]
    cfg = load_config(None, [*sets, "islands.count=4", "warm_start.steps=0"])
    row = pacing_of(cfg)
    assert row.kind == kind
    policies = build_policies(cfg, numel=8)
    assert type(policies.pacing) is cls
    staleness = type(policies.admission.staleness)
    assert staleness is (BoundedStaleness if row.bounded_staleness else ExactVersion)
    assert (policies.quorum is not None) == (row.quorum is not None)
    assert not row.live or row.quorum is not None  # live quorum settings need a quorum rule to change
    if kind not in (PacingKind.PER_ARRIVAL, PacingKind.QUORUM):  # these step per arrival: about a turn
        assert row.rounds_ahead(4) == policies.pacing.lag + 1
    else:
        assert row.rounds_ahead(4) == 5
    for setting in QUORUM_SETTINGS:
        update = SettingsUpdate(**{setting: 2 if setting == "quorum" else 1.0})
        if setting in row.live:
            check_settings(cfg, update, 4)
        else:
            with pytest.raises(ValueError, match=setting):
                check_settings(cfg, update, 4)


def test_a_quorum_pacing_shares_its_rule_with_the_engine():
    """The engine changes the rule mid-run; the pacing must see the same object."""
    cfg = load_config(None, ["mode=async", "islands.count=4", "warm_start.steps=0"])
    policies = build_policies(cfg, numel=8)
    assert isinstance(policies.pacing, Quorum) and policies.pacing.rule is policies.quorum
