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

Supported: ``policy="fixed"`` (every row runs ``levels`` with ``gamma1``/``gamma2``), every drafter, levels 2
and 3, full-attention models with SDPA or eager attention. `check_batch_request` refuses the rest by name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from . import compat
from .attention import RECORDER_KWARG, QueryRecorder, recording
from .caches.ragged import RaggedBufferCache, ragged_causal_mask
from .compat import layer_devices
from .config import TriForceConfig
from .decoder import Output, PaddedView
from .drafters import DraftContext, build_drafter
from .drafters.model import ModelDrafter
from .forward import prefill, settle
from .hierarchy import Candidates, Force1Only, Force2
from .lockstep import Lockstep
from .output_head import weight_left_output_layer
from .quantized import drafting_model
from .row_mixing import row_mixing_layers
from .sampling import ChainVerifier, Sampler, TorchSampler, scores_to_probs
from .scoring import process_rows
from .stats import TriForceStats

BATCH_ATTENTION = ("sdpa", "eager")  # implementations that read the 4-D per-row mask


def check_batch_request(model, config: TriForceConfig, generation_config, streamer, prefix_cache) -> None:
    """Refuse, by parameter name and allowed values, what batches do not support yet."""
    if config.policy != "fixed":
        raise ValueError(f"triforce_config=: batch size > 1 supports TriForceConfig.policy='fixed' only "
                         f"(got {config.policy!r}); set policy='fixed'")
    if config.tree_nodes:
        raise ValueError(f"triforce_config=: batch size > 1 supports TriForceConfig.tree_nodes=0 only (chains; got "
                         f"{config.tree_nodes})")
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
        raise ValueError("triforce_config=: cache= supports batch size 1 only")


@dataclass
class BatchResult:
    sequences: list[torch.LongTensor]  # per row [1, n_b], without its left padding
    row_stats: list[TriForceStats]
    stats: TriForceStats  # the batch: counts summed, Force-3 and prefill seconds of the batch


def aggregate(row_stats: list[TriForceStats], force3_seconds: float, prefill_seconds: float) -> TriForceStats:
    """Counts and per-row seconds summed (rows' lower levels run one after the other), the batched Force-3
    forwards and the prefills counted once, flags true if true for any row."""
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
    """The batched Force-3 loop of one call. Row ``b`` has its own padding view, processors, drafter, level,
    stats and stop; every random choice goes through ``sampler`` (default: torch's global RNG)."""

    def __init__(self, model, config: TriForceConfig, processors: LogitsProcessorList | None,
                 stopping_criteria: StoppingCriteriaList | None, max_lengths: list[int], do_sample: bool,
                 paddings: list[torch.Tensor], sampler: Sampler | None = None) -> None:
        self.model, self.config, self.do_sample = model, config, do_sample
        self.max_lengths = max_lengths
        self.views = [PaddedView(padding) for padding in paddings]
        self.processors = [view.processors(processors or LogitsProcessorList()) for view in self.views]
        self.criteria = stopping_criteria
        self.sampler = sampler if sampler is not None else TorchSampler()
        self.stats = [TriForceStats(draft_precision=config.draft_precision) for _ in paddings]
        self.force2_verifier = ChainVerifier(do_sample, self.sampler)
        self.force3_verifier = ChainVerifier(do_sample, self.sampler)
        self.additive_mask = compat.current_attention_implementation(model).removeprefix("triforce_") == "eager"

    def level(self, b: int, full: RaggedBufferCache):
        """Row ``b``'s proposing level: `Force1Only` or `Force2` over its own drafter and a view of its row."""
        context = DraftContext(self.model, self.config, self.processors[b], self.do_sample, self.sampler)
        drafter = build_drafter(context)
        if self.config.levels == 2:
            return drafter, Force1Only(drafter, self.config, self.stats[b])
        target = drafting_model(self.model, self.config.draft_precision)
        return drafter, Force2(target, drafter, self.config, self.processors[b], self.force2_verifier, full.row(b),
                               self.stats[b])

    def share_caches(self, levels: list) -> Lockstep:
        """The rows' Force-2 retrieval caches share storage, and so do their model drafters' sink+window caches:
        each tier then runs one forward for all its rows (`hf_triforce.lockstep`)."""
        lockstep = Lockstep(len(levels))
        if self.config.levels == 3:
            lockstep.share([level.cache for _, level in levels])
        if all(isinstance(drafter, ModelDrafter) for drafter, _ in levels):
            lockstep.share([drafter.cache for drafter, _ in levels])
        return lockstep

    def run(self, rows: list[torch.LongTensor]) -> BatchResult:
        with weight_left_output_layer(self.model) as weight_left:
            result = self._run(rows)
        for stats in result.row_stats + [result.stats]:
            stats.weight_left_output_layer = weight_left
        return result

    def _prefill(self, rows, full) -> tuple[list, list, float]:
        """Each distinct prompt prefilled once on its first row; identical rows copy that row's entries.
        Returns per row the last prompt row's logits and the prefill's queries, and the seconds taken."""
        start, done, logits, queries = time.perf_counter(), {}, [None] * len(rows), [None] * len(rows)
        for b, ids in enumerate(rows):
            key = (tuple(ids[0].tolist()), tuple(self.views[b].padding[0].tolist()))
            if key in done:
                full.copy_row(done[key], b)
                logits[b], queries[b] = logits[done[key]], queries[done[key]]
                continue
            recorder, began = QueryRecorder(), time.perf_counter()
            logits[b] = prefill(self.model, ids, full.row(b), self.config.prefill_chunk_size,
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

    def _run(self, rows: list[torch.LongTensor]) -> BatchResult:
        config, batch = self.config, len(rows)
        longest = max(self.max_lengths)
        full = RaggedBufferCache(compat.num_layers(self.model.config), batch, longest + config.gamma2 + 2)
        full.expect_devices(layer_devices(self.model))
        outs = [Output(ids, self.views[b], self.criteria, self.max_lengths[b], None, False, False, self.stats[b])
                for b, ids in enumerate(rows)]
        first_logits, queries, prefill_seconds = self._prefill(rows, full)
        done = [False] * batch
        for b, ids in enumerate(rows):
            scores = process_rows(self.processors[b], ids, first_logits[b], ids.shape[1])
            first = self.sampler.categorical(scores_to_probs(scores)[0]) if self.do_sample else int(scores[0].argmax())
            self.stats[b].force3_tokens += 1
            done[b] = outs[b].commit(first, scores[0], first_logits[b][0])
        levels = [self.level(b, full) for b in range(batch)]
        lockstep = self.share_caches(levels)
        started, force3_seconds = [False] * batch, 0.0
        while not all(done):
            active = [b for b in range(batch) if not done[b]]
            steps = {}
            for b in active:
                sequence, level = outs[b].sequence, levels[b][1]
                if not started[b]:
                    level.start(sequence, queries[b])
                    started[b] = True
                room = self.max_lengths[b] - sequence.shape[1] - 1
                steps[b] = level.candidate_steps(sequence, room, config.gamma1, config.gamma2)
            candidates: dict[int, Candidates] = lockstep.drive(steps)
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
            for b in range(batch):
                if b not in active:
                    full.set_length(b, lengths[b])  # a stopped row: its dummies are dropped
                    continue
                self._verify_row(b, outs[b], levels[b][1], candidates[b], logits[b], full, lengths[b], recorder,
                                 seconds, done)
        for out in outs:
            out.end()
        for b, stats in enumerate(self.stats):
            drafter, level = levels[b]
            stats.force1_seconds = drafter.seconds
            stats.new_tokens = outs[b].sequence.shape[1] - rows[b].shape[1]
            stats.retrieval_cache_bytes = level.nbytes()
            stats.draft_cache_bytes = drafter.nbytes()
            stats.retrieval_summary_bytes = level.summary_bytes()
        total = aggregate(self.stats, force3_seconds, prefill_seconds)
        total.lockstep_forwards, total.lockstep_requests = lockstep.forwards, lockstep.requests
        total.full_cache_bytes = full.nbytes()
        total.device_resident_bytes = (total.full_cache_bytes + total.retrieval_cache_bytes + total.draft_cache_bytes
                                       + total.retrieval_summary_bytes)
        return BatchResult([out.sequence for out in outs], self.stats, total)

    def _verify_row(self, b, out: Output, level, candidates: Candidates, logits: torch.Tensor,
                    full: RaggedBufferCache, cached: int, recorder: QueryRecorder, seconds: float,
                    done: list[bool]) -> None:
        """Row ``b`` of one batched step: verify against its own p, keep its accepted entries, commit."""
        stats, proposals = self.stats[b], candidates.tokens
        sequence = out.sequence
        extended = torch.cat((sequence, sequence.new_tensor([proposals])), dim=1)
        rows = logits[: len(proposals) + 1]
        p_scores = process_rows(self.processors[b], extended, rows, sequence.shape[1])
        accepted, next_token = self.force3_verifier.verify(proposals, candidates.probs, p_scores)
        stats.force3_seconds += seconds
        stats.force3_steps += 1
        stats.force3_accepted += accepted
        stats.plan_steps[self.config.levels] = stats.plan_steps.get(self.config.levels, 0) + 1
        committed, done[b] = out.commit_verified(proposals[:accepted] + [next_token], p_scores, rows)
        stats.force3_tokens += committed
        full.set_length(b, out.sequence.shape[1] - 1)  # the committed sequence but its last token
        if not done[b]:
            queries = {layer: q[b : b + 1, :, accepted] for layer, q in recorder.queries.items()}
            level.commit(out.sequence, accepted, len(proposals), queries)
