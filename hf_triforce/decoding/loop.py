"""The Force-3 loop: one `Decoder` serves one ``generate`` call, of batch size 1 or more.

    prefill every row's full cache -> first tokens
    until every row stopped:
        1. choose the step's plan (`policy.Plan`: plain, two or three levels, chains or trees)
        2. every active row's level proposes candidates (its Force 2 over its Force 1, or Force 1): the rows in
           lockstep, rows whose caches share storage running one forward per tier (`Lockstep`)
        3. Force 3 scores every active row's candidates in one forward (`force3.Force3`, `force3.RaggedForce3`)
        4. per active row, in row order: exact verification against its own p (min(1, p/q), residual
           resampling; a tree's SpecInfer rule), its cache kept to what it accepted, commit token by token
           (its `CommittedSequence`: stop criteria, streamer, scores), its level told (rollback / refresh)
        5. the policy told what the step cost and how each level did
    -> each row's sequence and statistics, the call's (`DecodeResult`)

The committed sequence, the scores handed to stopping criteria and processors, and the streamer see each row
as ``generate`` built it (left padding included, `PaddedView`); the model and the caches see the row without
its padding. Batch size 1's returned cache holds exactly the committed sequence but its last token, and grows when a
later call (plain ``generate`` too) continues from it with a longer sequence.

Exactness per row: row ``b``'s levels, caches, processors, acceptance and stop are its own; its forwards attend
exactly over its own entries at its own positions; each level hands up its tokens with the exact law they were
drawn from (docs/exactness.md). Statistics mean one thing for any batch size (`stats.TriForceStats`).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .. import compat
from ..caches.buffer import BufferCache
from ..config import TriForceConfig
from ..forwards.forward import Clock, device_clock
from ..kernels.call_kernels import CallKernels
from ..kernels.row_mixing import RowByRowMixingLayers
from ..stats import TriForceStats
from ..tokens import append_tokens
from ..verification.sampling import ChainVerifier, Sampler, TorchSampler, scores_to_probs
from ..verification.scoring import deferred_nan_checks, process_positions, read_back, row_processors
from ..verification.tree import TreeVerifier
from .hierarchy import Hierarchy
from .levels import Candidates, drafting_sequence
from .policy import Plan
from .report import StepRecorder, aggregate, proposed_of
from .resolved import ResolvedConfig, resolve


@dataclass
class DecodeResult:
    """One call's output. ``stats`` is the call's: batch size 1, the row's own; a batch, counts summed over rows and
    each shared forward's seconds counted once (`report.aggregate`). ``scores``/``logits``/``cache``: batch size 1
    only."""

    sequences: list[torch.LongTensor]  # per row [1, n_b], without its left padding
    row_stats: list[TriForceStats]
    stats: TriForceStats
    scores: list[torch.Tensor] = field(default_factory=list)  # per new token [1, vocab] (output_scores)
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token [1, vocab] (output_logits)
    cache: BufferCache | None = None  # the committed sequence but its last token (cache=, batch size 1)


class PaddedView:
    """Shows processors and stopping criteria the sequence as ``generate`` built them: padding first."""

    def __init__(self, padding: torch.Tensor) -> None:
        self.padding = padding  # [1, pad] token ids, possibly empty

    def __call__(self, sequence: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.padding, sequence), dim=1) if self.padding.shape[1] else sequence

    def processors(self, processors: LogitsProcessorList) -> LogitsProcessorList:
        if not self.padding.shape[1] or not processors:
            return processors
        view = self

        class Padded(LogitsProcessorList):
            def __call__(self, input_ids, scores, **kwargs):
                return processors(view(input_ids), scores, **kwargs)

        return Padded(processors)


class CommittedSequence:
    """One row's committed sequence, with what ``generate`` does per token: scores/logits, streamer, stop check."""

    def __init__(self, input_ids: torch.LongTensor, view: PaddedView, criteria: StoppingCriteriaList | None,
                 max_length: int, streamer=None, keep_scores: bool = False, keep_logits: bool = False) -> None:
        self.sequence = input_ids  # [1, n] without the left padding
        self.host = input_ids.cpu().numpy()  # the same on the host: lookups read it, not the device's
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.view, self.criteria, self.max_length, self.streamer = view, criteria, max_length, streamer
        self.keep_scores, self.keep_logits = keep_scores, keep_logits
        if streamer is not None:
            streamer.put(view(input_ids).cpu())

    def commit(self, token: int, scores: torch.Tensor, logits: torch.Tensor) -> bool:
        """Append one token; True when generation must stop."""
        return self.commit_verified([token], scores[None], logits[None])[1]

    def commit_verified(self, tokens: list[int], scores: torch.Tensor, logits: torch.Tensor) -> tuple[int, bool]:
        """Commit the tokens one verification emitted (token ``i`` with position ``i`` of ``scores``/``logits``) until a
        stop; returns how many were committed and whether generation must stop. The stopping criteria of every
        token up to ``max_length`` are evaluated first and read back at once (one host read, not one per token):
        a criterion may so be asked about a token after the one it stops at, which is then not committed."""
        start = self.sequence.shape[1]
        extended = append_tokens(self.sequence, tokens)
        n = min(len(tokens), self.max_length - start)
        stops = [False] * n
        if self.criteria and n:
            stops = read_back(torch.stack([self.criteria(self.view(extended[:, : start + i + 1]), scores[i][None]).all()
                                           for i in range(n)]))
        committed = next((i + 1 for i, stop in enumerate(stops) if stop), n)
        self.sequence = extended[:, : start + committed]
        self.host = np.concatenate((self.host, [tokens[:committed]]), axis=1)
        for index, token in enumerate(tokens[:committed]):
            if self.keep_scores:
                self.scores.append(scores[index][None])
            if self.keep_logits:
                self.logits.append(logits[index][None].float())
            if self.streamer is not None:
                self.streamer.put(torch.tensor([token]))
        return committed, any(stops) or start + committed >= self.max_length

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


def fixed_shape_counts(fixed_shapes: list, before: list[tuple], tier_mode: str, lean_forward) -> dict:
    """`TriForceDetail.tier_compile`: what the drafting tiers' fixed-shape forwards ran and compiled since ``before``
    (their counters then), and under ``"force3"`` what Force 3's lean forward (``lean_forward``'s, the last of
    ``fixed_shapes``) did."""
    def counts(pairs, mode: str) -> dict:
        return {"mode": mode, "forwards": sum(f.calls - b[0] for f, b in pairs),
                "compiles": sum(f.compiles - b[1] for f, b in pairs),
                "compile_seconds": sum(f.compile_seconds - b[2] for f, b in pairs)}

    pairs = list(zip(fixed_shapes, before))
    own = pairs.pop() if lean_forward is not None else None
    compiled = counts(pairs, tier_mode) if pairs else {}
    if own is not None:
        compiled["force3"] = counts([own], own[0].mode)
    return compiled


@dataclass
class Session:
    """A call's kernels and tier copies while it decodes (`Decoder.session`); ``fill`` writes what they did into a
    row's statistics."""

    kernels: CallKernels
    fixed_shapes: list
    before: list[tuple]  # each fixed-shape forward's (calls, compiles, compile seconds) when the call began
    lean_forward: object
    tier_compile: str
    copy_seconds: float
    row_by_row: RowByRowMixingLayers

    def fill(self, stats: TriForceStats) -> None:
        self.kernels.fill(stats.detail)
        stats.detail.tier_compile = fixed_shape_counts(self.fixed_shapes, self.before, self.tier_compile,
                                                       self.lean_forward)
        stats.detail.draft_copy_seconds = self.copy_seconds


@dataclass
class Row:
    """Row ``index`` of the batch in the loop: its committed output, the verifier's queries at its last cached token
    (a retrieval selection's input), whether it stopped."""

    index: int
    out: CommittedSequence
    queries: dict[int, torch.Tensor]
    prompt_length: int
    done: bool = False


class Decoder:
    """The Force-3 loop of one call. Row ``b`` has its own padding view, processors, drafters, levels, stats and
    stop; every random choice goes through ``sampler`` (default: torch's global RNG).

    Each step runs one plan for all its rows (`policy.Plan`): ``policy="fixed"`` the configured one,
    ``policy="auto"`` the one the call's `AdaptivePolicy` predicts fastest from the call's own timings (the
    batched forwards) and every row's acceptances. Each plan's per-row levels (and, in a batch, their shared
    caches) are built on the plan's first use."""

    def __init__(self, model, config: TriForceConfig | ResolvedConfig, processors: LogitsProcessorList | None,
                 stopping_criteria: StoppingCriteriaList | None, max_lengths: list[int], do_sample: bool,
                 paddings: list[torch.Tensor] | None = None, sampler: Sampler | None = None,
                 clock: Clock | None = None) -> None:
        config = resolve(config, model)  # "auto": lean-int4 where the lean forward covers; the sizes derived
        self.model, self.config, self.do_sample, self.max_lengths = model, config, do_sample, max_lengths
        batch = len(max_lengths)
        paddings = paddings if paddings is not None else [torch.empty(1, 0, dtype=torch.long)] * batch
        self.views = [PaddedView(padding) for padding in paddings]
        # row b's processors see row b as plain batched generate shows it: its padded view, at index b of the batch
        self.processors = [view.processors(row_processors(processors or LogitsProcessorList(), b, batch))
                           for b, view in enumerate(self.views)]
        self.criteria = stopping_criteria
        self.sampler = sampler if sampler is not None else TorchSampler()
        # times the tiers' forwards for the policy and the stats; a device's seconds are read after the fact
        self.clock = clock if clock is not None else device_clock(model)
        self.stats = [TriForceStats() for _ in range(batch)]
        # Force 3's exact rules (the same rule as Force 2's; their own objects, so that a test can alter one level)
        self.force3_verifier = ChainVerifier(do_sample, self.sampler)
        self.force3_tree_verifier = TreeVerifier(do_sample, self.sampler)
        if config.trees and any(window is not None for window in compat.layer_windows(model.config)):
            raise ValueError("TriForceConfig.tree_nodes / force2_tree_nodes > 0: candidate trees are not supported "
                             "on models with sliding-window layers; use 0 (chains)")
        # the rows' sizes as built (`admit_steps` changes a row's own max length, never its caches')
        self.hierarchy = Hierarchy(model, config, self.processors, do_sample, self.sampler, self.clock,
                                   list(max_lengths), paddings)
        self.force3 = self.hierarchy.force3
        self.policy, self.fixed_plan = self.hierarchy.policy, self.hierarchy.fixed_plan
        # timing and accounting: each row's statistics, the call's Force-3 seconds, the policy's observations
        self.recorder = StepRecorder(self.stats, self.policy, self.clock, self.hierarchy.lockstep, do_sample)
        self.prefill_seconds = 0.0
        self.admitted = False  # whether a row joined (`admit_steps`): the policy is seeded on the first

    @property
    def batch(self) -> int:
        return len(self.max_lengths)

    @property
    def force2_verifier(self) -> ChainVerifier:
        return self.hierarchy.force2_verifier

    @property
    def force2_tree_verifier(self) -> TreeVerifier:
        return self.hierarchy.force2_tree_verifier

    def run(self, prompts: list[torch.LongTensor], prefix_cache=None, streamer=None, keep_scores: bool = False,
            keep_logits: bool = False) -> DecodeResult:
        """Decode ``prompts`` (per row ``[1, n_b]``, without padding); ``streamer``, ``keep_scores`` and
        ``keep_logits``: batch size 1."""
        with self.session() as session:
            rows = self._start(prompts, prefix_cache, streamer, keep_scores, keep_logits, session.row_by_row)
            while active := [row for row in rows if not row.done]:
                self._step(active)
            result = self._result(prompts, rows)
        for stats in {id(s): s for s in [*result.row_stats, result.stats]}.values():
            session.fill(stats)
        return result

    @contextmanager
    def session(self) -> Iterator[Session]:
        """What a call holds while it decodes: the kernels built, the attention routes installed, the tiers' copies
        made before the linear layers switch to their routes, NaN checks deferred to the verifications' readbacks."""
        models = [model for model in (self.model, self.config.draft) if not isinstance(model, str)]
        with CallKernels(self.model, models, max(self.max_lengths)) as kernels, ExitStack() as stack:
            began = time.perf_counter()
            tier_models = self.hierarchy.tier_copies()  # a lean or int8 copy is made on a model's first call, then kept
            copy_seconds = time.perf_counter() - began
            fixed_shapes = list({id(f): f for f in (getattr(m, "fixed_shape", None) for m in tier_models)
                                 if f}.values())
            lean_forward = self.force3.lean_forward
            fixed_shapes += [lean_forward.fixed_shape] if lean_forward is not None else []
            session = Session(kernels, fixed_shapes, [(f.calls, f.compiles, f.compile_seconds) for f in fixed_shapes],
                              lean_forward, self.config.tier_compile, copy_seconds, kernels.switch_linear(models))
            stack.enter_context(deferred_nan_checks())
            yield session

    def _start(self, prompts, prefix_cache, streamer, keep_scores: bool, keep_logits: bool,
               row_by_row: RowByRowMixingLayers) -> list[Row]:
        """Prefill every row's full cache and commit each row's first token (sampled from the prefill's last position:
        no Force-3 step) as soon as its row is prefilled, rows in order (a batch's first row streams before the next
        prefills); the policy seeded with what the prefill measured (`Hierarchy.seed_policy`)."""
        rows: list[Row] = []

        def first_token(b: int, logits: torch.Tensor, queries: dict) -> None:
            rows.append(self._first_token(b, prompts[b], logits, queries, self.criteria, streamer, keep_scores,
                                          keep_logits))

        began = time.perf_counter()
        seconds_per_token = self.force3.prefill(prompts, prefix_cache, self.stats, first_token)
        self.prefill_seconds = time.perf_counter() - began
        if [row.index for row in rows] != list(range(len(prompts))):
            raise RuntimeError(f"Force 3's prefill handed up rows {[row.index for row in rows]}, not each row in order")
        row_by_row.enable()  # after the prefill (plain generate prefills with rows together too)
        self.hierarchy.seed_policy(seconds_per_token, max(ids.shape[1] for ids in prompts))
        return rows

    def _first_token(self, b: int, ids: torch.Tensor, logits: torch.Tensor, queries: dict, criteria, streamer=None,
                     keep_scores: bool = False, keep_logits: bool = False) -> Row:
        """Row ``b`` of prompt ``ids`` ``[1, n]`` prefilled (``logits`` ``[1, vocab]`` and ``queries`` at its last
        position): its first token sampled from the prefill's last position (no Force-3 step) and committed."""
        row = Row(b, CommittedSequence(ids, self.views[b], criteria, self.max_lengths[b], streamer, keep_scores,
                                       keep_logits), queries, ids.shape[1])
        scores = process_positions(self.processors[b], ids, logits, ids.shape[1])
        first = self.sampler.categorical(scores_to_probs(scores)[0]) if self.do_sample else int(scores[0].argmax())
        row.done = row.out.commit(first, scores[0], logits[0])
        return row

    def admit_steps(self, b: int, ids: torch.LongTensor, entries: list, max_length: int,
                    criteria: StoppingCriteriaList | None, processors: LogitsProcessorList | None,
                    streamer=None) -> Generator[int, None, Row]:
        """Row ``b`` of a batch, free (its last request's row stopped and `finish_row` ended it), takes a new request
        between two steps: prompt ``ids`` ``[1, n]`` (no padding) after ``entries`` (per layer ``(keys, values)``
        ``[1, kv_heads, held, head_dim]``: its first ``held`` tokens, held < n), up to ``max_length`` tokens,
        stopped by ``criteria``, scored by ``processors`` (its own, as a batch-1 ``generate`` builds them). Its full
        cache row, drafters, levels, statistics and stop are new; the other rows are not touched. A generator of its
        prefill's chunks (each chunk's tokens; the other rows may step in between, row ``b`` taking no part); returns
        the row, its first token committed (`Row.done` where that stopped it)."""
        if self.batch < 2:
            raise ValueError("Decoder.admit_steps: rows join batches (a decoder of two rows or more)")
        if not 0 <= b < self.batch:
            raise ValueError(f"Decoder.admit_steps: row {b} of a batch of {self.batch}")
        if not ids.shape[1] < max_length <= self.hierarchy.max_lengths[b]:
            raise ValueError(f"Decoder.admit_steps: max_length {max_length} must exceed the prompt's {ids.shape[1]} "
                             f"tokens and fit the row's {self.hierarchy.max_lengths[b]}")
        self.recorder.finish()  # the last step's timings counted in the rows that took part in it
        self.stats[b], self.max_lengths[b], self.views[b] = TriForceStats(), max_length, PaddedView(ids[:, :0])
        self.processors[b] = processors if processors is not None else LogitsProcessorList()
        self.hierarchy.reset_row(b, self.processors[b])
        logits, queries = yield from self.force3.admit_steps(b, ids, entries, self.stats[b])
        if not self.admitted:
            self.admitted = True
            self.hierarchy.seed_policy(None, ids.shape[1])
        return self._first_token(b, ids, logits, queries, criteria, streamer)

    def step(self, active: list[Row]) -> None:
        """One Force-3 step of the ``active`` rows (not done; rows may join between steps: `admit_steps`)."""
        self._step(active)

    def finish_row(self, row: Row, session: Session) -> TriForceStats:
        """``row`` stopped: its streamer ended, its statistics completed (`Hierarchy.finish_row`, the call's kernels
        and compiles so far); its batch row is free for `admit_steps`."""
        row.out.end()
        self.recorder.finish()
        stats = self.stats[row.index]
        self.hierarchy.finish_row(stats, row.index, row.out.sequence.shape[1] - row.prompt_length,
                                  self.tier_forwards())
        session.fill(stats)
        return stats

    def _step(self, active: list[Row]) -> None:
        """One Force-3 step of the ``active`` rows: the algorithm; what it costs goes to the recorder."""
        recorder, hierarchy = self.recorder, self.hierarchy
        # 1. plan; each row's level for it, caught up (a draft cache's fill, a selection: not the step's cost)
        plan = self._plan(active)
        recorder.planned(plan)
        levels = {row.index: self._caught_up_level(row, plan) for row in active}
        recorder.started({row.index: self._lookup_proposals(row) for row in active})
        # 2. candidates: every row's level proposes, the rows in lockstep
        candidates = hierarchy.drive({
            row.index: level.candidate_steps(row.out.sequence, self._room(row), plan.gamma1, plan.gamma2,
                                             plan.force1_tree, plan.force2_tree, row.out.host)
            for row in active if (level := levels[row.index]) is not None})
        candidates = {row.index: candidates.get(row.index, Candidates([], None)) for row in active}
        # 3. one Force-3 forward scores every row's candidates
        began = self.clock.start()
        scored = self.force3.score({row.index: row.out.sequence for row in active}, candidates, self.processors)
        recorder.scored(began, scored)
        # 4. per row: verify against its own p, keep what Force 3 accepted, commit, its level told
        for row in active:
            level, proposal = levels[row.index], candidates[row.index]
            accepted, committed = self._verify_row(row, plan, level, proposal, *scored[row.index])
            recorder.row(row.index, level.take_report() if level is not None else None, proposal, accepted, committed)
        # 5. learn: the policy told what the step cost and how each row's levels did
        recorder.ended(candidates)

    def _plan(self, active: list[Row]) -> Plan:
        """The step's plan: the configured one, or the adaptive policy's for the tokens the longest row may add."""
        if self.policy is None:
            return self.fixed_plan
        return self.policy.choose(max(self.max_lengths[row.index] - row.out.sequence.shape[1] for row in active))

    def _room(self, row: Row) -> int:
        """Candidates ``row`` has room for: its tokens left, but the one Force 3 adds."""
        return self.max_lengths[row.index] - row.out.sequence.shape[1] - 1

    def _caught_up_level(self, row: Row, plan: Plan):
        """``row``'s level for ``plan`` (None: plain), caught up with the row (a draft cache's fill, a selection:
        counted in the row's statistics, not in the step's cost)."""
        level = self.hierarchy.level(row.index, plan)
        if level is not None:
            level.start(row.out.sequence, row.queries)
            self.recorder.caught_up(row.index, level.take_report())
        return level

    def _lookup_proposals(self, row: Row) -> dict[str, list[int]]:
        """What each free lookup drafter of the policy would propose next for ``row`` (no state, no randomness)."""
        names = [name for name, kind in self.policy.drafters.items() if kind == "lookup"] if self.policy else []
        return {name: (drafter := self.hierarchy.drafter(row.index, name)).propose(
            drafting_sequence(drafter, row.out.sequence, row.out.host), 1)[0] for name in names}

    def _verify_row(self, row: Row, plan: Plan, level, candidates: Candidates, logits: torch.Tensor,
                    p_scores: torch.Tensor) -> tuple[int, int]:
        """Verify ``row``'s candidates against its own p (``p_scores`` ``[n + 1, vocab]``, ``logits`` the same
        positions unprocessed), keep its accepted entries, commit, tell its level. Returns ``(accepted, committed)``;
        the row's queries become those at its last cached token."""
        b, out, stats = row.index, row.out, self.stats[row.index]
        length, tree = out.sequence.shape[1], candidates.tree
        if tree is not None:  # the accepted path's entries compacted into place
            path, next_token = self.force3_tree_verifier.verify(tree, p_scores)
            self.force3.keep_tree_path(b, length, path)
            stats.detail.tree_side_accepts += tree.side_nodes(path)
            proposals, accepted, last = [tree.tokens[node] for node in path], len(path), path[-1] + 1 if path else 0
            positions = [0] + [node + 1 for node in path]  # the root's, then the accepted path's
            logits, p_scores = logits[positions], p_scores[positions]
            emitted = proposals + [next_token]
        else:
            accepted, next_token = self.force3_verifier.verify(candidates.tokens, candidates.probs, p_scores)
            emitted = self.force3_verifier.emitted(candidates.tokens, accepted, next_token)
            last = accepted
        stats.force3_steps += 1
        stats.force3_accepted += accepted
        stats.force3_rejections += accepted < proposed_of(candidates)
        stats.plan_steps[plan.levels] = stats.plan_steps.get(plan.levels, 0) + 1
        committed, row.done = out.commit_verified(emitted, p_scores, logits)
        stats.force3_tokens += committed
        self.force3.set_length(b, out.sequence.shape[1] - 1)  # the committed sequence but its last token
        row.queries = self.force3.queries(b, last)  # the position of its last cached token
        if not row.done and level is not None:
            level.commit(out.sequence, accepted, proposed_of(candidates), row.queries, emitted[:committed])
        return accepted, committed

    def tier_forwards(self) -> dict[str, str]:
        """Per tier that ran a drafting forward in a step (``"force1 <drafter>"``, ``"force2"``), the forward it ran,
        and Force 3's (`tiers.tier_forwards`). Lookup drafters run none."""
        return self.hierarchy.tier_forwards(self.recorder.tiers_run, self.force3.forward)

    def _result(self, prompts: list[torch.Tensor], rows: list[Row]) -> DecodeResult:
        self.recorder.finish()
        for row in rows:
            row.out.end()
        forwards, hierarchy = self.tier_forwards(), self.hierarchy
        for b, stats in enumerate(self.stats):
            hierarchy.finish_row(stats, b, rows[b].out.sequence.shape[1] - prompts[b].shape[1], forwards)
        total = aggregate(self.stats, float(self.recorder.force3_seconds), self.prefill_seconds)
        # the call's seconds count each shared forward once (a row's stats count every forward it took part in)
        lockstep, detail = hierarchy.lockstep, total.detail
        total.force2_seconds = float(lockstep.seconds.get("force2", total.force2_seconds))
        total.force1_seconds = hierarchy.shared_force1_seconds()
        detail.lockstep_forwards, detail.lockstep_requests = lockstep.forwards, lockstep.requests
        hierarchy.count_cache_bytes(total)
        if self.policy is not None:
            detail.plans = self.policy.summary()
        row_stats = [total] if self.batch == 1 else self.stats
        result = DecodeResult([row.out.sequence for row in rows], row_stats, total)
        if self.batch == 1:
            result.scores, result.logits = rows[0].out.scores, rows[0].out.logits
            # the caller may continue from it with any longer sequence (plain generate or TriForce): it grows
            result.cache = self.force3.cache.allow_growth()
        return result
