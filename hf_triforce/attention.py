"""An attention function registered with transformers that records queries for retrieval.

`Cache.update` never sees the query, so Force 2's chunk selection gets it here: ``triforce_<base>`` wraps
the model's own attention implementation ``<base>`` (sdpa, eager, ...), records the post-RoPE query of
each layer while a `QueryRecorder` is active, and otherwise computes exactly what ``<base>`` computes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "triforce_"


class QueryRecorder:
    """Holds the last recorded query per layer: ``[batch, heads, q_len, head_dim]``."""

    def __init__(self) -> None:
        self.active = False
        self.queries: dict[int, torch.Tensor] = {}

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.active, self.queries = True, {}
        try:
            yield
        finally:
            self.active = False

    def at(self, row: int) -> dict[int, torch.Tensor]:
        """Query of one row of the recorded block per layer: ``[batch, heads, head_dim]``."""
        return {layer: q[:, :, row] for layer, q in self.queries.items()}


RECORDER = QueryRecorder()


def _base_function(base: str, module: torch.nn.Module):
    if base == "eager":  # each model file defines its own eager attention (softcapping, sinks, ...)
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


def _make_wrapper(base: str):
    def triforce_attention(module, query, key, value, attention_mask, **kwargs):
        if RECORDER.active:
            RECORDER.queries[module.layer_idx] = query.detach()
        return _base_function(base, module)(module, query, key, value, attention_mask, **kwargs)

    triforce_attention.__name__ = f"{PREFIX}{base}"
    return triforce_attention


def wrapped_name(base: str) -> str:
    """Register (once) and return the recording wrapper's name for attention implementation ``base``."""
    if base.startswith(PREFIX):
        return base
    if base not in ALL_ATTENTION_FUNCTIONS and base != "eager":
        raise ValueError(
            f"TriForce cannot wrap attention implementation {base!r}; supported: eager, "
            f"{', '.join(k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if not k.startswith(PREFIX))}"
        )
    name = f"{PREFIX}{base}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_wrapper(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name
