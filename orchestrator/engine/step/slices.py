"""The outer step split over S coordinator slices (`coordinator.shards` > 1), the ZeRO idea
applied to the outer step: each slice owns a contiguous part of the vector and of the
outer optimizer state, pulls its part of every island's pseudo-gradient straight from
the island's object store, and reports a few numbers per update (size, finiteness,
squared norm) for admission. No process but a slice ever holds a whole pseudo-gradient.
Every outer rule is elementwise apart from norms, so S slices compute what one
coordinator does (tested bit for bit). A merge that reads whole-vector norms (RDA) gets
them as exact sums (`ExactSum`, a few scalars per update) that add up over the slices to
the bits one coordinator measures: each island's norm from `inspect`, the merged
direction's from `direct`; the coordinator turns them into one factor every slice scales
its part by."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from archipelago.workers.wire.compress import PayloadError, check_payload, decode
from archipelago.workers.wire.sync import Change

from ...algorithms.aggregate import (
    ExactSum,
    all_finite,
    exact_sqnorm,
    radial_scale,
    radial_terms,
    sqnorm,
)
from ...config import RunConfig
from ...config_sections import OuterMerge
from ..state.checkpoints import Location, part_name, save_part
from ..types import Contribution
from .admission import Facts
from .downlink import Downlink, SlicedDownlink
from .outer import (
    MERGES,
    Commit,
    OuterRule,
    OuterStep,
    Prefill,
    Proposal,
    as_tensor,
)


@dataclass(frozen=True)
class SliceStats:
    size: int
    finite: bool
    sqnorm: float
    exact: ExactSum | None = None  # the slice's part of ‖Δ‖² where the merge reads whole norms


class OuterSlice:
    """One coordinator slice: a contiguous part [lo, hi) of the vector with its part of the
    outer state. An update takes two calls: `inspect` decodes the islands' slices and
    returns their stats, then `close` averages and steps the admitted ones. Where the
    merge is the plain mean, `inspect` takes the mean of all of them in the pass that
    measures them (as `LocalOuter` does), and `close` steps on it if admission admitted
    exactly those weights at that scale."""

    def __init__(
        self,
        rule: OuterRule,
        bounds: tuple[int, int],
        params: np.ndarray,
        threads: int = 1,
        downlink: tuple[str, int] | None = None,
    ) -> None:
        """`downlink`: (codec, chunk) where islands hold a published copy that changes keep
        up to date (`compression.downlink`): this slice keeps its part of it."""
        torch.set_num_threads(threads)
        self.lo, self.hi = bounds
        self.param = torch.from_numpy(np.array(params))  # a private copy
        self.step = OuterStep(self.param, rule)
        # its part of the copy; the change it made last leaves as this call's answer (an
        # object in its node's store under Ray), so none is kept here
        self.downlink = Downlink(self.param, *downlink, None, keep=1) if downlink is not None else None
        self.pending: dict[int, list[tuple[int, np.ndarray]]] = {}
        # the update whose merge the mean buffer holds: its direction (`direct`), then scaled
        self.directed: int | None = None
        self.merged: int | None = None

    def inspect(
        self, key: int, parts: list[tuple[int, Any]], weights: dict[int, float], scale: float = 1.0
    ) -> list[SliceStats]:
        """Each part's stats; a part that does not decode to this slice's size (it came from
        an island's object store, unscreened) is reported as unfit, never raised: admission
        then rejects that island's update as misshapen. `weights`: each island's token
        weight, and `scale` the pacing's, for the step taken in the same pass."""
        decoded: list[tuple[int, np.ndarray]] = []
        unfit: set[int] = set()
        for i, p in parts:
            try:
                check_payload(p, self.hi - self.lo)
            except PayloadError:
                unfit.add(i)
                continue
            decoded.append((i, decode(p)))
        self.pending[key] = decoded
        exact: dict[int, ExactSum] = {}
        if self.step.prefills and not unfit and decoded and all(weights[i] > 0 for i, _ in decoded):
            ordered = sorted(decoded, key=lambda part: part[0])  # as `_parts`
            sq = [0.0] * len(ordered)
            self.step.mean.fill([(d, weights[i]) for i, d in ordered], sq, scale, owner=self._fill(key, weights, scale))
            sqs = {i: q for (i, _), q in zip(ordered, sq)}
        elif self.step.merge.exact_norms:
            exact = {i: exact_sqnorm(d, self.step.norm_rows) for i, d in decoded}
            sqs = {i: float(e) for i, e in exact.items()}
        else:
            sqs = {i: sqnorm(d) for i, d in decoded}
        found = dict(decoded)
        return [
            SliceStats(0, False, math.nan)
            if i in unfit
            else SliceStats(found[i].size, all_finite(found[i], sqs[i]), sqs[i], exact.get(i))
            for i, _ in parts
        ]

    @staticmethod
    def _fill(key: int, weights: dict[int, float], scale: float) -> Prefill:
        return Prefill(key=key, weights=dict(weights), scale=scale)

    def _holds(self, key: int, weights: dict[int, float], scale: float) -> bool:
        """Whether the mean buffer holds update `key`'s mean at exactly these weights and scale."""
        return self.step.mean.owner == self._fill(key, weights, scale)

    def direct(self, key: int, along: dict[int, float]) -> ExactSum:
        """RDA's direction over this slice: the mean of the updates weighted by `along`
        (w_i/‖Δ_i‖ from the whole norms; islands with 0 left out, in island order as one
        coordinator takes them) into the buffer, and its part of the direction's ‖·‖²."""
        ordered = sorted(self.pending[key], key=lambda part: part[0])
        self.directed, self.merged = key, None
        return self.step.mean.direction([(d, along.get(i, 0.0)) for i, d in ordered], self.step.norm_rows)

    def _scaled(self, key: int, factor: float) -> None:
        """The buffer holds `key`'s merge: its direction × `factor` (once, whichever call
        comes first)."""
        if self.merged == key:
            return
        if self.directed != key:
            raise ValueError(f"update {key}: no direction taken to scale")
        self.step.mean.sum.mul_(factor)
        self.directed, self.merged = None, key

    def _parts(self, key: int, weights: dict[int, float], keep: bool = False) -> list[tuple[np.ndarray, float]]:
        parts = self.pending[key] if keep else self.pending.pop(key)
        # in island order, not arrival order: float sums depend on their order (`LocalOuter`)
        return [(d, weights[i]) for i, d in sorted(parts, key=lambda part: part[0]) if i in weights]

    def gap_terms(
        self, key: int, weights: dict[int, float], anchor: int, scale: float, factor: float | None = None
    ) -> tuple[float, float] | None:
        """This slice's parts of the anchored gap penalty's norms; `factor`: the merge across
        slices' scale of the direction `direct` left (RDA), else the merge is taken here
        (or was, while inspecting)."""
        if factor is None:
            held = self._holds(key, weights, scale) and scale == 1.0  # the penalty reads the unscaled mean
            return self.step.gap_terms(None if held else self._parts(key, weights, keep=True), anchor)
        self._scaled(key, factor)
        return self.step.gap_terms(None, anchor)

    def close(
        self,
        key: int,
        weights: dict[int, float],
        scale: float,
        anchor: int | None,
        norms: tuple[float, float] | None,
        factor: float | None = None,
    ) -> float | None:
        """Step the admitted updates; `norms`: the anchored gap penalty's, over every slice
        (each slice computes the same Λ from them); `factor`: as for `gap_terms`."""
        if factor is not None:
            self._scaled(key, factor)
            self.pending.pop(key)
            self.merged = None
            return self.step.apply(None, scale, anchor, norms)
        if self._holds(key, weights, scale):
            self.pending.pop(key)
            return self.step.apply(None, 1.0, anchor, norms)
        return self.step.apply(self._parts(key, weights), scale, anchor, norms)

    def discard(self, key: int) -> None:
        self.pending.pop(key, None)
        self.directed = self.merged = None

    def anchor(self, version: int, keep_from: int) -> None:
        self.step.anchor(version, keep_from)

    def params(self) -> np.ndarray:
        return self.param.numpy()

    def change(self, version: int) -> tuple[Change, int]:
        """Its part's change of the published copy to `version` (after the step that made
        it), encoded here on its own node, and its bytes; islands apply it at its span.
        Under Ray the two are separate returns: the change stays in this node's store, the
        coordinator fetches only the count."""
        assert self.downlink is not None, "a slice keeps a part of the copy only where islands hold one"
        change = self.downlink.step(version, self, None)
        return replace(change, span=(self.lo, self.hi)), change.nbytes

    def copy(self) -> np.ndarray:
        """Its part of the published copy, as a joining island takes it whole."""
        assert self.downlink is not None
        return self.downlink.copy.numpy()

    def reset_copy(self) -> None:
        """After a restore: its part of the copy is its parameters."""
        if self.downlink is not None:
            self.downlink.reset(self.param)

    def set_lr(self, lr: float) -> None:
        self.step.set_lr(lr)

    def lr(self) -> float:
        return self.step.lr()

    def state_dict(self) -> dict[str, Any]:
        return self.step.state_dict()

    def save(self, location: str, name: str) -> dict[str, Any]:
        """This slice's parameters and outer state written from its own node as part `name`
        beside a checkpoint in `location`; the record the checkpoint keeps of it. Calls
        to a slice are taken one at a time, so the state it writes is the one the
        checkpoint was captured at: the next step's calls wait for the write."""
        state = {"params": self.step.param.detach(), "outer": self.step.state_dict(), "bounds": [self.lo, self.hi]}
        return {"name": name, "sha256": save_part(location, name, state), "bounds": [self.lo, self.hi]}

    def load(self, params: np.ndarray, state: dict[str, Any], version: int) -> None:
        self.param.copy_(torch.from_numpy(np.asarray(params)))
        self.step.load_state_dict(state, version)
        self.reset_copy()


def copy_kept(cfg: RunConfig) -> tuple[str, int] | None:
    """What each slice keeps of the published copy islands hold: (codec, chunk) of
    `compression.downlink` where they hold one, else nothing."""
    return (cfg.compression.downlink, cfg.compression.chunk) if cfg.tracks_copy else None


@dataclass(frozen=True)
class _PartsWritten:
    """The slices' parts of a checkpoint, being written (`checkpoints.Beside`)."""

    calls: SliceCalls
    answers: list[Any]

    def written(self) -> list[dict[str, Any]]:
        return list(self.calls.gather(self.answers))


class SliceCalls(Protocol):
    """How the slices are reached: in-process objects (tests) or Ray actors (runs). Each of
    `slices` answers `OuterSlice`'s methods, with its answer (in process) or a future of it
    (Ray); `gather` waits for a list of them. Every call is made by name in the code, on
    all slices at once."""

    @property
    def slices(self) -> Sequence[Any]: ...

    def gather(self, answers: list[Any]) -> list[Any]: ...

    def params(self) -> list[Any]:
        """Each slice's parameters (a reference an island can fetch, under Ray)."""
        ...

    def changes(self, version: int) -> list[tuple[Any, Any]]:
        """Each slice's change of its part of the published copy to `version` (a
        reference an island can fetch, under Ray: the change stays on the slice's node)
        and its bytes (a future of them, under Ray)."""
        ...

    def copies(self) -> list[Any]:
        """Each slice's part of the published copy (references, under Ray)."""
        ...

    def fetch(self, slices: list[Any]) -> list[np.ndarray]: ...

    def release(self) -> None:
        """End the slices (their nodes free for another phase's)."""
        ...


class LocalSlices:
    """`SliceCalls` over in-process slices (tests, and the engine without Ray)."""

    def __init__(
        self,
        rule: OuterRule,
        params: np.ndarray,
        bounds: list[tuple[int, int]],
        downlink: tuple[str, int] | None = None,
    ) -> None:
        self.slices = [OuterSlice(rule, b, params[b[0] : b[1]], downlink=downlink) for b in bounds]

    def gather(self, answers: list[Any]) -> list[Any]:
        return answers

    def params(self) -> list[np.ndarray]:
        return [s.params().copy() for s in self.slices]

    def changes(self, version: int) -> list[tuple[Change, int]]:
        return [s.change(version) for s in self.slices]

    def copies(self) -> list[np.ndarray]:
        return [s.copy().copy() for s in self.slices]

    def fetch(self, slices: list[np.ndarray]) -> list[np.ndarray]:
        return slices

    def release(self) -> None:
        return None  # in this process: they go with their references


class SlicedOuter:
    """Bytes never pass through here: each island sends its Δ as S slices and each slice
    pulls its own; the coordinator sees a few numbers per update."""

    def __init__(self, flat: torch.Tensor, bounds: list[tuple[int, int]], calls: SliceCalls, merge: OuterMerge) -> None:
        """`flat`: the coordinator's copy of the parameters (for evaluation and checkpoints);
        `merge`: the rule's (`outer_rule`), which every slice was built with."""
        self.flat, self.bounds, self.calls = flat, bounds, calls
        self.exact_norms = MERGES[merge].exact_norms
        self.numel = flat.numel()
        self._keys = itertools.count()
        self._lr: float | None = None  # as last read from the slices (`known_lr`)

    @property
    def _slices(self) -> Sequence[Any]:
        return self.calls.slices

    def propose(self, contributions: list[Contribution], scale: float = 1.0) -> Proposal:
        key = next(self._keys)
        weights = {c.island: c.weight for c in contributions}
        stats = self.calls.gather(
            [
                s.inspect(key, [(c.island, c.delta.parts[k]) for c in contributions], weights, scale)
                for k, s in enumerate(self._slices)
            ]
        )
        facts = []
        for j in range(len(contributions)):
            parts = [stats[k][j] for k in range(len(self.bounds))]
            exact = [p.exact for p in parts]
            whole = (
                float(sum((e for e in exact if e is not None), ExactSum()))
                if self.exact_norms and all(e is not None for e in exact)
                else sum(p.sqnorm for p in parts)
            )
            facts.append(Facts(sum(p.size for p in parts), all(p.finite for p in parts), whole))
        return Proposal(key=key, facts=facts, sqnorms=tuple((c.island, f.sqnorm) for c, f in zip(contributions, facts)))

    def commit(self, proposal: Proposal, decision: Commit) -> float | None:
        if decision.fragment is not None:  # refused by the config too: the published copy lives on the coordinator
            raise ValueError("coordinator slices do not take fragment steps")
        key, weights, scale, anchor = proposal.key, decision.weights, decision.scale, decision.anchor
        factor = self._radial(proposal, weights) if self.exact_norms and weights else None
        norms = None
        if weights and anchor is not None:
            terms = self.calls.gather([s.gap_terms(key, weights, anchor, scale, factor) for s in self._slices])
            if all(t is not None for t in terms):
                norms = (math.sqrt(sum(t[0] for t in terms)), math.sqrt(sum(t[1] for t in terms)))
        return self.calls.gather([s.close(key, weights, scale, anchor, norms, factor) for s in self._slices])[0]

    def _radial(self, proposal: Proposal, weights: dict[int, float]) -> float:
        """RDA across the slices: the mean norm and each update's weight along the direction
        from the whole norms the proposal summed, the direction taken by every slice, its
        length summed exactly from their parts; returns what the slices scale it by. The
        same scalars, in the same order, as `WeightedMean.radial_directional` on one."""
        screened = dict(proposal.sqnorms)
        order = sorted(weights)  # island order, as one coordinator merges
        radius, along = radial_terms([weights[i] for i in order], [screened[i] for i in order])
        parts = self.calls.gather([s.direct(proposal.key, dict(zip(order, along))) for s in self._slices])
        return radial_scale(radius, float(sum(parts, ExactSum())))

    def discard(self, proposal: Proposal) -> None:
        self.calls.gather([s.discard(proposal.key) for s in self._slices])

    def anchor(self, version: int, keep_from: int) -> None:
        self.calls.gather([s.anchor(version, keep_from) for s in self._slices])

    def params(self) -> list[Any]:
        return self.calls.params()

    def copy_to(self, flat: torch.Tensor) -> None:
        for (lo, hi), part in zip(self.bounds, self.calls.fetch(self.calls.params())):
            flat[lo:hi].copy_(as_tensor(part))

    def state_dict(self) -> dict[str, Any]:
        return {"slices": self.calls.gather([s.state_dict() for s in self._slices]), "bounds": self.bounds}

    def save_beside(self, location: Location, name: str) -> tuple[dict[str, Any], _PartsWritten]:
        """Each slice writes its parameters and outer state beside checkpoint `name` from its
        own node (started now; `_PartsWritten.written` waits): what the checkpoint itself
        holds of the outer step, and the parts to name in it."""
        names = [part_name(name, k) for k in range(len(self.bounds))]
        answers = [s.save(str(location), n) for s, n in zip(self._slices, names)]
        return {"bounds": self.bounds}, _PartsWritten(self.calls, answers)

    def load_state_dict(self, state: dict[str, Any], version: int) -> None:
        """Restore every slice from the checkpoint (`flat` already holds its parameters)."""
        if [tuple(b) for b in state["bounds"]] != self.bounds:
            raise ValueError(f"checkpoint has coordinator slices {state['bounds']}, this run {self.bounds}")
        self.calls.gather(
            [
                s.load(self.flat[lo:hi].numpy().copy(), st, version)
                for s, (lo, hi), st in zip(self._slices, self.bounds, state["slices"])
            ]
        )
        self.lr()  # the restored lr, known to the status before the first step

    def set_lr(self, lr: float) -> None:
        self.calls.gather([s.set_lr(lr) for s in self._slices])
        self._lr = lr

    def lr(self) -> float:
        """Read from the slices (the engine's thread, each round: a schedule moves it)."""
        self._lr = float(self.calls.gather([s.lr() for s in self._slices])[0])
        return self._lr

    def known_lr(self) -> float | None:
        return self._lr

    # the published copy, where islands hold one (`downlink.SlicedDownlink`): each slice its part
    def change_parts(self, version: int) -> tuple[list[Any], int]:
        """Each slice's change to `version`, as islands fetch them, and their bytes."""
        answers = self.calls.changes(version)
        return [part for part, _ in answers], sum(self.calls.gather([nbytes for _, nbytes in answers]))

    def copy_parts(self) -> list[Any]:
        return self.calls.copies()

    def copy_nbytes(self) -> int:
        """The whole copy's bytes, as an island takes it (the parameters' dtype)."""
        return self.numel * self.flat.element_size()

    def reset_copies(self) -> None:
        self.calls.gather([s.reset_copy() for s in self._slices])

    def release(self) -> None:
        self.calls.release()

    def downlink(self, codec: str, chunk: int, keep: int) -> SlicedDownlink:
        return SlicedDownlink(self, keep)  # each slice encodes its part with the codec it was built with
