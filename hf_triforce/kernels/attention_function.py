"""The attention function hf_triforce registers with transformers: ``triforce_<base>`` wraps the model's own
attention implementation ``<base>`` (sdpa, eager, ...), records each layer's query (`attention.QueryRecorder`) and
sends each call down its path (`attention`):

* multi-token calls (verification, chunked prefill) stay GQA-native: on CUDA a mask-free fused kernel where
  `attention.fused_route` finds one; on the CPU a few query rows over a long cache take `attention.split_kv_sdpa`;
  other masked SDPA calls on GQA models take `attention.gqa_sdpa`;
* one-row calls (decoding steps of every tier) take `attention.one_row_sdpa`: no mask, GQA-native;
* on the CPU, calls of up to `cpu_attention.MAX_NEW_TOKENS` tokens over at least `cpu_attention.MIN_CACHED` entries
  take the library's kernel (`cpu_attention.attend`) where it built and was timed cheaper (`attention_routes`); a
  ragged batch's forward takes it row by row where every row's call would (`ragged_attention`);
* a candidate tree's forward takes `tree_attention`; everything else is ``<base>``.

The paths are called through the `attention` module, so what a test or a benchmark replaces there is what the wrapper
runs. Sliding-window layers (`compat.module_window`) take only the paths that apply the mask transformers built for
them: `attention.gqa_sdpa` or ``<base>``, and `attention.one_row_sdpa` only when that mask is None.
"""

from __future__ import annotations

from .. import compat
from . import attention, attention_routes, cpu_attention, ragged_attention
from .attention import _ACTIVE_RECORDER, _plain_masked, _wants_fused, _wants_gqa_sdpa, _wants_one_row, _wants_split_kv
from .tree_attention import active_tree, tree_attention

PREFIX = "triforce_"


def _plain_cpu_call(query, attention_mask, kwargs, module) -> bool:
    """A CPU call of nothing but plain scaled attention under a mask transformers' SDPA masks build: what the CPU
    kernel may take without reading the mask."""
    return (
        query.device.type == "cpu"
        and _plain_masked(attention_mask, kwargs)
        and kwargs.get("s_aux") is None
        and not (kwargs.get("dropout") and module.training)
    )




def _make_wrapper(base: str):
    def triforce_attention(module, query, key, value, attention_mask, **kwargs):
        recorder = kwargs.pop(attention.RECORDER_KWARG, None) or _ACTIVE_RECORDER.get()
        if recorder is not None:
            recorder.record(module.layer_idx, query, attention_mask)
        # a sliding-window layer's mask cuts each row at its own window: only paths that read the mask
        windowed = compat.module_window(module, kwargs) is not None
        tree = active_tree()
        if tree is not None:  # a candidate tree's forward (tree_attention.py): the tree mask replaces the causal one
            # refused before the prefill (preflight.check_model probes every layer); checked again on the first layer
            # only: an eager float mask is [rows, cached] and read whole, per call
            if getattr(module, "layer_idx", 0) == 0 and attention.mask_adds_bias(attention_mask):
                raise ValueError(f"candidate trees are not supported on a model that adds a bias to its attention mask "
                                 f"(layer {getattr(module, 'layer_idx', '?')}; ALiBi): use chains (tree_nodes=0, "
                                 "force2_tree_nodes=0)")
            return tree_attention(module, query, key, value, tree, windowed, **kwargs)
        if base == "sdpa" and not windowed and _wants_fused(query, attention_mask, kwargs):
            fused = attention.fused_verify(module, query, key, value, attention_mask, **kwargs)
            if fused is not None:
                return fused
        if base == "sdpa" and not windowed and _plain_cpu_call(query, attention_mask, kwargs, module):
            rows = ragged_attention.attend_rows(query, key, value, kwargs.get("scaling"))  # a ragged batch's forward
            if rows is not None:
                return rows, None
            # a decoding step or a few-row verification over a long cache (batch 1, bottom-right causal: the mask is
            # not read), of a class the kernel was timed cheaper for
            if attention_routes.takes_kernel(query, key, value):
                return cpu_attention.attend(query, key, value, kwargs.get("scaling")), None
        if _wants_one_row(base, query, attention_mask, kwargs) and (attention_mask is None or not windowed):
            return attention.one_row_sdpa(module, query, key, value, attention_mask, **kwargs)
        if _wants_gqa_sdpa(base, query, key, attention_mask, kwargs):
            if not windowed and _wants_split_kv(query, key, value, kwargs.get("dropout", 0.0), module):
                return attention.split_kv_sdpa(module, query, key, value, attention_mask, **kwargs)
            return attention.gqa_sdpa(module, query, key, value, attention_mask, **kwargs)
        return compat.attention_function(base, module)(module, query, key, value, attention_mask, **kwargs)

    triforce_attention.__name__ = f"{PREFIX}{base}"
    return triforce_attention


def wrapped_name(base: str) -> str:
    """Register (once) and return the recording wrapper's name for attention implementation ``base``."""
    if base.startswith(PREFIX):
        return base
    if not compat.is_registered_attention(base) and base != "eager":
        raise ValueError(
            f"TriForce cannot wrap attention implementation {base!r}; supported: eager, "
            f"{', '.join(k for k in compat.attention_names() if not k.startswith(PREFIX))}"
        )
    name = f"{PREFIX}{base}"
    if not compat.is_registered_attention(name):
        compat.register_attention(name, _make_wrapper(base), masks_like=base)
    return name
