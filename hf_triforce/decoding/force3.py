"""Force 3: the target on its full cache. One forward per step scores every active row's candidates.

Two layouts of the full cache, one interface (`Decoder` drives either):

- `Force3` (batch size 1): a preallocated `BufferCache` (`OffloadedBufferCache` with ``full_cache_device="cpu"``),
  sliding-window layers keeping their window plus rollback room; candidate trees are scored in one tree forward
  and the accepted path's entries compacted into place. Chains are scored by transformers' forward or, where
  `tiers.force3_forward` says so (``TriForceConfig.force3_compile``; CUDA graphs by default where the tiers are
  graphed), by the target's native lean forward at fixed shapes over the whole buffer (`LeanModel.verify`).
- `RaggedForce3` (batch size > 1): a `RaggedBufferCache`, one length per row. Row ``b`` is fed [its last token,
  its candidates, dummies up to the widest row] after its own entries, at its own positions, under a per-row mask
  (`ragged_causal_mask`): its queries attend exactly over its own sequence, so its p is its batch-1 p up to
  summation order, as in plain batched ``generate``.

Both prefill (returning each row's last logits and last queries), ``score`` a step (raw logits and processed
scores per row, row ``0`` predicting the token after the committed sequence), keep a row's accepted entries
(``set_length``: rollback is a length), and give the queries at a position of the last forward (Force-2 selection).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from .. import compat
from ..caches.buffer import BufferCache, copy_prefix, prefix_rows
from ..caches.offloaded import OffloadedBufferCache
from ..caches.ragged import RaggedBufferCache
from ..caches.row_caches import RowCaches
from ..compat import layer_devices
from ..forwards.forward import (
    Clock,
    prefill,
    prefill_steps,
    ragged_forward,
    run_inline_chunks,
    score_continuation,
    score_fixed_shape,
)
from ..kernels.attention import QueryRecorder
from ..tokens import append_tokens
from ..verification.scoring import process_positions
from .levels import Candidates
from .resolved import ResolvedConfig
from .tiers import force3_forward
from .tree_forward import score_tree

# receives a row's prefill: (row, the last prompt position's logits [1, vocab], its queries per layer)
Prefilled = Callable[[int, torch.Tensor, dict], None]

# a model drafter's cache fill is priced from the prefill's first chunk only if that chunk had at least this many
# rows (fewer: per-forward overhead dominates, and the per-token price would be far too high)
SETUP_PRICE_MIN_ROWS = 64


def full_cache(model, config: ResolvedConfig, max_lengths: list[int]) -> BufferCache | RaggedBufferCache:
    """Force 3's preallocated cache for rows of up to ``max_lengths`` tokens, plus ``config.force3_room`` rows for a
    step's candidates: batch size 1, a `BufferCache` (an `OffloadedBufferCache` in host memory with
    ``full_cache_device="cpu"``) whose sliding-window layers keep their window plus that room to roll back (a rejected
    chain, a stop); a batch, a `RaggedBufferCache` of one row each."""
    layers, room = compat.num_layers(model.config), config.force3_room
    if len(max_lengths) > 1:
        cache = RaggedBufferCache(layers, len(max_lengths), max(max_lengths) + room)
    else:
        cache_class = OffloadedBufferCache if config.full_cache_device == "cpu" else BufferCache
        cache = cache_class(layers, max_lengths[0] + room, compat.layer_windows(model.config), rollback=room)
    return cache.expect_devices(layer_devices(model))


class Force3:
    """Force 3 of a call of batch size 1 (sliding windows, offloading, trees, ``cache=`` prefixes)."""

    def __init__(self, model, config: ResolvedConfig, max_length: int, clock: Clock) -> None:
        self.model, self.config, self.clock = model, config, clock
        self.cache = full_cache(model, config, [max_length])
        self.recorder = QueryRecorder()
        self.uncached = 1  # tokens of the sequence fed before the candidates in the last `score`
        # the chains' verification forward (`tiers.force3_forward`): None, transformers' forward; else the target's
        # native lean forward at fixed shapes, whose queries come out stacked ([layers, 1, heads, n, dim])
        self.lean_forward, self.forward = force3_forward(model, config)
        self.stacked: torch.Tensor | None = None  # the last `score`'s queries where the lean forward ran it

    def row(self, b: int) -> BufferCache:
        return self.cache

    def prefill(self, prompts: list[torch.Tensor], prefix, stats: list, prefilled: Prefilled) -> float | None:
        """Prefill the prompt after what ``prefix`` (``cache=``) holds, then hand ``prefilled`` its last position's
        logits and queries. Returns the prefill's seconds per token where its first chunk says (None: unknown). On a
        CUDA device reading the prefill's seconds waits for it (outside any decoding step)."""
        config, (input_ids,), clock = self.config, prompts, self.clock
        cached = 0
        if prefix is not None:
            start = clock.start()
            cached = copy_prefix(prefix, self.cache)
            stats[0].detail.prefix_copy_seconds = float(clock.stop(start))
        start, chunks = clock.start(), []
        logits = prefill(self.model, input_ids[:, cached:], self.cache, config.prefill_chunk_size,
                         config.show_progress, self.recorder, chunks, clock)
        stats[0].prefill_seconds = float(clock.stop(start))
        prefilled(0, logits, self.recorder.at(-1))
        measured = bool(chunks) and cached == 0 and chunks[0][0] >= SETUP_PRICE_MIN_ROWS
        return float(chunks[0][1]) / chunks[0][0] if measured else None

    def score(self, sequences: dict[int, torch.Tensor], candidates: dict[int, Candidates],
              processors: list) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The step's forward: ``{0: (logits, processed scores)}``, position ``i`` of a chain after its ``i``-th
        candidate; of a tree, position ``i + 1`` after node ``i``."""
        ((b, sequence),) = sequences.items()
        cache, found = self.cache, candidates[b]
        self.uncached = sequence.shape[1] - cache.length
        self.stacked = None
        if found.tree is not None:
            logits, scores = score_tree(self.model, cache, cache.length, sequence, found.tree, processors[b],
                                        self.recorder)
        elif self.lean_forward is not None:
            extended = append_tokens(sequence, found.tokens)
            logits, scores, self.stacked = score_fixed_shape(self.lean_forward, cache, extended, sequence.shape[1],
                                                             processors[b])
        else:
            extended = append_tokens(sequence, found.tokens)
            logits, scores = score_continuation(self.model, cache, cache.length, extended, sequence.shape[1],
                                                processors[b], self.recorder)
        return {b: (logits, scores)}

    def keep_tree_path(self, b: int, length: int, path: list[int]) -> None:
        """A tree's accepted ``path`` (node indices): its entries moved to follow the first ``length`` tokens."""
        self.cache.keep_rows(length, path)

    def set_length(self, b: int, length: int) -> None:
        self.cache.rollback(length)

    def queries(self, b: int, position: int) -> dict[int, torch.Tensor]:
        """Per layer, the query at ``position`` of the last `score` (``0``: the committed sequence's last token)."""
        if self.stacked is not None:
            return {layer: self.stacked[layer, :, :, self.uncached - 1 + position]
                    for layer in range(len(self.stacked))}
        return self.recorder.at(self.uncached - 1 + position)

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def resident_bytes(self) -> int:
        return self.cache.resident_bytes()


class RaggedForce3:
    """Force 3 of a batch: every row verified in one forward, each accepting its own number of tokens."""

    def __init__(self, model, config: ResolvedConfig, max_lengths: list[int], paddings: list[torch.Tensor],
                 clock: Clock) -> None:
        self.model, self.config, self.paddings, self.batch = model, config, paddings, len(max_lengths)
        self.clock = clock
        self.cache = full_cache(model, config, max_lengths)
        self.additive_mask = compat.current_attention_implementation(model).removeprefix("triforce_") == "eager"
        self.recorder = QueryRecorder()
        self.lean_forward, self.forward = force3_forward(model, config, len(max_lengths))  # None: per-row masks

    def row(self, b: int) -> BufferCache:
        return self.cache.row(b)

    def prefill(self, prompts: list[torch.Tensor], prefix, stats: list, prefilled: Prefilled) -> None:
        """Prefill row after row, each handing ``prefilled`` its last prompt position's logits and queries as soon as
        it is done (its first token is committed before the next row's prefill). Each distinct prompt is prefilled
        once, on its first row; identical rows copy that row's entries. ``prefix`` (``cache=``): a `RowCaches` (row
        ``b``'s first tokens in its own cache), or a transformers cache of the first ``c`` columns of the left-padded
        batch (what a forward of ``input_ids[:, :c]`` with its attention mask left); row ``b``'s entries (past its
        padding) are copied into its row and only the rest of its prompt is run. Returns None (rows prefill apart: a
        draft cache's fill is priced by the policy)."""
        done = {}
        self._check_prefix(prompts, prefix)
        for b, ids in enumerate(prompts):
            entries = self._entries(prefix, b)  # per layer (keys, values) [1, kv_heads, held, head_dim]
            held = entries[0][0].shape[2] if entries else 0
            key = (tuple(ids[0].tolist()), tuple(self.paddings[b][0].tolist()), held)
            if key in done:
                self.cache.copy_row(done[key][0], b)
                prefilled(b, *done[key][1:])
                continue
            done[key] = (b, *self.prefill_row(b, ids, entries, stats[b]))
            prefilled(b, *done[key][1:])
        return None

    def prefill_row(self, b: int, ids: torch.Tensor, entries: list, stats) -> tuple[torch.Tensor, dict]:
        """Row ``b`` (empty) holds ``entries`` (per layer ``(keys, values)`` ``[1, kv_heads, held, head_dim]``, the
        first ``held`` tokens of ``ids`` ``[1, n]``) and the rest of ``ids`` prefilled after them; returns the last
        position's logits ``[1, vocab]`` and queries per layer. The other rows are not touched."""
        return run_inline_chunks(self.prefill_row_steps(b, ids, entries, stats))

    def prefill_row_steps(self, b: int, ids: torch.Tensor, entries: list,
                          stats) -> Generator[int, None, tuple[torch.Tensor, dict]]:
        """`prefill_row` a chunk at a time (`forward.prefill_steps`: a batch decodes steps in between)."""
        recorder, seconds, row = QueryRecorder(), 0.0, self.cache.row(b)
        held = entries[0][0].shape[2] if entries else 0
        for layer, (keys, values) in zip(row.layers, entries):
            layer.write(keys, values)
        steps = prefill_steps(self.model, ids[:, held:], row, self.config.prefill_chunk_size,
                              self.config.show_progress, recorder)
        while True:
            began = self.clock.start()
            try:
                tokens = next(steps)
            except StopIteration as done:
                logits = done.value
                break
            finally:
                seconds = seconds + self.clock.stop(began)
            yield tokens
        stats.prefill_seconds = float(seconds)
        return logits, recorder.at(-1)

    def admit_steps(self, b: int, ids: torch.Tensor, entries: list,
                    stats) -> Generator[int, None, tuple[torch.Tensor, dict]]:
        """Row ``b`` emptied and prefilled anew with an unpadded prompt ``ids`` ``[1, n]`` after ``entries``
        (`prefill_row_steps`, a chunk at a time): a request joining the batch in a free row."""
        self.cache.set_length(b, 0)
        self.paddings[b] = ids[:, :0]
        return (yield from self.prefill_row_steps(b, ids, entries, stats))

    def _check_prefix(self, prompts: list[torch.Tensor], prefix) -> None:
        """A padded batch's ``cache=`` must hold fewer columns than the batch and one row per prompt."""
        if prefix is None or isinstance(prefix, RowCaches):
            return
        cached = int(prefix.get_seq_length())
        widths = [ids.shape[1] + padding.shape[1] for ids, padding in zip(prompts, self.paddings)]
        if cached >= max(widths) or prefix_rows(prefix) != len(prompts):
            raise ValueError(f"cache= holds {cached} columns of a batch of {prefix_rows(prefix)}; the "
                             f"batch has {len(prompts)} rows of {max(widths)} columns and must extend it by at least "
                             "one")

    def _entries(self, prefix, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``b``'s prefix entries per layer, ``[1, kv_heads, held, head_dim]`` (views; [] where it has none)."""
        if prefix is None:
            return []
        if isinstance(prefix, RowCaches):
            return prefix.entries(b)
        pad, cached = self.paddings[b].shape[1], int(prefix.get_seq_length())
        if cached <= pad:
            return []
        return [(layer.keys[b : b + 1, :, pad:cached], layer.values[b : b + 1, :, pad:cached])
                for layer in prefix.layers]

    def score(self, sequences: dict[int, torch.Tensor], candidates: dict[int, Candidates],
              processors: list) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The step's forward for the active rows ``sequences`` (stopped rows take no part)."""
        lengths = self.cache.lengths
        fed = {b: append_tokens(sequence[:, -1:], candidates[b].tokens)
               for b, sequence in sequences.items()}  # the last committed token, then the candidates
        logits = ragged_forward(self.model, self.cache, fed, {b: lengths[b] for b in fed}, self.recorder)
        scored = {}
        for b, sequence in sequences.items():
            extended = torch.cat((sequence, fed[b][:, 1:]), dim=1)
            own = logits[b, : fed[b].shape[1]]  # row b's positions
            scored[b] = (own, process_positions(processors[b], extended, own, sequence.shape[1]))
        return scored

    def keep_tree_path(self, b: int, length: int, path: list[int]) -> None:
        raise NotImplementedError("batches verify chains only (refused before the prefill: check_batch_request)")

    def set_length(self, b: int, length: int) -> None:
        self.cache.set_length(b, length)

    def queries(self, b: int, position: int) -> dict[int, torch.Tensor]:
        return {layer: q[b : b + 1, :, position] for layer, q in self.recorder.queries.items()}

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def resident_bytes(self) -> int:
        return self.cache.nbytes()
