"""`RetrievalCache`: the Force-2 cache — a fixed budget of KV entries retrieved from the full cache.

Keys of the full cache are grouped in chunks of ``chunk_size``; each chunk has a summary per KV head (its
mean key, computed once when the chunk is complete). A selection keeps the first chunk (attention sink),
the most recent tokens, and the top-k chunks in between scored against the current query of each layer;
for GQA the query heads of a group are summed, so one set of chunks serves the whole group. After each
Force-3 step the tail of exact (full-cache) entries for newly accepted tokens is copied in, and Force 2's
own speculative entries are rolled back. Memory depends only on the budget and the tail capacity. Its entries may be
kept in a narrower dtype than the full cache's (`BufferCache.store_as`: `TriForceConfig.retrieval_dtype`), rounded as
they are copied in or computed.

Sliding-window layers (``windows``) are not sparsified: their `WindowLayer` holds the exact last entries the
model keeps (copied from the full cache's window), so retrieval applies to full-attention layers only.
"""

from __future__ import annotations

import torch

from .buffer import BufferCache, WindowLayer


class RetrievalCache(BufferCache):
    """Layout per layer: ``[selected budget entries][exact tail][Force-2 speculative entries]``.

    Sequence coordinates: the selection represents tokens ``[0, base_upto)``; entry
    ``base_length + i`` holds token ``base_upto + i``.
    """

    def __init__(self, num_layers: int, budget: int, chunk_size: int, recent: int, tail_capacity: int,
                 windows: list[int | None] | None = None) -> None:
        super().__init__(num_layers, budget + tail_capacity, windows, rollback=tail_capacity)
        self.budget = budget
        self.chunk_size = chunk_size
        self.recent = recent
        self.tail_capacity = tail_capacity
        self.base_length = 0
        self.base_upto = 0
        self.synced = 0
        self.sees_whole_cache = True
        self.selections = 0
        # per layer, the chunk summaries in a buffer with room to grow (`_summary_count` of them valid): a chunk
        # completed during decoding is written in place, not appended by copying every summary (SmolLM2 at 32k:
        # 4,000 summaries, 3 MB a layer, at each re-selection)
        self._summaries: list[torch.Tensor | None] = [None] * num_layers
        self._summary_count = [0] * num_layers
        # per layer, the chunks its selected slots hold ([batch, kv_heads, k], slot order): a re-selection copies
        # only the chunks that changed (a full copy costs a Force-3 step's worth: docs/experiments.md, "Force 2: ...")
        self._held: list[torch.Tensor | None] = [None] * num_layers
        # per layer, ``(origin, upto)`` of its recent region when a re-selection may reuse it: it holds tokens
        # ``[upto - recent, upto)``, token ``t`` at slot ``(t - origin) % recent``; a re-selection copies only the
        # tokens that entered it (cheaper than copying it whole: docs/experiments.md, "Force 2: re-select ...")
        self._recent: list[tuple[int, int] | None] = [None] * num_layers

    def entries_for(self, seq_len: int) -> int:
        return self.base_length + seq_len - self.base_upto

    def rollback_to_sequence(self, seq_len: int) -> None:
        """Keep the entries of tokens ``[0, seq_len)`` (window layers count in tokens, the others in entries)."""
        entries = self.entries_for(seq_len)
        for layer in self.layers:
            layer.crop(seq_len if isinstance(layer, WindowLayer) else entries)

    def tail_room(self, upto: int) -> int:
        """Entries still free after syncing up to ``upto`` (window layers make their own room)."""
        if isinstance(self.layers[self.reference], WindowLayer):
            return self.tail_capacity
        return self.capacity - self.entries_for(upto)

    def _chunk_summaries(self, layer_idx: int, keys: torch.Tensor, n_chunks: int, device: torch.device) -> torch.Tensor:
        """Mean key per chunk and KV head for chunks ``1..n_chunks`` (cached; chunks never change), kept on
        ``device`` (the query's): an offloaded full cache is read only for the chunks completed since."""
        cs = self.chunk_size
        done, have = self._summaries[layer_idx], self._summary_count[layer_idx]
        if have < n_chunks:
            fresh = keys[:, :, cs * (1 + have) : cs * (1 + n_chunks)].to(device)
            fresh = fresh.unflatten(2, (n_chunks - have, cs)).float().mean(3)  # fp32 keys: a view, no copy
            if done is None or done.shape[2] < n_chunks:  # room for an eighth more (a chunk every 8 tokens or so)
                grown = fresh.new_empty(*fresh.shape[:2], n_chunks + max(n_chunks // 8, 16), fresh.shape[3])
                if done is not None:
                    grown[:, :, :have] = done[:, :, :have]
                done = self._summaries[layer_idx] = grown
            done[:, :, have:n_chunks] = fresh
            self._summary_count[layer_idx] = n_chunks
        return done[:, :, :n_chunks]

    def summary_bytes(self) -> int:
        """Bytes of the chunk summaries (one mean key per chunk, KV head and layer: context / chunk_size)."""
        return sum(t[:, :, :count].nbytes for t, count in zip(self._summaries, self._summary_count) if t is not None)

    @torch.no_grad()
    def select(self, full: BufferCache, upto: int, queries: dict[int, torch.Tensor]) -> None:
        """Rebuild the selection from the first ``upto`` entries of ``full``.

        ``queries[layer]`` is ``[batch, heads, head_dim]``: the query of the last cached token per layer.
        """
        cs = self.chunk_size
        self.selections += 1
        self.sees_whole_cache = upto <= self.budget
        for layer_idx, (layer, source) in enumerate(zip(self.layers, full.layers)):
            if isinstance(layer, WindowLayer):
                layer.copy_from(source, upto)
                continue
            keys, values = source.keys[:, :, :upto], source.values[:, :, :upto]
            held, self._held[layer_idx] = self._held[layer_idx], None
            recent, self._recent[layer_idx] = self._recent[layer_idx], None
            layer.length = 0
            if self.sees_whole_cache:
                layer.write(keys, values)
                continue
            recent_start = upto - self.recent  # > cs here: upto > budget >= recent + cs
            n_mid = (recent_start - cs) // cs  # complete chunks between the sink chunk and the recent tokens
            k = min(n_mid, (self.budget - cs - self.recent) // cs)
            if k > 0 and held is not None and held.shape[-1] == k and layer.is_initialized:
                # the sink chunk and the held chunks are in place: copy what changed, then the tokens that entered
                # the recent region
                chunks = self._top_chunks(layer_idx, source, n_mid, k, queries)
                self._held[layer_idx] = layer.replace_chunks(source.keys, source.values, cs, held, 1 + chunks, cs)
                layer.length = cs * (1 + k)
                self._recent[layer_idx] = self._renew_recent(layer, keys, values, upto, recent)
                continue
            layer.write(keys[:, :, :cs], values[:, :, :cs])
            if k > 0:
                chunks = self._top_chunks(layer_idx, source, n_mid, k, queries)
                layer.write_chunks(source.keys, source.values, 1 + chunks, cs)  # chunk 0 is the sink chunk
                self._held[layer_idx] = (1 + chunks).to(layer.keys.device)
                self._recent[layer_idx] = (recent_start, upto)
            layer.write(keys[:, :, recent_start:], values[:, :, recent_start:])
        self.base_length = self.layers[self.reference].length
        self.base_upto = self.synced = upto

    def _renew_recent(self, layer, keys: torch.Tensor, values: torch.Tensor, upto: int,
                      recent: tuple[int, int] | None) -> tuple[int, int]:
        """Make the ``self.recent`` entries after the layer's valid prefix hold tokens ``[upto - recent, upto)`` of
        ``keys``/``values``; where they held ``[was - recent, was)`` (``recent = (origin, was)``, token ``t`` at slot
        ``(t - origin) % recent``) with ``was <= upto``, only tokens ``[was, upto)`` are copied, each into the slot of
        the token ``recent`` before it, which left the region. Attention does not depend on the entries' order.
        Returns the region's new ``(origin, upto)``."""
        size, base = self.recent, layer.length
        origin, was = recent if recent is not None and upto - size <= recent[1] <= upto else (upto - size, upto - size)
        token = max(was, upto - size)
        while token < upto:  # at most two pieces: up to the region's end, then from its start
            slot = (token - origin) % size
            n = min(upto - token, size - slot)
            layer.keys[:, :, base + slot : base + slot + n] = keys[:, :, token : token + n]
            layer.values[:, :, base + slot : base + slot + n] = values[:, :, token : token + n]
            token += n
        layer.length = base + size
        return origin, upto

    def _top_chunks(self, layer_idx: int, source, n_mid: int, k: int, queries: dict[int, torch.Tensor]):
        """The ``k`` chunks among ``1..n_mid`` whose mean key scores highest against layer ``layer_idx``'s query
        (summed over each KV head's query heads), as ``[batch, kv_heads, k]`` indices from 0 (chunk 1), sorted."""
        if layer_idx not in queries:
            raise ValueError(
                f"RetrievalCache: no query was recorded for layer {layer_idx}: the model's attention does "
                "not go through transformers' AttentionInterface, which Force-2 retrieval reads it from"
            )
        query = queries[layer_idx].float()
        summaries = self._chunk_summaries(layer_idx, source.keys, n_mid, query.device)  # [b, kv, n_mid, d]
        batch, heads, dim = query.shape
        kv_heads = source.keys.shape[1]
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).sum(2)
        scores = torch.einsum("bhnd,bhd->bhn", summaries, grouped)
        return scores.topk(k, dim=-1).indices.sort(dim=-1).values

    def sync(self, full: BufferCache, upto: int) -> None:
        """Drop speculative entries and copy the exact entries of tokens ``[synced, upto)`` from ``full``."""
        self.rollback_to_sequence(self.synced)
        for layer, source in zip(self.layers, full.layers):
            if not isinstance(layer, WindowLayer):
                layer.write(source.keys[:, :, self.synced : upto], source.values[:, :, self.synced : upto])
            elif layer.length == self.synced and getattr(source, "start", 0) <= self.synced:
                keys, values = source.valid()
                span = slice(self.synced - getattr(source, "start", 0), upto - getattr(source, "start", 0))
                layer.write(keys[:, :, span], values[:, :, span])
            else:
                layer.copy_from(source, upto)
        self.synced = upto
