"""Applying the generation config's logits processors row by row, identically at every tier."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

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
    shown in its own padded view (`decoding.output.PaddedView`, applied outside this), as ``generate`` shows it."""
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
    """Processed fp32 scores ``[n, vocab]`` for ``n`` logit rows, row ``i`` processed with the sequence
    ``context_of(i)`` it predicts the next token of (asked only where there are processors); the one NaN guard of
    every tier's scores."""
    scores = logits.float()
    if processors:
        scores = torch.stack([processors(context_of(i), scores[i : i + 1].clone())[0] for i in range(scores.shape[0])])
    check_nan(scores)
    return scores


NAN_MESSAGE = ("NaN in the scores of a TriForce tier: the model produced NaN or inf logits (overflow in float16? try "
               "bfloat16 or float32); refusing to pick tokens from garbage")
# within `deferred_nan_checks`: the NaN checks noted since the last readback, as one device flag (None: none)
_PENDING: ContextVar[list | None] = ContextVar("hf_triforce_pending_nan", default=None)


@contextmanager
def deferred_nan_checks() -> Iterator[None]:
    """Within, `check_nan` reads nothing: it notes a device flag that the next `read_back` (a verification's
    acceptance readback) reads with its own values and raises on, so that a step's only host reads are its
    readbacks (on CUDA each read is a synchronisation). A flag still pending at the end is read then."""
    token = _PENDING.set([None])
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
    pending[0] = flag if pending[0] is None else pending[0] | flag.to(pending[0].device)
    return flag


def read_back(values: torch.Tensor | None) -> list:
    """``values`` (1-D) on the host in one transfer, with the pending NaN checks (`deferred_nan_checks`): raises
    `FloatingPointError` if one found a NaN. ``None``: only the pending checks (no read if none)."""
    pending = _PENDING.get()
    flag = pending[0] if pending is not None else None
    if flag is None:
        return [] if values is None else values.tolist()
    pending[0] = None
    flag = flag.reshape(1).to(values.device if values is not None else flag.device)
    both = flag if values is None else torch.cat((values, flag.to(values.dtype)))
    read = both.tolist()
    if read[-1]:
        raise FloatingPointError(NAN_MESSAGE)
    return read[:-1]


def process_rows(
    processors: LogitsProcessorList, sequence: torch.Tensor, logits: torch.Tensor, first_prefix: int
) -> torch.Tensor:
    """Processed fp32 scores ``[n, vocab]`` for ``n`` logit rows.

    Row ``i`` predicts the token after ``sequence[:, :first_prefix + i]`` and is processed with exactly that
    prefix, as `generate` would process it when decoding one token at a time.
    """
    return process_each(processors, lambda i: sequence[:, : first_prefix + i], logits)
