"""What a Force-3 step did, counted once where it happens: a level's `LevelReport`, a row's `RowOutcome`, the step's
`policy.StepRecord` (what the adaptive policy learns from).

A level (`levels.Force2Level`, `levels.Force1Level`) fills its report as it drafts, verifies and re-selects; the
`Decoder` takes it after each step (`take_report`), adds it to the row's `TriForceStats` and hands it to the policy
with Force 3's verdict (`policy.StepRecord`). Nothing is threaded through the loop as counters.

Terms: *drafted*: Force-1 tokens proposed (a tree counts its depth, so that acceptance compares with chains');
*verified* / *accepted*: of those, the ones Force 2 verified / accepted; *rejections*: Force-2 verifications that
rejected a draft; *handed*: tokens handed up to Force 3; a *selection*: a re-selection of the retrieval cache's chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..forwards.clock import Seconds
from ..stats import TriForceStats
from ..tokens import device_tokens
from ..verification.sampling import scores_to_probs
from ..verification.scoring import Deferred


@dataclass
class LevelReport:
    drafted: int = 0
    handed: int = 0
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
    # (tier, rows, seconds) of each forward timed for the policy's cost model ("force2", "force2-tree", "select")
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
        self.timings = [(tier, rows, float(seconds)) for tier, rows, seconds in self.timings]
        return self

    def add_to(self, stats: TriForceStats) -> None:
        """Count this report in a row's statistics, its seconds `read` (Force 1's seconds are counted from its
        drafters: `Decoder`)."""
        self.read()
        stats.force1_proposed += self.drafted
        stats.force2_proposed += self.handed
        stats.force2_steps += self.force2_steps
        stats.force2_verified += self.force2_verified
        stats.force2_accepted += self.force2_accepted
        stats.tree_nodes += self.tree_nodes
        stats.tree_side_accepts += self.tree_side_accepts
        stats.force2_seconds += self.force2_seconds
        stats.retrieval_selections += self.selections
        stats.retrieval_seconds += self.selection_seconds


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
