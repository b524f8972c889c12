"""The Force-3 loop: one `Decoder` serves one ``generate`` call, of batch size 1 or more.

    prefill every row's full cache -> first tokens
    until every row stopped:
        1. choose the step's plan (`policy.Plan`: plain, two or three levels, chains or trees)
        2. every active row's level proposes candidates (its Force 2 over its Force 1, or Force 1): the rows in
           lockstep, rows whose caches share storage running one forward per tier (`Lockstep`)
        3. Force 3 scores every active row's candidates in one forward (`force3.Force3`, `force3.RaggedForce3`)
        4. per active row, in row order: exact verification against its own p (min(1, p/q), residual
           resampling; a tree's SpecInfer rule), its cache kept to what it accepted, commit token by token
           (stop criteria, streamer), its level told (rollback / refresh)
        5. the policy told what the step cost and how each level did

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
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .. import compat
from ..config import TriForceConfig
from ..drafters import DRAFTERS
from ..drafters.model import ModelDrafter
from ..drafters.registry import MODEL_DRAFTER, drafting_sequence, spec_of
from ..forwards.clock import Clock, device_clock
from ..kernels import cpu_kernels
from ..kernels.attention_routes import attention_routes
from ..kernels.attention_routes import describe as describe_attention
from ..kernels.linear_routes import linear_routes
from ..kernels.row_mixing import RowsApart
from ..stats import TriForceStats
from ..verification.sampling import ChainVerifier, Sampler, TorchSampler, scores_to_probs
from ..verification.scoring import deferred_nan_checks, process_rows, row_processors
from ..verification.tree import TreeVerifier
from .hierarchy import Hierarchy
from .levels import Candidates
from .output import DecodeResult, Output, PaddedView
from .policy import ROW_COST_SLOPE, ROW_COST_SLOPES, AdaptivePolicy, Plan
from .report import StepRecorder, aggregate, proposed_of
from .resolved import ResolvedConfig, resolve
from .tiers import (
    kv_bytes_per_token,
    lean_self_drafting,
    tier_model,
    weight_bytes,
)


def adaptive_policy(config: ResolvedConfig, max_length: int, target=None) -> AdaptivePolicy | None:
    """``policy="auto"``: the configured drafter plus the free n-gram lookup (and, beside a draft model, the target's
    own lean copy where it drafts lean: the ``"self"`` drafter; `lean_self_drafting`), each as Force 1 of three levels
    too if ``levels=3`` and the request (``max_length`` tokens) is longer than the retrieval budget, with
    tree plans beside the chain plans where the config sets ``tree_nodes`` (drafters that propose trees) or
    ``force2_tree_nodes`` (three levels); ``"fixed"``: None (every step runs the configured plan).
    """
    if config.policy == "fixed":
        return None
    kinds = {config.draft_name: spec_of(config.draft).kind}
    if target is not None and lean_self_drafting(config, target):
        kinds["self"] = DRAFTERS["self"].kind
    kinds.setdefault("ngram", DRAFTERS["ngram"].kind)  # the free lookup, scored on every step
    # three levels only where Force 2 can see less than Force 3: a retrieval budget covering the whole
    # request makes Force 2 a copy of Force 3 at the same cost
    sparse = max_length > config.retrieval_budget
    three = tuple(kinds) if config.levels == 3 and sparse else ()
    trees = tuple(name for name in kinds if DRAFTERS[name].trees) if config.tree_nodes else ()
    return AdaptivePolicy(kinds, three, config.gamma1, config.gamma2, config.explore_every,
                          tree_drafters=trees, tree_nodes=config.tree_nodes if trees else 0,
                          force2_tree_nodes=config.force2_tree_nodes, tree_branch=config.tree_branch,
                          max_lookup_gamma2=config.lookup_gamma2, row_cost_slope=row_cost_slope(target),
                          refresh_every=config.refresh_interval)


def row_cost_slope(target) -> float:
    """The per-row cost prior of ``target``'s device type (`policy.ROW_COST_SLOPES`; a CPU's for any other)."""
    device = getattr(target, "device", None)
    return ROW_COST_SLOPES.get(getattr(device, "type", "cpu"), ROW_COST_SLOPE)


def fixed_shape_counts(fixed_shapes: list, before: list[tuple], tier_mode: str, lean_forward) -> dict:
    """`TriForceStats.tier_compile`: what the drafting tiers' fixed-shape forwards ran and compiled since ``before``
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
class Row:
    """Row ``index`` of the batch in the loop: its committed output, the verifier's queries at its last cached token
    (a retrieval selection's input), whether it stopped."""

    index: int
    out: Output
    queries: dict[int, torch.Tensor]
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
        self.hierarchy = Hierarchy(model, config, self.processors, do_sample, self.sampler, self.clock, max_lengths,
                                   paddings)
        self.force3 = self.hierarchy.force3
        self.draft_name = config.draft_name
        self.policy = adaptive_policy(config, max(max_lengths), model)
        self.fixed_plan = Plan(config.levels, self.draft_name, config.gamma1, config.gamma2,
                               force1_tree=bool(config.tree_nodes), force2_tree=bool(config.force2_tree_nodes))
        # timing and accounting: each row's statistics, the call's Force-3 seconds, the policy's observations
        self.recorder = StepRecorder(self.stats, self.policy, self.clock, self.hierarchy.lockstep, do_sample)
        self.prefill_seconds = 0.0

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
        began = time.perf_counter()
        tier_models = self._tier_models()  # a lean or int8 copy is made on a model's first call, then kept
        copy_seconds = time.perf_counter() - began
        fixed_shapes = list({id(f): f for f in (getattr(m, "fixed_shape", None) for m in tier_models) if f}.values())
        lean_forward = self.force3.lean_forward
        fixed_shapes += [lean_forward.fixed_shape] if lean_forward is not None else []
        before = [(f.calls, f.compiles, f.compile_seconds) for f in fixed_shapes]
        models = [model for model in (self.model, self.config.draft) if not isinstance(model, str)]
        build_seconds = cpu_kernels.prepare(models)  # compiled here, if at all: not inside a timed forward
        # the models' CPU linear layers multiply few rows by the route timed fastest on this CPU (`linear_routes`), and
        # attention over a long cache takes the kernel where it was timed cheaper (`attention_routes`)
        routes = [linear_routes(model) for model in models]
        calibrated = [r.calibration_seconds for r in routes]
        bypassed = dict(routes[0].bypassed)
        attention = attention_routes(self.model)
        attention_calibrated = attention.calibration_seconds
        with ExitStack() as stack:
            for model_routes in routes:
                stack.enter_context(model_routes.installed())
            stack.enter_context(attention.installed(self.model, max(self.max_lengths)))
            rows_apart = stack.enter_context(RowsApart(self.model))
            stack.enter_context(deferred_nan_checks())  # NaN checks read with the verifications' readbacks
            rows = self._start(prompts, prefix_cache, streamer, keep_scores, keep_logits, rows_apart)
            while active := [row for row in rows if not row.done]:
                self._step(active)
            result = self._result(prompts, rows)
        compiled = fixed_shape_counts(fixed_shapes, before, self.config.tier_compile, lean_forward)
        for stats in {id(s): s for s in [*result.row_stats, result.stats]}.values():
            stats.linear_routes = routes[0].used()
            stats.linear_calibration_seconds = sum(r.calibration_seconds - c for r, c in zip(routes, calibrated))
            stats.linear_bypassed = {why: calls - bypassed.get(why, 0) for why, calls in routes[0].bypassed.items()
                                     if calls > bypassed.get(why, 0)}
            stats.attention_routes = attention.used()
            stats.attention_calibration_seconds = attention.calibration_seconds - attention_calibrated
            stats.attention_kernel = describe_attention(self.model)
            stats.cpu_kernels = cpu_kernels.describe(self.model)
            stats.kernel_build_seconds = build_seconds
            stats.tier_compile = dict(compiled)
            stats.draft_copy_seconds = copy_seconds
        return result

    def tier_fractions(self, context: int) -> dict[str, float]:
        """The target's own tiers' one-row forwards as fractions of Force 3's at ``context`` tokens, by bytes read
        (a one-row forward is memory-bound): Force 1 self-drafting (``"draft:self"``: its tier weights and a
        sink+window cache) and Force 2 (``"force2"``: its tier weights and the retrieval budget), against the
        target's weights and the full cache (the policy's priors until each tier is timed)."""
        per_token = self.force3.nbytes() / max(self.max_lengths)  # the full cache's bytes per position
        force3 = weight_bytes(self.model) + context * per_token
        window = self.config.sink_tokens + self.config.window
        fractions = {}  # the tiers the policy may run (pricing one makes its copy)
        if "self" in self.policy.drafters:
            force1 = weight_bytes(tier_model(self.model, self.config.draft_precision, 1)) + window * per_token
            fractions["draft:self"] = force1 / force3
        if self.policy.three_level:
            force2 = weight_bytes(tier_model(self.model, self.config.draft_precision, 2)) + \
                min(self.config.retrieval_budget, context) * per_token
            fractions["force2"] = force2 / force3
        for name, drafter in self.filled_drafters().items():  # a draft model: its drafting copy and its own cache
            own = weight_bytes(drafter.model) + window * kv_bytes_per_token(drafter.fill_model)
            fractions[f"draft:{name}"] = own / force3
        return fractions

    def filled_drafters(self) -> dict[str, ModelDrafter]:
        """The policy's model drafters that fill their caches by a forward (a draft model; the self drafter copies
        the full cache's entries), row 0's, by name."""
        models = [name for name, kind in self.policy.drafters.items() if kind == "model"] if self.policy else []
        return {name: drafter for name in models if (drafter := self.hierarchy.drafter(0, name)).source is None}

    def drafting_tiers(self) -> tuple[bool, set[str]]:
        """What the plans this call may choose can run: whether Force 2 (a three-level plan), and which drafters
        that run a model (`DrafterSpec.kind` ``"model"``)."""
        if self.policy is None:
            three, drafters = self.fixed_plan.levels == 3, {self.fixed_plan.drafter}
        else:
            three, drafters = bool(self.policy.three_level), set(self.policy.drafters)
        return three, {name for name in drafters if name and DRAFTERS[name].kind == "model"}

    def _tier_models(self) -> list:
        """The models Force 1 and Force 2 run for the config's drafting precision in the plans this call may choose
        (`tiers.tier_model`: the models themselves for ``"model"``): Force 2's where a plan has three levels, the self
        drafter's and a draft model's where they may draft. A lookup drafter verified by Force 3 alone runs none, so
        no copy is made."""
        three, drafters = self.drafting_tiers()
        tiers = [(self.model, 2)] if three else []
        tiers += [(model, 1) for name, model in (("self", self.model), (MODEL_DRAFTER, self.config.draft))
                  if name in drafters]
        return [self.hierarchy.tier_model(model, tier) for model, tier in tiers]

    def _start(self, prompts, prefix_cache, streamer, keep_scores: bool, keep_logits: bool,
               rows_apart: RowsApart) -> list[Row]:
        """Prefill every row's full cache and commit each row's first token (sampled from the prefill's last row: no
        Force-3 step); the policy set up with what the prefill measured."""
        began = time.perf_counter()
        first_logits, queries, seconds_per_token = self.force3.prefill(prompts, prefix_cache, self.stats)
        self.prefill_seconds = time.perf_counter() - began
        rows_apart.enable()  # after the prefill (plain generate prefills with rows together too)
        rows = []
        for b, ids in enumerate(prompts):
            row = Row(b, Output(ids, self.views[b], self.criteria, self.max_lengths[b], streamer, keep_scores,
                                keep_logits), queries[b])
            scores = process_rows(self.processors[b], ids, first_logits[b], ids.shape[1])
            first = self.sampler.categorical(scores_to_probs(scores)[0]) if self.do_sample else int(scores[0].argmax())
            row.done = row.out.commit(first, scores[0], first_logits[b][0])
            rows.append(row)
        if self.policy is not None:  # a draft cache's fill is a short-context prefill, priced at the prefill's speed
            window = self.config.sink_tokens + self.config.window
            fill_rows = {name: window * weight_bytes(drafter.fill_model) / weight_bytes(self.model)
                         for name, drafter in self.filled_drafters().items()}  # a copy: ~free
            self.policy.set_up(fill_rows, seconds_per_token, self.tier_fractions(max(ids.shape[1] for ids in prompts)))
        return rows

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
            level, found = levels[row.index], candidates[row.index]
            accepted, committed = self._verify_row(row, plan, level, found, *scored[row.index])
            recorder.row(row.index, level.take_report() if level is not None else None, found, accepted, committed)
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
        """Verify ``row``'s candidates against its own p (``p_scores`` ``[n + 1, vocab]``, ``logits`` the same rows
        unprocessed), keep its accepted entries, commit, tell its level. Returns ``(accepted, committed)``; the row's
        queries become those at its last cached token."""
        b, out, stats = row.index, row.out, self.stats[row.index]
        length, tree = out.sequence.shape[1], candidates.tree
        if tree is not None:  # the accepted path's entries compacted into place
            path, next_token = self.force3_tree_verifier.verify(tree, p_scores)
            self.force3.keep_tree_path(b, length, path)
            stats.tree_side_accepts += tree.side_nodes(path)
            proposals, accepted, last_row = [tree.tokens[node] for node in path], len(path), path[-1] + 1 if path else 0
            rows = [0] + [node + 1 for node in path]
            logits, p_scores = logits[rows], p_scores[rows]
            emitted = proposals + [next_token]
        else:
            accepted, next_token = self.force3_verifier.verify(candidates.tokens, candidates.probs, p_scores)
            emitted = self.force3_verifier.emitted(candidates.tokens, accepted, next_token)
            last_row = accepted
        stats.force3_steps += 1
        stats.force3_accepted += accepted
        stats.plan_steps[plan.levels] = stats.plan_steps.get(plan.levels, 0) + 1
        committed, row.done = out.commit_verified(emitted, p_scores, logits)
        stats.force3_tokens += committed
        self.force3.set_length(b, out.sequence.shape[1] - 1)  # the committed sequence but its last token
        row.queries = self.force3.queries(b, last_row)
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
        forwards, (three, drafters) = self.tier_forwards(), self.drafting_tiers()
        hierarchy = self.hierarchy
        for b, stats in enumerate(self.stats):
            stats.draft_caches.update(hierarchy.draft_caches())
            stats.tier_forwards = dict(forwards)
            stats.draft_precision = self.config.draft_precision if three or drafters else "none"
            stats.force1_seconds = hierarchy.force1_seconds(b)
            stats.draft_prefill_seconds = hierarchy.draft_prefill_seconds(b)
            stats.new_tokens = rows[b].out.sequence.shape[1] - prompts[b].shape[1]
            stats.force2_sees_whole_cache = hierarchy.force2_sees_whole_cache(b)
            stats.retrieval_cache_bytes = hierarchy.retrieval_cache_bytes(b)
            stats.draft_cache_bytes = hierarchy.draft_cache_bytes(b)
            stats.retrieval_summary_bytes = hierarchy.retrieval_summary_bytes(b)
        total = aggregate(self.stats, float(self.recorder.force3_seconds), self.prefill_seconds)
        # the call's seconds count each shared forward once (a row's stats count every forward it took part in)
        total.force2_seconds = float(hierarchy.lockstep.seconds.get("force2", total.force2_seconds))
        total.force1_seconds = hierarchy.shared_force1_seconds()
        total.lockstep_forwards, total.lockstep_requests = hierarchy.lockstep.forwards, hierarchy.lockstep.requests
        total.full_cache_bytes = self.force3.nbytes()
        total.device_resident_bytes = (self.force3.resident_bytes() + total.retrieval_cache_bytes
                                       + total.draft_cache_bytes + total.retrieval_summary_bytes)
        if self.policy is not None:
            total.plans = self.policy.summary()
        row_stats = [total] if self.batch == 1 else self.stats
        result = DecodeResult([row.out.sequence for row in rows], row_stats, total)
        if self.batch == 1:
            result.scores, result.logits = rows[0].out.scores, rows[0].out.logits
            # the caller may continue from it with any longer sequence (plain generate or TriForce): it grows
            result.cache = self.force3.cache.allow_growth()
        return result
