"""`JoiningBatch`: a replica's TriForce requests of one `Job.batch_key` decoding as one `ContinuousBatch`.

A request joins while others decode: its prefill (the engine's steps 1-3: the store's prefix, the rest of the prompt
but its last token, the store's new entry) runs one chunk at a time, at most ``prefill_chunk_size`` tokens of the
waiting requests' prefills between two Force-3 steps of the decoding rows (`advance`: a long new prompt delays each
step by at most one chunk, and several short ones, a second question's after its stored document, run in one
step's turn); once prefilled it is added to
the batch (``cache=`` its prefill), which prefills its last token in a free row and commits its first token at the
next step. Each row stops on its own rules (`RowStops`) and is answered with its own statistics the moment it stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import StoppingCriteriaList

from ..continuous import BatchRequest, ContinuousBatch
from .engine import Answer, Cancelled, ChunkedPrefill, Engine, Job
from .row_stops import RowRules, RowStops

LENGTH_STEP = 1024  # a batch's rows hold the longest waiting request's tokens rounded up to a multiple of this


@dataclass(eq=False)
class _Member:
    """One job of the batch: its prefill under way (``prefill``), then its batch request (``request``)."""

    job: Job
    on_token: Callable[[int], None] | None
    on_answer: Callable[[Answer | BaseException], None]
    started: float = field(default_factory=time.perf_counter)
    prefill: ChunkedPrefill | None = None
    prefilled: tuple | None = None  # (cache, reused positions, seconds)
    request: BatchRequest | None = None
    rules: RowRules | None = None
    stop: tuple[list[int], str, dict] | None = None  # (tokens, reason, clock) once `RowStops` stopped it
    rows: int = 0  # the most rows it decoded beside (itself included)


class JoiningBatch:
    """Jobs of ``first``'s `Job.batch_key` on ``engine``, up to ``max_rows`` at once (decoding or prefilling), each of
    up to ``max_length`` tokens (at least ``first``'s), rounded up to `LENGTH_STEP`. A context (the batch's kernels are
    held while it is open); `join`, `advance` and `close` on one thread."""

    def __init__(self, engine: Engine, first: Job, max_rows: int, max_length: int | None = None) -> None:
        self.engine, self.key, self.max_rows = engine, first.batch_key(), max_rows
        length = -(-max(first.tokens_needed, max_length or 0) // LENGTH_STEP) * LENGTH_STEP
        shared = {k: v for k, v in first.generate_kwargs.items() if k not in ("max_new_tokens", "stop_strings")}
        self.batch = ContinuousBatch(engine.model, first.triforce, max_rows=max(max_rows, 2), max_length=length,
                                     **shared)
        self.members: list[_Member] = []
        self.record = {"rows": 0, "requests": 0, "started": time.time(), "max_length": length}

    def fits(self, job: Job) -> bool:
        """Whether ``job`` can join now: its key, a free row, and its tokens within the rows' length."""
        return (job.batch_key() == self.key and len(self.members) < self.max_rows
                and job.tokens_needed <= self.batch.max_length)

    @property
    def idle(self) -> bool:
        return not self.members

    def join(self, job: Job, on_token: Callable[[int], None] | None,
             on_answer: Callable[[Answer | BaseException], None]) -> None:
        """Take ``job`` (`fits`): its prefill starts at the next `advance`."""
        member = _Member(job, on_token, on_answer)
        member.prefill = self.engine.prefill_steps(job.ids[:, : job.ids.shape[1] - 1])
        self.members.append(member)
        self.record["requests"] += 1

    def advance(self) -> None:
        """Prefill chunks of the oldest prefills under way, up to ``prefill_chunk_size`` tokens (until a row decodes,
        when none does), then one step of the decoding rows; every row that stopped is answered. A job whose own
        request is refused is answered with the refusal; what else fails raises (the caller fails every job of the
        batch: `fail`)."""
        budget = self.engine.prefill_chunk_size
        while (prefilling := next((m for m in self.members if m.prefill is not None), None)) is not None:
            decoding = any(m.request is not None for m in self.members)
            if decoding and prefilling.prefill.next_chunk() > budget:
                break
            budget -= self._prefill_chunk(prefilling)
        if not any(m.request is not None for m in self.members):
            return
        finished = {id(request) for request in self.batch.step()}
        rows = sum(m.request is not None for m in self.members)
        self.record["rows"] = max(self.record["rows"], rows)
        for member in list(self.members):
            if member.request is None:
                continue
            member.rows = max(member.rows, rows)
            if id(member.request) in finished:
                self._answer(member)

    def _prefill_chunk(self, member: _Member) -> int:
        """One chunk of ``member``'s prefill, or its request added to the batch once the prefill is done; returns the
        chunk's tokens (0: none ran)."""
        if member.job.cancelled.is_set():
            self._leave(member, Cancelled())
            return 0
        if member.prefill.next_chunk():
            return member.prefill.run_chunk()
        member.prefill, member.prefilled = None, member.prefill.result()
        job = member.job
        member.rules = self.engine.row_rules(job, member.on_token,
                                             lambda tokens, reason, clock: setattr(member, "stop",
                                                                                   (tokens, reason, clock)))
        kwargs = {**job.generate_kwargs, "cache": member.prefilled[0],
                  "stopping_criteria": StoppingCriteriaList([RowStops(job.ids, [member.rules])])}
        kwargs.pop("stop_strings", None)  # `RowStops` holds them
        try:
            member.request = self.batch.add(job.ids, **kwargs)
        except ValueError as refused:  # the request's own refusal (generate's checks): its client is told
            self._leave(member, refused)
        return 0

    def _answer(self, member: _Member) -> None:
        request = member.request
        if member.stop is None:  # generate's own criteria stopped it first (an end of sequence RowStops missed)
            raise RuntimeError("JoiningBatch: a row stopped without its RowStops stopping it")
        tokens, reason, clock = member.stop
        if request.new_tokens != tokens:
            raise RuntimeError("JoiningBatch: a row's committed tokens differ from what its RowStops saw")
        answer = self.engine.answer(member.job, member.started, clock, tokens, reason, member.prefilled,
                                    request.stats)
        if isinstance(answer, Answer):
            answer.figures["batch"] = {"rows": member.rows, "started": self.record["started"]}
        self._leave(member, answer)

    def _leave(self, member: _Member, answer: Answer | BaseException) -> None:
        self.members.remove(member)
        member.on_answer(answer)

    def fail(self, error: BaseException) -> None:
        """Answer every job still in the batch with ``error`` (what ended the batch)."""
        for member in list(self.members):
            self._leave(member, error)

    def __enter__(self) -> JoiningBatch:
        self.batch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.batch.__exit__(*exc)
        self.record["seconds"] = time.time() - self.record["started"]
        self.engine.batches.append(dict(self.record))


__all__ = ["JoiningBatch"]
