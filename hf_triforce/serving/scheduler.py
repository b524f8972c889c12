"""`Scheduler`: a replica's one generation thread. Jobs come from any thread (`submit`) and run in arrival order;
concurrent jobs that can share a batch (`Engine.why_not_batched`, `Job.batch_key`) decode as one.

TriForce jobs batch continuously: the oldest waiting job opens a `JoiningBatch`, and every later job of its key joins
it while it decodes (up to ``max_batch_size`` at once), its prefill run a chunk between two steps; a row leaves the
moment it stops. A waiting job of another key (or too long for the batch's rows) stops the batch taking new jobs, so
that it ends and the job runs next. Plain jobs batch at request boundaries: when the engine is free it takes the
oldest waiting job and, up to ``max_batch_size``, every later waiting job of the same key, after waiting
``batch_wait_seconds`` from the oldest one's arrival for companions, as one plain batched ``generate``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from .engine import Answer, Cancelled, Engine, Job
from .joining import JoiningBatch

log = logging.getLogger(__name__)


@dataclass
class _Waiting:
    job: Job
    on_token: Callable[[int], None] | None
    future: Future
    emitted: bool = False


class Scheduler:
    """Runs ``engine``'s jobs on one thread, concurrent compatible ones as one batch (see the module's docstring)."""

    def __init__(self, engine: Engine, max_batch_size: int = 8, batch_wait_seconds: float = 0.02) -> None:
        if max_batch_size < 1:
            raise ValueError(f"Scheduler: max_batch_size must be >= 1, got {max_batch_size}")
        if batch_wait_seconds < 0:
            raise ValueError(f"Scheduler: batch_wait_seconds must be >= 0, got {batch_wait_seconds}")
        self.engine, self.max_batch_size, self.batch_wait_seconds = engine, max_batch_size, batch_wait_seconds
        self._waiting: list[_Waiting] = []
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job, on_token: Callable[[int], None] | None = None) -> Future:
        """Queue ``job``; the future holds its `Answer` (or the exception that ended it, `Cancelled` included).
        ``on_token`` receives each committed token, on the scheduler's thread."""
        future: Future = Future()
        with self._changed:
            if self._closed:
                raise RuntimeError("Scheduler.submit: the scheduler is closed")
            self._waiting.append(_Waiting(job, on_token, future))
            self._changed.notify()
        return future

    def close(self, timeout: float | None = None) -> None:
        """Stop taking jobs: waiting jobs fail with RuntimeError; waits up to ``timeout`` seconds (None: as long as
        it takes) for the running batch to finish."""
        with self._changed:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._changed.notify()
        for item in waiting:
            item.future.set_exception(RuntimeError("the server is shutting down"))
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (first := self._oldest()) is not None:
            if self.max_batch_size > 1 and first.job.triforce is not None and self.engine.why_not_batched(
                    first.job) is None:
                self._run_joining()
            else:
                self._run(self._take())

    def _oldest(self) -> _Waiting | None:
        """The oldest waiting job, left waiting (None once closed); waits for one."""
        with self._changed:
            while not self._waiting and not self._closed:
                self._changed.wait()
            return None if self._closed else self._waiting[0]

    def _run_joining(self) -> None:
        """Run a `JoiningBatch` opened for the oldest waiting job until it holds no job (module docstring)."""
        with self._changed:
            first = self._waiting[0]
            # rows long enough for every request of its kind waiting now (they arrive together, a few tokens apart)
            key = first.job.batch_key()
            length = max(item.job.tokens_needed for item in self._waiting if item.job.batch_key() == key)
        try:
            batch = JoiningBatch(self.engine, first.job, self.max_batch_size, length)
        except ValueError:  # the job's own refusal: it runs alone, and is told there
            self._run(self._take())
            return
        joined = self._joining(batch)
        if not joined:  # too long for a batch of its own context: it runs alone
            self._run(self._take())
            return
        try:
            with batch:
                while joined or not batch.idle:
                    for item in joined:
                        if item.future.set_running_or_notify_cancel():
                            batch.join(item.job, self._token_hand(item), self._answer_hand(item))
                    if not batch.idle:
                        batch.advance()
                    joined = self._joining(batch)
        except Exception as error:  # answered rows keep their answers; the others learn why the batch ended
            log.warning("a batch of %d requests failed (%s: %s)", len(batch.members), type(error).__name__, error)
            batch.fail(error)

    def _joining(self, batch: JoiningBatch) -> list[_Waiting]:
        """The waiting jobs that join ``batch`` now, oldest first, up to the first that cannot (it runs next). A job of
        the batch's key is batchable as its first was (`Engine.why_not_batched` depends on the key alone, and is not
        asked again: within the batch the model's attention is the batch's own)."""
        with self._changed:
            taken = []
            for item in self._waiting:
                if self._closed or not batch.fits(item.job):
                    break
                taken.append(item)
            self._waiting = self._waiting[len(taken):]
            return taken

    def _take(self) -> list[_Waiting] | None:
        """The next group to run (None once closed): the oldest waiting job and the later plain ones it can batch
        with."""
        with self._changed:
            while not self._waiting and not self._closed:
                self._changed.wait()
            if self._closed:
                return None
            first = self._waiting[0]
            if (self.max_batch_size > 1 and first.job.triforce is None
                    and self.engine.why_not_batched(first.job) is None):
                deadline = first.job.submitted + self.batch_wait_seconds
                while (left := deadline - time.perf_counter()) > 0 and len(self._waiting) < self.max_batch_size:
                    self._changed.wait(left)
                group, prompts = [first], {first.job.ids.numpy().tobytes()}
                for item in self._waiting[1:]:
                    prompt = item.job.ids.numpy().tobytes()
                    if (len(group) < self.max_batch_size and prompt not in prompts
                            and item.job.batch_key() == first.job.batch_key()
                            and self.engine.why_not_batched(item.job) is None):
                        group.append(item)
                        prompts.add(prompt)
            else:
                group = [first]
            taken = {id(item) for item in group}
            self._waiting = [item for item in self._waiting if id(item) not in taken]
            return group

    def _run(self, group: list[_Waiting]) -> None:
        group = [item for item in group if item.future.set_running_or_notify_cancel()]
        if len(group) == 1:
            self._run_alone(group[0])
            return
        try:
            self.engine.run_batch([item.job for item in group], [self._token_hand(item) for item in group],
                                  [self._answer_hand(item) for item in group])
        except Exception as error:  # answered rows keep their answers; the others learn why the batch ended
            if not any(item.emitted for item in group):
                log.warning("a batch of %d failed before its first token (%s: %s); its requests run one by one",
                            len(group), type(error).__name__, error)
                for item in group:
                    self._run_alone(item)
                return
            for item in group:
                if not item.future.done():
                    item.future.set_exception(error)

    def _run_alone(self, item: _Waiting) -> None:
        try:
            answer = self.engine.run(item.job, self._token_hand(item))
        except BaseException as error:  # the request's own failure, Cancelled included: its client is told
            item.future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        item.future.set_result(answer)

    @staticmethod
    def _token_hand(item: _Waiting) -> Callable[[int], None]:
        def on_token(token: int) -> None:
            item.emitted = True
            if item.on_token is not None:
                item.on_token(token)
        return on_token

    @staticmethod
    def _answer_hand(item: _Waiting) -> Callable[[Answer | BaseException], None]:
        def on_answer(answer: Answer | BaseException) -> None:
            if isinstance(answer, BaseException):
                item.future.set_exception(answer)
            else:
                item.future.set_result(answer)
        return on_answer


__all__ = ["Cancelled", "Scheduler"]
