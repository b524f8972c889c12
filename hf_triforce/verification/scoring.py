"""Applying the generation config's logits processors row by row, identically at every tier."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .. import compat

# transformers' processors whose row b depends on row b's ids and scores only, with no per-row state
# (tests/test_batch.py checks each against the same rows processed as one batch): a batch row runs them on its
# own row. Every other processor runs on the row placed in a batch of the call's size (`InBatch`), which costs
# that many rows: repetition_penalty (per-row padding lengths) + top_p, 49152-token vocabulary, 512 ids, one
# CPU thread, per scored row: 10 ms both on the row alone, 10 ms with repetition_penalty in a batch of 8 and
# top_p alone (as here), 75-80 ms both in a batch of 8 (the sort of top_p).
ROW_WISE = (
    EpsilonLogitsWarper, EtaLogitsWarper, ExponentialDecayLengthPenalty, ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor, LogitNormalization, MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper, TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
)


class InBatch(LogitsProcessor):
    """One processor shown row ``row`` at index ``row`` of a batch of ``batch`` rows, the others copies of it, as
    plain batched ``generate`` shows it that row: per-row state built from the call's inputs (a
    ``prompt_ignore_length`` per padded row, the prompts of ``encoder_repetition_penalty``) lines up with the
    row. Returns that row's result."""

    def __init__(self, processor, row: int, batch: int) -> None:
        self.processor, self.row, self.batch = LogitsProcessorList([processor]), row, batch

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        rows = self.processor(input_ids.repeat(self.batch, 1), scores.repeat(self.batch, 1))
        return rows[self.row : self.row + 1]


def own_prefix_constraint(processor: PrefixConstrainedLogitsProcessor, row: int) -> PrefixConstrainedLogitsProcessor:
    """``prefix_allowed_tokens_fn`` bound to row ``row``'s batch id (``row // num_return_sequences``, as in
    ``generate``), for that row alone: the callback is never asked about another batch id (a per-row constraint,
    a trie of that row's entities, may have nothing to allow for another row's sentence and ``generate`` would
    then raise). Its fallback when every allowed token scores -inf (the allowed tokens at 0) then looks at
    this row only, where ``generate`` looks at the batch id's rows together and leaves such a row at -inf
    everywhere if a sibling row has an allowed token (a row sampling cannot draw from)."""
    allowed, rows_per_id = compat.prefix_constraint(processor)
    batch_id = row // rows_per_id
    return PrefixConstrainedLogitsProcessor(lambda _, sentence: allowed(batch_id, sentence), 1)


def row_processors(processors: LogitsProcessorList, row: int, batch: int) -> LogitsProcessorList:
    """The call's processors for row ``row`` of a ``batch``-row ``generate`` call, scored one row at a time (the
    batch's rows advance at different rates): each returns what it returns for that row in plain batched
    ``generate`` (``ROW_WISE`` ones on the row alone, ``prefix_allowed_tokens_fn`` bound to the row's batch id,
    any other in a batch of the call's size, `InBatch`). The row is the expanded row of ``num_return_sequences``,
    shown in its own padded view (`decoding.loop.PaddedView`, applied outside this), as ``generate`` shows it."""
    if batch == 1 or not processors:
        return processors
    return LogitsProcessorList(
        processor if type(processor) in ROW_WISE
        else own_prefix_constraint(processor, row) if type(processor) is PrefixConstrainedLogitsProcessor
        else InBatch(processor, row, batch)
        for processor in processors
    )


def process_each(processors: LogitsProcessorList, context_of: Callable[[int], torch.Tensor],
                 logits: torch.Tensor) -> torch.Tensor:
    """Processed fp32 scores ``[n, vocab]`` for the logits of ``n`` positions, position ``i`` processed with the
    sequence ``context_of(i)`` it predicts the next token of (asked only where there are processors); the one NaN guard
    of every tier's scores."""
    scores = logits.float()
    if processors:
        scores = torch.stack([processors(context_of(i), scores[i : i + 1].clone())[0] for i in range(scores.shape[0])])
    check_nan(scores)
    return scores


NAN_MESSAGE = ("NaN in the scores of a TriForce tier: the model produced NaN or inf logits (overflow in float16? try "
               "bfloat16 or float32); refusing to pick tokens from garbage")


@dataclass
class _Pending:
    """Within `deferred_nan_checks`: what the next `read_back` reads besides its own values."""

    flag: torch.Tensor | None = None  # the NaN checks noted since the last readback, as one device flag
    reads: list[Deferred] = field(default_factory=list)


_PENDING: ContextVar[_Pending | None] = ContextVar("hf_triforce_pending_reads", default=None)


class Deferred:
    """The values of a 1-D tensor, read on the host with the next readback (`read_back`: within
    `deferred_nan_checks`, a verification's acceptance readback) rather than by a read of their own; outside that
    context, read at once. ``values`` once read (asked before the next readback: read then)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.host: list | None = None  # the values, once read
        pending = _PENDING.get()
        if pending is None:
            self.host = tensor.tolist()
        else:
            pending.reads.append(self)

    @property
    def values(self) -> list:
        if self.host is None:
            read_back(None)
        return self.host


@contextmanager
def deferred_nan_checks() -> Iterator[None]:
    """Within, `check_nan` reads nothing: it notes a device flag that the next `read_back` (a verification's
    acceptance readback) reads with its own values and raises on, and `Deferred` values wait for that readback too,
    so that a step's only host reads are its readbacks (on CUDA each read is a synchronisation). What is still
    pending at the end is read then."""
    token = _PENDING.set(_Pending())
    try:
        yield
        read_back(None)
    finally:
        _PENDING.reset(token)


def check_nan(scores: torch.Tensor) -> torch.Tensor | None:
    """Raise `FloatingPointError` if ``scores`` hold a NaN: now, or (`deferred_nan_checks`) at the next readback;
    then returns the device flag (a 0-d bool tensor; None when checked now)."""
    pending = _PENDING.get()
    if pending is None:
        if torch.isnan(scores).any():
            raise FloatingPointError(NAN_MESSAGE)
        return None
    flag = torch.isnan(scores).any()
    pending.flag = flag if pending.flag is None else pending.flag | flag.to(pending.flag.device)
    return flag


def read_back(values: torch.Tensor | None) -> list:
    """``values`` (1-D) on the host in one transfer, with what is pending (`deferred_nan_checks`): raises
    `FloatingPointError` if a NaN check found a NaN, and fills the pending `Deferred` values. ``None``: only what is
    pending (no read if nothing is)."""
    pending = _PENDING.get()
    if pending is None or (pending.flag is None and not pending.reads):
        return [] if values is None else values.tolist()
    flag, reads = pending.flag, pending.reads
    pending.flag, pending.reads = None, []
    parts = ([] if values is None else [values]) + [deferred.tensor for deferred in reads]
    parts += [] if flag is None else [flag]
    device = parts[0].device
    read = torch.cat([_as_int64(part.reshape(-1)).to(device) for part in parts]).tolist()
    if flag is not None and read[-1]:
        raise FloatingPointError(NAN_MESSAGE)
    at = 0 if values is None else values.numel()
    for deferred in reads:
        size = deferred.tensor.numel()
        deferred.host = _from_int64(read[at : at + size], deferred.tensor.dtype)
        at += size
    return [] if values is None else _from_int64(read[: values.numel()], values.dtype)


def _as_int64(values: torch.Tensor) -> torch.Tensor:
    """``values`` as int64 holding each value exactly (floats bit for bit: float64 as its 8 bytes, narrower ones as
    float32's 4), so that tensors of several dtypes travel in one transfer."""
    if values.dtype == torch.float64:
        return values.view(torch.int64)
    if values.is_floating_point():
        return values.float().view(torch.int32).long()
    return values.long()


def _from_int64(read: list[int], dtype: torch.dtype) -> list:
    """The host values `_as_int64` packed from a tensor of ``dtype`` (floats narrower than float64: as float32)."""
    if dtype == torch.float64:
        return np.asarray(read, dtype=np.int64).view(np.float64).tolist()
    if dtype.is_floating_point:
        return np.asarray(read, dtype=np.int64).astype(np.int32).view(np.float32).tolist()
    if dtype == torch.bool:
        return [bool(value) for value in read]
    return read


def process_positions(
    processors: LogitsProcessorList, sequence: torch.Tensor, logits: torch.Tensor, first_prefix: int
) -> torch.Tensor:
    """Processed fp32 scores ``[n, vocab]`` for the logits of ``n`` positions of one forward.

    Position ``i`` predicts the token after ``sequence[:, :first_prefix + i]`` and is processed with exactly that
    prefix, as `generate` would process it when decoding one token at a time.
    """
    return process_each(processors, lambda i: sequence[:, : first_prefix + i], logits)
