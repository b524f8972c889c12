"""`Engine`: one model answering one request at a time, with TriForce and a `PrefixStore`, through the library's
public API only (``generate(..., triforce_config=, cache=)``, ``out.triforce_stats``).

A request's prompt ``ids`` ([1, n]) runs as:
1. the longest stored prefix of ``ids[:, :n - 1]`` (`PrefixStore.lookup`), read through a view;
2. the rest of ``ids[:, :n - 1]`` prefilled after it, into new tensors (chunks of ``prefill_chunk_size``);
3. that cache of ``n - 1`` positions stored (`PrefixStore.put`): a later prompt sharing a prefix with it reuses it;
4. ``generate(ids, cache=<it>, triforce_config=...)``, which reads the cache and never writes to it, prefills the
   last prompt token and decodes; without TriForce, ``generate`` on a `StaticCache` filled from it (plain decoding,
   the baseline).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, StaticCache

from ..config import TriForceConfig
from .prefix_store import PrefixStore


class Cancelled(Exception):
    """The request was cancelled (its client left) while it generated."""


@dataclass
class Job:
    """One request, checked (`hf_triforce.serving.requests`): its prompt ([1, n]), ``generate`` keyword arguments
    (``max_new_tokens``, sampling, ``stop_strings``, ...), the TriForce configuration (None: plain decoding) and
    the seed (None: the RNG as it is)."""

    ids: torch.Tensor
    generate_kwargs: dict[str, Any]
    triforce: TriForceConfig | None
    seed: int | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Answer:
    """A finished request: its new tokens, why it stopped (``"stop"`` or ``"length"``) and its figures."""

    tokens: list[int]
    finish_reason: str
    figures: dict[str, Any]


class _TokenSink:
    """A ``generate`` streamer: hands each new token to ``on_token`` (the prompt, put first, is skipped); raises
    `Cancelled` once the job is cancelled, which stops the generation."""

    def __init__(self, job: Job, on_token: Callable[[int], None] | None, clock: dict) -> None:
        self.job, self.on_token, self.clock, self.prompt_seen = job, on_token, clock, False

    def put(self, value: torch.Tensor) -> None:
        if self.job.cancelled.is_set():
            raise Cancelled()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        self.clock.setdefault("first", now)
        self.clock["last"] = now
        for token in value.reshape(-1).tolist():
            if self.on_token is not None:
                self.on_token(int(token))

    def end(self) -> None:
        pass


def _json_safe(value: Any) -> Any:
    """Stats as JSON: dict keys as strings, non-finite floats as None."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class Engine:
    """A model, its tokenizer and a `PrefixStore`, running `Job` s one at a time (callers serialise them: the
    serving layer runs them on one thread).

    ``prefill_chunk_size``: tokens per forward of the server's own prefill (step 2), which bounds its activations.
    """

    def __init__(self, model, tokenizer, store: PrefixStore | None, prefill_chunk_size: int = 2048) -> None:
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.prefill_chunk_size = prefill_chunk_size
        self.context_length = getattr(model.config, "max_position_embeddings", None)

    def prefill(self, ids: torch.Tensor) -> tuple[DynamicCache, int, float]:
        """A cache of ``ids`` ([1, n]) (steps 1-3): ``(cache, reused positions, seconds)``."""
        start = time.perf_counter()
        tokens = ids[0]
        cache, reused = (self.store.lookup(tokens) if self.store is not None else (None, 0))
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            for begin in range(reused, tokens.shape[0], self.prefill_chunk_size):
                self.model(ids[:, begin : begin + self.prefill_chunk_size], cache=cache, use_cache=True,
                           logits_to_keep=1)
        if self.store is not None and reused < tokens.shape[0]:
            self.store.put(tokens, cache)
        return cache, reused, time.perf_counter() - start

    def run(self, job: Job, on_token: Callable[[int], None] | None = None) -> Answer:
        """Answer ``job``; ``on_token`` receives each new token as it is committed (streaming)."""
        started = time.perf_counter()
        ids = job.ids
        n = ids.shape[1]
        if n < 2:  # generate needs a token after the cache= prefix
            cache, reused, prefill_seconds = None, 0, 0.0
        else:
            cache, reused, prefill_seconds = self.prefill(ids[:, : n - 1])
        clock: dict[str, float] = {}
        kwargs = dict(job.generate_kwargs)
        kwargs.setdefault("tokenizer", self.tokenizer)
        if job.seed is not None:
            torch.manual_seed(job.seed)
        if job.triforce is not None:
            if cache is not None:
                kwargs["cache"] = cache
            out = self.model.generate(ids, triforce_config=job.triforce, streamer=_TokenSink(job, on_token, clock),
                                      return_dict_in_generate=True, **kwargs)
            stats = out.triforce_stats
        else:
            if cache is not None:
                kwargs["cache"] = self._static_copy(cache, n + kwargs["max_new_tokens"])
            out = self.model.generate(ids, streamer=_TokenSink(job, on_token, clock), return_dict_in_generate=True,
                                      **kwargs)
            stats = None
        tokens = out.sequences[0, n:].tolist()
        finish = "length" if len(tokens) >= kwargs["max_new_tokens"] else "stop"
        return Answer(tokens, finish, self._figures(started, clock, tokens, reused, prefill_seconds, stats))

    def _static_copy(self, prefix: DynamicCache, max_len: int) -> StaticCache:
        """A `StaticCache` of ``max_len`` positions holding a copy of ``prefix`` (plain decoding's cache)."""
        cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        for index, layer in enumerate(prefix.layers):
            cache.update(layer.keys, layer.values, index)
        return cache

    def _figures(self, started: float, clock: dict, tokens: list[int], reused: int, prefill_seconds: float,
                 stats) -> dict[str, Any]:
        first = clock.get("first")
        decode_seconds = clock["last"] - first if first is not None else 0.0
        figures = {
            "enabled": stats is not None,
            "time_to_first_token_seconds": (first - started) if first is not None else None,
            # tokens after the first over the seconds from the first to the last (the first comes from the prefill)
            "decode_tokens_per_second": (len(tokens) - 1) / decode_seconds if decode_seconds > 0 else None,
            "prefix_reused_tokens": reused,
            "server_prefill_seconds": prefill_seconds,
        }
        if stats is not None:
            figures.update(
                force2_acceptance=stats.force2_acceptance,
                force3_acceptance=stats.force3_acceptance,
                tokens_per_force3_step=stats.tokens_per_force3_step,
                plan_steps=stats.plan_steps,
                plans=stats.plans,
                stats=stats.to_dict(),
            )
        return _json_safe(figures)
