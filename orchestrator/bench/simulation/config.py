"""The simulated fleet's settings, read beside a run's config, never inside it.

`load_simulated` reads one config file and `--set` list as `archipelago run` does and takes
the `simulation` section (or `simulation.*` settings) out before the run's config sees them:
the product's `RunConfig` has no simulation field, and a config with one is refused by the
product with a pointer here.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import Field, ValidationError, field_validator, model_validator

from archipelago.orchestrator.bench.simulation.links import LinkConfig
from archipelago.orchestrator.config import AUTO_SHARDS, RunConfig
from archipelago.orchestrator.config_load import (
    SIMULATION,
    ConfigError,
    format_error,
    read_config_data,
    validate_config,
)
from archipelago.orchestrator.config_sections import Strict
from archipelago.orchestrator.engine.policies import Ablation
from archipelago.orchestrator.modes import mode_of, modes_where


class Clock(str, Enum):
    VIRTUAL = "virtual"  # nothing sleeps: time is simulated (`virtual_step_s`)
    REAL = "real"  # the islands' own pace, and every price waited for on the real clock


VIRTUAL_ONLY = ("slowdown", "virtual_step_s", "speed_noise", "replacement_speed")  # a simulated pace


class ReplacementSpeed(str, Enum):
    FULL = "full"
    REPLACED = "replaced"


class SimulationConfig(Strict):
    """A fleet on one machine — slower islands, slow links, a shared head and a virtual
    clock — so modes can be compared under the conditions of a real one. The islands really
    train; only time is simulated, by the pools of this package. Not part of a run's config
    (`RunConfig` has no such section): `archipelago simulate`, the benches and the tests read
    it beside one (`load_simulated`)."""

    link: LinkConfig = Field(
        default_factory=LinkConfig, description="every island's link to the coordinator (both directions)"
    )
    links: list[LinkConfig] | None = Field(
        None, description="one link per initial island instead; joiners and replacements use `link`"
    )
    nominal_params: int | None = Field(
        None,
        ge=1,
        description="price every transfer on the links as if the model had this many parameters (its bytes "
        "scaled by nominal / actual, so a codec's ratio holds): a small model trains while its exchanges cost "
        "what a large one's would. The byte counts stay the bytes that moved",
    )
    slowdown: list[float] | None = Field(
        None,
        description="one factor >= 1 per initial island stretching every inner step (2 = half speed); "
        "joiners and replacements run at 1",
    )
    virtual_step_s: float = Field(
        1.0,
        gt=0,
        description="the virtual clock: island i's inner step takes virtual_step_s x its slowdown simulated "
        "seconds and nothing sleeps; results are taken in the order of their simulated finish times and the "
        "run's clock (deadlines, links, clock_seconds) is simulated, while the islands really train",
    )
    clock: Clock = Field(
        Clock.VIRTUAL,
        description="virtual: time is simulated (virtual_step_s, slowdown) and nothing sleeps, so a fleet is "
        "measured exactly on a contended machine; real (on Ray): the islands train at their own pace and every "
        "price (the links, the head's card and step) is waited for, so the wall time holds them as a real "
        "fleet's does — what a benchmark of hidden communication times; the settings of a simulated pace "
        "(slowdown, virtual_step_s, speed_noise, replacement_speed) need the virtual clock",
    )
    head_gbps: float | None = Field(
        None,
        gt=0,
        description="the head's network card, shared by every transfer in and out of the coordinator (one card "
        "per coordinator slice: each slice on a node of its own); null: each island's link is its own",
    )
    price_head: bool = Field(
        False,
        description="charge the coordinator's outer step (merge and outer optimizer) and its checkpoints at the "
        "rates measured on a CPU head (`orchestrator/plan/head.py`), at nominal_params: the version is ready "
        "only when the head is done, and the head does one thing at a time",
    )
    ddp_overlap: bool = Field(
        False,
        description="data-parallel as PyTorch DDP runs it: the gradient's bucketed all-reduce overlapped with "
        "backward, by the better of a ring and a tree; false: a ring all-reduce after the step",
    )
    speed_noise: float = Field(
        0.0,
        ge=0,
        description="the spread (sigma of a log-normal of mean 1) of every speed the engine measures: an "
        "island's probe and each work's compute seconds; its true pace is unchanged",
    )
    drop_prob: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="an ablation: the outer step leaves out each pseudo-gradient it admitted with this "
        "probability (the DiLoCo paper's dropped updates); modes whose outer step may drop",
    )
    restart_s: float | None = Field(
        None,
        ge=0,
        description="the checkpoint-restart baseline (a job restarted by Ray Train): every island failure "
        "halts the whole fleet this long and gives up every island's work not yet stepped; null: the fleet "
        "goes on as the product's does",
    )
    strike_idle: bool = Field(
        False,
        description="timed failures strike any island alive, working or not (a machine fails whether or not it "
        "computes: one waiting at a barrier or in data-parallel's all-reduce too); false: only an island with "
        "work due, a strike finding none passing harmlessly",
    )
    replacement_speed: ReplacementSpeed = Field(
        ReplacementSpeed.FULL,
        description="full: an island placed after the start (a replacement, a joiner) runs at speed 1; "
        "replaced: at the speed of the node the last released island had (the cluster gives its node back)",
    )

    @field_validator("slowdown")
    @classmethod
    def _factors(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(f < 1 for f in v):
            raise ValueError("slowdown factors must be >= 1")
        return v

    @model_validator(mode="after")
    def _paced_by_the_clock(self) -> SimulationConfig:
        if self.clock == Clock.REAL and (paced := sorted(set(VIRTUAL_ONLY) & self.model_fields_set)):
            raise ValueError(
                f"{', '.join(paced)}: a simulated pace needs clock virtual (on clock real islands train at their own)"
            )
        return self

    def ablation(self) -> Ablation:
        """What this fleet's run changes in the run's decisions (the engine's seam for it)."""
        return Ablation(drop_prob=self.drop_prob, restart_s=self.restart_s)

    def check_islands(self, count: int) -> None:
        """One entry per initial island in each per-island list."""
        for name, entries in (("slowdown", self.slowdown), ("links", self.links)):
            if entries is not None and len(entries) != count:
                raise ValueError(f"simulation.{name} has {len(entries)} entries for {count} islands (islands.count)")

    def slowdown_of(self, index: int) -> float:
        """Island `index`'s factor; islands past the list (joiners, replacements) run at full speed."""
        s = self.slowdown
        return s[index] if s and index < len(s) else 1.0

    def virtual_seconds(self, index: int, steps: int) -> float:
        """Simulated seconds of `steps` inner steps of island `index` under the virtual clock."""
        return steps * self.virtual_step_s * self.slowdown_of(index)

    def link_of(self, index: int) -> LinkConfig:
        """Island `index`'s link; islands past `links` (joiners, replacements) use `link`."""
        return self.links[index] if self.links and index < len(self.links) else self.link


def load_simulated(
    path: str | Path | None = None, overrides: list[str] | None = None, check_task: bool = True
) -> tuple[RunConfig, SimulationConfig]:
    """The run's config and its simulation from one file and `--set` list; ConfigError
    naming the field if either is wrong."""
    data = read_config_data(path, overrides or [])
    raw = data.pop(SIMULATION, None) or {}
    cfg = validate_config(data, check_task)
    try:
        sim = SimulationConfig.model_validate(raw)
        sim.check_islands(cfg.islands.count)
        if sim.drop_prob and not mode_of(cfg).drops:
            raise ValueError(f"simulation.drop_prob applies to mode {modes_where(lambda m: m.drops)} only")
    except ValidationError as err:
        raise ConfigError(format_error(err, SIMULATION)) from err
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return cfg, sim


def reference() -> str:
    """The settings' table of `docs/simulation.md` (a test compares it with the page)."""
    from archipelago.orchestrator.config_docs import field_table

    return "\n".join(field_table(f"{SIMULATION}.", SimulationConfig)[0])


def planned_head(cfg: RunConfig, sim: SimulationConfig, *, slice_nodes: int = 0) -> RunConfig:
    """`cfg` with the slices and codecs it leaves `auto` chosen as a run's plan chooses them
    (`plan/head.py:choose_head`), at the simulated head's card (else an
    island's link) and the nominal size (else the model's own, as the plan measures it),
    on a fleet with `slice_nodes` nodes for coordinator slices (each a card of the link's
    speed and a CPU of its own)."""
    if not cfg.codecs_left_to_plan and cfg.coordinator.shards != AUTO_SHARDS:
        return cfg
    from archipelago.orchestrator.plan.cache import model_memory
    from archipelago.orchestrator.plan.head import choose_head

    params = sim.nominal_params or model_memory(cfg).params
    gbps = sim.head_gbps or sim.link.gbps
    for choice in choose_head(cfg, params, link_gbps=gbps, step_s=sim.virtual_step_s, offered=slice_nodes):
        if choice is not None:
            cfg = choice.apply(cfg)
    return cfg
