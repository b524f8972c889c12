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
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .attention import QueryRecorder
from .caches.buffer import BufferCache, copy_prefix
from .config import TriForceConfig
from .drafters import DraftContext, build_drafter
from .forward import prefill, score_continuation
from .hierarchy import Force1Only, Force2
from .output_head import weight_left_output_layer
from .quantized import drafting_model
from .sampling import ChainVerifier, Sampler, TorchSampler, scores_to_probs
from .scoring import process_rows
from .stats import TriForceStats


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

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


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

    def make_level(self, full: BufferCache):
        """The level that proposes to Force 3: `Force2` over Force 1, or Force 1 alone (``levels=2``)."""
        context = DraftContext(self.model, self.config, self.processors, self.do_sample, self.sampler)
        drafter = build_drafter(context)
        self.drafter = drafter
        if self.config.levels == 2:
            return Force1Only(drafter, self.config, self.stats)
        drafting_target = drafting_model(self.model, self.config.draft_precision)
        return Force2(drafting_target, drafter, self.config, self.processors, self.force2_verifier, full, self.stats)

    def run(self, input_ids: torch.LongTensor, streamer=None, prefix_cache=None, keep_scores: bool = False,
            keep_logits: bool = False) -> DecodeResult:
        with weight_left_output_layer(self.model) as weight_left:
            result = self._run(input_ids, streamer, prefix_cache, keep_scores, keep_logits)
        self.stats.weight_left_output_layer = weight_left
        return result

    def _run(self, input_ids, streamer, prefix_cache, keep_scores, keep_logits) -> DecodeResult:
        config, stats, recorder = self.config, self.stats, QueryRecorder()
        full = BufferCache(self.model.config.num_hidden_layers, self.max_length + config.gamma2 + 2)
        cached = copy_prefix(prefix_cache, full) if prefix_cache is not None else 0
        out = Output(input_ids, self.view, self.criteria, self.max_length, streamer, keep_scores, keep_logits, stats)
        verifier = self.force3_verifier

        start = time.perf_counter()
        logits = prefill(self.model, input_ids[:, cached:], full, config.prefill_chunk_size, config.show_progress,
                         recorder)
        stats.prefill_seconds = time.perf_counter() - start
        scores = process_rows(self.processors, input_ids, logits, input_ids.shape[1])
        first = self.sampler.categorical(scores_to_probs(scores)[0]) if self.do_sample else int(scores[0].argmax())
        done = out.commit(first, scores[0], logits[0])

        level = self.make_level(full)
        if not done:
            level.start(out.sequence, recorder.at(-1))
        while not done:
            length = out.sequence.shape[1]
            candidates = level.get_candidates(out.sequence, self.max_length - length - 1)
            proposals = candidates.tokens
            extended = torch.cat((out.sequence, out.sequence.new_tensor([proposals])), dim=1)
            uncached = length - full.length
            begin = time.perf_counter()
            logits, p_scores = score_continuation(self.model, full, full.length, extended, length, self.processors,
                                                  recorder)
            stats.force3_seconds += time.perf_counter() - begin
            accepted, next_token = verifier.verify(proposals, candidates.probs, p_scores)
            full.rollback(length + accepted)
            stats.force3_steps += 1
            stats.force3_accepted += accepted
            for index, token in enumerate(proposals[:accepted] + [next_token]):
                stats.force3_tokens += 1
                done = out.commit(token, p_scores[index], logits[index])
                if done:
                    break
            if not done:
                level.commit(out.sequence, accepted, len(proposals), recorder.at(uncached - 1 + accepted))
        full.rollback(out.sequence.shape[1] - 1)  # a stop inside an accepted run commits fewer tokens
        out.end()
        stats.force1_seconds = self.drafter.seconds
        stats.new_tokens = out.sequence.shape[1] - input_ids.shape[1]
        stats.full_cache_bytes = full.nbytes()
        stats.retrieval_cache_bytes = level.nbytes()
        stats.draft_cache_bytes = self.drafter.nbytes()
        out.result.cache = full
        return out.result
