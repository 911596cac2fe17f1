"""The modes' registry: one row per mode, each row's section a mode section of the config,
and what a row declares is what the run does (the planner's lag, the config's refusals,
the H a mode refuses at launch and live)."""

from __future__ import annotations

import pytest

from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import ConfigError, load_config
from archipelago.orchestrator.engine.commands import SettingsUpdate
from archipelago.orchestrator.engine.policies import check_settings
from archipelago.orchestrator.mode_settings import AsyncSettings, DilocoSettings, Mode, ModeSettings
from archipelago.orchestrator.modes import MODES, mode_of


def test_every_mode_has_one_row_and_its_settings_are_the_configs_mode_union():
    """The config's `mode` field is the union of the rows' settings classes, discriminated by
    `name`: each row's class is picked for its mode's name, and holds its own settings only."""
    assert list(MODES) == list(Mode)
    classes = [row.settings for row in MODES.values()]
    assert len(set(classes)) == len(classes)
    for mode, row in MODES.items():
        assert issubclass(row.settings, ModeSettings) and row.settings().name == mode
        cfg = RunConfig(mode=mode.value, inner_steps=48)
        assert type(cfg.mode) is row.settings and mode_of(cfg) is row
        assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # the union round-trips
    # a setting only another mode has is an unknown key, named with the modes that have it
    with pytest.raises(ConfigError, match=r"mode\.eager: not a setting of mode diloco \(one of mode overlap\)"):
        load_config(None, ["mode.eager=false"])
    with pytest.raises(ConfigError, match=r"mode: 'sync' is not a mode: one of async, ddp, diloco"):
        load_config(None, ["mode=sync"])


def test_the_mode_sections_of_earlier_releases_load_into_mode_with_one_warning(tmp_path, caplog):
    """A config written for the four mode sections (`asynchronous`, `diloco`, `overlap`,
    `streaming`) still loads: each setting moved to `mode` (the speeds' smoothing, which
    every mode reads, to the run's top level), one warning naming them; a setting given at
    both places is refused naming both, and one the mode has not is refused as before."""
    old = tmp_path / "old.yaml"
    old.write_text("mode: async\nasynchronous:\n  quorum: 3\n  rule: quorum\n  speed_smoothing: 0.25\n")
    with caplog.at_level("WARNING"):
        cfg = load_config(old, ["islands.count=4"])
    assert cfg.mode == AsyncSettings(quorum=3) and cfg.speed_smoothing == 0.25
    moved = [r.getMessage() for r in caplog.records if "mode sections" in r.getMessage()]
    assert len(moved) == 1 and "asynchronous.quorum as mode.quorum" in moved[0]
    assert "asynchronous.speed_smoothing as speed_smoothing" in moved[0]
    assert load_config(None, ["mode=diloco", "diloco.dylu=true", "asynchronous.max_staleness=2"]).mode == (
        DilocoSettings(dylu=True, max_staleness=2)
    )
    with pytest.raises(ConfigError, match=r"streaming\.fragments moved to mode\.fragments: give it once"):
        load_config(None, ["mode=streaming", "mode.fragments=2", "streaming.fragments=4"])
    with pytest.raises(ConfigError, match=r"mode\.quorum: not a setting of mode diloco"):
        load_config(None, ["asynchronous.quorum=2"])  # a quorum a DiLoCo run never read: refused, as before


def test_a_setting_its_mode_reads_only_with_another_is_refused_naming_both():
    with pytest.raises(
        ConfigError, match=r"mode\.quorum is set, but a run of mode streaming reads it only with mode\.pacing: quorum"
    ):
        load_config(None, ["mode=streaming", "inner_steps=48", "mode.quorum=2"])
    with pytest.raises(
        ConfigError, match=r"mode\.max_staleness is set, but a run of mode diloco reads it only with mode\.dylu: true"
    ):
        load_config(None, ["mode.max_staleness=2"])
    assert (
        load_config(None, ["mode=streaming", "inner_steps=48", "mode.pacing=quorum", "mode.quorum=2"]).mode.quorum == 2
    )


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
    from archipelago.orchestrator.bench.simulation.config import load_simulated

    with pytest.raises(ConfigError, match=r"simulation.drop_prob applies to mode diloco only"):
        load_simulated(None, [f"mode={mode.value}", "warm_start.steps=0", "simulation.drop_prob=0.1", *extra])


def test_streaming_refuses_an_h_that_breaks_its_segments_at_launch_and_when_changed_live():
    cfg = load_config(None, ["mode=streaming", "inner_steps=48", "mode.tau=5", "warm_start.steps=0"])
    check_settings(cfg, SettingsUpdate(inner_steps=96), 4)
    with pytest.raises(ValueError, match=r"must be a multiple of mode\.fragments"):
        check_settings(cfg, SettingsUpdate(inner_steps=50), 4)
    # 24 / 4 fragments = segments of 6 steps: tau 5 still fits; 16 / 4 = 4 does not
    check_settings(cfg, SettingsUpdate(inner_steps=24), 4)
    with pytest.raises(ValueError, match=r"mode\.tau = 5 must be shorter than a segment"):
        check_settings(cfg, SettingsUpdate(inner_steps=16), 4)
    with pytest.raises(ConfigError, match=r"mode\.tau = 5 must be shorter than a segment"):
        load_config(None, ["mode=streaming", "inner_steps=16", "mode.tau=5", "warm_start.steps=0"])
    diloco = load_config(None, ["warm_start.steps=0"])
    check_settings(diloco, SettingsUpdate(inner_steps=7), 4)  # no row but streaming's refuses an H


@pytest.mark.parametrize("mode", list(Mode))
def test_config_show_by_mode_lists_the_mode_settings_such_a_run_reads_and_no_other(mode, capsys):
    import yaml

    from archipelago.orchestrator.cli import main

    extra = ["--set", "inner_steps=48"] if MODES[mode].fragments else []
    assert main(["config", "show", "--mode", mode.value, "--set", "warm_start.steps=0", *extra]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["mode"]["name"] == mode.value
    cfg = load_config(None, [f"mode={mode.value}", "warm_start.steps=0", *extra[1:]])
    unread, _ = cfg.mode.unread()
    assert set(shown["mode"]) == set(type(cfg.mode).model_fields) - unread
    assert not {m.value for m in Mode} & set(shown)  # no section of another mode's
    assert shown["outer"] == cfg.outer.model_dump(mode="json")  # the rest as `config show` prints it


@pytest.mark.parametrize(
    ("overrides", "kind"),
    [
        (["mode=diloco"], "InnerSteps"),
        (["mode=ddp", "warm_start.steps=0"], "GradientStep"),
        (["mode=async"], "InnerSteps"),
        (["mode=overlap", "mode.eager=false"], "InnerSteps"),
        (["mode=overlap", "mode.eager=true"], "EagerSteps"),
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
