"""Forwards on a cache at absolute positions: logits, processed scores of a continuation, chunked prefill.

Every tier calls the model through these, with explicit ``position_ids`` (a cache may hold a subset of the
sequence) and, when the caller wants the queries (Force-2 selection), a `QueryRecorder`.

Tiers are written as generators of forward requests (`ForwardRequest`), so that a batch can run its rows' forwards
together.

A tier's ``*_steps`` method is a generator: each time it needs the model it yields a `ForwardRequest` and
receives that forward's logits; its result is the generator's return value. Batch size 1 drives it with
`run_inline` (each request runs when it is yielded: exactly a direct call). `hf_triforce.decoding.lockstep` drives
every row of a batch together and runs the requests of rows whose caches share storage in one batched
forward (each row's logits are its own, up to summation order).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList

from .. import compat
from ..caches.ragged import RaggedBufferCache, ragged_causal_mask
from ..kernels.attention import RECORDER_KWARG, QueryRecorder, recording
from ..verification.scoring import process_positions
from .clock import Clock, HostClock, Seconds


def forward_logits(model, tokens: torch.Tensor, cache, start: int, keep: int,
                   recorder: QueryRecorder | None = None) -> torch.Tensor:
    """Logits ``[keep, vocab]`` of the last ``keep`` positions of ``tokens`` placed at absolute ``start``."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)
    extra = {RECORDER_KWARG: recorder} if recorder is not None else {}
    with recording(recorder):
        out = model(input_ids=tokens, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=keep, **extra)
    return out.logits[0, -keep:]  # the last positions also where a model ignores logits_to_keep (Whisper's)


def ragged_forward(model, cache: RaggedBufferCache, rows: dict[int, torch.Tensor], starts: dict[int, int],
                   recorder: QueryRecorder | None = None) -> torch.Tensor:
    """One forward of a batch on a `RaggedBufferCache`: row ``b`` of ``rows`` feeds its tokens ``[1, n_b]`` at
    absolute positions ``starts[b], starts[b] + 1, ...`` after its own entries, padded to the widest row with
    dummies (its last token); a row not in ``rows`` takes no part. Only each row's real entries are written
    (`RaggedBufferCache.writing`) and its real queries attend exactly over its own entries (`ragged_causal_mask`:
    other rows' columns and every dummy contribute exactly zero). Returns logits ``[batch, n, vocab]``; row ``b``'s
    are its first ``n_b``."""
    lengths, n = cache.lengths, max(tokens.shape[1] for tokens in rows.values())
    device = next(iter(rows.values())).device
    counts = [0] * len(lengths)
    tokens = torch.zeros(len(lengths), n, dtype=torch.long, device=device)
    positions = torch.tensor(lengths, device=device)[:, None] + torch.arange(n, device=device)
    for b, row in rows.items():
        count = counts[b] = row.shape[1]
        if lengths[b] + count > cache.capacity:
            raise RuntimeError(f"RaggedBufferCache overflow: row {b} holds {lengths[b]} entries, + {count} exceed "
                               f"its capacity {cache.capacity}")
        tokens[b, :count] = row[0]
        tokens[b, count:] = row[0, -1]
        positions[b] = starts[b] + torch.arange(n, device=device)
    additive = compat.current_attention_implementation(model).removeprefix("triforce_") == "eager"
    mask = ragged_causal_mask(lengths, n, model.dtype, device, additive, counts)
    extra = {RECORDER_KWARG: recorder} if recorder is not None else {}
    with cache.writing(counts), recording(recorder):
        out = model(input_ids=tokens, cache=cache, position_ids=positions, attention_mask=mask, use_cache=True,
                    logits_to_keep=n, **extra)
    return out.logits[:, -n:]


def score_continuation(model, cache, cached: int, extended: torch.Tensor, prefix: int,
                       processors: LogitsProcessorList,
                       recorder: QueryRecorder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits and processed scores for every position after ``extended[:, :prefix]``.

    ``cache`` holds the first ``cached`` tokens of ``extended``; the rest is fed in one forward.
    """
    logits = forward_logits(model, extended[:, cached:], cache, cached, extended.shape[1] - prefix + 1, recorder)
    return logits, process_positions(processors, extended, logits, prefix)


def score_fixed_shape(verifier, cache, extended: torch.Tensor, prefix: int,
                      processors: LogitsProcessorList) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`score_continuation` by Force 3's fixed-shape forward (``verifier``: a `LeanModel.verifying` view, which
    computes the target's logits from its own weights): raw logits, processed scores, and the queries of every fed
    row ``[layers, 1, heads, n, dim]`` (outputs of the forward, read without a host transfer)."""
    cached = cache.length
    tokens = extended[:, cached:]
    positions = torch.arange(cached, extended.shape[1], device=tokens.device).unsqueeze(0)
    logits, queries = verifier.verify(tokens, positions, cache)
    logits = logits[-(extended.shape[1] - prefix + 1) :]  # the rows predicting the tokens after extended[:, :prefix]
    return logits, process_positions(processors, extended, logits, prefix), queries


def prefill(model, tokens: torch.Tensor, cache, chunk_size: int, show_progress: bool = False,
            recorder: QueryRecorder | None = None, chunk_seconds: list | None = None,
            clock: Clock | None = None) -> torch.Tensor:
    """Chunked prefill of ``tokens`` after what ``cache`` holds; returns the last row's logits ``[1, vocab]``.

    Memory stays bounded by ``chunk_size`` activations; the last chunk's queries go to ``recorder`` (they
    seed the first retrieval selection). Interruptible between chunks (KeyboardInterrupt propagates).
    ``chunk_seconds``, if given, receives ``(tokens, seconds)`` per chunk, timed on ``clock`` (`clock.Seconds` on a
    CUDA device's, read by the caller: reading them waits for the chunk, outside any decoding step).
    """
    if chunk_seconds is not None and clock is None:
        raise ValueError("prefill: chunk_seconds needs the clock that times the chunks")
    start = int(cache.get_seq_length())
    bounds = list(range(0, tokens.shape[1], chunk_size))
    logits = None
    bar = tqdm(bounds, desc="prefill", unit="chunk", disable=not show_progress or len(bounds) < 2)
    for begin in bar:
        piece = tokens[:, begin : begin + chunk_size]
        began = clock.start() if chunk_seconds is not None else None
        logits = forward_logits(model, piece, cache, start + begin, 1, recorder if begin == bounds[-1] else None)
        if chunk_seconds is not None:
            chunk_seconds.append((piece.shape[1], clock.stop(began)))
    return logits


T = TypeVar("T")
Steps = Generator["ForwardRequest", torch.Tensor, T]


@dataclass
class ForwardRequest:
    """``tokens`` ``[1, n]`` fed after what ``cache`` holds, at positions ``start, start + 1, ...``; the logits
    of the last ``keep`` rows are wanted (``[keep, vocab]``). ``clock``: the call's (`clock.device_clock`), which
    times the forward; ``seconds``: set by whoever ran it, the forward's seconds on that clock (`clock.Seconds`
    read later on a device's)."""

    model: Any
    cache: Any
    tokens: torch.Tensor
    start: int
    keep: int
    clock: Clock = field(default_factory=HostClock)
    seconds: float | Seconds = 0.0

    def run(self) -> torch.Tensor:
        """This request alone, as a batch-1 forward."""
        began = self.clock.start()
        logits = forward_logits(self.model, self.tokens, self.cache, self.start, self.keep)
        self.seconds = self.clock.stop(began)
        return logits


def run_inline(steps: Steps[T]) -> T:
    """Drive a tier's generator alone: every request runs as a batch-1 forward when it is yielded."""
    try:
        request = next(steps)
        while True:
            request = steps.send(request.run())
    except StopIteration as done:
        return done.value
