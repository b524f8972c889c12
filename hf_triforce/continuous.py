"""`ContinuousBatch`: requests decoding together with TriForce, each joining at a step boundary and leaving the moment
it stops (continuous batching), each exactly what ``generate(..., triforce_config=)`` gives it alone.

    batch = ContinuousBatch(model, TriForceConfig(), max_rows=8, max_length=9000)
    with batch:
        first = batch.add(ids, max_new_tokens=64)          # any generate keyword of one request
        while not batch.idle:
            for request in batch.step():                   # requests that joined, then one Force-3 step of all
                print(request.sequences, request.stats)    # the requests that stopped in it

Each `add` is prepared by ``generate`` itself (a ``custom_generate`` callable that returns the request instead of
decoding it): its processors, stopping criteria, ``max_length`` and checks are those of the same ``generate`` call
alone. `step` first lets waiting requests into free rows (each prefilled in its own row of Force 3's batch cache,
after what its ``cache=`` holds, up to one prefill chunk per step while other rows decode, its first token committed
once prefilled), then runs one Force-3 step of every decoding row (`decoding.loop.Decoder`). A row that stops is
answered at once and its row is free for the next request.

Exactness per row: a row's full-cache row, drafters, levels, processors, statistics and stop are its own and new when
it joins (`Decoder.admit_steps`); its forwards attend exactly over its own entries at its own positions; every random
draw is a fresh one from the shared sampler, so its sampled law is its own law alone, whoever joins or leaves
(docs/exactness.md). Rows share ``do_sample`` (the verification rule); temperatures, top-p, stop strings and lengths
are per request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from . import compat
from .caches.row_caches import RowCaches
from .config import TriForceConfig
from .decoding.loop import Decoder, Row
from .decoding.preflight import check_batch_request, check_model
from .integration import move_stop_strings_to_criteria
from .request import check_request, recording_attention
from .stats import TriForceStats
from .verification.sampling import Sampler


@dataclass(eq=False)
class BatchRequest:
    """One request of a `ContinuousBatch`: its prompt ``[1, n]``, what ``generate`` built for it, and, once it stopped
    (`done`), its ``sequences`` ``[1, n + new]`` and ``stats``."""

    input_ids: torch.LongTensor
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList
    max_length: int
    do_sample: bool
    entries: list = field(repr=False)  # per layer (keys, values) [1, kv_heads, held, head_dim] of its cache=
    streamer: object = None
    row: Row | None = field(default=None, repr=False)  # its row while it decodes
    joining: Generator | None = field(default=None, repr=False)  # its prefill under way (`Decoder.admit_steps`)
    sequences: torch.LongTensor | None = None
    stats: TriForceStats | None = None

    @property
    def done(self) -> bool:
        return self.sequences is not None

    @property
    def new_tokens(self) -> list[int]:
        """The tokens committed so far (all of them once `done`)."""
        if self.row is None and self.sequences is None:
            return []
        sequence = self.sequences if self.sequences is not None else self.row.out.sequence
        return sequence[0, self.input_ids.shape[1] :].tolist()


def _prepared(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
              triforce_config: TriForceConfig | None = None, triforce_streamer=None, **model_kwargs) -> BatchRequest:
    """A ``custom_generate`` callable: what ``generate`` built for the request, checked as a TriForce call of batch
    size 1 is, returned instead of decoded."""
    check_request(model, input_ids, triforce_config, generation_config, model_kwargs, logits_processor)
    if input_ids.shape[0] != 1:
        raise ValueError(f"ContinuousBatch.add: input_ids of one request ([1, n]), got {tuple(input_ids.shape)}")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("ContinuousBatch.add: attention_mask must keep every position (a request is not padded)")
    cache = model_kwargs.get("cache")
    rows = RowCaches([cache])
    rows.check([input_ids.shape[1]], compat.num_layers(model.config))
    return BatchRequest(input_ids, logits_processor or LogitsProcessorList(), stopping_criteria,
                        generation_config.max_length, bool(generation_config.do_sample), rows.entries(0),
                        triforce_streamer)


class ContinuousBatch:
    """Up to ``max_rows`` requests of up to ``max_length`` tokens each (prompt and new tokens) decoding together
    (module docstring). ``generate_kwargs``: every request's ``generate`` keywords unless its `add` sets them
    (``do_sample`` is the batch's); ``sampler``: every random draw (default: torch's global RNG). Use it as a context
    (its kernels and routes are held while it is open), on one thread."""

    def __init__(self, model, triforce_config: TriForceConfig | None = None, max_rows: int = 8,
                 max_length: int | None = None, sampler: Sampler | None = None, **generate_kwargs) -> None:
        config = triforce_config if triforce_config is not None else TriForceConfig()
        if not isinstance(config, TriForceConfig):
            raise TypeError(f"triforce_config must be a TriForceConfig, got {type(config).__name__}")
        if not isinstance(max_rows, int) or max_rows < 2:
            raise ValueError(f"ContinuousBatch: max_rows must be an int >= 2, got {max_rows!r}")
        max_length = max_length if max_length is not None else getattr(model.config, "max_position_embeddings", None)
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"ContinuousBatch: max_length (tokens of a request's prompt and answer) must be an int "
                             f">= 2, got {max_length!r}")
        if "do_sample" in generate_kwargs and not isinstance(generate_kwargs["do_sample"], bool):
            raise ValueError(f"ContinuousBatch: do_sample must be True or False, got {generate_kwargs['do_sample']!r}")
        self.model, self.config, self.max_rows, self.max_length = model, config, max_rows, max_length
        self.generate_kwargs = generate_kwargs
        self.do_sample = bool(generate_kwargs.get("do_sample", model.generation_config.do_sample))
        check_batch_request(model, config, model.generation_config, None, None)
        self.decoder = Decoder(model, config, None, None, [max_length] * max_rows, self.do_sample, sampler=sampler)
        self.waiting: deque[BatchRequest] = deque()
        self.rows: list[BatchRequest | None] = [None] * max_rows  # the request in each row
        self._stack: ExitStack | None = None
        self._session = None

    @property
    def idle(self) -> bool:
        """No request waits or decodes."""
        return not self.waiting and all(request is None for request in self.rows)

    def add(self, input_ids: torch.LongTensor, streamer=None, **generate_kwargs) -> BatchRequest:
        """Queue a request (prompt ``input_ids`` ``[1, n]``, unpadded; ``cache=``: a batch-1 cache of its first
        tokens, only read; any other ``generate`` keyword of one request); it joins at the next `step` with a free
        row. Raises what ``generate(input_ids, triforce_config=..., **generate_kwargs)`` alone would raise before its
        prefill, and ValueError where it needs more than ``max_length`` tokens or another ``do_sample``."""
        kwargs = {**self.generate_kwargs, **generate_kwargs}
        move_stop_strings_to_criteria(self.model, kwargs)
        with torch.no_grad():
            request = compat.ORIGINAL_GENERATE(self.model, input_ids, custom_generate=_prepared,
                                               triforce_config=self.config, triforce_streamer=streamer, **kwargs)
        if request.do_sample != self.do_sample:
            raise ValueError(f"ContinuousBatch.add: do_sample={request.do_sample}; this batch's rows decode with "
                             f"do_sample={self.do_sample}")
        if request.max_length > self.max_length:
            raise ValueError(f"ContinuousBatch.add: the request needs {request.max_length} tokens (its prompt and "
                             f"max_new_tokens / max_length); this batch's rows hold max_length={self.max_length}")
        self.waiting.append(request)
        return request

    def step(self) -> list[BatchRequest]:
        """Waiting requests take free rows (in arrival order) and are prefilled there, up to one prefill chunk's
        tokens (``TriForceConfig.prefill_chunk_size``) while other rows decode (all of it while none does); then one
        Force-3 step of every decoding row. Returns the requests that stopped (`BatchRequest.done`), their rows
        free."""
        if self._session is None:
            raise RuntimeError("ContinuousBatch.step outside `with batch:`")
        finished = []
        with torch.no_grad():
            while self.waiting and None in self.rows:
                b, request = self.rows.index(None), self.waiting.popleft()
                request.joining = self.decoder.admit_steps(b, request.input_ids, request.entries, request.max_length,
                                                           request.criteria, request.processors, request.streamer)
                self.rows[b] = request
            budget = self.decoder.config.prefill_chunk_size
            for request in self.rows:
                while request is not None and request.joining is not None:
                    if budget <= 0 and any(r is not None and r.row is not None for r in self.rows):
                        break
                    try:
                        budget -= next(request.joining)
                    except StopIteration as joined:
                        request.row, request.joining, request.entries = joined.value, None, []
            active = [request.row for request in self.rows
                      if request is not None and request.row is not None and not request.row.done]
            if active:
                self.decoder.step(active)
            for b, request in enumerate(self.rows):
                if request is not None and request.row is not None and request.row.done:
                    request.stats = self.decoder.finish_row(request.row, self._session)
                    request.sequences = request.row.out.sequence
                    self.rows[b] = None
                    finished.append(request)
        return finished

    def __enter__(self) -> ContinuousBatch:
        stack = ExitStack()
        try:
            stack.enter_context(recording_attention(self.model))
            check_model(self.model, self.config, torch.zeros(1, 1, dtype=torch.long), batch=True)
            self._session = stack.enter_context(self.decoder.session())
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack, self._session = self._stack, None, None
        if stack is not None:
            stack.__exit__(*exc)


__all__ = ["BatchRequest", "ContinuousBatch"]
