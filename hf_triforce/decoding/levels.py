"""The levels that propose to Force 3: Force 2 over Force 1 (`Force2Level`, three levels), or Force 1 straight to
Force 3 (`Force1Level`, two levels).

A level's ``start(sequence, queries)`` catches it up before a step that uses it (a draft cache's fill, the first
retrieval selection, a sync after steps without it). ``candidate_steps(sequence, limit, gamma1, gamma2,
force1_tree, force2_tree)`` is a generator of its forwards (`hf_triforce.forwards.forward`: a batch's rows run them
in lockstep) that returns a `Candidates`: up to ``limit`` tokens and, row by row, the exact distribution each was
drawn from (``None``: point masses, or greedy decoding), or a candidate tree. After Force 3 has committed,
``commit(sequence, accepted, proposed, queries, committed)`` is told the committed sequence (its last token not yet
cached), how many of the ``proposed`` it accepted, the verifier's queries at the last cached row and the tokens
the step committed (on the host); every cache rolls back or catches up. What it did meanwhile — drafted, verified,
accepted, handed up, seconds per tier — it counts in its `LevelReport`, which ``take_report()`` hands over.

Force 2 verifies Force 1's chain with its `ChainVerifier` (accept with min(1, q/r), else draw from the
residual) and hands up the tokens it emitted with q: each emitted token is distributed exactly as q, so
Force 3's own verification against p is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessorList

from .. import compat
from ..caches.buffer import BufferCache
from ..caches.retrieval import RetrievalCache
from ..compat import layer_devices
from ..drafters import Drafter
from ..drafters.branching import branched_chain
from ..forwards.forward import Clock, ForwardRequest, TierGenerator, run_inline
from ..tokens import agreement, append_tokens
from ..verification.draft_tree import DraftTree
from ..verification.sampling import ChainVerifier, scores_to_probs
from ..verification.scoring import process_positions
from ..verification.tree import TreeVerifier
from .report import LevelReport
from .resolved import ResolvedConfig
from .tree_forward import score_tree

# the dtype Force 2's retrieval cache stores its entries in, per concrete `TriForceConfig.retrieval_dtype` (None: as
# computed, the model's)
RETRIEVAL_STORAGE = {"model": None, "bfloat16": torch.bfloat16}


def drafting_sequence(drafter: Drafter, sequence: torch.Tensor, host: np.ndarray | None) -> torch.Tensor | np.ndarray:
    """What ``drafter`` proposes from: ``host``, the sequence's host copy (int64 ``[1, n]``), for a drafter that reads
    token values (``host_sequence``: the lookups), where the caller has one; else ``sequence``."""
    return host if host is not None and drafter.host_sequence else sequence


def proposal_steps(drafter: Drafter, sequence: torch.Tensor, n: int, host: np.ndarray | None = None
                   ) -> TierGenerator[tuple[list[int] | torch.Tensor, torch.Tensor | None]]:
    """``drafter.propose(sequence, n)`` as a generator of forward requests (`Drafter.propose_steps`; ``host``: the
    sequence's host copy, `drafting_sequence`). The tokens are ids, or a ``[n]`` tensor on the device where the
    drafter keeps them there (verification reads them back with its acceptance)."""
    return (yield from drafter.propose_steps(drafting_sequence(drafter, sequence, host), n))


@dataclass
class Candidates:
    """Proposed tokens and the distribution each was drawn from (``[n, vocab]``, or ``None``); or a candidate
    ``tree`` (``TriForceConfig.tree_nodes``: then ``tokens`` is empty and Force 3 verifies the tree)."""

    tokens: list[int]
    probs: torch.Tensor | None
    tree: DraftTree | None = None


class NoDrafter(Drafter):
    """Force 1 of `Force2Level` drafting alone: it proposes nothing, so each Force-2 round emits Force 2's own token."""

    def prefill(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, sequence: torch.Tensor, n: int) -> tuple[list[int], None]:
        return [], None

    def rollback(self, length: int) -> None:
        pass

    def nbytes(self) -> int:
        return 0


class Reporting:
    """A level's `LevelReport`: filled as it works, handed over (and started afresh) by `take_report`."""

    report: LevelReport

    def take_report(self) -> LevelReport:
        report, self.report = self.report, LevelReport()
        return report


class Force2Level(Reporting):
    """The target (or its int8 copy) on a `RetrievalCache`: verifies Force 1, hands its tokens up with q.

    One per row and call, whichever drafter is Force 1 (`use`): the retrieval tier does not depend on who drafts
    for it, so its selection, chunk summaries and memory are paid once (one per drafter would cost, SmolLM2 at 16k,
    budget 4096, a second 189 MB cache and its first selection, 0.3 s of a 4.5 s call).
    """

    def __init__(self, model, drafter: Drafter, config: ResolvedConfig, processors: LogitsProcessorList,
                 verifier: ChainVerifier, full: BufferCache, clock: Clock,
                 tree_verifier: TreeVerifier | None = None) -> None:
        self.model, self.drafter, self.config = model, drafter, config
        self.clock = clock  # the call's (`clock.device_clock`): times its forwards and selections
        self.tree_verifier = tree_verifier  # verifies Force 1's trees (TriForceConfig.tree_nodes)
        self.processors, self.verifier, self.full = processors, verifier, full
        self.report = LevelReport()
        self.started = False
        tail = config.refresh_interval * (config.gamma2 + 1) + config.round_rows
        self.cache = RetrievalCache(
            compat.num_layers(model.config), config.retrieval_budget, config.chunk_size, config.recent_tokens, tail,
            compat.layer_windows(model.config),
        ).expect_devices(layer_devices(model)).store_as(RETRIEVAL_STORAGE[config.retrieval_dtype])
        self.steps_since_selection = 0
        self.handed_to_force3: tuple[int, list[int]] | None = None  # (position, chain) of its last chain

    @property
    def covered(self) -> int:
        """Tokens of the sequence the retrieval cache covers (holds entries for)."""
        return self.cache.base_upto + self.cache.length - self.cache.base_length

    def use(self, drafter: Drafter) -> None:
        """Force 1 of the coming step(s) (`NoDrafter`: Force 2 drafts alone, its own token each round). A drafter
        that sat out steps catches up when it next drafts (its cache was rolled back to the committed sequence after
        its last step; `prefill` fills it only once)."""
        self.drafter = drafter

    def start(self, sequence: torch.Tensor, queries: dict[int, torch.Tensor]) -> None:
        """Before the first proposal, and again after steps that ran without this level (plain decoding or
        two levels): the drafter catches up and the retrieval cache catches up with the full cache."""
        self.drafter.prefill(sequence)  # a drafter's first use fills its cache; later calls do nothing
        if not self.started:
            self.select(queries, first=True)
            self.started = True
        elif self.cache.synced != self.full.length:
            if self.cache.tail_room(self.full.length) >= self.config.round_rows:
                self.cache.sync(self.full, self.full.length)
            else:
                self.select(queries)

    def select(self, queries: dict[int, torch.Tensor], first: bool = False) -> None:
        """Re-select the retrieval cache's chunks. The ``first`` selection (every chunk summarised and copied) is
        set-up, like a draft cache's fill, not a re-selection's cost: it is not timed for the policy, whose cost
        model prices it apart (`policy.RETRIEVAL`)."""
        start = self.clock.start()
        self.cache.select(self.full, self.full.length, queries)
        seconds = self.clock.stop(start)
        self.report.selection_seconds += seconds
        self.report.selections += 1
        if not first:
            self.report.timings.append(("select", 1, seconds))
        self.steps_since_selection = 0

    def scores(self, sequence: torch.Tensor, proposals: list[int] | torch.Tensor) -> torch.Tensor:
        """Processed Force-2 scores for each proposal's position and the one after."""
        return run_inline(self.score_steps(sequence, proposals))

    def score_steps(self, sequence: torch.Tensor, proposals: list[int] | torch.Tensor) -> TierGenerator[torch.Tensor]:
        """`scores` as a generator of its forward (`hf_triforce.forwards.forward`)."""
        extended = append_tokens(sequence, proposals) if len(proposals) else sequence
        positions = extended.shape[1] - self.covered  # the forward's (`covered` counts them in once it has run)
        request = ForwardRequest(self.model, self.cache, extended[:, self.covered :], self.covered, len(proposals) + 1,
                                 self.clock)
        logits = yield request
        self.report.force2_seconds += request.seconds
        self.report.timings.append(("force2", positions, request.seconds))
        return process_positions(self.processors, extended, logits, sequence.shape[1])

    def verify_tree(self, sequence: torch.Tensor, depth: int, host: np.ndarray | None = None):
        """Force 1's tree of depth ``depth`` verified in one tree forward on the retrieval cache; its accepted
        path's entries are compacted into place. Returns what the chain branch of `candidate_steps` has: the
        accepted path as ``proposals``, ``None`` (their laws: unused past verification), ``accepted``, the next
        token, q at the root's and the path's positions, and the tree's depth."""
        config = self.config
        tree = self.drafter.propose_tree(drafting_sequence(self.drafter, sequence, host), depth, config.tree_nodes,
                                         config.tree_branch) if depth > 0 \
            else DraftTree([], [])
        chain = tree.as_chain()
        if chain is not None:  # no branching this step (or nothing proposed): the cheaper chain path
            proposals, proposal_probs = chain
            q_scores = self.scores(sequence, proposals)
            accepted, next_token = self.verifier.verify(proposals, proposal_probs, q_scores)
            self.report.tree_nodes += len(tree)
            return proposals, proposal_probs, accepted, next_token, q_scores[: accepted + 1], len(proposals)
        first = self.cache.length + sequence.shape[1] - self.covered  # cache coordinates of the first node
        positions = sequence.shape[1] - self.covered + len(tree)  # the tree forward's (`covered` counts them after it)
        start = self.clock.start()
        _, q_scores = score_tree(self.model, self.cache, self.covered, sequence, tree, self.processors)
        seconds = self.clock.stop(start)
        self.report.force2_seconds += seconds
        self.report.timings.append(("force2-tree", positions, seconds))
        path, next_token = self.tree_verifier.verify(tree, q_scores)
        self.cache.keep_rows(first, path)
        self.report.tree_nodes += len(tree)
        self.report.tree_side_accepts += tree.side_nodes(path)
        kept = [0] + [node + 1 for node in path]  # the root's position, then the accepted path's
        depth = max(tree.depths(), default=0)
        return [tree.tokens[node] for node in path], None, len(path), next_token, q_scores[kept], depth

    def emitted_scores(self, q_scores: torch.Tensor, proposals: list[int], proposal_probs: torch.Tensor | None,
                       accepted: int) -> torch.Tensor:
        """The scores of the ``accepted + 1`` tokens one Force-2 verification emits: q at each position (an accepted
        draft and a residual resample are both distributed exactly as q, whatever Force 1 drew from)."""
        return q_scores[: accepted + 1]

    def candidate_steps(self, sequence: torch.Tensor, limit: int, gamma1: int | None = None,
                        gamma2: int | None = None, force1_tree: bool | None = None,
                        force2_tree: bool | None = None, host: np.ndarray | None = None) -> TierGenerator[Candidates]:
        """Up to ``min(gamma2, limit)`` tokens (gammas default to the config's); ``force1_tree``: Force 1
        proposes trees of ``tree_nodes``, ``force2_tree``: a tree of ``force2_tree_nodes`` goes up (both default
        to whether the config sets those); ``host``: the sequence's host copy, for a lookup Force 1
        (`drafting_sequence`). A generator of its forwards (`hf_triforce.forwards.forward`)."""
        force1_tree = bool(self.config.tree_nodes) if force1_tree is None else force1_tree
        force2_tree = bool(self.config.force2_tree_nodes) if force2_tree is None else force2_tree
        gamma1 = self.config.gamma1 if gamma1 is None else gamma1
        wanted = min(self.config.gamma2 if gamma2 is None else gamma2, limit)
        if wanted <= 0:
            return Candidates([], None)
        prompt_length, round_scores, tokens = sequence.shape[1], [], []  # tokens: what this level emitted (host)
        drafting_before = self.drafter.seconds
        while len(tokens) < wanted:
            still_wanted = wanted - len(tokens)
            if force1_tree:  # proposed: the tree's depth, so that acceptance compares with chains'
                proposals, proposal_probs, accepted, next_token, q_scores, proposed = self.verify_tree(
                    sequence, min(gamma1, still_wanted - 1), host)
                emitted = proposals[:accepted] + [next_token]
            else:
                proposals, proposal_probs = yield from proposal_steps(self.drafter, sequence,
                                                                      min(gamma1, still_wanted - 1), host)
                q_scores = yield from self.score_steps(sequence, proposals)
                accepted, next_token = self.verifier.verify(proposals, proposal_probs, q_scores)
                emitted = self.verifier.emitted(proposals, accepted, next_token)
                proposed = len(proposals)
            report = self.report
            report.force2_rejections += accepted < proposed
            report.drafted += proposed
            report.force2_verified += proposed
            report.force2_accepted += accepted
            report.force2_steps += 1
            sequence = append_tokens(sequence, emitted)
            host = None if host is None else np.concatenate((host, [emitted]), axis=1)
            tokens += emitted
            round_scores.append(self.emitted_scores(q_scores, proposals, proposal_probs, accepted))
            self.cache.rollback_to_sequence(sequence.shape[1] - 1)
            self.drafter.rollback(sequence.shape[1] - 1)
        end = prompt_length + wanted
        self.cache.rollback_to_sequence(min(self.covered, end))
        self.drafter.rollback(end)
        self.report.to_force3 += wanted
        self.report.force1_seconds += self.drafter.seconds - drafting_before
        q_scores = torch.cat(round_scores)[:wanted]
        probs = scores_to_probs(q_scores) if self.verifier.do_sample else None
        tokens = tokens[:wanted]
        self.handed_to_force3 = (prompt_length, tokens)
        if force2_tree:
            return self.branched(tokens, q_scores, probs)
        return Candidates(tokens, probs)

    def branched(self, tokens: list[int], q_scores: torch.Tensor, probs: torch.Tensor | None) -> Candidates:
        """``TriForceConfig.force2_tree_nodes``: the chain Force 2 emitted plus, where it is least certain, the
        tokens q ranks next (point masses; `branching`). Exact: each chain token is distributed as its q row
        given the tokens before it (`emitted_scores`), and each alternative is a function of the chain."""
        laws = list(probs) if probs is not None else list(scores_to_probs(q_scores))
        chain_laws = list(probs) if probs is not None else [None] * len(tokens)
        tree = branched_chain(tokens, laws, chain_laws, self.config.force2_tree_nodes, self.config.tree_branch)
        self.report.tree_nodes += len(tree)
        return Candidates(tokens, probs) if tree.is_chain() else Candidates([], None, tree)

    def commit(self, sequence: torch.Tensor, accepted: int, proposed: int, queries: dict[int, torch.Tensor],
               committed: list[int]) -> None:
        """Roll back to the committed ``sequence`` (its last token not yet cached; ``committed``: the tokens this
        step committed, on the host) or, where Force 3 accepted one of a tree's alternatives, to where it left the
        handed-up chain; refresh the selection."""
        keep = sequence.shape[1] - 1
        if self.handed_to_force3 is not None:
            start, chain = self.handed_to_force3
            keep = min(keep, start + agreement(committed[: keep - start], chain))
            self.handed_to_force3 = None
        self.drafter.rollback(keep)
        self.cache.sync(self.full, self.full.length)
        self.steps_since_selection += 1
        low = self.config.refresh_below is not None and proposed and accepted / proposed < self.config.refresh_below
        no_room = self.cache.tail_room(self.full.length) < self.config.round_rows
        if self.steps_since_selection >= self.config.refresh_interval or low or no_room:
            self.select(queries)

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def summary_bytes(self) -> int:
        return self.cache.summary_bytes()


class Force1Level(Reporting):
    """Two levels (``TriForceConfig(levels=2)``): Force 1's drafts go straight to Force 3.

    With ``draft="self"`` this is StreamingLLM-cache self-speculation (MagicDec-style), the baseline
    TriForce's middle tier is measured against.
    """

    def __init__(self, drafter: Drafter, config: ResolvedConfig) -> None:
        self.drafter, self.config = drafter, config
        self.report = LevelReport()
        self.started = False

    def start(self, sequence: torch.Tensor, queries: dict[int, torch.Tensor]) -> None:
        if not self.started:
            self.drafter.prefill(sequence)
            self.started = True

    def candidate_steps(self, sequence: torch.Tensor, limit: int, gamma1: int | None = None,
                        gamma2: int | None = None, force1_tree: bool | None = None,
                        force2_tree: bool | None = None, host: np.ndarray | None = None) -> TierGenerator[Candidates]:
        """Up to ``min(gamma2, limit)`` tokens, or (``force1_tree``, default: whether the config sets
        ``tree_nodes``) Force 1's tree of that depth; ``gamma1`` and ``force2_tree`` are unused (no Force 2);
        ``host``: as `Force2Level.candidate_steps`. A generator of its forwards (`hf_triforce.forwards.forward`)."""
        force1_tree = bool(self.config.tree_nodes) if force1_tree is None else force1_tree
        wanted = min(self.config.gamma2 if gamma2 is None else gamma2, limit)
        if wanted <= 0:
            return Candidates([], None)
        drafting_before = self.drafter.seconds
        if force1_tree:  # Force 3 verifies Force 1's tree
            tree = self.drafter.propose_tree(drafting_sequence(self.drafter, sequence, host), wanted,
                                             self.config.tree_nodes, self.config.tree_branch)
            self.report.force1_seconds += self.drafter.seconds - drafting_before
            depth = max(tree.depths(), default=0)  # counted like a chain of that length (acceptance comparable)
            self.report.drafted += depth
            self.report.to_force3 += depth
            self.report.tree_nodes += len(tree)
            chain = tree.as_chain()  # no branching this step (or nothing proposed): the cheaper chain path
            return Candidates(*chain) if chain is not None else Candidates([], None, tree)
        proposals, probs = yield from proposal_steps(self.drafter, sequence, wanted, host)
        self.report.force1_seconds += self.drafter.seconds - drafting_before
        self.report.drafted += len(proposals)
        self.report.to_force3 += len(proposals)
        return Candidates(proposals, probs)

    def commit(self, sequence: torch.Tensor, accepted: int, proposed: int, queries: dict[int, torch.Tensor],
               committed: list[int]) -> None:
        self.drafter.rollback(sequence.shape[1] - 1)

    def nbytes(self) -> int:
        return 0

    def summary_bytes(self) -> int:
        return 0
