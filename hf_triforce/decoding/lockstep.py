"""Lockstep: the rows of a batch drive their tiers together, and rows that share a cache run one forward.

Each row of a batch has its own Force-2 retrieval cache and its own Force-1 sink+window cache, but `share`
lays the same cache of every row into one `RaggedBufferCache`: row ``b``'s cache keeps its own class, state
and single-row code (selection, sync, eviction, rollback) and its layers become views of row ``b`` of the
shared buffers. `Lockstep.drive` then runs each row's tier generator (`hf_triforce.forwards.forward`) and, round after
round, takes the largest set of pending requests that target the same shared cache and runs them as one
forward: row ``b``'s tokens at its own positions after its own entries, padded with dummies to the widest
request, under a per-row mask (`ragged_causal_mask`); only each row's real entries are written. So the
weights are read once for all rows instead of once per row.

Exactness: row ``b``'s queries attend exactly over its own cache (other rows' columns and all dummies are
masked, contributing exactly zero), at its own positions, so its logits are those of its batch-1 forward up
to summation order. Force 1 and Force 2 need no more: a row's q and r are the laws it drew from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..caches.buffer import BufferCache, BufferLayer
from ..caches.ragged import RaggedBufferCache, RowLayer
from ..forwards.forward import ForwardRequest, Seconds, TierGenerator, ragged_forward


class Lockstep:
    """The shared caches of one batch (``batch`` rows) and the driver of its rows' tier generators."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.rows: dict[int, tuple[RaggedBufferCache, int]] = {}  # id(row cache) -> (shared cache, row)
        self.tiers: dict[int, str] = {}  # id(shared cache) -> its tier's name
        self.forwards = 0  # batched forwards run
        self.requests = 0  # requests they served
        # per tier, seconds of its batched forwards (`clock.Seconds` on a CUDA device: read after the step's readbacks)
        self.seconds: dict[str, float | Seconds] = {}
        self.row_seconds: float | Seconds = 0.0  # the same seconds counted once per row served (the rows' stats add up)

    def share(self, caches: Sequence[BufferCache], tier: str) -> RaggedBufferCache:
        """Lay row ``b``'s ``caches[b]`` (empty, same layout) into row ``b`` of one new shared cache; ``tier``
        names it in `seconds`."""
        if len(caches) != self.batch:
            raise ValueError(f"Lockstep.share: {len(caches)} caches for a batch of {self.batch}")
        first = caches[0]
        for cache in caches:
            if len(cache.layers) != len(first.layers) or cache.capacity != first.capacity:
                raise ValueError("Lockstep.share: the rows' caches differ in layers or capacity")
            if any(type(layer) is not BufferLayer or layer.is_initialized for layer in cache.layers):
                raise ValueError("Lockstep.share: only empty caches of plain BufferLayers (no sliding-window "
                                 "layers) can share storage")
        shared = RaggedBufferCache(len(first.layers), self.batch, first.capacity)
        shared.expect_devices([layer.expected_device for layer in first.layers])
        shared.store_as(first.layers[0].storage_dtype)  # a Force-2 cache's entries stay at its retrieval_dtype
        for b, cache in enumerate(caches):
            cache.layers = [RowLayer(layer, b) for layer in shared.layers]
            self.rows[id(cache)] = (shared, b)
        self.tiers[id(shared)] = tier
        return shared

    def replace(self, old: BufferCache, new: BufferCache) -> None:
        """Lay ``new`` (empty, the layout ``old`` had) into the shared row ``old`` holds, emptied: a new request's
        cache in the row a finished one leaves."""
        shared, b = self.rows.pop(id(old))
        if len(new.layers) != len(shared.layers) or new.capacity != shared.capacity:
            raise ValueError("Lockstep.replace: the new cache differs from the shared one in layers or capacity")
        if any(type(layer) is not BufferLayer or layer.is_initialized for layer in new.layers):
            raise ValueError("Lockstep.replace: only an empty cache of plain BufferLayers can share storage")
        shared.set_length(b, 0)
        new.layers = [RowLayer(layer, b) for layer in shared.layers]
        self.rows[id(new)] = (shared, b)

    def mark(self) -> tuple[float | Seconds, float | Seconds]:
        """``(row_seconds, seconds of every batched forward)`` now, for `repeated_seconds_since`."""
        return self.row_seconds, sum(self.seconds.values())

    def repeated_seconds_since(self, mark: tuple[float | Seconds, float | Seconds]) -> float | Seconds:
        """Seconds that the rows' own stats counted more than once since ``mark``: a batched forward's seconds are
        in every row it served, once per row."""
        return (self.row_seconds - mark[0]) - (sum(self.seconds.values()) - mark[1])

    def drive(self, steps: dict[int, TierGenerator[Any]]) -> dict[int, Any]:
        """Run every row's generator to its end; returns each row's result."""
        pending: dict[int, ForwardRequest] = {}
        results: dict[int, Any] = {}

        def advance(b: int, logits: torch.Tensor | None) -> None:
            try:
                pending[b] = steps[b].send(logits) if logits is not None else next(steps[b])
            except StopIteration as done:
                pending.pop(b, None)
                results[b] = done.value

        for b in steps:
            advance(b, None)
        while pending:
            groups: dict[int, list[int]] = {}
            for b, request in pending.items():
                shared = self.rows.get(id(request.cache))
                groups.setdefault(id(shared[0]) if shared is not None else -1 - b, []).append(b)
            rows = max(groups.values(), key=len)
            if id(pending[rows[0]].cache) not in self.rows:  # a cache of its own: a batch-1 forward
                advance(rows[0], pending[rows[0]].run())
                continue
            logits = self.forward({b: pending[b] for b in rows})
            for b in rows:
                advance(b, logits[b])
        return results

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        """One forward of the requests of rows sharing a cache; returns each row's ``[keep, vocab]`` logits. Each
        request's ``seconds`` is the forward's (what the row waited for), on the first request's clock (a call's
        requests share one)."""
        shared = self.rows[id(next(iter(requests.values())).cache)][0]
        models = {id(request.model) for request in requests.values()}
        if len(models) != 1:
            raise RuntimeError("Lockstep.forward: requests on one shared cache must use one model")
        clock = next(iter(requests.values())).clock
        began = clock.start()
        logits = ragged_forward(next(iter(requests.values())).model, shared,
                                {b: request.tokens for b, request in requests.items()},
                                {b: request.start for b, request in requests.items()})
        seconds = clock.stop(began)
        tier = self.tiers[id(shared)]
        self.seconds[tier] = self.seconds.get(tier, 0.0) + seconds
        self.forwards += 1
        self.requests += len(requests)
        self.row_seconds += seconds * len(requests)
        result = {}
        for b, request in requests.items():
            request.seconds = seconds
            count = request.tokens.shape[1]
            result[b] = logits[b, count - request.keep : count]
        return result
