"""Config loading: YAML, dotted overrides, and errors that name the field."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from archipelago.orchestrator.cli import main
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import ConfigError, load_config


def test_defaults_are_sync_diloco_with_four_islands():
    cfg = load_config()
    assert cfg.mode.name == "diloco" and cfg.islands.count == 4
    assert (cfg.outer.optimizer, cfg.outer.lr, cfg.outer.momentum) == ("nesterov", 0.7, 0.9)
    assert cfg.task.factory == "archipelago.workers.tasks.lm_task:make_task"


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"rounds": 5, "outer": {"lr": 0.3}, "task": {"kwargs": {"d_model": 64}}}))
    cfg = load_config(path, ["outer.lr=0.5", "islands.count=2", "task.kwargs.split=non_iid"])
    assert cfg.rounds == 5 and cfg.outer.lr == 0.5 and cfg.islands.count == 2
    assert cfg.task.kwargs == {"d_model": 64, "split": "non_iid"}


@pytest.mark.parametrize(
    "override, field",
    [
        ("outer.lr=-1", "outer.lr"),
        ("islands.count=0", "islands.count"),
        ("outer.optimizer=lion", "outer.optimizer"),
        ("inner.warmup_steps=abc", "inner.warmup_steps"),
        ("outer.learning_rate=0.1", "outer.learning_rate"),
        ("task.kwargs.d_model=-3", "task.kwargs.d_model"),
        ("task.kwargs.source=s3", "task.kwargs.source"),
        ("task.factory=nosuchmodule:make", "task.factory"),
        ("task.factory=no_colon", "task.factory"),
    ],
)
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value)


def test_cross_field_rules_are_reported():
    with pytest.raises(ConfigError, match="n_heads"):
        load_config(None, ["task.kwargs.d_model=130"])
    with pytest.raises(ConfigError, match="needs a DiLoCo-family mode"):
        load_config(None, ["mode=ddp", "outer.merge=radial_directional", "warm_start.steps=0"])


def test_a_benchmarks_knobs_are_not_a_runs_and_old_configs_say_where_they_went(caplog):
    """`outer.drop_prob` and `elastic.on_failure: restart` (an ablation, the checkpoint-restart
    baseline) are a simulated fleet's now: a run's config naming them is refused with a
    pointer to `archipelago simulate`, after a warning that names where each went; the
    simulated fleet reads them there."""
    from archipelago.orchestrator.bench.simulation.config import load_simulated

    for old, new in (
        (["outer.drop_prob=0.5"], "simulation.drop_prob"),
        (["elastic.on_failure=restart", "elastic.restart_s=7"], "simulation.restart_s = 7"),
    ):
        caplog.clear()
        with pytest.raises(ConfigError, match="archipelago simulate"):
            load_config(None, old)
        assert new in caplog.text
    _, sim = load_simulated(None, ["elastic.on_failure=restart", "elastic.restart_s=7", "outer.drop_prob=0.5"])
    assert sim.restart_s == 7 and sim.drop_prob == 0.5
    _, sim = load_simulated(None, ["elastic.on_failure=continue"])
    assert sim.restart_s is None
    for gone in ("drop_prob", "on_failure", "restart_s"):
        assert gone not in str(RunConfig.model_json_schema())


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["mode=diloco", "mode.quorum=2"], "mode.quorum: not a setting of mode diloco"),  # a synchronous run has none
        (["mode=async", "mode.alpha=0.5"], "mode.alpha: not a setting of mode async (one of mode streaming)"),
        (["mode=overlap", "mode.fragments=2"], "mode.fragments: not a setting of mode overlap"),
        (["mode=ddp", "mode.eager=false"], "mode.eager: not a setting of mode ddp (one of mode overlap)"),
        (["mode=async", "mode.rule=quorum", "mode.tau=2"], "mode.tau: not a setting of mode async"),
        # a setting of the mode's that these settings do not read
        (["mode=streaming", "inner_steps=48", "mode.grace_k=1"], "mode.grace_k is set, but a run of mode streaming"),
        (["mode=diloco", "mode.max_staleness=2"], "mode.max_staleness is set, but a run of mode diloco"),
    ],
)
def test_a_setting_the_mode_never_reads_is_refused_naming_it(overrides, error):
    """A setting the run's mode has not, or reads only with another setting, is an error
    naming the field (it would otherwise be ignored without a word)."""
    with pytest.raises(ConfigError, match=re.escape(error)):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["mode=async", "mode.quorum=2", "speed_smoothing=0.2"],
        ["mode=diloco", "mode.dylu=true", "mode.max_staleness=2"],  # a DyLU barrier admits by staleness
        ["mode=streaming", "inner_steps=48", "mode.pacing=quorum", "mode.quorum=2"],
        ["mode=overlap", "mode.eager=false", "speed_smoothing=0.2"],  # every mode's speed tracker
        ["mode=ddp", "speed_smoothing=0.2"],
    ],
)
def test_settings_the_mode_reads_are_accepted(overrides):
    load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        load_config(None, ["rounds"])


def test_cli_invalid_config_exits_2_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "--set", "outer.lr=-1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "outer.lr" in err and "greater than 0" in err
    assert not out.exists()


def test_config_show_round_trips(tmp_path):
    shown = subprocess.run(
        [sys.executable, "-m", "archipelago.orchestrator.cli", "config", "show", "--set", "rounds=7"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = tmp_path / "shown.yaml"
    path.write_text(shown)
    assert load_config(path).rounds == 7


def test_the_config_validates_without_the_island_runtime_or_torch():
    """The run config imports only the island's part of the contract (`workers/wire/spec.py`),
    so validating a config (the CLI's first step) does not pay for torch."""
    probe = "import sys, archipelago.orchestrator.config as c; c.RunConfig(); print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_registered_codec_is_accepted_by_name_and_described():
    """A codec registered in `workers/wire/codecs/` needs nothing else to be usable: the
    config accepts its name in both directions and its documentation lists it."""
    from archipelago.orchestrator.config import RunConfig
    from archipelago.workers.wire.codecs import CODECS

    for name, codec in CODECS.items():
        cfg = RunConfig(compression={"codec": name, "downlink": name})
        assert cfg.compression.codec == cfg.compression.downlink == name
        assert (
            f"{name} ({codec.about})"
            in RunConfig.model_fields["compression"].annotation.model_fields["codec"].description
        )


def test_exponent_floats_are_numbers_in_files_and_overrides(tmp_path):
    """PyYAML reads `1e4` as a string: typed fields coerced it, but a task's free-form kwargs
    (an architecture's `rope_theta: 1e4`) reached transformers as the text '1e4'."""
    from archipelago.orchestrator.config_load import parse_override

    assert parse_override("task.kwargs.architecture.rope_theta=1e4")[1] == 10000.0
    assert parse_override("x=-2.5E-3")[1] == -0.0025 and parse_override("x=1e4x")[1] == "1e4x"
    path = tmp_path / "c.yaml"
    path.write_text("outer:\n  lr: 7e-1\ntask:\n  kwargs:\n    architecture: {rope_theta: 1e4}\n")
    cfg = load_config(path, [], check_task=False)
    assert cfg.outer.lr == 0.7 and cfg.task.kwargs["architecture"] == {"rope_theta": 10000.0}
    assert isinstance(cfg.task.kwargs["architecture"]["rope_theta"], float)


def test_what_the_config_derives_it_keeps_out_of_the_sections_the_user_set():
    """Auto values (`warm_start.steps: null`, `outer.merge: null`) are derived by the run's
    config, not written back into their sections: the sections say what the user set, a
    config dumped and loaded again is the same config, and the derived values follow a
    change of what they derive from."""
    from archipelago.orchestrator.config_sections import OuterMerge
    from archipelago.orchestrator.mode_settings import DilocoSettings

    cfg = load_config(None, ["mode=async", "rounds=8", "inner_steps=50"])
    assert cfg.warm_start.steps is None and cfg.outer.merge is None
    assert cfg.warm_steps == 100 and cfg.merge == OuterMerge.RADIAL_DIRECTIONAL
    again = RunConfig.model_validate(cfg.model_dump(mode="json"))
    assert again == cfg and again.warm_steps == 100
    longer = cfg.model_copy(update={"rounds": 16})
    assert longer.warm_steps == 200  # a quarter of the run, as the field says: not the value resolved before
    assert cfg.model_copy(update={"mode": DilocoSettings()}).merge == OuterMerge.MEAN  # it follows the mode
