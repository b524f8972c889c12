"""The two speculative loops: Force 1 -> Force 2 (a `CandidateGenerator`) and Force 2 -> Force 3.

Each level hands up tokens with the exact distribution they were drawn from; `verify_chain` accepts or
resamples from the residual, so Force 2 emits tokens distributed exactly as q and Force 3 exactly as p.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator

from .attention import RECORDER
from .caches.buffer import BufferCache, copy_prefix
from .caches.retrieval import RetrievalCache
from .config import TriForceConfig
from .drafters import ModelDrafter, NgramDrafter
from .output_head import weight_left_output_layer
from .quantized import int8_copy
from .sampling import sample, scores_to_probs, verify_chain
from .scoring import process_rows
from .stats import TriForceStats


def forward_logits(model, tokens: torch.Tensor, cache, start: int, keep: int) -> torch.Tensor:
    """Logits ``[keep, vocab]`` of the last ``keep`` rows of ``tokens`` placed at absolute ``start``."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)
    out = model(input_ids=tokens, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=keep)
    return out.logits[0]


def score_continuation(model, cache, cached: int, extended: torch.Tensor, prefix: int,
                       processors: LogitsProcessorList) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits and processed scores for every position after ``extended[:, :prefix]``.

    ``cache`` holds the first ``cached`` tokens of ``extended``; the rest is fed in one forward.
    """
    logits = forward_logits(model, extended[:, cached:], cache, cached, extended.shape[1] - prefix + 1)
    return logits, process_rows(processors, extended, logits, prefix)


class TriForceCandidateGenerator(CandidateGenerator):
    """Force 1 drafts, Force 2 (the target on a `RetrievalCache`) verifies; hands up Force 2's tokens.

    ``get_candidates`` returns ``(candidate_ids, candidate_scores)``: the input followed by up to ``gamma2``
    tokens, and per token the processed scores whose softmax is exactly the distribution it was drawn from.
    ``update_candidate_strategy`` is told the committed sequence after Force 3 and rolls every cache back.
    """

    def __init__(self, model, drafter, config: TriForceConfig, processors: LogitsProcessorList,
                 do_sample: bool, full: BufferCache, stats: TriForceStats) -> None:
        self.model, self.drafter, self.config = model, drafter, config
        self.processors, self.do_sample, self.full, self.stats = processors, do_sample, full, stats
        tail = config.refresh_every * (config.gamma2 + 1) + config.gamma1 + config.gamma2 + 2
        self.cache = RetrievalCache(
            model.config.num_hidden_layers, config.retrieval_budget, config.chunk_size, config.recent_tokens, tail
        )
        self.steps_since_selection = 0
        self.last_proposed = 0

    @property
    def seen(self) -> int:
        """Tokens of the sequence that the retrieval cache holds entries for."""
        return self.cache.base_upto + self.cache.length - self.cache.base_length

    def select(self, queries: dict[int, torch.Tensor]) -> None:
        start = time.perf_counter()
        self.cache.select(self.full, self.full.length, queries)
        self.stats.retrieval_seconds += time.perf_counter() - start
        self.stats.retrieval_selections += 1
        self.stats.force2_sees_whole_cache = self.cache.sees_whole_cache
        self.steps_since_selection = 0

    def force2_scores(self, sequence: torch.Tensor, proposals: list[int]) -> torch.Tensor:
        """Processed Force-2 scores for each proposal's position and the one after."""
        extended = torch.cat((sequence, sequence.new_tensor([proposals])), dim=1) if proposals else sequence
        start = time.perf_counter()
        _, scores = score_continuation(self.model, self.cache, self.seen, extended, sequence.shape[1], self.processors)
        self.stats.force2_seconds += time.perf_counter() - start
        return scores

    def get_candidates(self, input_ids: torch.LongTensor, max_candidates: int | None = None):
        wanted = self.config.gamma2 if max_candidates is None else min(self.config.gamma2, max_candidates)
        self.last_proposed = wanted
        if wanted <= 0:
            return input_ids, None
        sequence, rows = input_ids, []
        while sequence.shape[1] - input_ids.shape[1] < wanted:
            still_wanted = wanted - (sequence.shape[1] - input_ids.shape[1])
            proposals, proposal_probs = self.drafter.propose(sequence, min(self.config.gamma1, still_wanted - 1))
            q_scores = self.force2_scores(sequence, proposals)
            accepted, next_token = verify_chain(proposals, proposal_probs, q_scores, self.do_sample)
            self.stats.force1_proposed += len(proposals)
            self.stats.force2_accepted += accepted
            self.stats.force2_steps += 1
            sequence = torch.cat((sequence, sequence.new_tensor([proposals[:accepted] + [next_token]])), dim=1)
            rows.append(q_scores[: accepted + 1])
            self.cache.rollback_to_sequence(sequence.shape[1] - 1)
            self.drafter.rollback(sequence.shape[1] - 1)
        end = input_ids.shape[1] + wanted
        self.cache.rollback_to_sequence(min(self.seen, end))
        self.drafter.rollback(end)
        self.stats.force2_proposed += wanted
        return sequence[:, :end], torch.cat(rows)[None, :wanted]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int,
                                  queries: dict[int, torch.Tensor] | None = None) -> None:
        """Roll back to the committed ``input_ids`` (its last token not yet cached); refresh the selection."""
        self.drafter.rollback(input_ids.shape[1] - 1)
        self.cache.sync(self.full, self.full.length)
        self.steps_since_selection += 1
        low = (
            self.config.refresh_below is not None
            and self.last_proposed
            and num_matches / self.last_proposed < self.config.refresh_below
        )
        no_room = self.cache.tail_room(self.full.length) < self.config.gamma1 + self.config.gamma2 + 2
        if queries is not None and (self.steps_since_selection >= self.config.refresh_every or low or no_room):
            self.select(queries)
        elif no_room:
            raise RuntimeError("RetrievalCache tail is full and no query was given to refresh the selection")


class DraftCandidateGenerator(CandidateGenerator):
    """Two levels only (``TriForceConfig(levels=2)``): Force 1's drafts go straight to Force 3.

    With ``draft="self"`` this is StreamingLLM-cache self-speculation (MagicDec-style), the baseline
    TriForce's middle tier is measured against. Candidate scores are ``log r``; ``None`` for greedy
    drafts or a deterministic drafter (a point mass).
    """

    def __init__(self, drafter, config: TriForceConfig, stats: TriForceStats) -> None:
        self.drafter, self.config, self.stats = drafter, config, stats

    def get_candidates(self, input_ids: torch.LongTensor, max_candidates: int | None = None):
        wanted = self.config.gamma2 if max_candidates is None else min(self.config.gamma2, max_candidates)
        if wanted <= 0:
            return input_ids, None
        proposals, probs = self.drafter.propose(input_ids, wanted)
        self.stats.force1_proposed += len(proposals)
        self.stats.force2_proposed += len(proposals)
        candidates = torch.cat((input_ids, input_ids.new_tensor([proposals])), dim=1) if proposals else input_ids
        return candidates, None if probs is None else torch.log(probs)[None]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int,
                                  queries: dict[int, torch.Tensor] | None = None) -> None:
        self.drafter.rollback(input_ids.shape[1] - 1)


@dataclass
class DecodeResult:
    sequences: torch.LongTensor
    stats: TriForceStats
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    cache: BufferCache | None = None


def drafting_copy(model, config: TriForceConfig):
    """The model as Force 1 / Force 2 run it: itself, or its int8 copy (``draft_precision="int8"``)."""
    return int8_copy(model) if config.draft_precision == "int8" else model


def make_drafter(model, config: TriForceConfig, processors: LogitsProcessorList, do_sample: bool):
    if config.draft == "ngram":
        return NgramDrafter(config.ngram_max, config.ngram_min)
    draft_model = model if config.draft == "self" else config.draft
    return ModelDrafter(drafting_copy(draft_model, config), config.sink_tokens, config.window, processors, do_sample)


def prefill(model, tokens: torch.Tensor, cache, chunk_size: int, show_progress: bool = False) -> torch.Tensor:
    """Chunked prefill of ``tokens`` after what ``cache`` holds; returns the last row's logits ``[1, vocab]``.

    Memory stays bounded by ``chunk_size`` activations; the last chunk records the queries that seed the
    first retrieval selection. Interruptible between chunks (KeyboardInterrupt propagates).
    """
    start = int(cache.get_seq_length())
    bounds = list(range(0, tokens.shape[1], chunk_size))
    logits = None
    bar = tqdm(bounds, desc="prefill", unit="chunk", disable=not show_progress or len(bounds) < 2)
    for begin in bar:
        piece = tokens[:, begin : begin + chunk_size]
        if begin == bounds[-1]:
            with RECORDER.recording():
                logits = forward_logits(model, piece, cache, start + begin, 1)
        else:
            forward_logits(model, piece, cache, start + begin, 1)
    return logits


def triforce_decode(
    model,
    input_ids: torch.LongTensor,
    config: TriForceConfig,
    processors: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    max_length: int,
    do_sample: bool,
    streamer=None,
    prefix_cache=None,
    keep_scores: bool = False,
    keep_logits: bool = False,
) -> DecodeResult:
    """Generate with the three tiers until a stopping criterion or ``max_length``; batch size 1."""
    with weight_left_output_layer(model) as weight_left:
        result = _decode(model, input_ids, config, processors, stopping_criteria, max_length, do_sample, streamer,
                         prefix_cache, keep_scores, keep_logits)
    result.stats.weight_left_output_layer = weight_left
    result.stats.draft_precision = config.draft_precision
    return result


def _decode(model, input_ids, config, processors, stopping_criteria, max_length, do_sample, streamer, prefix_cache,
            keep_scores, keep_logits) -> DecodeResult:
    stats = TriForceStats()
    result = DecodeResult(input_ids, stats)
    num_layers = model.config.num_hidden_layers
    full = BufferCache(num_layers, max_length + config.gamma2 + 2)
    cached = copy_prefix(prefix_cache, full) if prefix_cache is not None else 0
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def commit(token: int, scores: torch.Tensor, logits: torch.Tensor) -> bool:
        """Append one token; True when generation must stop."""
        result.sequences = torch.cat((result.sequences, result.sequences.new_tensor([[token]])), dim=1)
        if keep_scores:
            result.scores.append(scores[None])
        if keep_logits:
            result.logits.append(logits[None].float())
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        stopped = bool(stopping_criteria(result.sequences, scores[None]).all()) if stopping_criteria else False
        return stopped or result.sequences.shape[1] >= max_length

    start = time.perf_counter()
    logits = prefill(model, input_ids[:, cached:], full, config.prefill_chunk_size, config.show_progress)
    stats.prefill_seconds = time.perf_counter() - start
    scores = process_rows(processors, input_ids, logits, input_ids.shape[1])
    first = sample(scores_to_probs(scores)[0]) if do_sample else int(scores[0].argmax())
    done = commit(first, scores[0], logits[0])

    drafter = make_drafter(model, config, processors, do_sample)
    if config.levels == 3:
        generator = TriForceCandidateGenerator(drafting_copy(model, config), drafter, config, processors, do_sample,
                                               full, stats)
    else:
        generator = DraftCandidateGenerator(drafter, config, stats)
    if not done:
        drafter.prefill(result.sequences)
        if config.levels == 3:
            generator.select(RECORDER.at(-1))
    while not done:
        length = result.sequences.shape[1]
        candidates, q_scores = generator.get_candidates(result.sequences, max_length - length - 1)
        proposals = candidates[0, length:].tolist()
        uncached = length - full.length
        begin = time.perf_counter()
        with RECORDER.recording():
            logits, p_scores = score_continuation(model, full, full.length, candidates, length, processors)
        stats.force3_seconds += time.perf_counter() - begin
        q_probs = scores_to_probs(q_scores[0]) if do_sample and q_scores is not None else None
        accepted, next_token = verify_chain(proposals, q_probs, p_scores, do_sample)
        full.rollback(length + accepted)
        stats.force3_steps += 1
        stats.force3_accepted += accepted
        for index, token in enumerate(proposals[:accepted] + [next_token]):
            stats.force3_tokens += 1
            done = commit(token, p_scores[index], logits[index])
            if done:
                break
        if not done:
            queries = RECORDER.at(uncached - 1 + accepted)
            generator.update_candidate_strategy(result.sequences, p_scores, accepted, queries=queries)
    stats.force1_seconds = drafter.seconds
    stats.new_tokens = result.sequences.shape[1] - input_ids.shape[1]
    stats.full_cache_bytes = full.nbytes()
    stats.retrieval_cache_bytes = generator.cache.nbytes() if config.levels == 3 else 0
    stats.draft_cache_bytes = drafter.nbytes()
    result.cache = full
    if streamer is not None:
        streamer.end()
    return result
