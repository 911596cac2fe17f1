"""What a coordinator checkpoint holds of a running engine, and putting it back.

Only committed work is captured — results waiting for their outer step and work in
flight are redone by a restarted coordinator — so nothing is lost or counted twice. The
file format and its integrity are `engine/state/checkpoints.py`'s."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from archipelago.workers.wire.flat import FlatParams

from ...config import RunConfig
from ...config_load import upgraded as upgraded_config
from ..fleet.island_states import IslandStates
from ..pacing.base import Pacing
from ..pacing.quorum import QuorumRule
from ..state.checkpoints import PARTS, Location
from ..state.flights import Flight, RunState
from ..state.ledger import DataLedger
from ..state.membership import Membership
from ..state.stats import RunStats
from ..step.admission import Admission
from ..step.outer import Outer
from ..types import RunFailed
from ..work.publisher import Publisher

FORMAT = 2  # the checkpoint's layout: 2, each part's `state_dict()` under its own key (`upgraded` reads 1)
# settings a checkpoint must share with the run resuming it (as the config has them, dotted)
RESUMABLE = ("mode.name", "data_shards")


def _setting(data: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        data = data.get(key) if isinstance(data, dict) else None  # type: ignore[assignment]
    return data


@dataclass(kw_only=True, eq=False)
class RunCore:
    """The parts of a round engine a checkpoint captures and restores (a `RoundEngine` is
    one; `build.assemble` restores into them before the rest of the engine is built)."""

    cfg: RunConfig
    run_id: str
    flat: FlatParams
    outer: Outer
    admission: Admission
    members: Membership
    ledger: DataLedger
    run: RunState
    stats: RunStats
    pacing: Pacing
    publisher: Publisher
    states: IslandStates
    quorum: QuorumRule | None  # the quorum pacing's live settings (None: another pacing)


def capture(engine: RunCore, flights: dict[int, Flight], location: Location, name: str) -> dict[str, Any]:
    """Everything a restarted coordinator needs (tensors and plain values only). Tensors
    are the live ones, not copies, so the head holds the state once, not twice, while it
    checkpoints: the file is written on a thread of its own while the engine goes on, and
    nothing changes those tensors before the write has ended (`Outputs.fence`, before the
    next outer step). The plain values are copied here, on the engine's thread: the ledger
    and the members change with every dispatch and arrival during the write. `flights`:
    the work out and waiting, not captured (its results' steps are taken off the
    completed ones). `location` and `name`: where the checkpoint goes, for the parts an
    outer step split over slices writes beside it from their own nodes (then neither its
    parameters nor its state pass through the coordinator)."""
    beside = engine.outer.save_beside(location, name)
    if beside is None:
        engine.outer.copy_to(engine.flat.data)
        params, outer, parts = engine.flat.data.detach(), engine.outer.state_dict(), {}
    else:
        params, (outer, written) = None, beside
        parts = {PARTS: written}
    uncommitted = sum(f.result.steps for f in flights.values() if f.result is not None)
    return _containers_copied(
        {
            **parts,
            "format": FORMAT,
            "run_id": engine.run_id,
            "branch": engine.cfg.checkpoint.resume_from,  # resumed from a chosen checkpoint: its number
            "config": engine.cfg.model_dump(mode="json"),
            "params": params,
            "version": engine.run.version,
            "outer": outer,
            **{name: part.state_dict() for name, part in _parts(engine).items()},
            "completed_steps": engine.run.completed_steps - uncommitted,
            # what an operator changed mid-run (H, the quorum rule's settings; the outer lr is
            # in the outer optimizer's state): the restarted coordinator's config has the old values
            "settings": {
                "inner_steps": engine.run.inner_steps,
                "hang_after_steps": engine.run.hang_after_steps,
                "quorum": dataclasses.asdict(engine.quorum) if engine.quorum is not None else None,
            },
            "island_states": engine.states.kept(engine.members),  # every inner-state file a kept checkpoint names
        }
    )


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _parts(engine: RunCore) -> dict[str, Stateful]:
    """The parts saved as their own `state_dict()` under these keys (the outer step's needs
    the version it resumes at, and the parameters and the run's own numbers are plain)."""
    return {
        "admission": engine.admission,
        "membership": engine.members,
        "ledger": engine.ledger,
        "counters": engine.stats,
    }


def upgraded(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint in this release's layout: one written before `format` 2 kept the
    membership's three entries at the top level; one written before the mode sections
    moved into `mode` saved its config with them."""
    if state.get("format", 1) < 2:
        state = {**state, "membership": {k: state[k] for k in ("members", "retired", "target") if k in state}}
    # its config as this release writes one (the mode sections moved into `mode`)
    return {**state, "config": upgraded_config(copy.deepcopy(state["config"]))}


def _containers_copied(value: Any) -> Any:
    """`value` with every dict, list and tuple in it copied, its tensors and scalars shared."""
    if isinstance(value, dict):
        return {k: _containers_copied(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_containers_copied(v) for v in value)
    return value


def restore(engine: RunCore, state: dict[str, Any]) -> None:
    """Put a captured state back into a freshly built engine of the same run (in this
    release's layout or an older one: `upgraded`)."""
    state = upgraded(state)
    saved, cfg = state["config"], engine.cfg
    now = cfg.model_dump(mode="json")
    for key in RESUMABLE:
        if _setting(saved, key) != _setting(now, key):
            raise RunFailed(
                f"the checkpoint in {cfg.checkpoint_dir} is of a run with {key} = {_setting(saved, key)!r}, "
                f"this run has {_setting(now, key)!r}: resume with the same config or another path"
            )
    engine.flat.load(state["params"])
    engine.publisher.restored()
    run = engine.run
    run.version = run.base = run.closes = state["version"]
    engine.outer.load_state_dict(state["outer"], state["version"])
    for name, part in _parts(engine).items():
        part.load_state_dict(state[name])
    run.completed_steps = state["completed_steps"]
    engine.states.load(state.get("island_states", []))  # absent from a checkpoint older than it
    # an operator's mid-run change survives a restart of the same config; a config that
    # changes the setting itself (a resume with a new file) wins over the checkpoint's
    settings = state.get("settings", {})  # absent from a checkpoint older than it
    if "inner_steps" in settings and saved.get("inner_steps") == cfg.inner_steps:
        run.inner_steps = settings["inner_steps"]
    # (a live threshold exists only where the config had heartbeats: the same config has them)
    if (
        settings.get("hang_after_steps")
        and saved.get("elastic", {}).get("hang_after_steps") == cfg.elastic.hang_after_steps
    ):
        run.hang_after_steps = settings["hang_after_steps"]
    if engine.quorum is not None and settings.get("quorum"):
        was = saved["mode"]
        kept = {k: v for k, v in settings["quorum"].items() if was.get(k) == now["mode"].get(k)}
        engine.quorum.restore(kept)
    engine.pacing.resume(run, engine.stats.rounds_done)
