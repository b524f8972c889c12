"""``TriForceConfig(loop="assisted")``: TriForce run by transformers' own assisted-generation loop.

    prompt without left padding -> the full cache (a `BufferCache`) prefilled with all of it but its last token,
    the last row's query recorded -> transformers' ``_assisted_decoding`` (`compat.assisted_decoding`) with a
    `TriForceCandidateGenerator` over that cache: each iteration Force 1 drafts and Force 2 verifies
    (`get_candidates`), the model verifies Force 2's tokens with transformers' rule and crops the cache, the
    generator's levels follow (`update_candidate_strategy`); the verification forwards' queries are recorded
    through the attention wrapper for Force 2's retrieval selection.

What ``generate`` shows the processors, the stopping criteria and the streamer is the sequence as it built it,
left padding included (`PaddedView`); the model and the caches see it without. Sampling: a stop that the loop's
last accepted candidate completes may be followed in the loop by one more token; it is cut from the returned
sequence (a streamer has seen it).
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from . import compat
from .caches.buffer import copy_prefix
from .candidates import TriForceCandidateGenerator
from .config import TriForceConfig
from .decoding.force3 import full_cache
from .decoding.loop import PaddedView
from .decoding.preflight import check_model
from .decoding.resolved import resolve
from .decoding.tiers import drafting_models
from .forwards.forward import prefill
from .kernels.attention import recording
from .kernels.call_kernels import CallKernels
from .request import TriForceGenerateOutput, prefix_cache, recording_attention, strip_padding
from .verification.sampling import Sampler


class PaddedCriteria(StoppingCriteriaList):
    """Stopping criteria shown the sequence with its left padding first, as ``generate`` built it."""

    def __init__(self, criteria: StoppingCriteriaList, view: PaddedView) -> None:
        super().__init__(criteria)
        self.view = view

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return super().__call__(self.view(input_ids), scores, **kwargs)


def first_stop(criteria: StoppingCriteriaList, sequence: torch.Tensor, start: int) -> int:
    """The shortest length ``> start`` of ``sequence`` ``[1, n]`` at which ``criteria`` stop generation (``n`` if
    none does before)."""
    for length in range(start + 1, sequence.shape[1]):
        if bool(criteria(sequence[:, :length], None).any()):
            return length
    return sequence.shape[1]


def assisted_generate(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                      config: TriForceConfig, streamer, model_kwargs: dict):
    """`integration.triforce_generate` for ``config.loop == "assisted"`` (the request already checked there).
    Returns the sequences, or a `TriForceGenerateOutput` with ``return_dict_in_generate``."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"TriForceConfig(loop='assisted') runs transformers' assisted-generation loop, which decodes "
                         f"one prompt per call; got a batch of {input_ids.shape[0]}: use loop='triforce' (the default) "
                         "for batches")
    ids, pad = strip_padding(input_ids, model_kwargs.get("attention_mask"))
    prefix = prefix_cache(model_kwargs, ids, pad)
    view = PaddedView(input_ids[:, :pad])
    processors = view.processors(logits_processor or LogitsProcessorList())
    criteria = PaddedCriteria(stopping_criteria or StoppingCriteriaList(), view)
    unpadded = copy.deepcopy(generation_config)
    unpadded.max_length = generation_config.max_length - pad
    with recording_attention(model):
        check_model(model, config, ids[:, :1])  # before the prefill: what would fail after it fails now
        if streamer is not None:
            streamer.put(input_ids.cpu())  # generate puts the prompt before decoding
        out, generator = run_assisted(model, ids, processors, criteria, unpadded, config, streamer, prefix)
    sequences = out.sequences if not isinstance(out, torch.Tensor) else out
    if generator.do_sample and stopping_criteria:  # the loop's token past a stop its last candidate completed
        length = first_stop(criteria, sequences, ids.shape[1])
        if length < sequences.shape[1]:
            generator.full.rollback(length - 1)
            sequences = sequences[:, :length]
    new_tokens = sequences.shape[1] - ids.shape[1]
    stats = generator.finish(new_tokens)
    sequences = torch.cat((input_ids[:, :pad], sequences), dim=1)
    if isinstance(out, torch.Tensor):
        return sequences
    return TriForceGenerateOutput(
        sequences=sequences,
        scores=out.scores[:new_tokens] if out.scores is not None else None,
        logits=out.logits[:new_tokens] if out.logits is not None else None,
        cache=generator.full,
        triforce_stats=stats,
        triforce_row_stats=[stats],
    )


def run_assisted(model, ids: torch.LongTensor, processors, criteria, generation_config, config: TriForceConfig,
                 streamer=None, prefix=None, sampler: Sampler | None = None):
    """Prefill and decode ``ids`` ``[1, n]`` (no padding; ``prefix``: a cache holding its start) in transformers'
    loop; returns what ``_assisted_decoding`` returns and the `TriForceCandidateGenerator` (its ``full`` cache, its
    ``stats``). ``sampler``: the tiers' random draws (default: torch's global RNG, as transformers' loop)."""
    resolved = resolve(config, model, driver="assisted")
    cache = full_cache(model, resolved, [generation_config.max_length])
    models = [model, *([config.draft] if isinstance(config.draft, torch.nn.Module) else [])]
    with recording_attention(model), CallKernels(model, models, generation_config.max_length) as kernels:
        generator = TriForceCandidateGenerator(model, generation_config, processors, triforce_config=resolved,
                                               stopping_criteria=criteria, full_cache=cache, sampler=sampler)
        row_by_row = kernels.switch_linear(drafting_models(generator.config, model))
        began = time.perf_counter()
        cached = copy_prefix(prefix, cache) if prefix is not None else 0
        with torch.no_grad():
            prefill(model, ids[:, cached:-1], cache, config.prefill_chunk_size, config.show_progress,
                    generator.recorder)
        generator.stats.prefill_seconds = time.perf_counter() - began
        generator.prefilled()
        row_by_row.enable()  # after the prefill, as in the library's own loop
        with recording(generator.recorder):
            out = compat.assisted_decoding(model, generator, ids, processors, criteria, generation_config, streamer,
                                           cache=cache, use_cache=True, logits_to_keep=1)
    kernels.fill(generator.stats.detail)
    return out, generator
