"""Batches: Force 3 verifies every row in one forward, each row accepting its own number of tokens.

One `BatchDecoder` serves one ``generate`` call of batch size > 1 (left-padded prompts of different
lengths, or the copies of ``num_return_sequences``)::

    prefill each distinct prompt once on its row of a `RaggedBufferCache` (copies share it) -> first tokens
    until every row stopped:
        every active row's level proposes candidates (its own Force 2 over its own Force 1), the rows in lockstep:
            the rows' Force-1 forwards run as one batched forward, so do their Force-2 forwards (`Lockstep`)
        one batched Force-3 forward: row b gets [its last token, its candidates, dummies up to the widest row],
            placed after its own cached entries (per-row positions, `ragged_causal_mask`)
        per active row: exact verification against its own p, its cache length set to what it committed,
            commit token by token (stop criteria), its level told (rollback / refresh)

Exactness per row: row ``b``'s queries attend exactly over its own entries (the mask hides padding, dummies
and the other rows' longer columns: they contribute exactly zero after the softmax), at its own positions,
so its p is the target's p for that row up to summation order, as in plain batched ``generate``. Force 2 and
Force 1 keep each row's own caches, selection and acceptance; their forwards are batched across rows the same
way (`hf_triforce.lockstep`), and each row's q/r is the law that row drew from.

Each step runs one plan for every row: ``policy="fixed"`` the configured one, ``policy="auto"`` the batch's own
adaptive policy's choice (from the batched forwards' timings and every row's acceptances). Every drafter, levels 2
and 3, full-attention models with SDPA or eager attention. `check_batch_request` refuses the rest by name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from . import compat
from .attention import RECORDER_KWARG, QueryRecorder, recording
from .caches.ragged import RaggedBufferCache, ragged_causal_mask
from .compat import CacheLayerMixin, layer_devices
from .config import TriForceConfig
from .decoder import Output, PaddedView, adaptive_policy
from .drafters import DraftContext, build_drafter
from .drafters.model import ModelDrafter
from .drafters.registry import MODEL_DRAFTER
from .forward import prefill, settle
from .hierarchy import Candidates, Force1Only, Force2
from .lockstep import Lockstep
from .output_head import weight_left_output_layer
from .policy import Plan
from .quantized import drafting_model
from .row_mixing import row_mixing_layers
from .sampling import ChainVerifier, Sampler, TorchSampler, scores_to_probs
from .scoring import process_rows, row_processors
from .stats import TriForceStats

BATCH_ATTENTION = ("sdpa", "eager")  # implementations that read the 4-D per-row mask


def check_batch_request(model, config: TriForceConfig, generation_config, streamer, prefix_cache) -> None:
    """Refuse, by parameter name and allowed values, what batches do not support yet."""
    if config.trees:
        raise ValueError("triforce_config=: batch size > 1 supports chains only: TriForceConfig.tree_nodes=0 and "
                         f"force2_tree_nodes=0 (got {config.tree_nodes} and {config.force2_tree_nodes})")
    if config.full_cache_device is not None:
        raise ValueError(f"triforce_config=: batch size > 1 supports TriForceConfig.full_cache_device=None only "
                         f"(got {config.full_cache_device!r})")
    if any(window is not None for window in compat.layer_windows(model.config)):
        raise ValueError("triforce_config=: batch size > 1 supports full-attention models only; this model has "
                         "sliding-window layers (their window counts cache columns, which differ from a row's "
                         "positions once rows accept different numbers of tokens)")
    base = compat.current_attention_implementation(model)
    if base not in BATCH_ATTENTION:
        raise ValueError(f"triforce_config=: batch size > 1 supports attn_implementation in {BATCH_ATTENTION} "
                         f"(got {base!r})")
    if row_mixing_layers(model):
        raise ValueError("triforce_config=: batch size > 1 is not supported on models with LLM.int8 layers whose "
                         "rows depend on each other (llm_int8_threshold > 0)")
    if streamer is not None:
        raise ValueError("triforce_config=: streamer= supports batch size 1 only (as transformers' streamers)")
    if generation_config.output_scores or generation_config.output_logits:
        raise ValueError("triforce_config=: output_scores/output_logits support batch size 1 only")
    if prefix_cache is not None:
        for index, layer in enumerate(prefix_cache.layers):
            if not isinstance(layer, CacheLayerMixin) or getattr(layer, "is_sliding", False) \
                    or not hasattr(layer, "keys"):
                raise ValueError(f"cache=: layer {index} is a {type(layer).__name__}; a batch continues from the "
                                 "DynamicCache or StaticCache of a forward of the same left-padded batch")


@dataclass
class BatchResult:
    sequences: list[torch.LongTensor]  # per row [1, n_b], without its left padding
    row_stats: list[TriForceStats]
    stats: TriForceStats  # the batch: counts summed, Force-3 and prefill seconds of the batch


def aggregate(row_stats: list[TriForceStats], force3_seconds: float, prefill_seconds: float) -> TriForceStats:
    """Counts and per-row seconds summed, the batched Force-3 forwards and the prefills counted once, flags
    true if true for any row (`BatchDecoder` then counts each shared lower-tier forward once)."""
    total = TriForceStats(draft_precision=row_stats[0].draft_precision)
    for f in fields(TriForceStats):
        values = [getattr(s, f.name) for s in row_stats]
        if isinstance(values[0], bool):
            setattr(total, f.name, any(values))
        elif isinstance(values[0], (int, float)):
            setattr(total, f.name, sum(values))
        elif isinstance(values[0], dict):
            merged: dict = {}
            for value in values:
                for key, count in value.items():
                    merged[key] = merged.get(key, 0) + count
            setattr(total, f.name, merged)
    total.force3_steps = max(s.force3_steps for s in row_stats)  # batched forwards
    total.force3_seconds, total.prefill_seconds = force3_seconds, prefill_seconds
    return total


class BatchDecoder:
    """The batched Force-3 loop of one call. Row ``b`` has its own padding view, processors, drafters, levels,
    stats and stop; every random choice goes through ``sampler`` (default: torch's global RNG).

    Each batched step runs one plan for all its rows (`policy.Plan`): ``policy="fixed"`` the configured one,
    ``policy="auto"`` the one the batch's `AdaptivePolicy` predicts fastest from the batch's own timings (the
    batched forwards) and every row's acceptances. Each plan's per-row levels (and their shared caches) are
    built on the plan's first use."""

    def __init__(self, model, config: TriForceConfig, processors: LogitsProcessorList | None,
                 stopping_criteria: StoppingCriteriaList | None, max_lengths: list[int], do_sample: bool,
                 paddings: list[torch.Tensor], sampler: Sampler | None = None) -> None:
        self.model, self.config, self.do_sample = model, config, do_sample
        self.max_lengths = max_lengths
        self.views = [PaddedView(padding) for padding in paddings]
        # row b's processors see row b as plain batched generate shows it: its padded view, at index b of the batch
        self.processors = [view.processors(row_processors(processors or LogitsProcessorList(), b, len(self.views)))
                           for b, view in enumerate(self.views)]
        self.criteria = stopping_criteria
        self.sampler = sampler if sampler is not None else TorchSampler()
        self.stats = [TriForceStats(draft_precision=config.draft_precision) for _ in paddings]
        self.force2_verifier = ChainVerifier(do_sample, self.sampler)
        self.force3_verifier = ChainVerifier(do_sample, self.sampler)
        self.additive_mask = compat.current_attention_implementation(model).removeprefix("triforce_") == "eager"
        self.draft_name = config.draft if isinstance(config.draft, str) else MODEL_DRAFTER
        self.policy = adaptive_policy(config, self.draft_name, max(max_lengths))
        self.fixed_plan = Plan(config.levels, self.draft_name, config.gamma1, config.gamma2)
        self.lockstep = Lockstep(len(paddings))
        self.drafters: dict[str, list] = {}  # name -> per row
        self.levels: dict[tuple[int, str], list] = {}  # (levels, drafter) -> per row

    def drafter(self, b: int, name: str):
        """Row ``b``'s drafter ``name``; every row's is built at once, model drafters' caches shared."""
        if name not in self.drafters:
            config = self.config if name == self.draft_name else replace(self.config, draft=name)
            rows = [build_drafter(DraftContext(self.model, config, processors, self.do_sample, self.sampler))
                    for processors in self.processors]
            if all(isinstance(drafter, ModelDrafter) for drafter in rows):
                self.lockstep.share([drafter.cache for drafter in rows], f"draft:{name}")
            self.drafters[name] = rows
        return self.drafters[name][b]

    def drafting_seconds(self, b: int) -> float:
        """Seconds row ``b``'s drafters spent (the walls of the shared forwards it took part in)."""
        return sum(drafters[b].seconds for drafters in self.drafters.values())

    def level(self, b: int, plan: Plan, full: RaggedBufferCache):
        """Row ``b``'s level for ``plan``: None (plain), `Force1Only` or `Force2` (its Force-2 retrieval cache a
        row of a cache shared by every row's)."""
        if plan.levels == 1:
            return None
        key = (plan.levels, plan.drafter)
        if key not in self.levels:
            timed = self.policy.observe_forward if self.policy is not None else None
            target = drafting_model(self.model, self.config.draft_precision)
            rows = [Force1Only(self.drafter(r, plan.drafter), self.config, self.stats[r]) if plan.levels == 2
                    else Force2(target, self.drafter(r, plan.drafter), self.config, self.processors[r],
                                self.force2_verifier, full.row(r), self.stats[r], timed)
                    for r in range(len(self.stats))]
            if plan.levels == 3:
                self.lockstep.share([level.cache for level in rows], "force2")
            self.levels[key] = rows
        return self.levels[key][b]

    def run(self, rows: list[torch.LongTensor], prefix_cache=None) -> BatchResult:
        with weight_left_output_layer(self.model) as weight_left:
            result = self._run(rows, prefix_cache)
        for stats in result.row_stats + [result.stats]:
            stats.weight_left_output_layer = weight_left
        return result

    def _prefill(self, rows, full, prefix=None) -> tuple[list, list, float]:
        """Each distinct prompt prefilled once on its first row; identical rows copy that row's entries.
        ``prefix`` (``cache=``): a transformers cache of the first ``c`` columns of the left-padded batch (what
        a forward of ``input_ids[:, :c]`` with its attention mask left): row ``b``'s entries, past its padding,
        are copied into its row and only the rest of its prompt is run. Returns per row the last prompt row's
        logits and the prefill's queries, and the seconds taken."""
        start, done, logits, queries = time.perf_counter(), {}, [None] * len(rows), [None] * len(rows)
        cached = int(prefix.get_seq_length()) if prefix is not None else 0
        width = max(self.views[b].padding.shape[1] + ids.shape[1] for b, ids in enumerate(rows))
        if prefix is not None and (cached >= width or prefix.layers[0].keys.shape[0] != len(rows)):
            raise ValueError(f"cache= holds {cached} columns of a batch of {prefix.layers[0].keys.shape[0]}; the "
                             f"batch has {len(rows)} rows of {width} columns and must extend it by at least one")
        for b, ids in enumerate(rows):
            key = (tuple(ids[0].tolist()), tuple(self.views[b].padding[0].tolist()))
            if key in done:
                full.copy_row(done[key], b)
                logits[b], queries[b] = logits[done[key]], queries[done[key]]
                continue
            recorder, began, row = QueryRecorder(), time.perf_counter(), full.row(b)
            pad = self.views[b].padding.shape[1]
            if cached > pad:  # this row's entries in the prefix: columns [pad, cached)
                for layer, source in zip(row.layers, prefix.layers):
                    layer.write(source.keys[b : b + 1, :, pad:cached], source.values[b : b + 1, :, pad:cached])
            logits[b] = prefill(self.model, ids[:, max(cached - pad, 0):], row, self.config.prefill_chunk_size,
                                self.config.show_progress, recorder)
            self.stats[b].prefill_seconds = time.perf_counter() - began  # copies: 0
            queries[b] = recorder.at(-1)
            done[key] = b
        return logits, queries, time.perf_counter() - start

    def _forward(self, full: RaggedBufferCache, tokens: torch.Tensor, recorder: QueryRecorder) -> torch.Tensor:
        """One batched Force-3 forward of ``tokens`` ``[batch, n]``, row ``b`` after its own entries."""
        lengths, n = full.lengths, tokens.shape[1]
        positions = torch.tensor(lengths, device=tokens.device)[:, None] + torch.arange(n, device=tokens.device)
        mask = ragged_causal_mask(lengths, n, self.model.dtype, tokens.device, self.additive_mask)
        with recording(recorder):
            out = self.model(input_ids=tokens, cache=full, position_ids=positions, attention_mask=mask,
                             use_cache=True, logits_to_keep=n, **{RECORDER_KWARG: recorder})
        return out.logits

    def _run(self, rows: list[torch.LongTensor], prefix_cache=None) -> BatchResult:
        config, batch, policy = self.config, len(rows), self.policy
        longest = max(self.max_lengths)
        full = RaggedBufferCache(compat.num_layers(self.model.config), batch, longest + config.gamma2 + 2)
        full.expect_devices(layer_devices(self.model))
        outs = [Output(ids, self.views[b], self.criteria, self.max_lengths[b], None, False, False, self.stats[b])
                for b, ids in enumerate(rows)]
        first_logits, queries, prefill_seconds = self._prefill(rows, full, prefix_cache)
        done = [False] * batch
        for b, ids in enumerate(rows):
            scores = process_rows(self.processors[b], ids, first_logits[b], ids.shape[1])
            first = self.sampler.categorical(scores_to_probs(scores)[0]) if self.do_sample else int(scores[0].argmax())
            self.stats[b].force3_tokens += 1
            done[b] = outs[b].commit(first, scores[0], first_logits[b][0])
        if policy is not None:  # a model drafter's cache fill: priced by the policy's fallback (rows prefill apart)
            policy.setup_seconds = {name: None for name, kind in policy.drafters.items() if kind == "model"}
        lookups = [name for name, kind in (policy.drafters.items() if policy else []) if kind == "lookup"]
        force3_seconds = 0.0
        while not all(done):
            active = [b for b in range(batch) if not done[b]]
            plan = policy.choose(max(self.max_lengths[b] - outs[b].sequence.shape[1] for b in active)) \
                if policy is not None else self.fixed_plan
            levels = {b: self.level(b, plan, full) for b in active}
            for b, level in levels.items():  # one-time set-up (a draft cache's fill, a selection): not the step's
                if level is not None:
                    level.start(outs[b].sequence, queries[b])
            if policy is not None and plan.levels > 1:
                policy.started(plan.drafter)
            # what each free lookup would propose next, scored against Force 3 below (no state, no randomness)
            counterfactual = {b: {name: self.drafter(b, name).propose(outs[b].sequence, 1)[0] for name in lookups}
                              for b in active}
            step_start, before = time.perf_counter(), self._counters(levels)
            shared_before = sum(self.lockstep.seconds.values())
            steps = {b: level.candidate_steps(outs[b].sequence, self.max_lengths[b] - outs[b].sequence.shape[1] - 1,
                                              plan.gamma1, plan.gamma2)
                     for b, level in levels.items() if level is not None}
            candidates: dict[int, Candidates] = self.lockstep.drive(steps)
            for b in active:
                candidates.setdefault(b, Candidates([], None))
            n = 1 + max(len(c.tokens) for c in candidates.values())
            tokens = torch.zeros(batch, n, dtype=torch.long, device=rows[0].device)
            for b in active:  # the last committed token, the candidates, dummies (never seen by this row)
                last = int(outs[b].sequence[0, -1])
                proposals = candidates[b].tokens
                tokens[b] = tokens.new_tensor([last] + proposals + [last] * (n - 1 - len(proposals)))
            lengths, recorder = full.lengths, QueryRecorder()
            begin = time.perf_counter()
            logits = settle(self._forward(full, tokens, recorder))
            seconds = time.perf_counter() - begin
            force3_seconds += seconds
            verified = {}
            for b in range(batch):
                if b not in active:
                    full.set_length(b, lengths[b])  # a stopped row: its dummies are dropped
                    continue
                verified[b] = self._verify_row(b, outs[b], plan, levels[b], candidates[b], logits[b], full,
                                               recorder, seconds, done, queries)
            if policy is not None:
                self._observe(plan, levels, candidates, verified, counterfactual, n, seconds, before, shared_before,
                              time.perf_counter() - step_start)
        for out in outs:
            out.end()
        return self._result(rows, outs, full, force3_seconds, prefill_seconds)

    def _result(self, rows, outs, full, force3_seconds: float, prefill_seconds: float) -> BatchResult:
        for b, stats in enumerate(self.stats):
            stats.force1_seconds = self.drafting_seconds(b)
            stats.new_tokens = outs[b].sequence.shape[1] - rows[b].shape[1]
            stats.retrieval_cache_bytes = sum(levels[b].nbytes() for levels in self.levels.values())
            stats.draft_cache_bytes = sum(drafters[b].nbytes() for drafters in self.drafters.values())
            stats.retrieval_summary_bytes = sum(levels[b].summary_bytes() for levels in self.levels.values())
        total = aggregate(self.stats, force3_seconds, prefill_seconds)
        # the batch's seconds count each shared forward once (a row's stats count every forward it took part in)
        shared = self.lockstep.seconds
        total.force2_seconds = shared.get("force2", 0.0)
        total.force1_seconds = sum(shared.get(f"draft:{name}", sum(drafter.seconds for drafter in drafters))
                                   for name, drafters in self.drafters.items())  # lookups: rows one by one
        total.lockstep_forwards, total.lockstep_requests = self.lockstep.forwards, self.lockstep.requests
        total.full_cache_bytes = full.nbytes()
        total.device_resident_bytes = (total.full_cache_bytes + total.retrieval_cache_bytes + total.draft_cache_bytes
                                       + total.retrieval_summary_bytes)
        if self.policy is not None:
            total.plans = self.policy.summary()
        return BatchResult([out.sequence for out in outs], self.stats, total)

    def _counters(self, levels: dict) -> dict[int, tuple]:
        """Per row, the counters a step's observation subtracts: Force-2 accepted, rejections, Force-1 proposed,
        drafters' seconds."""
        return {b: (self.stats[b].force2_accepted, getattr(level, "rejections", 0), self.stats[b].force1_proposed,
                    self.drafting_seconds(b)) for b, level in levels.items()}

    def _verify_row(self, b, out: Output, plan: Plan, level, candidates: Candidates, logits: torch.Tensor,
                    full: RaggedBufferCache, recorder: QueryRecorder, seconds: float, done: list[bool],
                    queries: list) -> tuple[int, int, torch.Tensor]:
        """Row ``b`` of one batched step: verify against its own p, keep its accepted entries, commit. Returns
        ``(accepted, committed, processed scores of the first row)``; ``queries[b]`` becomes the query at its
        last cached token."""
        stats, proposals = self.stats[b], candidates.tokens
        sequence = out.sequence
        extended = torch.cat((sequence, sequence.new_tensor([proposals])), dim=1)
        rows = logits[: len(proposals) + 1]
        p_scores = process_rows(self.processors[b], extended, rows, sequence.shape[1])
        accepted, next_token = self.force3_verifier.verify(proposals, candidates.probs, p_scores)
        stats.force3_seconds += seconds
        stats.force3_steps += 1
        stats.force3_accepted += accepted
        stats.plan_steps[plan.levels] = stats.plan_steps.get(plan.levels, 0) + 1
        committed, done[b] = out.commit_verified(proposals[:accepted] + [next_token], p_scores, rows)
        stats.force3_tokens += committed
        full.set_length(b, out.sequence.shape[1] - 1)  # the committed sequence but its last token
        queries[b] = {layer: q[b : b + 1, :, accepted] for layer, q in recorder.queries.items()}
        if not done[b] and level is not None:
            level.commit(out.sequence, accepted, len(proposals), queries[b])
        return accepted, committed, p_scores[0]

    def _observe(self, plan: Plan, levels: dict, candidates: dict, verified: dict, counterfactual: dict, n: int,
                 force3_seconds: float, before: dict, shared_before: float, step_seconds: float) -> None:
        """Tell the batch's policy what the step cost (the batched forwards' seconds: a plan's cost for the
        whole batch) and how each row's levels did (acceptances, lookups' counterfactuals)."""
        policy = self.policy
        policy.observe_forward("force3", n, force3_seconds)
        drafted, drafts = 0.0, 0
        for b, (accepted, _, first_scores) in verified.items():
            probs = scores_to_probs(first_scores) if self.do_sample else None
            for name, tokens in counterfactual[b].items():
                acceptance = 0.0
                if tokens:
                    acceptance = float(probs[tokens[0]]) if probs is not None else float(
                        int(first_scores.argmax()) == tokens[0])
                policy.observe_lookup(name, bool(tokens), acceptance)
            proposed = len(candidates[b].tokens)
            if plan.levels == 2 and proposed:
                policy.observe_direct(plan.drafter, accepted, proposed)
            elif plan.levels == 3:
                f2_accepted, rejections, force1_proposed, _ = before[b]
                policy.observe_three_level(plan, self.stats[b].force2_accepted - f2_accepted,
                                           levels[b].rejections - rejections, accepted, proposed)
            if plan.levels > 1:
                drafted += self.drafting_seconds(b) - before[b][3]
                drafts += proposed if plan.levels == 2 else self.stats[b].force1_proposed - before[b][2]
        rows = max(len(verified), 1)
        lookup = plan.levels > 1 and policy.drafters[plan.drafter] == "lookup"
        if plan.levels > 1 and drafts:
            # model drafters: seconds per drafted token of the batch (a row's seconds are the walls of the shared
            # forwards it took part in); lookups: seconds per step, the rows' calls one after the other
            policy.observe_forward(f"draft:{plan.drafter}", 1, drafted if lookup else drafted / drafts)
        # the forwards' seconds: Force 3's, the shared lower-tier forwards', a lookup's calls; the rest (per-row
        # scoring, sampling, verification, selections) is the plan's overhead per step
        forward_seconds = force3_seconds + sum(self.lockstep.seconds.values()) - shared_before + (drafted if lookup
                                                                                                   else 0.0)
        tokens = sum(committed for _, committed, _ in verified.values()) / rows  # per row, as predictions are
        policy.observe_step(plan, tokens, step_seconds, forward_seconds)
