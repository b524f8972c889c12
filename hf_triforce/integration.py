"""``generate(..., triforce_config=cfg)``, ``custom_generate=triforce_generate`` and the pipeline.

Uses transformers through its public generation conventions; the internals it relies on (how ``generate``
calls a ``custom_generate`` callable, the attention registry) are reached through `compat`, which the
contract tests pin.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    ClassifierFreeGuidanceLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from . import compat
from .config import TriForceConfig
from .decoding.loop import Decoder
from .decoding.preflight import check_batch_request, check_model
from .decoding.tiers import check_lean_eligible, drafting_models
from .kernels.attention import wrapped_name
from .kernels.lean import LEAN_PRECISIONS
from .kernels.quantized import check_int8_eligible
from .kernels.row_mixing import ROW_INDEPENDENT_MAX_ROWS, row_mixing_layers
from .stats import TriForceStats

TESTED_TRANSFORMERS = compat.TESTED_TRANSFORMERS
_HANDLED_MODEL_KWARGS = {"attention_mask", "cache", "use_cache", "position_ids", "logits_to_keep"}
# Processors that keep state across calls or run the model themselves: TriForce scores several rows per
# forward and rows that Force 3 rejects, so their state would advance on tokens that are never committed.
_REFUSED_PROCESSORS = {
    UnbatchedClassifierFreeGuidanceLogitsProcessor: "guidance_scale (classifier-free guidance runs the model "
    "on its own cache, one token at a time)",
    ClassifierFreeGuidanceLogitsProcessor: "guidance_scale (classifier-free guidance needs a doubled batch)",
    SynthIDTextWatermarkLogitsProcessor: "watermarking_config with SynthID (its state advances on every call)",
}


@dataclass
class TriForceGenerateOutput(compat.GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus ``triforce_stats``."""

    triforce_stats: TriForceStats | None = None
    triforce_row_stats: list[TriForceStats] | None = None  # per row (batch size 1: [triforce_stats])


def recording_attention(model):
    """Switch the model to the query-recording wrapper of its own attention implementation (a context)."""
    return compat.attention_implementation(model, wrapped_name(compat.current_attention_implementation(model)))


def _check_request(model, input_ids: torch.Tensor, config: TriForceConfig, generation_config, model_kwargs,
                   logits_processor) -> None:
    if getattr(model.config, "is_encoder_decoder", False) or not getattr(model.config, "is_causal", True):
        raise ValueError("triforce_config= needs a decoder-only causal LM; this model is encoder-decoder or non-causal")
    if generation_config.num_beams != 1:
        raise ValueError(f"triforce_config= supports num_beams=1 only (got {generation_config.num_beams})")
    if generation_config.use_cache is False:
        raise ValueError("triforce_config= needs use_cache=True: every tier decodes on a cache")
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise ValueError(f"triforce_config= does not support {flag}=True")
    if model_kwargs.get("mm_encoder_outputs"):  # generate passes {} to a multimodal model given text only
        raise ValueError(f"triforce_config= supports text-only prompts on multimodal models; got "
                         f"{sorted(model_kwargs['mm_encoder_outputs'])} inputs")
    unknown = sorted(k for k, v in model_kwargs.items()
                     if v is not None and k not in _HANDLED_MODEL_KWARGS and not (k == "mm_encoder_outputs" and not v))
    if unknown:
        raise ValueError(f"triforce_config= does not support the model kwargs {unknown}")
    # per-layer attention types as plain generate's cache reads them: full and sliding-window layers are
    # supported (sliding layers keep their window in every tier); any other type is refused here, by name
    compat.layer_windows(model.config)
    if row_mixing_layers(model) and max(config.gamma1, config.gamma2) + 1 > ROW_INDEPENDENT_MAX_ROWS:
        raise ValueError(
            f"triforce_config=: the model has layers whose rows depend on each other (bitsandbytes LLM.int8 with "
            f"llm_int8_threshold > 0), which TriForce runs one row at a time in calls of up to "
            f"{ROW_INDEPENDENT_MAX_ROWS} rows: gamma1 + 1 and gamma2 + 1 must be at most {ROW_INDEPENDENT_MAX_ROWS} "
            f"(got gamma1={config.gamma1}, gamma2={config.gamma2})"
        )
    if config.draft_precision == "int8":
        check_int8_eligible(model)
        if not isinstance(config.draft, str):
            check_int8_eligible(config.draft)
    if config.draft_precision in LEAN_PRECISIONS:
        for drafting in drafting_models(config, model):
            check_lean_eligible(drafting, config.draft_precision)
    for processor in logits_processor or []:
        for refused, why in _REFUSED_PROCESSORS.items():
            if isinstance(processor, refused):
                raise ValueError(f"triforce_config= does not support {why}: {type(processor).__name__}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and generation_config.max_length > limit:
        raise ValueError(
            f"triforce_config=: prompt + new tokens reach {generation_config.max_length} positions, beyond the "
            f"model's max_position_embeddings={limit}; configure a RoPE extension (rope_parameters) first"
        )
    if not isinstance(config.draft, str):
        draft_vocab = config.draft.get_output_embeddings().weight.shape[0]
        target_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab:
            raise ValueError(
                f"TriForceConfig.draft has vocabulary size {draft_vocab}, the target has {target_vocab}: "
                "the draft model must share the target's vocabulary"
            )


def _strip_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Drop left padding (one row, ``[1, n]``); any other masked position is an error."""
    if attention_mask is None or bool(attention_mask.all()):
        return input_ids, 0
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input shape {tuple(input_ids.shape)}")
    pad = int((attention_mask[0].cumsum(0) == 0).sum())
    if not bool(attention_mask[0, pad:].all()):
        raise ValueError("triforce_config= supports left padding only in attention_mask")
    if pad == input_ids.shape[1]:
        raise ValueError("triforce_config=: a row of attention_mask is all padding (an empty prompt)")
    return input_ids[:, pad:], pad


def _generate_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, config, streamer,
                    model_kwargs):
    """Batch size > 1 (`hf_triforce.decoding.loop`): rows padded on the right as plain ``generate`` pads
    stopped rows."""
    mask = model_kwargs.get("attention_mask")
    prefix = model_kwargs.get("cache")
    prefix = prefix if prefix is not None and prefix.get_seq_length() > 0 else None
    check_batch_request(model, config, generation_config, streamer, prefix)
    rows, pads = [], []
    for b in range(input_ids.shape[0]):
        ids, pad = _strip_padding(input_ids[b : b + 1], None if mask is None else mask[b : b + 1])
        rows.append(ids)
        pads.append(pad)
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
    _check_request(model, input_ids, config, generation_config, model_kwargs, logits_processor)
    if config.loop == "assisted":
        from .assisted import assisted_generate  # it imports this module

        return assisted_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, config,
                                 triforce_streamer, model_kwargs)
    if input_ids.shape[0] > 1:
        return _generate_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, config,
                               triforce_streamer, model_kwargs)
    ids, pad = _strip_padding(input_ids, model_kwargs.get("attention_mask"))
    prefix = model_kwargs.get("cache")
    if prefix is not None and prefix.get_seq_length() == 0:
        prefix = None  # the empty cache that generate prepares by default
    if prefix is not None and int(prefix.get_seq_length()) >= ids.shape[1]:
        raise ValueError(
            f"cache= holds {int(prefix.get_seq_length())} tokens; the prompt must extend it by at least one token"
        )
    if pad and prefix is not None:
        raise ValueError("triforce_config= does not support a padded prompt together with cache=")
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


def _move_stop_strings_to_criteria(model, kwargs: dict[str, Any]) -> None:
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
    _move_stop_strings_to_criteria(self, kwargs)
    return compat.ORIGINAL_GENERATE(self, *args, triforce_config=triforce_config, **kwargs)


def enable() -> None:
    """Install ``triforce_config=`` on every model's ``generate`` (idempotent; done on ``import hf_triforce``)."""
    compat.install_generate(_generate)


def disable() -> None:
    """Restore transformers' own ``generate``."""
    compat.install_generate(None)
