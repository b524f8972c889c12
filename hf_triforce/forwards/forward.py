"""Forwards on a cache at absolute positions (logits, processed scores of a continuation, chunked prefill), and the
clock that times them.

Every tier calls the model through these, with explicit ``position_ids`` (a cache may hold a subset of the
sequence) and, when the caller wants the queries (Force-2 selection), a `QueryRecorder`. A tier's ``*_steps``
method is a generator of forward requests (`ForwardRequest`): it yields each request, receives that forward's
logits and returns its result. Batch size 1 drives it with `run_inline` (exactly a direct call);
`hf_triforce.decoding.lockstep` drives a batch's rows together, running the requests of rows whose caches share
storage in one batched forward.

The clock (`Clock`: ``start``, ``stop``) times each tier's forwards for the adaptive policy without waiting for the
device: `HostClock` (``time.perf_counter``; a CPU model, whose seconds are known at once, or one split over several
CUDA devices, synchronised at each ``stop``) and `EventClock` (one CUDA device: CUDA events on its current stream,
giving `Seconds` read after the step's readback has waited for the stream anyway). `Seconds` add, subtract and
scale like floats; ``float(seconds)`` reads them. A clock is ``immediate`` where its seconds are known at once
(`report.StepRecorder` reads a step's timings when it ends, else at the end of the next step).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList

from .. import compat
from ..caches.ragged import RaggedBufferCache, ragged_causal_mask
from ..kernels.attention import RECORDER_KWARG, QueryRecorder, recording
from ..kernels.ragged_attention import rows_of
from ..verification.scoring import process_positions


class Interval(Protocol):
    """One timed region on a device. ``value``: its seconds once read (None until then)."""

    value: float | None

    def read(self) -> float:
        """The region's seconds; waits for the device where it has not passed the region's end yet."""


class Seconds:
    """``constant + sum(coefficient * interval)``: seconds of which some are measured on a device and not read yet.
    Adding, subtracting and scaling keep them unread; ``float()`` reads them (`Interval.read`). Intervals already
    read fold into the constant, so a running total holds only what is still unread."""

    __slots__ = ("constant", "terms")

    def __init__(self, constant: float = 0.0, terms: Iterable[tuple[float, Interval]] = ()) -> None:
        pending = []
        for coefficient, interval in terms:
            if interval.value is not None:
                constant += coefficient * interval.value
            else:
                pending.append((coefficient, interval))
        self.constant, self.terms = constant, tuple(pending)

    def __add__(self, other: float | Seconds) -> Seconds:
        if isinstance(other, Seconds):
            return Seconds(self.constant + other.constant, self.terms + other.terms)
        return Seconds(self.constant + other, self.terms)

    __radd__ = __add__

    def __mul__(self, factor: float) -> Seconds:
        return Seconds(self.constant * factor, ((coefficient * factor, i) for coefficient, i in self.terms))

    __rmul__ = __mul__

    def __neg__(self) -> Seconds:
        return self * -1.0

    def __sub__(self, other: float | Seconds) -> Seconds:
        return self + -other

    def __rsub__(self, other: float) -> Seconds:
        return -self + other

    def __truediv__(self, divisor: float) -> Seconds:
        return self * (1.0 / divisor)

    def __float__(self) -> float:
        return self.constant + sum(coefficient * interval.read() for coefficient, interval in self.terms)

    def __repr__(self) -> str:
        return f"Seconds({self.constant!r} + {len(self.terms)} unread)"


class Clock(Protocol):
    immediate: bool  # True: ``stop`` returns a float known at once

    def start(self) -> Any:
        """A mark of now, for ``stop``."""

    def stop(self, started: Any) -> float | Seconds:
        """Seconds since ``started`` (a mark of this clock)."""


class HostClock:
    """``time.perf_counter`` seconds, known at once. ``devices``: CUDA devices synchronised at each ``stop`` (a model
    split over several: their work is waited for, so that the seconds measure it)."""

    immediate = True

    def __init__(self, devices: Iterable[torch.device] = ()) -> None:
        self.devices = tuple(devices)

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float) -> float:
        for device in self.devices:
            torch.cuda.synchronize(device)
        return time.perf_counter() - started


class EventInterval:
    """The region between two recorded ``torch.cuda.Event(enable_timing=True)``; read once the device has passed
    ``end`` (``end.query()``, which does not wait), else after waiting for it (``end.synchronize()``)."""

    def __init__(self, begin: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.begin, self.end = begin, end
        self.value: float | None = None

    def read(self) -> float:
        if self.value is None:
            if not self.end.query():
                self.end.synchronize()
            self.value = self.begin.elapsed_time(self.end) / 1000.0  # elapsed_time: milliseconds
            self.begin = self.end = None  # the events are released once read
        return self.value


class EventClock:
    """CUDA events on ``device``'s current stream: a region's seconds are the device's, read after the fact."""

    immediate = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _recorded(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> torch.cuda.Event:
        return self._recorded()

    def stop(self, started: torch.cuda.Event) -> Seconds:
        return Seconds(0.0, [(1.0, EventInterval(started, self._recorded()))])


def device_clock(model: torch.nn.Module) -> Clock:
    """The clock timing ``model``'s forwards: `EventClock` where its weights lie on one CUDA device, `HostClock`
    otherwise (synchronising the CUDA devices among several)."""
    devices = {parameter.device for parameter in model.parameters()}
    cuda = sorted((device for device in devices if device.type == "cuda"), key=str)
    if len(devices) == 1 and cuda:
        return EventClock(cuda[0])
    return HostClock(cuda)


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
    with cache.writing(counts), recording(recorder), rows_of(lengths, counts):
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
    return run_inline_chunks(prefill_steps(model, tokens, cache, chunk_size, show_progress, recorder, chunk_seconds,
                                           clock))


def prefill_steps(model, tokens: torch.Tensor, cache, chunk_size: int, show_progress: bool = False,
                  recorder: QueryRecorder | None = None, chunk_seconds: list | None = None,
                  clock: Clock | None = None) -> Generator[int, None, torch.Tensor]:
    """`prefill` as a generator: yields each chunk's tokens after its forward (a batch may decode a step in between)
    and returns the last row's logits; the same chunks, so the same entries, as `prefill`."""
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
        yield piece.shape[1]
    return logits


def run_inline_chunks(steps: Generator[int, None, T]) -> T:
    """Run a generator of chunks (`prefill_steps`) to its end; returns its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


T = TypeVar("T")
TierGenerator = Generator["ForwardRequest", torch.Tensor, T]


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


def run_inline(steps: TierGenerator[T]) -> T:
    """Drive a tier's generator alone: every request runs as a batch-1 forward when it is yielded."""
    try:
        request = next(steps)
        while True:
            request = steps.send(request.run())
    except StopIteration as done:
        return done.value
