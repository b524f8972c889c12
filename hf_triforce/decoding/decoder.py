"""Force 3: the target on its full cache verifies what the level below proposes, one forward per step.

One `TriForceDecoder` serves one ``generate`` call (batch size 1)::

    prefill the full cache -> first token
    level.start(sequence, queries)
    until a stop:
        candidates = level.get_candidates(sequence, room)      # Force 2 over Force 1, or Force 1
        p = scores of sequence + candidates on the full cache  # one forward, queries recorded
        accepted, next = verifier.verify(candidates, p)        # exact: min(1, p/q), residual resampling
        full cache rolls back to the committed length; commit tokens one by one (stop criteria, streamer)
        level.commit(sequence, queries at the last cached row)

The committed sequence, the scores handed to stopping criteria and processors, and the streamer see the
prompt as ``generate`` received it (left padding included, `PaddedView`); the model and the caches see
the prompt without its padding. The returned cache holds exactly the committed sequence but its last token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .. import compat
from ..caches.buffer import BufferCache, copy_prefix
from ..caches.offloaded import OffloadedBufferCache
from ..compat import layer_devices
from ..config import TriForceConfig
from ..drafters import DRAFTERS, DraftContext, build_drafter
from ..drafters.registry import MODEL_DRAFTER, spec_of
from ..kernels.attention import QueryRecorder
from ..kernels.output_head import weight_left_output_layer
from ..kernels.quantized import drafting_model
from ..kernels.row_mixing import RowsApart
from ..stats import TriForceStats
from ..verification.sampling import ChainVerifier, Sampler, TorchSampler, scores_to_probs
from ..verification.scoring import process_rows
from ..verification.tree import TreeVerifier
from .forward import prefill, score_continuation, settle
from .levels import Candidates, Force1Only, Force2
from .policy import AdaptivePolicy, Plan
from .tree_forward import score_tree


@dataclass
class DecodeResult:
    sequences: torch.LongTensor  # without the left padding
    stats: TriForceStats
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    cache: BufferCache | None = None


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


class Output:
    """The committed sequence, with what ``generate`` does per token: scores/logits, streamer, stop check."""

    def __init__(self, input_ids: torch.LongTensor, view: PaddedView, criteria: StoppingCriteriaList | None,
                 max_length: int, streamer, keep_scores: bool, keep_logits: bool, stats: TriForceStats) -> None:
        self.result = DecodeResult(input_ids, stats)
        self.view, self.criteria, self.max_length, self.streamer = view, criteria, max_length, streamer
        self.keep_scores, self.keep_logits = keep_scores, keep_logits
        if streamer is not None:
            streamer.put(view(input_ids).cpu())

    @property
    def sequence(self) -> torch.LongTensor:
        return self.result.sequences

    def commit(self, token: int, scores: torch.Tensor, logits: torch.Tensor) -> bool:
        """Append one token; True when generation must stop."""
        result = self.result
        result.sequences = torch.cat((result.sequences, result.sequences.new_tensor([[token]])), dim=1)
        if self.keep_scores:
            result.scores.append(scores[None])
        if self.keep_logits:
            result.logits.append(logits[None].float())
        if self.streamer is not None:
            self.streamer.put(torch.tensor([token]))
        stopped = bool(self.criteria(self.view(result.sequences), scores[None]).all()) if self.criteria else False
        return stopped or result.sequences.shape[1] >= self.max_length

    def commit_verified(self, tokens: list[int], scores: torch.Tensor, logits: torch.Tensor) -> tuple[int, bool]:
        """Commit the tokens one verification emitted (token ``i`` with row ``i`` of ``scores``/``logits``) until a
        stop; returns how many were committed and whether generation must stop."""
        for index, token in enumerate(tokens):
            if self.commit(token, scores[index], logits[index]):
                return index + 1, True
        return len(tokens), False

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


def adaptive_policy(config: TriForceConfig, draft_name: str, max_length: int) -> AdaptivePolicy | None:
    """``policy="auto"``: the configured drafter plus the free n-gram lookup, each as Force 1 of three levels
    too if ``levels=3`` and the request (``max_length`` tokens) is longer than the retrieval budget, with
    tree plans beside the chain plans where the config sets ``tree_nodes`` (drafters that propose trees) or
    ``force2_tree_nodes`` (three levels); ``"fixed"``: None (every step runs the configured plan)."""
    if config.policy == "fixed":
        return None
    kinds = {draft_name: spec_of(config.draft).kind}
    kinds.setdefault("ngram", DRAFTERS["ngram"].kind)  # the free lookup, scored on every step
    # three levels only where Force 2 can see less than Force 3: a retrieval budget covering the whole
    # request makes Force 2 a copy of Force 3 at the same cost
    sparse = max_length > config.retrieval_budget
    three = tuple(kinds) if config.levels == 3 and sparse else ()
    trees = tuple(name for name in kinds if DRAFTERS[name].trees) if config.tree_nodes else ()
    return AdaptivePolicy(kinds, three, config.gamma1, config.gamma2, config.explore_every,
                          tree_drafters=trees, tree_nodes=config.tree_nodes if trees else 0,
                          force2_tree_nodes=config.force2_tree_nodes, tree_branch=config.tree_branch)


class TriForceDecoder:
    """The Force-3 loop of one call. ``sampler`` draws every random choice (default: torch's global RNG)."""

    def __init__(self, model, config: TriForceConfig, processors: LogitsProcessorList | None,
                 stopping_criteria: StoppingCriteriaList | None, max_length: int, do_sample: bool,
                 padding: torch.Tensor | None = None, sampler: Sampler | None = None) -> None:
        self.model, self.config, self.max_length, self.do_sample = model, config, max_length, do_sample
        self.view = PaddedView(padding if padding is not None else torch.empty(1, 0, dtype=torch.long))
        self.processors = self.view.processors(processors or LogitsProcessorList())
        self.criteria = stopping_criteria
        self.sampler = sampler if sampler is not None else TorchSampler()
        self.stats = TriForceStats(draft_precision=config.draft_precision)
        # one verification rule per level (the same exact rule; separate objects so a test can alter one level)
        self.force2_verifier = ChainVerifier(do_sample, self.sampler)
        self.force3_verifier = ChainVerifier(do_sample, self.sampler)
        self.force2_tree_verifier = TreeVerifier(do_sample, self.sampler)  # TriForceConfig.tree_nodes > 0
        self.force3_tree_verifier = TreeVerifier(do_sample, self.sampler)
        if config.trees and any(window is not None for window in compat.layer_windows(model.config)):
            raise ValueError("TriForceConfig.tree_nodes / force2_tree_nodes > 0: candidate trees are not supported "
                             "on models with sliding-window layers; use 0 (chains)")
        self.draft_name = config.draft if isinstance(config.draft, str) else MODEL_DRAFTER
        self.drafters: dict[str, object] = {}
        self.levels: dict[tuple[int, str], object] = {}
        self.policy = adaptive_policy(config, self.draft_name, max_length)
        self.fixed_plan = Plan(config.levels, self.draft_name, config.gamma1, config.gamma2,
                               force1_tree=bool(config.tree_nodes), force2_tree=bool(config.force2_tree_nodes))

    def drafter(self, name: str):
        """The drafter ``name`` (``"model"``: the config's draft model), built once per call."""
        if name not in self.drafters:
            config = self.config if name == self.draft_name else replace(self.config, draft=name)
            context = DraftContext(self.model, config, self.processors, self.do_sample, self.sampler)
            self.drafters[name] = build_drafter(context)
        return self.drafters[name]

    def level(self, plan: Plan, full: BufferCache):
        """The level that proposes for ``plan``: None (plain), `Force1Only` or `Force2` (built once)."""
        if plan.levels == 1:
            return None
        key = (plan.levels, plan.drafter)
        if key not in self.levels:
            drafter = self.drafter(plan.drafter)
            if plan.levels == 2:
                self.levels[key] = Force1Only(drafter, self.config, self.stats)
            else:
                drafting_target = drafting_model(self.model, self.config.draft_precision)
                timed = self.policy.observe_forward if self.policy is not None else None
                self.levels[key] = Force2(drafting_target, drafter, self.config, self.processors,
                                          self.force2_verifier, full, self.stats, timed, self.force2_tree_verifier)
        return self.levels[key]

    def drafter_setup_estimate(self, prefill_seconds_per_token: float | None) -> dict[str, float | None]:
        """Seconds a model drafter's first use costs: filling its sink+window cache at the prefill's speed
        (None: unknown, the policy's fallback applies)."""
        rows = self.config.sink_tokens + self.config.window
        return {name: None if prefill_seconds_per_token is None else rows * prefill_seconds_per_token
                for name, kind in self.policy.drafters.items() if kind == "model"}

    def _drafter_seconds(self) -> float:
        return sum(drafter.seconds for drafter in self.drafters.values())

    def _observe(self, plan: Plan, level, candidates: Candidates, accepted: int, first_scores: torch.Tensor,
                 counterfactual: dict[str, list[int]], force3_seconds: float, before: tuple, drafted_before: float,
                 step_seconds: float, committed: int) -> None:
        """Tell the policy what the step cost and how each level did (timings, acceptances, counterfactuals)."""
        policy, tree = self.policy, candidates.tree
        proposed = len(candidates.tokens) if tree is None else max(tree.depths(), default=0)
        if tree is None:
            policy.observe_forward("force3", proposed + 1, force3_seconds)
        else:
            policy.observe_forward("force3-tree", len(tree) + 1, force3_seconds)
        forward_seconds = force3_seconds
        probs = scores_to_probs(first_scores) if self.do_sample else None
        for name, tokens in counterfactual.items():
            if tokens:
                token = tokens[0]
                acceptance = float(probs[token]) if probs is not None else float(int(first_scores.argmax()) == token)
                policy.observe_lookup(name, True, acceptance)
            else:
                policy.observe_lookup(name, False, 0.0)
        drafted = self._drafter_seconds() - drafted_before
        lookup = plan.levels > 1 and policy.drafters[plan.drafter] == "lookup"
        if plan.levels == 2:
            if proposed:
                policy.observe_direct(plan.drafter, accepted, proposed, plan.force1_tree)
                # model drafters: seconds per drafted token; lookups: seconds per call
                policy.observe_forward(f"draft:{plan.drafter}", 1, drafted if lookup else drafted / proposed)
        elif plan.levels == 3:
            f2_accepted = self.stats.force2_accepted - before[0]
            f2_rejections = level.rejections - before[1]
            policy.observe_three_level(plan, f2_accepted, f2_rejections, accepted, proposed)
            drafts = self.stats.force1_proposed - before[3]
            if drafts and not lookup:
                policy.observe_forward(f"draft:{plan.drafter}", 1, drafted / drafts)
            forward_seconds += self.stats.force2_seconds - before[2]
            forward_seconds += self.stats.retrieval_seconds - before[4]  # selection: its own term in the model
        policy.observe_step(plan, committed, step_seconds, forward_seconds + drafted)

    def run(self, input_ids: torch.LongTensor, streamer=None, prefix_cache=None, keep_scores: bool = False,
            keep_logits: bool = False) -> DecodeResult:
        with weight_left_output_layer(self.model) as weight_left, RowsApart(self.model) as rows_apart:
            self.rows_apart = rows_apart  # enabled after the prefill (plain generate prefills batched too)
            result = self._run(input_ids, streamer, prefix_cache, keep_scores, keep_logits)
        self.stats.weight_left_output_layer = weight_left
        return result

    def _run(self, input_ids, streamer, prefix_cache, keep_scores, keep_logits) -> DecodeResult:
        config, stats, recorder = self.config, self.stats, QueryRecorder()
        cache_class = OffloadedBufferCache if config.full_cache_device == "cpu" else BufferCache
        # sliding-window layers keep their window plus room for the deepest rollback (a rejected chain, a stop)
        room = config.force3_rows  # a verification's proposals: a chain or a tree
        full = cache_class(compat.num_layers(self.model.config), self.max_length + room + 2,
                           compat.layer_windows(self.model.config), rollback=config.gamma2 + 2)
        full.expect_devices(layer_devices(self.model))
        cached = copy_prefix(prefix_cache, full) if prefix_cache is not None else 0
        out = Output(input_ids, self.view, self.criteria, self.max_length, streamer, keep_scores, keep_logits, stats)

        start, chunks = time.perf_counter(), []
        logits = prefill(self.model, input_ids[:, cached:], full, config.prefill_chunk_size, config.show_progress,
                         recorder, chunks)
        stats.prefill_seconds = time.perf_counter() - start
        self.rows_apart.enable()
        scores = process_rows(self.processors, input_ids, logits, input_ids.shape[1])
        first = self.sampler.categorical(scores_to_probs(scores)[0]) if self.do_sample else int(scores[0].argmax())
        done = out.commit(first, scores[0], logits[0])

        queries = recorder.at(-1)
        if self.policy is not None:
            # a draft cache's fill is a short-context prefill: priced from a first prefill chunk that started at
            # position 0 with enough rows to say; else (a cache= prefix) the policy prices it from Force 3
            measured = bool(chunks) and cached == 0 and chunks[0][0] >= 64
            self.policy.setup_seconds = self.drafter_setup_estimate(chunks[0][1] / chunks[0][0] if measured else None)
        lookups = [name for name, kind in (self.policy.drafters.items() if self.policy else []) if kind == "lookup"]
        while not done:
            length = out.sequence.shape[1]
            plan = self.policy.choose(self.max_length - length) if self.policy is not None else self.fixed_plan
            level = self.level(plan, full)
            if level is not None:  # one-time set-up (draft cache prefill, first selection) is not the step's cost
                level.start(out.sequence, queries)
                if self.policy is not None:
                    self.policy.started(plan.drafter)
            # what each free lookup would propose next, scored against Force 3 below (no state, no randomness)
            counterfactual = {name: self.drafter(name).propose(out.sequence, 1)[0] for name in lookups}
            step_start, drafted_before = time.perf_counter(), self._drafter_seconds()
            before = (stats.force2_accepted, getattr(level, "rejections", 0), stats.force2_seconds,
                      stats.force1_proposed, stats.retrieval_seconds)
            if level is not None:
                candidates = level.get_candidates(out.sequence, self.max_length - length - 1, plan.gamma1, plan.gamma2,
                                                  plan.force1_tree, plan.force2_tree)
            else:
                candidates = Candidates([], None)
            proposals = candidates.tokens
            uncached = length - full.length
            begin = time.perf_counter()
            if candidates.tree is not None:  # one tree forward; the accepted path's entries compacted into place
                tree = candidates.tree
                logits, p_scores = score_tree(self.model, full, full.length, out.sequence, tree, self.processors,
                                              recorder)
                settle(p_scores)
                path, next_token = self.force3_tree_verifier.verify(tree, p_scores)
                full.keep_rows(length, path)
                stats.tree_side_accepts += tree.side_nodes(path)
                proposals, accepted = [tree.tokens[node] for node in path], len(path)
                rows = [0] + [node + 1 for node in path]
                logits, p_scores = logits[rows], p_scores[rows]
                last_row = uncached + path[-1] if path else uncached - 1  # the recorder's row of the last token
            else:
                extended = torch.cat((out.sequence, out.sequence.new_tensor([proposals])), dim=1)
                logits, p_scores = score_continuation(self.model, full, full.length, extended, length,
                                                      self.processors, recorder)
                settle(p_scores)
                accepted, next_token = self.force3_verifier.verify(proposals, candidates.probs, p_scores)
                last_row = uncached - 1 + accepted
            force3_seconds = time.perf_counter() - begin
            stats.force3_seconds += force3_seconds
            full.rollback(length + accepted)
            stats.force3_steps += 1
            stats.force3_accepted += accepted
            stats.plan_steps[plan.levels] = stats.plan_steps.get(plan.levels, 0) + 1
            committed, done = out.commit_verified(proposals[:accepted] + [next_token], p_scores, logits)
            stats.force3_tokens += committed
            queries = recorder.at(last_row)
            if not done and level is not None:
                proposed = len(proposals) if candidates.tree is None else max(candidates.tree.depths(), default=0)
                level.commit(out.sequence, accepted, proposed, queries)
            if self.policy is not None:
                self._observe(plan, level, candidates, accepted, p_scores[0], counterfactual, force3_seconds,
                              before, drafted_before, time.perf_counter() - step_start, committed)
        full.rollback(out.sequence.shape[1] - 1)  # a stop inside an accepted run commits fewer tokens
        out.end()
        stats.force1_seconds = self._drafter_seconds()
        stats.new_tokens = out.sequence.shape[1] - input_ids.shape[1]
        stats.full_cache_bytes = full.nbytes()
        stats.retrieval_cache_bytes = sum(level.nbytes() for level in self.levels.values())
        stats.draft_cache_bytes = sum(drafter.nbytes() for drafter in self.drafters.values())
        stats.retrieval_summary_bytes = sum(level.summary_bytes() for level in self.levels.values())
        stats.device_resident_bytes = (full.resident_bytes() + stats.retrieval_cache_bytes + stats.draft_cache_bytes
                                       + stats.retrieval_summary_bytes)
        if self.policy is not None:
            stats.plans = self.policy.summary()
        out.result.cache = full
        return out.result
