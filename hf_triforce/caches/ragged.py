"""`RaggedBufferCache`: Force 3's full cache for a batch, one length per row (rollback is a length, per row).

Row ``b`` keeps its own tokens, without padding, in columns ``[0, lengths[b])`` of a shared
``[batch, kv_heads, capacity, head_dim]`` buffer. A batched forward feeds every row the same number ``n`` of
new tokens: row ``b``'s are written at ``[lengths[b], lengths[b] + n)``, and the attention sees columns
``[0, max(lengths) + n)`` under a 4-D mask that shows row ``b``'s query ``i`` exactly its columns
``[0, lengths[b] + i]`` (`ragged_causal_mask`). Columns past a row's length are stale entries of rejected or
dummy tokens, never seen. So rows accept different numbers of tokens without holes and without moving
entries, and each row attends exactly over its own sequence.

`row(b)` is a batch-1 `BufferCache` view of row ``b`` (its buffers are views of the shared ones, its
length is ``lengths[b]``): the single-row pieces (prefill, the Force-2 retrieval cache's selection and
sync) read and write a row through it unchanged.
"""

from __future__ import annotations

import contextlib

import torch

from ..compat import Cache, CacheLayerMixin
from .buffer import BufferCache, BufferLayer


class RaggedLayer(CacheLayerMixin):
    """One layer: ``[batch, kv_heads, capacity, head_dim]`` buffers and ``lengths[b]`` valid entries per row."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, batch: int, capacity: int) -> None:
        super().__init__()
        self.batch, self.capacity = batch, capacity
        self.lengths = [0] * batch
        self.counts: list[int] | None = None  # per row, how many of a forward's n entries are real (`writing`)
        self.expected_device: torch.device | None = None
        self.storage_dtype: torch.dtype | None = None  # the entries' dtype when stored (None: as computed)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate for the whole batch (``key_states`` may be one row's: a row prefill through `row`)."""
        heads, k_dim = key_states.shape[1], key_states.shape[-1]
        device = self.expected_device if self.expected_device is not None else key_states.device
        dtype = self.storage_dtype
        self.keys = key_states.new_zeros((self.batch, heads, self.capacity, k_dim), device=device, dtype=dtype)
        self.values = value_states.new_zeros((self.batch, heads, self.capacity, value_states.shape[-1]),
                                             device=device, dtype=dtype)
        self.device = device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write row ``b``'s first ``counts[b]`` new entries (all ``n`` unless `writing` said otherwise) at
        ``lengths[b]``; return columns ``[0, max(new lengths))``."""
        if key_states.shape[0] != self.batch:
            raise RuntimeError(f"RaggedLayer: a forward of batch {key_states.shape[0]} on a cache of batch "
                               f"{self.batch}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        counts = self.counts if self.counts is not None else [n] * self.batch
        width = max(length + count for length, count in zip(self.lengths, counts))
        if width > self.capacity:
            raise RuntimeError(f"RaggedLayer overflow: {width} entries exceed its capacity {self.capacity}")
        for b, (length, count) in enumerate(zip(self.lengths, counts)):
            self.keys[b, :, length : length + count] = key_states[b, :, :count]
            self.values[b, :, length : length + count] = value_states[b, :, :count]
            self.lengths[b] = length + count
        return self.keys[:, :, :width], self.values[:, :, :width]

    def get_seq_length(self) -> int:
        return max(self.lengths)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(self.lengths) + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.lengths = [0] * self.batch

    def copy_row(self, source: int, target: int) -> None:
        """Row ``target`` becomes a copy of row ``source`` (a prompt prefilled once for several rows)."""
        n = self.lengths[source]
        self.keys[target, :, :n] = self.keys[source, :, :n]
        self.values[target, :, :n] = self.values[source, :, :n]
        self.lengths[target] = n

    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes


class RowLayer(BufferLayer):
    """Row ``row`` of a `RaggedLayer` as a batch-1 `BufferLayer`: its buffers and length are the parent's."""

    def __init__(self, parent: RaggedLayer, row: int) -> None:  # no BufferLayer.__init__: only its counter
        self.parent, self.row, self.capacity = parent, row, parent.capacity
        self.chunks_copied = 0

    @property
    def device(self) -> torch.device:
        return self.parent.device

    @property
    def keys(self) -> torch.Tensor:
        return self.parent.keys[self.row : self.row + 1]

    @property
    def values(self) -> torch.Tensor:
        return self.parent.values[self.row : self.row + 1]

    @property
    def is_initialized(self) -> bool:
        return self.parent.is_initialized

    @property
    def expected_device(self) -> torch.device | None:
        return self.parent.expected_device

    @property
    def storage_dtype(self) -> torch.dtype | None:
        return self.parent.storage_dtype

    @property
    def length(self) -> int:
        return self.parent.lengths[self.row]

    @length.setter
    def length(self, value: int) -> None:
        self.parent.lengths[self.row] = value

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, filled: int = 0) -> None:
        self.parent.lazy_initialization(key_states, value_states)  # the whole batch's buffers: all zeroed

    def nbytes(self) -> int:
        return 0  # the parent's buffers


class RowView(BufferCache):
    """A batch-1 `BufferCache` over one row of a `RaggedBufferCache` (no buffers of its own)."""

    def __init__(self, ragged: RaggedBufferCache, row: int) -> None:  # no BufferCache.__init__: layers are views
        Cache.__init__(self, layers=[RowLayer(layer, row) for layer in ragged.layers])
        self.capacity, self.windows, self.reference = ragged.capacity, [None] * len(ragged.layers), 0


class RaggedBufferCache(Cache):
    """A `Cache` of `RaggedLayer`s (full-attention layers only: a sliding window counts columns, which are
    not a row's positions once rows differ in length)."""

    def __init__(self, num_layers: int, batch: int, capacity: int) -> None:
        super().__init__(layers=[RaggedLayer(batch, capacity) for _ in range(num_layers)])
        self.batch, self.capacity = batch, capacity

    @property
    def lengths(self) -> list[int]:
        return list(self.layers[0].lengths)

    def expect_devices(self, devices: list[torch.device | None]) -> RaggedBufferCache:
        """Allocate layer ``i`` on ``devices[i]`` (``None``: where its entries are computed)."""
        for layer, device in zip(self.layers, devices):
            layer.expected_device = None if device is None else torch.device(device)
        return self

    def store_as(self, dtype: torch.dtype | None) -> RaggedBufferCache:
        """Keep every layer's entries in ``dtype`` (None: the dtype they are computed in), converted as written."""
        for layer in self.layers:
            layer.storage_dtype = dtype
        return self

    def row(self, b: int) -> RowView:
        return RowView(self, b)

    def set_length(self, b: int, length: int) -> None:
        """Row ``b`` keeps its first ``length`` entries (a rollback, or the commit of accepted entries)."""
        for layer in self.layers:
            if length > layer.lengths[b]:
                raise ValueError(f"row {b} holds {layer.lengths[b]} entries; cannot extend it to {length}")
            layer.lengths[b] = length

    def copy_row(self, source: int, target: int) -> None:
        for layer in self.layers:
            layer.copy_row(source, target)

    @contextlib.contextmanager
    def writing(self, counts: list[int]):
        """Within: a forward of ``n`` tokens per row keeps only row ``b``'s first ``counts[b]`` entries (the
        rest are dummies that pad the batch; ``0``: a row that takes no part in this forward)."""
        if len(counts) != self.batch:
            raise ValueError(f"writing: {len(counts)} counts for a batch of {self.batch}")
        for layer in self.layers:
            layer.counts = list(counts)
        try:
            yield self
        finally:
            for layer in self.layers:
                layer.counts = None

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def ragged_causal_mask(lengths: list[int], new: int, dtype: torch.dtype, device: torch.device,
                       additive: bool, counts: list[int] | None = None) -> torch.Tensor:
    """The 4-D mask of a batched forward of ``new`` tokens per row after ``lengths[b]`` cached entries:
    ``[batch, 1, new, width]``, row ``b``'s query ``i`` sees columns ``[0, lengths[b] + i]``.

    ``counts`` (`RaggedBufferCache.writing`): row ``b`` keeps only its first ``counts[b]`` entries; its
    later (dummy) queries see what its last real one sees, and the width is ``max(lengths[b] + counts[b])``.
    Without: every row keeps ``new``, width ``max(lengths) + new``. Boolean (True: attend) for SDPA-style
    attention; ``additive``: 0 / dtype-min, as eager attention adds it.
    """
    counts = counts if counts is not None else [new] * len(lengths)
    width = max(length + count for length, count in zip(lengths, counts))
    offsets = torch.arange(new, device=device)
    last = torch.tensor(lengths, device=device)[:, None] + torch.minimum(
        offsets, torch.tensor(counts, device=device)[:, None] - 1).clamp(min=0)  # [batch, new]
    last = last.clamp(max=width - 1)
    visible = torch.arange(width, device=device) <= last[..., None]
    visible = visible[:, None]
    if not additive:
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
