"""`Engine`: one model answering requests, alone or several as one batch, with TriForce and a `PrefixStore`, through
the library's public generation API (``generate(..., triforce_config=, cache=, attention_mask=)``,
``out.triforce_stats``).

A request's prompt ``ids`` ([1, n]) runs as:
1. the longest stored prefix of ``ids[:, :n - 1]`` (`PrefixStore.lookup`), read through a view;
2. the rest of ``ids[:, :n - 1]`` prefilled after it, into new tensors (chunks of ``prefill_chunk_size``,
   `ChunkedPrefill`);
3. that cache of ``n - 1`` positions stored (`PrefixStore.put`): a later prompt sharing a prefix with it reuses it;
4. ``generate(ids, cache=<it>, triforce_config=...)``, which reads the cache and never writes to it, prefills the
   last prompt token and decodes; without TriForce, ``generate`` on a `StaticCache` filled from it (plain decoding,
   the baseline).

Concurrent TriForce requests decode as one `joining.JoiningBatch` (a `ContinuousBatch`: each request joins at a step
boundary after its steps 1-3, run one prefill chunk between two steps, and leaves when it stops), each row exact
(greedy identical to the request alone, its sampled law its own). Concurrent plain requests decode as one plain
batched ``generate`` (`Engine.run_batch`) from the rows' caches laid side by side (`padded_batch`). One criterion per
batch (`RowStops`) stops each row on its own rules and answers it as soon as it stops, while the other rows decode on.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, StaticCache, StoppingCriteriaList, StopStringCriteria

from ..config import TriForceConfig
from ..decoding.preflight import check_batch_request
from .padded_batch import left_padded, padded_cache
from .prefix_store import PrefixStore
from .row_stops import RowRules, RowStops

BATCHES_KEPT = 64  # the figures of a replica's most recent batches (`Engine.batches`)


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
    submitted: float = field(default_factory=time.perf_counter)  # its clock: time to first token counts from here

    @property
    def tokens_needed(self) -> int:
        """Its prompt's tokens and ``max_new_tokens``: what a batch row must hold for it."""
        return self.ids.shape[1] + self.generate_kwargs["max_new_tokens"]

    def batch_key(self) -> str | None:
        """Jobs of one key can share a batch: the same TriForce configuration and ``generate`` arguments but for
        ``max_new_tokens`` and ``stop_strings`` (each row's own). None: the job runs alone (a seed sets the one RNG
        a batch shares; a one-token prompt has no cache to continue)."""
        if self.seed is not None or self.ids.shape[1] < 2:
            return None
        shared = {k: v for k, v in sorted(self.generate_kwargs.items()) if k not in ("max_new_tokens", "stop_strings")}
        return repr((self.triforce, shared))


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


class ChunkedPrefill:
    """Steps 1-3 of a prompt ``ids`` ([1, n]) on ``engine``, a chunk at a time: the store is looked up when the first
    chunk is asked for (`next_chunk`), so that it finds what other requests stored meanwhile; `run_chunk` runs the next
    chunk; `result` stores the cache and returns ``(cache, reused positions, seconds of its own work)``."""

    def __init__(self, engine: Engine, ids: torch.Tensor) -> None:
        self.engine, self.ids = engine, ids
        self.cache: DynamicCache | None = None
        self.reused = self.done = 0
        self.seconds = 0.0

    def next_chunk(self) -> int:
        """The next chunk's tokens (0: the prompt is prefilled)."""
        if self.cache is None:
            began, store = time.perf_counter(), self.engine.store
            cache, self.reused = store.lookup(self.ids[0]) if store is not None else (None, 0)
            self.cache = cache if cache is not None else DynamicCache(config=self.engine.model.config)
            self.done = self.reused
            self.seconds += time.perf_counter() - began
        return min(self.engine.prefill_chunk_size, self.ids.shape[1] - self.done)

    def run_chunk(self) -> int:
        """Run the next chunk (`next_chunk` first); returns its tokens."""
        tokens, began = self.next_chunk(), time.perf_counter()
        with torch.no_grad():
            self.engine.model(self.ids[:, self.done : self.done + tokens], cache=self.cache, use_cache=True,
                              logits_to_keep=1)
        self.done += tokens
        self.seconds += time.perf_counter() - began
        return tokens

    def result(self) -> tuple[DynamicCache, int, float]:
        if self.next_chunk():
            raise RuntimeError("ChunkedPrefill.result before its last chunk")
        began, store = time.perf_counter(), self.engine.store
        if store is not None and self.reused < self.ids.shape[1]:
            store.put(self.ids[0], self.cache)
        self.seconds += time.perf_counter() - began
        return self.cache, self.reused, self.seconds


class Engine:
    """A model, its tokenizer and a `PrefixStore`, running `Job` s alone (`run`) or as one batch (`run_batch`);
    callers serialise the calls (the serving layer runs them on one thread, `Scheduler`).

    ``prefill_chunk_size``: tokens per forward of the server's own prefill (step 2), which bounds its activations.
    """

    def __init__(self, model, tokenizer, store: PrefixStore | None, prefill_chunk_size: int = 2048) -> None:
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.prefill_chunk_size = prefill_chunk_size
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self.batches: deque[dict[str, Any]] = deque(maxlen=BATCHES_KEPT)  # each batch's figures, newest last
        self._stop_strings: dict[tuple[str, ...], StopStringCriteria] = {}

    def why_not_batched(self, job: Job) -> str | None:
        """None where ``job`` can decode in a batch with others of its `Job.batch_key`, else why not (the batch
        path's own refusals: trees, a full cache on another device, sliding-window layers, ...)."""
        if job.batch_key() is None:
            return "a seeded request or a one-token prompt runs alone"
        if job.triforce is None:
            return None
        try:
            check_batch_request(self.model, job.triforce, self.model.generation_config, None, None)
        except ValueError as error:
            return str(error)
        return None

    def prefill(self, ids: torch.Tensor) -> tuple[DynamicCache, int, float]:
        """A cache of ``ids`` ([1, n]) (steps 1-3): ``(cache, reused positions, seconds)``."""
        prefill = self.prefill_steps(ids)
        while prefill.next_chunk():
            prefill.run_chunk()
        return prefill.result()

    def prefill_steps(self, ids: torch.Tensor) -> ChunkedPrefill:
        """`prefill` one chunk at a time (a batch decodes steps in between): `ChunkedPrefill`."""
        return ChunkedPrefill(self, ids)

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
        return Answer(tokens, finish, self._figures(job, started, clock, tokens, reused, prefill_seconds, stats))

    def run_batch(self, jobs: list[Job], on_tokens: list[Callable[[int], None] | None],
                  on_answers: list[Callable[[Answer | BaseException], None]]) -> None:
        """Answer ``jobs`` (two or more plain ones of one `Job.batch_key`) as one plain batched ``generate`` from the
        rows' caches laid side by side (`padded_batch`; TriForce jobs decode as a `JoiningBatch` instead).
        ``on_tokens[b]`` receives row ``b``'s tokens as they are committed; ``on_answers[b]`` its `Answer` the moment
        it stops (or `Cancelled` where its client left), while the other rows decode on. Raises what ``generate``
        raises (no row is then answered by this call)."""
        started = time.perf_counter()
        keys = {job.batch_key() for job in jobs}
        if len(jobs) < 2 or len(keys) != 1 or None in keys or jobs[0].triforce is not None:
            raise ValueError(f"Engine.run_batch: two or more plain jobs of one batch key (got {len(jobs)} of "
                             f"{len(keys)})")
        prefills = [self.prefill(job.ids[:, : job.ids.shape[1] - 1]) for job in jobs]  # each row's steps 1-3
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, mask = left_padded([job.ids for job in jobs], pad)
        lengths = [job.ids.shape[1] for job in jobs]
        kwargs = {k: v for k, v in jobs[0].generate_kwargs.items() if k != "stop_strings"}
        kwargs["max_new_tokens"] = max(job.generate_kwargs["max_new_tokens"] for job in jobs)
        row_batch = {"rows": len(jobs), "started": time.time()}  # what each row's figures say of its batch

        def answered(b: int) -> Callable[[list[int], str, dict], None]:
            def on_stop(tokens: list[int], reason: str, clock: dict) -> None:
                answer = self.answer(jobs[b], started, clock, tokens, reason, prefills[b], None)
                if isinstance(answer, Answer):
                    answer.figures["batch"] = dict(row_batch)  # its own copy: the batch's record grows after
                on_answers[b](answer)
            return on_stop

        rules = [self.row_rules(job, on_tokens[b], answered(b)) for b, job in enumerate(jobs)]
        kwargs.update(attention_mask=mask, pad_token_id=pad, stopping_criteria=StoppingCriteriaList([RowStops(ids,
                      rules)]), return_dict_in_generate=True)
        cache = padded_cache([cache for cache, _, _ in prefills], lengths, self.model.config)
        out = self.model.generate(ids, cache=self._static_copy(cache, ids.shape[1] + kwargs["max_new_tokens"]),
                                  **kwargs)
        for b, row in enumerate(rules):
            if not row.stopped or out.sequences[b, ids.shape[1]: ids.shape[1] + len(row.tokens)].tolist() != row.tokens:
                raise RuntimeError(f"Engine.run_batch: row {b}'s committed tokens differ from generate's sequence")
        self.batches.append(_json_safe({**row_batch, "seconds": time.perf_counter() - started}))

    def row_rules(self, job: Job, on_token: Callable[[int], None] | None,
                  on_stop: Callable[[list[int], str, dict], None]) -> RowRules:
        """``job``'s stop rules as a batch row (`RowStops`): ``on_token`` receives each committed token, ``on_stop``
        its tokens, finish reason (``"cancelled"`` too) and clock (when its first and last tokens came) once it
        stops."""
        clock: dict[str, float] = {}
        eos = job.generate_kwargs.get("eos_token_id")
        eos = eos if eos is not None else self.model.generation_config.eos_token_id
        eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)

        def token(value: int) -> None:
            now = time.perf_counter()
            clock.setdefault("first", now)
            clock["last"] = now
            if on_token is not None:
                on_token(value)

        return RowRules(job.generate_kwargs["max_new_tokens"], eos, self._stop_criterion(job), job.cancelled, token,
                        lambda tokens, reason: on_stop(tokens, reason, clock))

    def answer(self, job: Job, started: float, clock: dict, tokens: list[int], reason: str,
               prefilled: tuple[DynamicCache, int, float], stats) -> Answer | Cancelled:
        """A batch row's answer once it stopped (`row_rules`): `Cancelled` where its client left; ``started``: when
        the engine took it up, ``prefilled``: its prefill's ``(cache, reused, seconds)``, ``stats``: its TriForce
        statistics (None: plain)."""
        if reason == "cancelled":
            return Cancelled()
        _, reused, seconds = prefilled
        return Answer(tokens, reason, self._figures(job, started, clock, tokens, reused, seconds, stats))

    def _stop_criterion(self, job: Job) -> StopStringCriteria | None:
        """``job``'s stop strings as transformers' criterion (built once per list: it indexes the vocabulary)."""
        strings = job.generate_kwargs.get("stop_strings")
        if not strings:
            return None
        key = tuple(strings)
        if key not in self._stop_strings:
            self._stop_strings[key] = StopStringCriteria(tokenizer=self.tokenizer, stop_strings=list(key))
        return self._stop_strings[key]

    def _static_copy(self, prefix: DynamicCache, max_len: int) -> StaticCache:
        """A `StaticCache` of ``max_len`` positions holding a copy of ``prefix`` (plain decoding's cache)."""
        cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        for index, layer in enumerate(prefix.layers):
            cache.update(layer.keys, layer.values, index)
        return cache

    def _figures(self, job: Job, started: float, clock: dict, tokens: list[int], reused: int, prefill_seconds: float,
                 stats) -> dict[str, Any]:
        """A request's figures; ``started``: when the engine took it up (its queue wait ends there)."""
        first = clock.get("first")
        decode_seconds = clock["last"] - first if first is not None else 0.0
        figures = {
            "enabled": job.triforce is not None,
            "queue_seconds": started - job.submitted,
            "time_to_first_token_seconds": (first - job.submitted) if first is not None else None,
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
                plans=stats.detail.plans,
                stats=stats.to_dict(),
            )
        return _json_safe(figures)
