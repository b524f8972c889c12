"""The ONLY module that touches transformers internals.

Written against transformers 5.24 (declared range ``>=5.24,<6``); ``tests/test_integration_contract.py``
fails loudly when one of the internals used here changes:

- ``GenerationMixin.generate`` is wrapped so that ``triforce_config=`` routes to ``custom_generate``
  (a bare unknown kwarg is otherwise rejected by ``_validate_model_kwargs``), and ``streamer=`` is
  forwarded under another name (``generate`` does not hand it to a ``custom_generate`` callable);
- ``generate(custom_generate=fn)`` calls ``fn(model, input_ids, logits_processor=, stopping_criteria=,
  generation_config=, <fn's own kwargs>, **model_kwargs)`` after all of its setup;
- ``config._attn_implementation`` is switched, for the duration of a call, to the recording wrapper of
  `attention.py`; masks come from the cache's ``get_mask_sizes`` and ``get_seq_length``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .attention import wrapped_name
from .config import TriForceConfig
from .hierarchy import triforce_decode
from .stats import TriForceStats

TESTED_TRANSFORMERS = (">=5.24", "<6")
_HANDLED_MODEL_KWARGS = {"attention_mask", "cache", "use_cache", "position_ids", "logits_to_keep"}


@dataclass
class TriForceGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus ``triforce_stats``."""

    triforce_stats: TriForceStats | None = None


@contextmanager
def recording_attention(model) -> Iterator[None]:
    """Switch the model to the query-recording wrapper of its own attention implementation."""
    config = model.config
    original = config._attn_implementation
    config._attn_implementation = wrapped_name(original or "eager")
    try:
        yield
    finally:
        config._attn_implementation = original


def _check_request(model, input_ids: torch.Tensor, config: TriForceConfig, generation_config, model_kwargs) -> None:
    if getattr(model.config, "is_encoder_decoder", False) or not getattr(model.config, "is_causal", True):
        raise ValueError("triforce_config= needs a decoder-only causal LM; this model is encoder-decoder or non-causal")
    if generation_config.num_beams != 1:
        raise ValueError(f"triforce_config= supports num_beams=1 only (got {generation_config.num_beams})")
    if generation_config.num_return_sequences != 1:
        raise ValueError("triforce_config= supports num_return_sequences=1 only")
    if input_ids.shape[0] != 1:
        raise ValueError(f"triforce_config= supports batch size 1 (got input of batch size {input_ids.shape[0]})")
    if generation_config.use_cache is False:
        raise ValueError("triforce_config= needs use_cache=True: every tier decodes on a cache")
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            raise ValueError(f"triforce_config= does not support {flag}=True")
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _HANDLED_MODEL_KWARGS)
    if unknown:
        raise ValueError(f"triforce_config= does not support the model kwargs {unknown}")
    sliding = getattr(model.config, "sliding_window", None)
    if sliding is not None and generation_config.max_length > sliding:
        raise ValueError(
            f"triforce_config=: the model uses sliding-window attention ({sliding} tokens) and the request reaches "
            f"{generation_config.max_length} tokens; TriForce supports full attention only"
        )
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
    """Drop left padding (batch 1); any other masked position is an error."""
    if attention_mask is None or bool(attention_mask.all()):
        return input_ids, 0
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input shape {tuple(input_ids.shape)}")
    pad = int((attention_mask[0].cumsum(0) == 0).sum())
    if not bool(attention_mask[0, pad:].all()):
        raise ValueError("triforce_config= supports left padding only in attention_mask")
    return input_ids[:, pad:], pad


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
    _check_request(model, input_ids, config, generation_config, model_kwargs)
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
    with recording_attention(model):
        result = triforce_decode(
            model,
            ids,
            config,
            logits_processor,
            stopping_criteria,
            max_length=generation_config.max_length - pad,
            do_sample=bool(generation_config.do_sample),
            streamer=triforce_streamer,
            prefix_cache=prefix,
            keep_scores=bool(generation_config.output_scores),
            keep_logits=bool(generation_config.output_logits),
        )
    sequences = torch.cat((input_ids[:, :pad], result.sequences), dim=1) if pad else result.sequences
    if not generation_config.return_dict_in_generate:
        return sequences
    return TriForceGenerateOutput(
        sequences=sequences,
        scores=tuple(result.scores) if generation_config.output_scores else None,
        logits=tuple(result.logits) if generation_config.output_logits else None,
        cache=result.cache,
        triforce_stats=result.stats,
    )


_ORIGINAL_GENERATE = GenerationMixin.generate


def _move_stop_strings_to_criteria(kwargs: dict[str, Any]) -> None:
    """``generate`` drops ``tokenizer=`` before building stop-string criteria for a ``custom_generate``
    callable (5.24); build the `StopStringCriteria` here instead."""
    stop_strings, tokenizer = kwargs.pop("stop_strings", None), kwargs.pop("tokenizer", None)
    if stop_strings is None:
        return
    if tokenizer is None:
        raise ValueError("stop_strings= needs the model's tokenizer: pass tokenizer= to generate")
    criteria = StoppingCriteriaList(list(kwargs.pop("stopping_criteria", None) or []))
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria


@functools.wraps(_ORIGINAL_GENERATE)
def _generate(self, *args, triforce_config: TriForceConfig | None = None, **kwargs):
    if triforce_config is None and kwargs.get("custom_generate") is not triforce_generate:
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    if kwargs.get("custom_generate", triforce_generate) is not triforce_generate:
        raise ValueError("triforce_config= cannot be combined with another custom_generate")
    if kwargs.get("assistant_model") is not None:
        raise ValueError("triforce_config= cannot be combined with assistant_model: use TriForceConfig(draft=model)")
    kwargs["custom_generate"] = triforce_generate
    kwargs["triforce_streamer"] = kwargs.pop("streamer", None)
    _move_stop_strings_to_criteria(kwargs)
    return _ORIGINAL_GENERATE(self, *args, triforce_config=triforce_config, **kwargs)


def enable() -> None:
    """Install ``triforce_config=`` on every model's ``generate`` (idempotent; done on ``import hf_triforce``)."""
    GenerationMixin.generate = _generate


def disable() -> None:
    """Restore transformers' own ``generate``."""
    GenerationMixin.generate = _ORIGINAL_GENERATE


def transformers_version() -> str:
    return transformers.__version__
