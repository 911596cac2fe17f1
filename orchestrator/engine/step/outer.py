"""The outer step over the global parameters: on the coordinator alone (`LocalOuter`), or
split over S coordinator slices that each own a contiguous part of the vector and of the
outer optimizer state (`SlicedOuter`, the ZeRO idea applied to the outer step).

Both take a step as a proposal: `propose` turns the islands' payloads into the `Facts`
admission needs (a sliced coordinator sums its slices' squared norms, so no process but
the slice's ever holds a whole pseudo-gradient), then admission decides and the engine
either `commit`s the admitted updates — averaged with their token weights into one
preallocated buffer, set as the flat parameter's `.grad`, stepped by the outer rule's
stock `optimizer.step()` in place — or `discard`s the proposal. The proposal holds what
its screening made: the decoded updates and, when the merge is the plain mean, the mean
of all of them taken in the same pass that measured their norms (`Prefill`), which a
commit of exactly those weights steps on without reading the updates again. Every outer
rule is elementwise apart from norms, so S slices compute what one coordinator does
(tested bit for bit).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from archipelago.workers.wire.compress import decode
from archipelago.workers.wire.fragments import Fragments

from ...algorithms.aggregate import WeightedMean, all_finite, exact_sqnorm, sqnorm
from ...algorithms.outer import GapPenalty
from ...config_sections import CompressionConfig, OuterMerge
from ..state.checkpoints import Beside, Location
from ..types import Contribution, Decision, Verdict
from .admission import Admission, Facts
from .downlink import Downlink, SlicedDownlink
from .gap import Gap

Scheduler = torch.optim.lr_scheduler.LRScheduler


# how the admitted updates become the one the rule steps on (`outer.merge`), given the
# updates' squared norms when the screen measured them (None: the merge measures what it
# needs) and the rows its norms are summed over
Merge = Callable[[WeightedMean, Sequence[tuple[np.ndarray, float]], Sequence[float] | None, int], torch.Tensor]


@dataclass(frozen=True)
class MergeRow:
    """One `outer.merge`: how it combines the admitted updates, and what the rest of the
    step reads of it."""

    combine: Merge
    # the screen's pass can take the merge with the norms (the weighted mean)
    prefills: bool
    # it reads whole-vector norms, measured by `exact_sqnorm` so that coordinator slices
    # sum them to the same bits (`SlicedOuter` exchanges them as scalars)
    exact_norms: bool


MERGES: dict[OuterMerge, MergeRow] = {
    OuterMerge.MEAN: MergeRow(lambda mean, parts, _sq, _rows: mean.fill(parts), prefills=True, exact_norms=False),
    OuterMerge.RADIAL_DIRECTIONAL: MergeRow(WeightedMean.radial_directional, prefills=False, exact_norms=True),
}


@dataclass(frozen=True)
class OuterRule:
    """How to build the outer optimizer over a flat parameter (a row of `step/rules.py`)."""

    build: Callable[[torch.nn.Parameter], tuple[torch.optim.Optimizer, Scheduler | None]]
    # CO2's staleness gap penalty Λ, set in the optimizer's param group (`gap`) before each
    # step; an anchored one reads the parameters each round started from, kept for it
    penalty: GapPenalty | None = None
    merge: OuterMerge = OuterMerge.MEAN  # how the admitted updates become the one stepped on (`MERGES`)
    # values per row of a merge's exact norms: the run's compression.chunk (`outer_rule`), on
    # which coordinator slices' bounds fall
    norm_rows: int = CompressionConfig.model_fields["chunk"].default


def as_tensor(x: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(x))


class OuterStep:
    """One buffer's outer state: the rule's optimizer over a flat `Parameter` that shares
    `flat`'s storage, the mean buffer, and the rule's gap penalty (CO2's `Gap`), if any."""

    def __init__(self, flat: torch.Tensor, rule: OuterRule) -> None:
        self.param = torch.nn.Parameter(flat, requires_grad=True)  # shares storage
        self.optimizer, self.scheduler = rule.build(self.param)
        self.gap = Gap(rule.penalty, self.param) if rule.penalty is not None else None
        self.merge, self.norm_rows = MERGES[rule.merge], rule.norm_rows
        self.prefills = self.merge.prefills  # the mean taken while screening is the plain mean only
        self.mean = WeightedMean(flat.numel(), flat.dtype)

    def measure(self, delta: np.ndarray) -> float:
        """An update's squared norm as the screen takes it: exact over rows where the merge
        reads it (`MergeRow.exact_norms`), else one BLAS pass."""
        return float(exact_sqnorm(delta, self.norm_rows)) if self.merge.exact_norms else sqnorm(delta)

    def combine(self, parts: Sequence[tuple[np.ndarray, float]], sqnorms: Sequence[float] | None) -> torch.Tensor:
        """The merge of `parts` into the preallocated buffer."""
        return self.merge.combine(self.mean, parts, sqnorms, self.norm_rows)

    def gap_terms(self, parts: list[tuple[np.ndarray, float]] | None, anchor: int) -> tuple[float, float] | None:
        """(‖x − x_s‖², ‖Δ̄‖²) over this buffer when the rule's Λ reads them (a sliced
        coordinator sums them over its slices), else None. `parts` None: the buffer holds
        the merge already (a merge across slices made it)."""
        if self.gap is None or not self.gap.anchored:
            return None
        # the preallocated buffer; `apply` refills it
        return self.gap.terms(self.mean.sum if parts is None else self.combine(parts, None), anchor)

    def apply(
        self,
        parts: list[tuple[np.ndarray, float]] | None,
        scale: float = 1.0,
        anchor: int | None = None,
        norms: tuple[float, float] | None = None,
        sqnorms: Sequence[float] | None = None,
    ) -> float | None:
        """Step the rule on the merge of `parts` (× `scale`; None: the mean buffer already
        holds it, filled while screening; `sqnorms`: theirs, as screened); returns CO2's Λ.
        `norms`: (‖x − x_s‖, ‖Δ̄‖) over the whole vector, for an anchored penalty when this
        buffer is one slice of it (else measured here)."""
        grad = self.combine(parts, sqnorms) if parts is not None else self.mean.sum
        if scale != 1.0:
            grad.mul_(scale)
        self.param.grad = grad
        gap = self.gap.set(self.optimizer, grad, anchor, norms) if self.gap is not None else None
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.param.grad = None
        self.mean.owner = None  # a step may have written into the buffer (torch's Nesterov does)
        return gap

    def anchor(self, version: int, keep_from: int) -> None:
        """Keep the parameters of `version` for the rounds that will start from it."""
        if self.gap is not None:
            self.gap.keep(version, keep_from)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scheduler is not None:
            self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], version: int) -> None:
        """Resume at `version` (the parameters are already loaded); a CO2 pipeline refills from it."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.gap is not None:
            self.gap.reset(version)


@dataclass(frozen=True, kw_only=True)
class Prefill:
    """What a proposal's screening pass left in the mean buffer: the mean of every update
    of proposal `key`, at these token `weights`, × the pacing's `scale`. The buffer names
    the fill it holds (`WeightedMean.owner`), so a commit steps on it only while it is
    still this one and admission asked for exactly these weights and this scale."""

    key: int
    weights: dict[int, float]
    scale: float


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """A step proposed from some contributions: the facts admission judges them by, its
    decoded updates (on one coordinator: each island's Δ, weight and squared norm as
    screened, in island order; a sliced coordinator's stay in the slices that pulled them,
    which know them by `key`), and the mean its screening took (`prefilled`, one coordinator's)."""

    key: int
    facts: list[Facts]
    updates: tuple[tuple[int, np.ndarray, float, float], ...] = ()
    sqnorms: tuple[tuple[int, float], ...] = ()  # a sliced coordinator's: each island's, summed over its slices
    prefilled: Prefill | None = None


@dataclass(frozen=True, kw_only=True)
class Commit:
    """What admission decided for a proposal: the admitted islands' token weights, the
    pacing's scale, the version the round started from (CO2's anchor) and the fragment
    (streaming) the step updates."""

    weights: dict[int, float]
    scale: float = 1.0
    anchor: int | None = None
    fragment: int | None = None


class Outer(Protocol):
    """The engine's view of the outer step, whole or sliced."""

    numel: int

    def propose(self, contributions: list[Contribution], scale: float = 1.0) -> Proposal: ...
    def commit(self, proposal: Proposal, decision: Commit) -> float | None:
        """Take the step; CO2's Λ, if the rule has one."""

    def discard(self, proposal: Proposal) -> None: ...
    def anchor(self, version: int, keep_from: int) -> None: ...
    def params(self) -> Any: ...
    def copy_to(self, flat: torch.Tensor) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def save_beside(self, location: Location, name: str) -> tuple[dict[str, Any], Beside] | None:
        """Where parts of its state are written beside checkpoint `name` by processes of their
        own (coordinator slices): what the checkpoint holds of it and the parts being
        written; None: all of it goes in the checkpoint (`state_dict`)."""

    def load_state_dict(self, state: dict[str, Any], version: int) -> None: ...
    def set_lr(self, lr: float) -> None: ...
    def lr(self) -> float: ...
    def known_lr(self) -> float | None:
        """The lr as of the last outer step or setting, read without asking a remote slice:
        what the status serves from a control thread (a slow slice never holds a read)."""

    def release(self) -> None:
        """End the processes it steps on (coordinator slices), so the phase after this one
        can place its own where these were (a slice node offers one slice's resource)."""

    def downlink(self, codec: str, chunk: int, keep: int) -> Downlink | SlicedDownlink:
        """The keeper of the copy islands hold (`compression.downlink`): one coordinator
        keeps it whole, coordinator slices a part each; `keep` versions of changes."""


class LocalOuter:
    """The whole vector on the coordinator, in `flat`, the coordinator model's buffer,
    which the outer rule's parameter shares. With streaming's `fragments`, each fragment
    has its own outer state over a gathered copy of its positions, written back into
    `flat` after each of its steps (no other step touches those positions)."""

    def __init__(self, flat: torch.Tensor, rule: OuterRule, fragments: Fragments | None = None) -> None:
        self.flat, self.fragments = flat, fragments
        self.numel = flat.numel()
        if fragments is None:
            self.steps = [OuterStep(flat, rule)]
        else:
            self.steps = [OuterStep(flat[fragments.positions(p)].clone(), rule) for p in range(fragments.count)]
        self._keys = itertools.count()

    def _size(self, fragment: int | None) -> int:
        return self.numel if fragment is None or self.fragments is None else self.fragments.size(fragment)

    def propose(self, contributions: list[Contribution], scale: float = 1.0) -> Proposal:
        """The facts of each update. Unfragmented, with every update of the right shape and
        a merge that is the plain mean, the mean of all of them (× the pacing's `scale`) is
        taken in the same pass (`WeightedMean.fill`): admission nearly always admits every
        update, and `commit` then steps on it without reading the updates again
        (`Proposal.prefilled`); otherwise `commit` averages the admitted ones itself."""
        key = next(self._keys)
        decoded = [
            (c.island, c.delta if isinstance(c.delta, np.ndarray) else decode(c.delta), c.weight) for c in contributions
        ]
        # kept in island order, not arrival order: float sums depend on their order, and the
        # same run must give the same model whichever island's result came first
        ordered = sorted(decoded, key=lambda part: part[0])
        fits = [d.shape == (self._size(c.fragment),) for c, (_, d, _) in zip(contributions, decoded)]
        prefill = None
        step = self.steps[0]
        if self.fragments is None and step.prefills and all(fits) and decoded and all(w > 0 for _, _, w in decoded):
            prefill = Prefill(key=key, weights={i: w for i, _, w in ordered}, scale=scale)
            sq = [0.0] * len(ordered)
            step.mean.fill([(d, w) for _, d, w in ordered], sq, scale, owner=prefill)
            by_island = {i: q for (i, _, _), q in zip(ordered, sq)}
            sqs = [by_island[i] for i, _, _ in decoded]
        else:
            sqs = [step.measure(d) if ok else math.nan for ok, (_, d, _) in zip(fits, decoded)]
        facts = [Facts(d.size, ok and all_finite(d, q), q) for ok, q, (_, d, _) in zip(fits, sqs, decoded)]
        screened = {i: q for (i, _, _), q in zip(decoded, sqs)}
        updates = tuple((i, d, w, screened[i]) for i, d, w in ordered)
        return Proposal(key=key, facts=facts, updates=updates, prefilled=prefill)

    def commit(self, proposal: Proposal, decision: Commit) -> float | None:
        weights, scale, anchor = decision.weights, decision.scale, decision.anchor
        admitted = [(i, d, q) for i, d, _, q in proposal.updates if i in weights]  # island order
        parts = [(d, weights[i]) for i, d, _ in admitted]
        sqnorms = [q for _, _, q in admitted]  # the merge reads no update again for its norm
        if self.fragments is None:
            step = self.steps[0]
            asked = Prefill(key=proposal.key, weights=weights, scale=scale)
            if proposal.prefilled == asked and step.mean.owner is proposal.prefilled:  # the mean its screening took
                return step.apply(None, 1.0, anchor)
            return step.apply(parts, scale, anchor, sqnorms=sqnorms)
        if decision.fragment is None:
            raise ValueError("a fragmented outer step needs the fragment it updates")
        step = self.steps[decision.fragment]
        gap = step.apply(parts, scale, anchor, sqnorms=sqnorms)
        with torch.no_grad():
            self.flat[self.fragments.positions(decision.fragment)] = step.param.detach()
        return gap

    def discard(self, proposal: Proposal) -> None:
        return None  # nothing is kept for a proposal but what it holds

    def anchor(self, version: int, keep_from: int) -> None:
        for step in self.steps:
            step.anchor(version, keep_from)

    def params(self) -> np.ndarray:
        """A view of the parameters as numpy: publishing copies it (`ray.put`)."""
        return self.flat.detach().numpy()

    def copy_to(self, flat: torch.Tensor) -> None:
        return None  # `flat` is where every step leaves the parameters

    def release(self) -> None:
        return None  # it steps in this process

    def downlink(self, codec: str, chunk: int, keep: int) -> Downlink:
        return Downlink(self.flat, codec, chunk, self.fragments, keep)

    def state_dict(self) -> dict[str, Any]:
        if self.fragments is None:
            return self.steps[0].state_dict()
        return {"fragments": [step.state_dict() for step in self.steps]}

    def save_beside(self, location: Location, name: str) -> None:
        return None  # the whole state is the coordinator's: it goes in its checkpoint

    def load_state_dict(self, state: dict[str, Any], version: int) -> None:
        """Resume at `version`, `flat` already loaded: each fragment's copy is gathered again."""
        if self.fragments is None:
            self.steps[0].load_state_dict(state, version)
            return
        with torch.no_grad():
            for p, (step, st) in enumerate(zip(self.steps, state["fragments"])):
                step.param.copy_(self.flat[self.fragments.positions(p)])
                step.load_state_dict(st, version)

    def set_lr(self, lr: float) -> None:
        for step in self.steps:
            step.set_lr(lr)

    def lr(self) -> float:
        return self.steps[0].lr()

    def known_lr(self) -> float | None:
        return self.lr()


@dataclass(frozen=True)
class StepOutcome:
    verdicts: list[Verdict]
    islands: list[int]
    stepped: bool
    gap: float | None = None

    @property
    def accepted(self) -> list[int]:
        return [i for i, v in zip(self.islands, self.verdicts) if v.admitted]

    @property
    def rejected(self) -> dict[int, str]:
        return {i: v.why for i, v in zip(self.islands, self.verdicts) if v.decision == Decision.REJECT}

    @property
    def dropped(self) -> list[int]:
        return [i for i, v in zip(self.islands, self.verdicts) if v.decision == Decision.DROP]


def take_step(
    outer: Outer,
    admission: Admission,
    contributions: list[Contribution],
    expected: int | None,
    current: int,
    anchor: int | None = None,
    fragment: int | None = None,
    scale: float = 1.0,
) -> StepOutcome:
    """One outer step: the facts of each update, admission's verdicts (against `expected`,
    or bounded staleness against `current`), then the weighted mean of the admitted ones
    through the outer rule, × `scale` (the pacing's). Nothing rejected ever touches the parameters."""
    proposal = outer.propose(contributions, scale)
    verdicts = [
        admission.judge(c, f, expected if expected is not None else current, current)
        for c, f in zip(contributions, proposal.facts)
    ]
    weights = {c.island: c.weight for c, v in zip(contributions, verdicts) if v.admitted}
    if not weights:
        outer.discard(proposal)
        return StepOutcome(verdicts, [c.island for c in contributions], False)
    scale *= min(v.scale for v in verdicts if v.admitted)
    gap = outer.commit(proposal, Commit(weights=weights, scale=scale, anchor=anchor, fragment=fragment))
    return StepOutcome(verdicts, [c.island for c in contributions], True, gap)
