"""Timing one decoding call from a shared prefill: what the demo compares (the bench, `hf_triforce_bench`, builds
its methods on it)."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, StaticCache

from ..forwards.forward import prefill

PREFILL_CHUNK = 1024  # tokens a prefill forward takes at once


def prefill_prefix(model, ids: torch.Tensor, chunk_size: int = PREFILL_CHUNK) -> DynamicCache:
    """A `DynamicCache` holding every prompt token but the last (``ids``: ``[1, prompt]``), with a progress bar."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prefill(model, ids[:, :-1], cache, chunk_size, show_progress=True)
    return cache


def static_copy(model, prefix: DynamicCache, max_len: int) -> StaticCache:
    """A `StaticCache` of ``max_len`` positions holding a copy of ``prefix``'s entries."""
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    for index, layer in enumerate(prefix.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), index)
    return cache


def timed_generate(model, ids: torch.Tensor, new_tokens: int, seed: int = 0, **kwargs) -> tuple[float, object]:
    """``(decode seconds, output)`` of one ``model.generate`` call of exactly ``new_tokens`` tokens after
    ``torch.manual_seed(seed)`` (``ids``: ``[batch, prompt]``; ``kwargs``: generate's). A TriForce call's seconds leave
    out what is not decoding (`TriForceStats.setup_seconds`); a cache given in ``kwargs`` is made before the clock."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    seconds = time.perf_counter() - start
    stats = getattr(out, "triforce_stats", None)
    return (seconds if stats is None else seconds - stats.setup_seconds), out
