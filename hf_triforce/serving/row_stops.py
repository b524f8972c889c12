"""`RowStops`: the one stopping criterion of a served batch. Row ``b`` of a left-padded batch stops on its own end of
sequence, stop strings, ``max_tokens`` or cancellation, and hands each of its new tokens on as it is committed.

``generate`` asks the criteria about a row's sequence after every token it may commit: plain batched ``generate``
with the whole batch (``[B, L]``) once per new token, ``generate(..., triforce_config=)`` row by row (``[1, L]``),
each token a verification emitted in order, as the row is padded (`hf_triforce.decoding.loop`). A verification's
token ``i`` is committed exactly when no criterion stops at a token before it. Since `RowStops` holds every stop
rule of its rows (no other criterion is passed, and ``generate``'s own end-of-sequence and length rules stop no row
earlier than it does), a token it is asked about while its row has not stopped is committed: it is handed on at
once, and the row's answer is final the moment `RowStops` stops it, while the rest of the batch decodes on.

A row is told apart by its padded prompt (the first ``W`` columns of every sequence ``generate`` shows): rows of one
batch have distinct padded prompts (`hf_triforce.serving.scheduler` batches no two equal prompts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria


@dataclass
class RowRules:
    """What stops one row and where its tokens go.

    max_tokens: new tokens at most; eos: end-of-sequence token ids; stop_strings: a `StopStringCriteria` or None;
    cancelled: set when the row's client leaves; on_token: each committed token; on_stop: ``(tokens,
    finish_reason)`` once, when the row stops (``"stop"``, ``"length"`` or ``"cancelled"``).
    """

    max_tokens: int
    eos: frozenset[int]
    stop_strings: StoppingCriteria | None
    cancelled: threading.Event
    on_token: Callable[[int], None] | None
    on_stop: Callable[[list[int], str], None]
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False


class RowStops(StoppingCriteria):
    """Stops each row of ``padded`` ([B, W] token ids, padding first) by its ``rules[b]``."""

    def __init__(self, padded: torch.Tensor, rules: list[RowRules]) -> None:
        if padded.shape[0] != len(rules):
            raise ValueError(f"RowStops: {len(rules)} rules for a batch of {padded.shape[0]}")
        self.width, self.rules = padded.shape[1], rules
        self.rows = {self._key(padded[b]): b for b in range(padded.shape[0])}
        if len(self.rows) != len(rules):
            raise ValueError("RowStops: two rows of the batch have the same padded prompt")

    @staticmethod
    def _key(row: torch.Tensor) -> bytes:
        return row.detach().to("cpu", torch.long).numpy().tobytes()

    def row_of(self, sequence: torch.Tensor) -> int:
        """The batch row whose padded prompt begins ``sequence`` ([L])."""
        b = self.rows.get(self._key(sequence[: self.width]))
        if b is None:
            raise RuntimeError("RowStops: asked about a sequence that begins with none of the batch's prompts")
        return b

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        # input_ids: [k, L], each row a padded prompt and its new tokens; returns [k]
        done = [self._ask(input_ids[i : i + 1]) for i in range(input_ids.shape[0])]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def _ask(self, sequence: torch.Tensor) -> bool:
        rules = self.rules[self.row_of(sequence[0])]
        if rules.stopped:  # the tokens generate shows after a row's stop are never committed
            return True
        new = sequence.shape[1] - self.width
        if new != len(rules.tokens) + 1:
            raise RuntimeError(f"RowStops: asked about new token {new} of a row that has committed "
                               f"{len(rules.tokens)}; each token is asked about once, in order")
        token = int(sequence[0, -1])
        rules.tokens.append(token)
        if rules.on_token is not None:
            rules.on_token(token)
        if rules.cancelled.is_set():
            return self._stop(rules, "cancelled")
        if len(rules.tokens) >= rules.max_tokens:
            return self._stop(rules, "length")
        if token in rules.eos or (rules.stop_strings is not None and bool(rules.stop_strings(sequence, None)[0])):
            return self._stop(rules, "stop")
        return False

    @staticmethod
    def _stop(rules: RowRules, reason: str) -> bool:
        rules.stopped = True
        rules.on_stop(list(rules.tokens), reason)
        return True
