"""What a Force-3 step did, counted once where it happens: a level's `LevelReport`, a row's `RowOutcome`, the step's
`StepRecord` (what the adaptive policy learns from), and the `StepRecorder` that counts them.

A level (`levels.Force2Level`, `levels.Force1Level`) fills its report as it drafts, verifies and re-selects; the
`Decoder` takes it after each step (`take_report`) and hands it to the `StepRecorder`, which is handed the step's
other facts as they happen (its plan, its levels' catch-ups, Force 3's forward, each row's outcome), counts them in
each row's `TriForceStats`, sums the call's Force-3 seconds, notes which tiers ran, and tells the policy what each
step cost and how each level did (`StepRecord`). Nothing is threaded through the loop as counters.

Terms: *drafted*: Force-1 tokens proposed (a tree counts its depth, so that acceptance compares with chains');
*verified* / *accepted*: of those, the ones Force 2 verified / accepted; *rejections*: Force-2 verifications that
rejected a draft; *to_force3*: tokens handed up to Force 3; a *selection*: a re-selection of the retrieval chunks.

On a device's clock (`forwards.forward`) a step's timings are read at the end of the next step (or of the call),
after that step's readbacks have waited for the device, so reading its events waits for nothing and the policy learns
each step's costs one step late. On an immediate clock they are counted when the step ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, is_dataclass

import torch

from ..forwards.forward import Clock, Seconds
from ..stats import TriForceStats
from ..tokens import device_tokens
from ..verification.sampling import scores_to_probs
from ..verification.scoring import Deferred
from .policy import AdaptivePolicy, Choice, Plan


@dataclass
class LevelReport:
    drafted: int = 0
    to_force3: int = 0
    force2_steps: int = 0
    force2_verified: int = 0
    force2_accepted: int = 0
    force2_rejections: int = 0
    tree_nodes: int = 0
    tree_side_accepts: int = 0
    # seconds on the call's clock: floats once `read` (`clock.Seconds` of a CUDA device's until then)
    force1_seconds: float | Seconds = 0.0  # its drafter's (in a batch: the shared forwards the row took part in)
    force2_seconds: float | Seconds = 0.0
    selections: int = 0
    selection_seconds: float | Seconds = 0.0
    # (tier, positions, seconds) of each forward timed for the policy's cost model ("force2", "force2-tree", "select")
    timings: list[tuple[str, int, float | Seconds]] = field(default_factory=list)

    @property
    def lower_seconds(self) -> float | Seconds:
        """Seconds below Force 3: Force 1's, Force 2's forwards, selections."""
        return self.force1_seconds + self.force2_seconds + self.selection_seconds

    def read(self) -> LevelReport:
        """This report with its seconds read, as floats (on a CUDA device: after a readback that followed them, so
        that reading waits for nothing). Returns itself."""
        self.force1_seconds, self.force2_seconds = float(self.force1_seconds), float(self.force2_seconds)
        self.selection_seconds = float(self.selection_seconds)
        self.timings = [(tier, positions, float(seconds)) for tier, positions, seconds in self.timings]
        return self

    def add_to(self, stats: TriForceStats) -> None:
        """Count this report in a row's statistics, its seconds `read` (Force 1's seconds are counted from its
        drafters: `Decoder`)."""
        self.read()
        stats.force3_proposed += self.to_force3
        stats.force2_verified += self.force2_verified
        stats.force2_accepted += self.force2_accepted
        stats.force2_rejections += self.force2_rejections
        stats.force2_seconds += self.force2_seconds
        detail = stats.detail
        detail.force1_proposed += self.drafted
        detail.force2_steps += self.force2_steps
        detail.tree_nodes += self.tree_nodes
        detail.tree_side_accepts += self.tree_side_accepts
        detail.retrieval_selections += self.selections
        detail.retrieval_seconds += self.selection_seconds


@dataclass
class RowOutcome:
    """One row of a step: its level's report (None: a plain step), the tokens proposed to Force 3 (a tree: its
    depth), how many Force 3 accepted and how many were committed; per free lookup drafter, the acceptance
    probability under Force 3 of the token it would have proposed next (None: it would have proposed nothing)."""

    report: LevelReport | None
    proposed: int
    accepted: int
    committed: int
    lookups: dict[str, float | None]


class LookupAcceptances:
    """A row's `RowOutcome.lookups`: per free lookup drafter (``proposals``: what each would propose next, the
    counterfactual), the acceptance probability of its first token under Force 3's first row ``first_scores``
    ``[vocab]`` (``p(x)`` sampling, ``x == argmax p`` greedy); None where it proposes nothing. Computed on the device
    now and read with the next readback (`scoring.Deferred`: the row's verification); `read` after it."""

    def __init__(self, proposals: dict[str, list[int]], first_scores: torch.Tensor, do_sample: bool) -> None:
        self.names = list(proposals)
        self.proposing = [name for name, tokens in proposals.items() if tokens]
        self.deferred = None
        if self.proposing:
            tokens = device_tokens([proposals[name][0] for name in self.proposing], first_scores.device)
            values = scores_to_probs(first_scores).index_select(0, tokens) if do_sample \
                else (tokens == first_scores.argmax()).float()
            self.deferred = Deferred(values)

    def read(self) -> dict[str, float | None]:
        read = dict(zip(self.proposing, self.deferred.values)) if self.deferred is not None else {}
        return {name: read.get(name) for name in self.names}


@dataclass
class StepRecord:
    """One Force-3 step of ``plan``: its forward (``force3_rows`` rows, a tree's where ``force3_tree``), each
    active row's outcome, the step's wall seconds and the part spent in forwards (each shared forward once), and the
    policy's decision for it. Its tier seconds are on the call's clock: the policy is handed it `read`."""

    plan: Plan
    force3_rows: int
    force3_tree: bool
    force3_seconds: float | Seconds
    rows: list[RowOutcome]
    seconds: float
    forward_seconds: float | Seconds
    choice: Choice | None = None  # what the policy decided for the step (None: its last decision)

    def read(self) -> StepRecord:
        """This record with its seconds and its rows' reports `LevelReport.read`. Returns itself."""
        self.force3_seconds, self.forward_seconds = float(self.force3_seconds), float(self.forward_seconds)
        for row in self.rows:
            if row.report is not None:
                row.report.read()
        return self


@dataclass
class UnreadStep:
    """A step's timings until they are read: per row its level's catch-up report (a draft cache's fill, a selection
    before the step), Force 3's seconds, per active row its level's report (None: a plain step), and the policy's
    record (None: no policy)."""

    catch_ups: list[tuple[int, LevelReport]] = field(default_factory=list)
    force3_seconds: float | Seconds = 0.0
    rows: list[tuple[int, LevelReport | None]] = field(default_factory=list)
    record: StepRecord | None = None


def proposed_of(candidates) -> int:
    """Tokens a step proposed: a chain's length, a tree's depth (so that acceptance compares with chains')."""
    return len(candidates.tokens) if candidates.tree is None else max(candidates.tree.depths(), default=0)


class StepRecorder:
    """The accounting of one call's steps over rows with statistics ``stats``; ``policy``: the call's adaptive policy
    (None: fixed plans), ``lockstep``: where a batch's shared forwards are counted, ``do_sample``: how a free lookup's
    counterfactual proposal is scored against Force 3."""

    def __init__(self, stats: list[TriForceStats], policy: AdaptivePolicy | None, clock: Clock, lockstep,
                 do_sample: bool) -> None:
        self.stats, self.policy, self.clock, self.lockstep, self.do_sample = stats, policy, clock, lockstep, do_sample
        self.tiers_run: set[str] = set()  # "force2" and "force1 <drafter>" of the plans that ran a step
        self.force3_seconds: float | Seconds = 0.0  # the call's
        self.step: UnreadStep | None = None  # the step under way
        self.unread: UnreadStep | None = None  # the last step's, where the clock reads them a step late
        self.plan: Plan | None = None
        self.began, self.mark = 0.0, None
        self.lookups: dict[int, dict[str, list[int]]] = {}
        self.looked_up: dict[int, LookupAcceptances] = {}
        self.outcomes: list[RowOutcome] = []

    def planned(self, plan: Plan) -> None:
        """A step of ``plan`` begins (its levels are caught up next)."""
        self.plan, self.step, self.outcomes = plan, UnreadStep(), []
        self.tiers_run |= {"force2"} if plan.levels == 3 else set()
        self.tiers_run |= {f"force1 {plan.drafter}"} if plan.levels > 1 and plan.drafter else set()

    def caught_up(self, b: int, report: LevelReport) -> None:
        """Row ``b``'s level caught up with the row before the step (counted in the row, not in the step's cost)."""
        self.step.catch_ups.append((b, report))

    def started(self, lookups: dict[int, dict[str, list[int]]]) -> None:
        """The step's own work starts; ``lookups``: per row, what each free lookup drafter would propose next."""
        if self.policy is not None:
            self.policy.started(self.plan)
        self.lookups, self.began = lookups, time.perf_counter()
        self.mark = self.lockstep.mark() if self.policy is not None else None  # where shared forwards repeat

    def scored(self, began, scored: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Force 3's forward, begun at ``began`` on the clock, scored every row (``scored``: per row its logits and
        processed scores); the free lookups are scored against each row's first row of p, read with the rows'
        verifications."""
        self.step.force3_seconds = self.clock.stop(began)
        self.force3_seconds += self.step.force3_seconds
        self.looked_up = {b: LookupAcceptances(self.lookups[b], p_rows[1][0], self.do_sample)
                          for b, p_rows in scored.items()}

    def row(self, b: int, report: LevelReport | None, candidates, accepted: int, committed: int) -> None:
        """Row ``b`` verified: Force 3 accepted ``accepted`` of its ``candidates``, ``committed`` tokens were
        committed; ``report``: its level's (None: a plain step)."""
        self.step.rows.append((b, report))
        self.outcomes.append(RowOutcome(report, proposed_of(candidates), accepted, committed,
                                        self.looked_up[b].read()))

    def ended(self, candidates: dict) -> None:
        """The step ended: the policy's record of it (what it cost, each forward's seconds once, and how each row's
        levels did), counted now or a step late (module docstring)."""
        step = self.step
        if self.policy is not None:
            trees = [proposal.tree for proposal in candidates.values() if proposal.tree is not None]  # batch size 1
            width = len(trees[0]) + 1 if trees else 1 + max(len(proposal.tokens) for proposal in candidates.values())
            lower = sum(outcome.report.lower_seconds for outcome in self.outcomes if outcome.report is not None)
            repeated = self.lockstep.repeated_seconds_since(self.mark)
            step.record = StepRecord(self.plan, width, bool(trees), step.force3_seconds, self.outcomes,
                                     time.perf_counter() - self.began, step.force3_seconds + lower - repeated,
                                     self.policy.choice())
        self.step = None
        if self.clock.immediate:
            self._count(step)
            return
        step, self.unread = self.unread, step
        if step is not None:
            self._count(step)

    def finish(self) -> None:
        """The call ended: the last step's timings (its verification's readback has waited for them)."""
        if self.unread is not None:
            self._count(self.unread)
            self.unread = None

    def _count(self, step: UnreadStep) -> None:
        """Read a step's timings: each row's statistics counted, the policy told (its catch-ups' forwards, then the
        step's record)."""
        force3_seconds = float(step.force3_seconds)
        for b, report in step.catch_ups:
            report.add_to(self.stats[b])
            for timing in report.timings if self.policy is not None else ():  # a catch-up selection
                self.policy.observe_forward(*timing)
        for b, report in step.rows:
            self.stats[b].force3_seconds += force3_seconds
            if report is not None:
                report.add_to(self.stats[b])
        if step.record is not None:
            self.policy.observe(step.record.read())


def _summed(values: list):
    """One value of the rows' ``values`` (of one field): `TriForceStats` and `TriForceDetail` field by field, flags true
    if true for any row, descriptions (the same in every row) kept, dicts key by key, counts and seconds summed."""
    first = values[0]
    if is_dataclass(first):
        return type(first)(**{f.name: _summed([getattr(v, f.name) for v in values]) for f in fields(first)})
    if isinstance(first, dict):
        keys = dict.fromkeys(key for v in values for key in v)
        return {key: _summed([v[key] for v in values if key in v]) for key in keys}
    if isinstance(first, bool):
        return any(values)
    return first if isinstance(first, str) else sum(values)


def aggregate(row_stats: list[TriForceStats], force3_seconds: float, prefill_seconds: float) -> TriForceStats:
    """The call's statistics: the rows' `_summed`, Force-3 steps (its forwards), Force-3 and prefill seconds of the call
    (`Decoder` then counts each shared lower-tier forward once)."""
    total = _summed(row_stats)
    total.force3_steps = max(s.force3_steps for s in row_stats)  # Force-3 forwards
    total.force3_seconds, total.prefill_seconds = force3_seconds, prefill_seconds
    return total
