"""`BufferLayer`: one layer's keys and values in a preallocated buffer written by position (rollback is a length)."""

from __future__ import annotations

import torch

from ..compat import CacheLayerMixin


class BufferLayer(CacheLayerMixin):
    """One layer's keys/values in a ``[batch, kv_heads, capacity, head_dim]`` buffer; ``length`` entries valid.

    The attention sees the valid prefix plus the new entries; every new query attends to all stored
    entries (the causal mask is laid in cache coordinates by transformers).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    # False: a write past the capacity raises (every tier sizes its caches for the call); True: the buffers grow
    # (`BufferCache.allow_growth`: a cache handed to the caller, whose next call may outgrow it)
    grows = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.expected_device: torch.device | None = None  # the layer's execution device, when known
        self.chunks_copied = 0  # chunks `replace_chunks` copied in (a re-selection copies only what changed)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, filled: int = 0) -> None:
        """Allocate on the layer's execution device when known (entries copied in from an offloaded cache
        arrive from the host), else where the entries are. Every entry is zero but the first ``filled``, which the
        caller writes next: left unwritten here, since zeroing a full cache costs as much as copying a prefix into
        it (SmolLM2 at 16k: 0.25 s of a 64-token call). Entries past the valid prefix stay finite (zero, or an
        entry rolled back), which fixed-shape forwards that read whole buffers under a mask rely on."""
        batch, heads, _, k_dim = key_states.shape
        device = self.expected_device if self.expected_device is not None else key_states.device
        self.keys = key_states.new_empty((batch, heads, self.capacity, k_dim), device=device)
        self.values = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]), device=device)
        for buffer in (self.keys, self.values):
            buffer[:, :, filled:].zero_()
        self.device = device
        self.is_initialized = True

    def check_device(self, key_states: torch.Tensor) -> None:
        """Entries the model computes must come from this layer's execution device."""
        if self.expected_device is not None and key_states.device != self.expected_device:
            raise RuntimeError(
                f"{type(self).__name__}: entries computed on {key_states.device}, but this layer executes on "
                f"{self.expected_device} (device_map); the cache is never moved to another device silently"
            )

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append entries after the valid prefix."""
        n = key_states.shape[-2]
        if self.grows and self.length + n > self.capacity:
            self.grow(self.length + n)
        if self.length + n > self.capacity:
            raise RuntimeError(
                f"{type(self).__name__} overflow: {self.length} + {n} entries exceed its capacity {self.capacity}"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states, filled=n)  # written just below: entries [0, n)
        self.keys[:, :, self.length : self.length + n] = key_states
        self.values[:, :, self.length : self.length + n] = value_states
        self.length += n

    def grow(self, needed: int) -> None:
        """Reallocate the buffers with room for at least ``needed`` entries, a quarter more than the capacity at least
        (a decode that keeps outgrowing them copies each entry a bounded number of times): the valid prefix copied
        over, the rest zero, on the same device (host buffers stay pinned where they were); unallocated buffers are
        allocated at that capacity when first written."""
        capacity = max(needed, self.capacity + self.capacity // 4)
        for name in ("keys", "values") if self.is_initialized else ():
            old = getattr(self, name)
            new = torch.empty((*old.shape[:2], capacity, old.shape[-1]), dtype=old.dtype, device=old.device,
                              pin_memory=old.is_pinned())
            new[:, :, : self.length] = old[:, :, : self.length]
            new[:, :, self.length :].zero_()
            setattr(self, name, new)
        self.capacity = capacity

    def write_chunks(self, keys: torch.Tensor, values: torch.Tensor, chunks: torch.Tensor, chunk_size: int) -> None:
        """Append, for each ``[b, h]``, the chunks ``chunks[b, h]`` of ``keys[b, h]`` (and of ``values``) after
        the valid prefix; chunk ``j`` is rows ``[chunk_size * j, chunk_size * (j + 1))``.

        ``keys``/``values``: ``[batch, heads, n, dim]`` with each ``[b, h]`` slice contiguous (a buffer's);
        ``chunks``: ``[batch, heads, k]``. Whole chunks are copied straight into the buffer, one
        ``index_select`` per head: an element-wise ``gather`` costs several times more on the CPU.
        """
        m = chunks.shape[-1] * chunk_size
        if not self.is_initialized:
            self.lazy_initialization(keys[:, :, :0], values[:, :, :0])
        if self.length + m > self.capacity:
            raise RuntimeError(
                f"{type(self).__name__} overflow: {self.length} + {m} entries exceed its capacity {self.capacity}"
            )
        whole = keys.shape[2] // chunk_size * chunk_size
        end = self.length + m
        chunks = chunks.to(keys.device)  # once: the source may be an offloaded cache in host memory
        for b in range(chunks.shape[0]):
            for h in range(chunks.shape[1]):
                for source, target in ((keys, self.keys), (values, self.values)):
                    rows = source[b, h, :whole].view(whole // chunk_size, chunk_size * source.shape[-1])
                    out = target[b, h, self.length : end].view(-1, chunk_size * source.shape[-1])
                    index = chunks[b, h]
                    if rows.device == out.device:
                        torch.index_select(rows, 0, index, out=out)
                    else:  # an offloaded full cache: gather where it lives, then copy to this layer's device
                        out.copy_(torch.index_select(rows, 0, index))
        self.length = end

    def replace_chunks(self, keys: torch.Tensor, values: torch.Tensor, start: int, held: torch.Tensor,
                       chunks: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """Make the entries ``[start, start + k * chunk_size)``, which hold the chunks ``held`` (``[batch, heads,
        k]``, in slot order) of ``keys``/``values``, hold the chunks ``chunks`` (``[batch, heads, k]``) instead,
        copying only those not held already into the slots of those no longer wanted; returns the new slot order.
        The order of a selection's entries does not matter to attention (positions are in the rotated keys, and
        every later row sees them all). Source layout as in `write_chunks`.

        Every (batch, head) row at once: membership by scatter into a ``[rows, chunks]`` mask, one gather and one
        indexed write per keys/values (per head, `torch.isin` and the copies cost 43 ms a selection of SmolLM2's 30
        layers at 16k, most of it per-op overhead). A row frees as many slots as it takes new chunks, and both
        lists are read in row-major order, so the i-th new chunk lands in the i-th free slot of its own row."""
        batch, heads, k = held.shape
        rows, count = batch * heads, keys.shape[2] // chunk_size
        held_rows, wanted_rows = held.reshape(rows, k), chunks.to(held.device).reshape(rows, k)
        wanted = torch.zeros(rows, count, dtype=torch.bool, device=held.device).scatter_(1, wanted_rows, True)
        had = torch.zeros_like(wanted).scatter_(1, held_rows, True)
        kept, new = wanted.gather(1, held_rows), ~had.gather(1, wanted_rows)
        if sync_free(held.device):
            order = self._replace_in_place(keys, values, start, held_rows, wanted_rows, kept, new, chunk_size)
            return order.view(batch, heads, k)
        free_row, free_slot = (~kept).nonzero(as_tuple=True)
        incoming = wanted_rows[new]  # row-major, as the free slots
        self.chunks_copied += incoming.numel()
        order = held_rows.clone()
        order[free_row, free_slot] = incoming
        for source, target in ((keys, self.keys), (values, self.values)):
            width = chunk_size * source.shape[-1]
            from_rows = source[:, :, : count * chunk_size].reshape(rows, count, width)
            slots = target[:, :, start : start + k * chunk_size].view(rows, k, width)
            where = from_rows.device
            slots[free_row.to(slots.device), free_slot.to(slots.device)] = (
                from_rows[free_row.to(where), incoming.to(where)].to(slots.device))
        return order.view(batch, heads, k)

    def _replace_in_place(self, keys: torch.Tensor, values: torch.Tensor, start: int, held_rows: torch.Tensor,
                          wanted_rows: torch.Tensor, kept: torch.Tensor, new: torch.Tensor,
                          chunk_size: int) -> torch.Tensor:
        """`replace_chunks` in fixed shapes, with no host read (``held_rows``/``wanted_rows``/``kept``/``new``:
        ``[rows, k]``): each row's free slots (stable-sorted first) take its new chunks (sorted first) in order,
        the same assignment as the data-dependent path; the other slots rewrite the chunk they hold. Every slot is
        written: on an accelerator the copy is cheap, a host read of how many changed is not."""
        rows, k = held_rows.shape
        free_first = torch.sort(kept.to(torch.uint8), dim=1, stable=True).indices
        new_first = torch.sort((~new).to(torch.uint8), dim=1, stable=True).indices
        changes = (~kept).sum(1, keepdim=True)
        taken = torch.where(torch.arange(k, device=kept.device) < changes, wanted_rows.gather(1, new_first),
                            held_rows.gather(1, free_first))
        order = held_rows.scatter(1, free_first, taken)
        self.chunks_copied += k * rows
        index = torch.arange(rows, device=order.device)[:, None]
        for source, target in ((keys, self.keys), (values, self.values)):
            width = chunk_size * source.shape[-1]
            from_rows = source[:, :, : keys.shape[2] // chunk_size * chunk_size].reshape(rows, -1, width)
            slots = target[:, :, start : start + k * chunk_size].view(rows, k, width)
            where = from_rows.device
            slots.copy_(from_rows[index.to(where), order.to(where)])
        return order

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.check_device(key_states)
        self.write(key_states, value_states)
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def keep_rows(self, first: int, rows: list[int]) -> None:
        """Of the entries from ``first`` on keep only ``rows`` (increasing offsets from ``first``), moved into
        place at ``first, first + 1, ...``: a verified candidate tree's accepted path, without a re-forward."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or first + rows[-1] >= self.length)):
            raise ValueError(f"keep_rows: offsets {rows} must increase and lie in [0, {self.length - first})")
        if self.is_initialized and rows != list(range(len(rows))):
            index = torch.tensor(rows, device=self.keys.device) + first
            for buffer in (self.keys, self.values):
                buffer[:, :, first : first + len(rows)] = buffer.index_select(2, index)
        self.length = min(self.length, first + len(rows))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.grows else self.capacity  # transformers' convention: -1 for no maximum

    def crop(self, max_length: int) -> None:
        """transformers semantics: keep ``max_length`` entries, or drop ``-max_length`` when negative."""
        keep = self.length + max_length if max_length < 0 else max_length
        self.length = max(0, min(self.length, keep))

    def reset(self) -> None:
        self.length = 0

    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes

    def resident_bytes(self) -> int:
        """Bytes this layer keeps on its compute device between forwards."""
        return self.nbytes()


def sync_free(device: torch.device) -> bool:
    """Whether to avoid host reads of tensor values on ``device`` (each is a synchronisation there)."""
    return device.type != "cpu"
