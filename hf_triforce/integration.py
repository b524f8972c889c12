"""``generate(..., triforce_config=cfg)``, ``custom_generate=triforce_generate`` and the pipeline.

Uses transformers through its public generation conventions; the internals it relies on (how ``generate``
calls a ``custom_generate`` callable, the attention registry) are reached through `compat`, which the
contract tests pin.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from transformers import StoppingCriteriaList, StopStringCriteria

from . import compat
from .assisted import assisted_generate
from .caches.row_caches import RowCaches
from .config import TriForceConfig
from .decoding.loop import Decoder
from .decoding.preflight import check_batch_request, check_model
from .request import (
    TriForceGenerateOutput,
    check_request,
    prefix_cache,
    recording_attention,
    strip_padding,
)

TESTED_TRANSFORMERS = compat.TESTED_TRANSFORMERS

def _generate_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, config, streamer,
                    model_kwargs):
    """Batch size > 1 (`hf_triforce.decoding.loop`): rows padded on the right as plain ``generate`` pads
    stopped rows."""
    mask = model_kwargs.get("attention_mask")
    rows, pads = [], []
    for b in range(input_ids.shape[0]):
        ids, pad = strip_padding(input_ids[b : b + 1], None if mask is None else mask[b : b + 1])
        rows.append(ids)
        pads.append(pad)
    prefix = model_kwargs.get("cache")
    if isinstance(prefix, RowCaches):  # its rows may be made as their turn comes: kept whatever they hold now
        prefix.check([ids.shape[1] for ids in rows], compat.num_layers(model.config))
    elif prefix is not None and prefix.get_seq_length() == 0:
        prefix = None
    check_batch_request(model, config, generation_config, streamer, prefix)
    decoder = Decoder(model, config, logits_processor, stopping_criteria,
                      max_lengths=[generation_config.max_length - pad for pad in pads],
                      do_sample=bool(generation_config.do_sample),
                      paddings=[input_ids[b : b + 1, :pad] for b, pad in enumerate(pads)])
    with recording_attention(model):
        check_model(model, config, rows[0][:, :1], batch=True)  # before the prefill: what would fail after it fails now
        result = decoder.run(rows, prefix)
    rows_out = [torch.cat((input_ids[b : b + 1, :pad], seq), dim=1) for b, (pad, seq) in
                enumerate(zip(pads, result.sequences))]
    width = max(row.shape[1] for row in rows_out)
    # plain generate pads stopped rows with pad_token_id, else with the first eos_token_id
    pad_token = generation_config.pad_token_id
    if pad_token is None:
        pad_token = generation_config.eos_token_id
    if any(row.shape[1] < width for row in rows_out):
        if pad_token is None:
            raise ValueError("triforce_config=: rows stopped at different lengths and neither pad_token_id nor "
                             "eos_token_id is set to pad them with")
        pad_token = int(pad_token[0] if isinstance(pad_token, (list, tuple)) else pad_token)
    sequences = torch.cat([torch.nn.functional.pad(row, (0, width - row.shape[1]), value=pad_token or 0)
                           for row in rows_out])
    if not generation_config.return_dict_in_generate:
        return sequences
    return TriForceGenerateOutput(sequences=sequences, triforce_stats=result.stats,
                                  triforce_row_stats=result.row_stats)


def triforce_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    triforce_config: TriForceConfig | None = None,
    triforce_streamer: Any = None,
    **model_kwargs,
):
    """A ``custom_generate`` callable.

    ``model.generate(ids, custom_generate=triforce_generate, triforce_config=cfg)`` is the same as
    ``model.generate(ids, triforce_config=cfg)``.
    """
    config = triforce_config if triforce_config is not None else TriForceConfig()
    if not isinstance(config, TriForceConfig):
        raise TypeError(f"triforce_config must be a TriForceConfig, got {type(config).__name__}")
    generation_config = generation_config if generation_config is not None else model.generation_config
    check_request(model, input_ids, config, generation_config, model_kwargs, logits_processor)
    if config.loop == "assisted":
        return assisted_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, config,
                                 triforce_streamer, model_kwargs)
    if input_ids.shape[0] > 1:
        return _generate_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, config,
                               triforce_streamer, model_kwargs)
    ids, pad = strip_padding(input_ids, model_kwargs.get("attention_mask"))
    prefix = prefix_cache(model_kwargs, ids, pad)
    decoder = Decoder(model, config, logits_processor, stopping_criteria,
                      max_lengths=[generation_config.max_length - pad],
                      do_sample=bool(generation_config.do_sample), paddings=[input_ids[:, :pad]])
    with recording_attention(model):
        check_model(model, config, ids[:, :1])  # before the prefill: what would fail after it fails now
        result = decoder.run([ids], prefix_cache=prefix, streamer=triforce_streamer,
                             keep_scores=bool(generation_config.output_scores),
                             keep_logits=bool(generation_config.output_logits))
    sequences = torch.cat((input_ids[:, :pad], result.sequences[0]), dim=1)
    if not generation_config.return_dict_in_generate:
        return sequences
    return TriForceGenerateOutput(
        sequences=sequences,
        scores=tuple(result.scores) if generation_config.output_scores else None,
        logits=tuple(result.logits) if generation_config.output_logits else None,
        cache=result.cache,
        triforce_stats=result.stats,
        triforce_row_stats=result.row_stats,
    )


def move_stop_strings_to_criteria(model, kwargs: dict[str, Any]) -> None:
    """``generate`` drops ``tokenizer=`` before building stop-string criteria for a ``custom_generate``
    callable (5.24, 5.25): build the `StopStringCriteria` here, from ``stop_strings=`` or the generation config."""
    stop_strings, tokenizer = kwargs.pop("stop_strings", None), kwargs.pop("tokenizer", None)
    source = kwargs.get("generation_config") or model.generation_config
    if getattr(source, "stop_strings", None) is not None:
        stop_strings = stop_strings if stop_strings is not None else source.stop_strings
        kwargs["generation_config"] = copy.deepcopy(source)
        kwargs["generation_config"].stop_strings = None
    if stop_strings is None:
        return
    if tokenizer is None:
        raise ValueError("stop_strings= needs the model's tokenizer: pass tokenizer= to generate")
    criteria = StoppingCriteriaList(list(kwargs.pop("stopping_criteria", None) or []))
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria


@functools.wraps(compat.ORIGINAL_GENERATE)
def _generate(self, *args, triforce_config: TriForceConfig | None = None, **kwargs):
    # a Hub repository's (or local folder's) custom_generate/generate.py, and a transformers patched for
    # candidate_generator=, take triforce_config= themselves
    passed_on = isinstance(kwargs.get("custom_generate"), str) or kwargs.get("candidate_generator") is not None
    if passed_on and triforce_config is not None:
        kwargs["triforce_config"] = triforce_config
    if passed_on or (triforce_config is None and kwargs.get("custom_generate") is not triforce_generate):
        return compat.ORIGINAL_GENERATE(self, *args, **kwargs)
    if kwargs.get("custom_generate", triforce_generate) is not triforce_generate:
        raise ValueError("triforce_config= cannot be combined with another custom_generate")
    if kwargs.get("assistant_model") is not None:
        raise ValueError("triforce_config= cannot be combined with assistant_model: use TriForceConfig(draft=model)")
    kwargs["custom_generate"] = triforce_generate
    kwargs["triforce_streamer"] = kwargs.pop("streamer", None)
    move_stop_strings_to_criteria(self, kwargs)
    return compat.ORIGINAL_GENERATE(self, *args, triforce_config=triforce_config, **kwargs)


def enable() -> None:
    """Install ``triforce_config=`` on every model's ``generate`` (idempotent; done on ``import hf_triforce``)."""
    compat.install_generate(_generate)


def disable() -> None:
    """Restore transformers' own ``generate``."""
    compat.install_generate(None)
