"""The request layer: what every public entry point (``generate(triforce_config=)``, ``custom_generate``, the pipeline,
``loop="assisted"``, transformers' ``candidate_generator=`` factory, a server) does around the decoding.

    check_request(...)      refuse what no TriForce call can decode, before the prefill
    strip_padding(...)      a row's left padding removed (any other masked position refused)
    prefix_cache(...)       ``cache=``: the prefix the prompt extends, or None
    recording_attention     the model on the query-recording wrapper of its attention (a context)
    TriForceGenerateOutput  what ``generate`` returns with ``return_dict_in_generate``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    ClassifierFreeGuidanceLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from . import compat
from .caches.buffer import check_taken, prefix_rows
from .caches.row_caches import RowCaches
from .config import TriForceConfig
from .decoding.tiers import check_lean_eligible, drafting_models
from .kernels.attention_function import wrapped_name
from .kernels.lean import LEAN_PRECISIONS
from .kernels.quantized import check_int8_eligible
from .kernels.row_mixing import ROW_INDEPENDENT_MAX_ROWS, row_mixing_layers
from .stats import TriForceStats

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


def check_request(model, input_ids: torch.Tensor, config: TriForceConfig, generation_config, model_kwargs,
                  logits_processor) -> None:
    """Refuse, before any forward, what no TriForce call of ``model`` can decode: an encoder-decoder model, beams, no
    cache, a ``cache=`` it cannot read (`check_taken`), attentions or hidden states asked for, model kwargs it does
    not handle, processors whose state would advance on rejected tokens, a drafting precision a drafting model cannot
    take, a request beyond the model's positions, a draft model of another vocabulary; and any field of ``config``
    set after construction to a value it does not allow (`TriForceConfig.validate`). ``input_ids``: ``[batch, n]``."""
    if isinstance(config, TriForceConfig):  # a resolved configuration was checked when it was resolved
        config.validate()
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
    if model_kwargs.get("cache") is not None:
        check_taken(model_kwargs["cache"])
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


def strip_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
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


def prefix_cache(model_kwargs: dict, ids: torch.Tensor, pad: int):
    """The ``cache=`` the prompt ``ids`` ``[1, n]`` (its ``pad`` tokens of left padding removed) extends: None where
    there is none or it is ``generate``'s empty default; refused where it holds the whole prompt or another batch
    size than the prompt's, or the prompt is padded."""
    prefix = model_kwargs.get("cache")
    if isinstance(prefix, RowCaches):
        raise ValueError("cache=RowCaches continues a batch (batch size > 1); a prompt of batch size 1 takes its own "
                         "cache as cache=")
    if prefix is None or prefix.get_seq_length() == 0:
        return None
    if prefix_rows(prefix) != ids.shape[0]:
        raise ValueError(
            f"cache= holds a prefill of batch size {prefix_rows(prefix)}; the prompt (input_ids) has batch size "
            f"{ids.shape[0]}: a cache extends only prompts of its own batch size"
        )
    if int(prefix.get_seq_length()) >= ids.shape[1]:
        raise ValueError(
            f"cache= holds {int(prefix.get_seq_length())} tokens; the prompt must extend it by at least one token"
        )
    if pad:
        raise ValueError("triforce_config= does not support a padded prompt together with cache=")
    return prefix
