"""The modes' registry: one row per mode, each row's section a mode section of the config,
and what a row declares is what the run does (the planner's lag, the config's refusals,
the H a mode refuses at launch and live)."""

from __future__ import annotations

import pytest

from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import ConfigError, load_config
from archipelago.orchestrator.config_sections import ModeSection
from archipelago.orchestrator.engine.commands import SettingsUpdate
from archipelago.orchestrator.engine.policies import check_settings
from archipelago.orchestrator.modes import MODES, Mode


def test_every_mode_has_one_row_and_its_section_is_a_mode_section_of_the_config():
    assert list(MODES) == list(Mode)
    fields = RunConfig.model_fields
    sections = [row.section for row in MODES.values() if row.section is not None]
    assert len(sections) == len(set(sections))
    for section in sections:
        assert issubclass(fields[section].annotation, ModeSection), section  # type: ignore[arg-type]
    # every mode section of the config belongs to a row: a section no row names is read by no run
    assert {
        n for n, f in fields.items() if isinstance(f.annotation, type) and issubclass(f.annotation, ModeSection)
    } == set(sections)


@pytest.mark.parametrize("mode", [m for m in Mode if not MODES[m].pseudo_gradients])
def test_what_needs_pseudo_gradients_is_refused_where_a_row_has_none(mode):
    for setting, needs in (
        ("coordinator.shards=2", "coordinator.shards > 1 needs a DiLoCo-family mode"),
        ("compression.downlink=int8", "compression.downlink needs a DiLoCo-family mode"),
        ("outer.merge=radial_directional", "needs a DiLoCo-family mode"),
        ("inner.optimizer=muon", "inner.optimizer muon needs a DiLoCo-family mode"),
    ):
        with pytest.raises(ConfigError, match=needs):
            load_config(None, [f"mode={mode.value}", "warm_start.steps=0", setting])


@pytest.mark.parametrize("mode", [m for m in Mode if not MODES[m].drops])
def test_dropping_updates_is_refused_where_a_row_does_not_drop(mode):
    extra = ["inner_steps=48"] if MODES[mode].fragments else []
    from archipelago.orchestrator.simulation.config import load_simulated

    with pytest.raises(ConfigError, match=r"simulation.drop_prob applies to mode diloco only"):
        load_simulated(None, [f"mode={mode.value}", "warm_start.steps=0", "simulation.drop_prob=0.1", *extra])


def test_streaming_refuses_an_h_that_breaks_its_segments_at_launch_and_when_changed_live():
    cfg = load_config(None, ["mode=streaming", "inner_steps=48", "streaming.tau=5", "warm_start.steps=0"])
    check_settings(cfg, SettingsUpdate(inner_steps=96), 4)
    with pytest.raises(ValueError, match=r"must be a multiple of streaming\.fragments"):
        check_settings(cfg, SettingsUpdate(inner_steps=50), 4)
    # 24 / 4 fragments = segments of 6 steps: tau 5 still fits; 16 / 4 = 4 does not
    check_settings(cfg, SettingsUpdate(inner_steps=24), 4)
    with pytest.raises(ValueError, match=r"streaming\.tau = 5 must be shorter than a segment"):
        check_settings(cfg, SettingsUpdate(inner_steps=16), 4)
    with pytest.raises(ConfigError, match=r"streaming\.tau = 5 must be shorter than a segment"):
        load_config(None, ["mode=streaming", "inner_steps=16", "streaming.tau=5", "warm_start.steps=0"])
    diloco = load_config(None, ["warm_start.steps=0"])
    check_settings(diloco, SettingsUpdate(inner_steps=7), 4)  # no row but streaming's refuses an H


@pytest.mark.parametrize("mode", list(Mode))
def test_config_show_by_mode_lists_the_mode_settings_such_a_run_reads_and_no_other(mode, capsys):
    import yaml

    from archipelago.orchestrator.cli import main

    extra = ["--set", "inner_steps=48"] if MODES[mode].fragments else []
    assert main(["config", "show", "--mode", mode.value, "--set", "warm_start.steps=0", *extra]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["mode"] == mode.value
    cfg = load_config(None, [f"mode={mode.value}", "warm_start.steps=0", *extra[1:]])
    reads = cfg.settings_read()
    for row in MODES.values():
        if row.section is None:
            continue
        fields = reads.get(row.section, frozenset())
        if fields is None:  # a section the run reads whole
            assert set(shown[row.section]) == set(type(getattr(cfg, row.section)).model_fields)
        elif fields:
            assert set(shown[row.section]) == fields, row.section
        else:
            assert row.section not in shown, row.section
    assert shown["outer"] == cfg.outer.model_dump(mode="json")  # the rest as `config show` prints it


@pytest.mark.parametrize(
    ("overrides", "kind"),
    [
        (["mode=diloco"], "InnerSteps"),
        (["mode=ddp", "warm_start.steps=0"], "GradientStep"),
        (["mode=async"], "InnerSteps"),
        (["mode=overlap", "overlap.eager=false"], "InnerSteps"),
        (["mode=overlap", "overlap.eager=true"], "EagerSteps"),
        (["mode=streaming", "inner_steps=48"], "FragmentSteps"),
    ],
)
def test_each_row_gives_its_islands_their_round_and_every_round_has_a_strategy(overrides, kind):
    """The island a run builds does what its mode's row says (through the spec the pool
    hands out), and no `IslandRound` lacks a strategy."""
    from archipelago.orchestrator.engine.specs import island_spec
    from archipelago.workers.runtime.rounds import ROUNDS
    from archipelago.workers.wire.spec import IslandRound

    assert set(ROUNDS) == set(IslandRound)
    spec = island_spec(load_config(None, overrides), 0)
    assert ROUNDS[spec.round].__name__ == kind
