"""Preallocated KV buffers written by position: rollback is a length change (the Force-3 full cache).

`WindowLayer`: the cache layer of a sliding-window attention layer — what the model itself keeps, plus rollback room.

A sliding layer of window ``W`` attends, at absolute position ``t``, to the tokens ``(t - W, t]`` (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - W``; ``DynamicSlidingWindowLayer`` keeps ``W - 1`` past entries).
Every tier keeps exactly that for such a layer, whatever it keeps for full-attention layers: a `WindowLayer`
holds a contiguous run of the most recent tokens in **absolute** coordinates (``get_seq_length()`` is the
number of tokens seen, ``get_mask_sizes`` reports the offset of its first entry), so transformers' own
sliding-window mask cuts every row of a multi-token forward at that row's own window.

Contract: after any update it holds at least the last ``keep`` entries (``keep >= W - 1`` plus the deepest
rollback its tier performs); `crop` below what it holds raises instead of returning a wrong cache.
"""

from __future__ import annotations

import torch

from ..compat import QUANTIZED_CACHE_LAYERS, Cache, CacheLayerMixin


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
        self.storage_dtype: torch.dtype | None = None  # the entries' dtype when stored (None: as computed)
        self.chunks_copied = 0  # chunks `replace_chunks` copied in (a re-selection copies only what changed)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, filled: int = 0) -> None:
        """Allocate on the layer's execution device when known (entries copied in from an offloaded cache
        arrive from the host), else where the entries are. Every entry is zero but the first ``filled``, which the
        caller writes next: left unwritten here, since zeroing a full cache costs as much as copying a prefix into
        it (SmolLM2 at 16k: 0.25 s of a 64-token call). Entries past the valid prefix stay finite (zero, or an
        entry rolled back), which fixed-shape forwards that read whole buffers under a mask rely on."""
        batch, heads, _, k_dim = key_states.shape
        device = self.expected_device if self.expected_device is not None else key_states.device
        dtype = self.storage_dtype
        self.keys = key_states.new_empty((batch, heads, self.capacity, k_dim), device=device, dtype=dtype)
        self.values = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]), device=device,
                                             dtype=dtype)
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
                    if rows.device == out.device and rows.dtype == out.dtype:
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
        indexed write per keys/values (per head, `torch.isin` and the copies would be mostly per-op overhead:
        docs/experiments.md, "Force 2: re-select every 4 Force-3 steps"). A row frees as many slots as it takes new
        chunks, and both lists are read in row-major order, so the i-th new chunk lands in the i-th free slot of its own
        row."""
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
                from_rows[free_row.to(where), incoming.to(where)].to(slots.device, slots.dtype))
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


class WindowLayer(BufferLayer):
    """Entries of tokens ``[start, length)`` in ``keys[:, :, : length - start]``; ``length`` is absolute."""

    is_sliding = True

    def __init__(self, window: int, keep: int, capacity: int) -> None:
        if keep < window - 1 or capacity <= keep:
            raise ValueError(f"WindowLayer: need keep >= window - 1 and capacity > keep (window {window}, keep {keep}, "
                             f"capacity {capacity})")
        super().__init__(capacity)
        self.window, self.keep = window, keep
        self.start = 0

    @property
    def held(self) -> int:
        return self.length - self.start

    def _drop(self, n: int) -> int:
        """Oldest entries the next update of ``n`` entries drops (the mask sizes are announced before it runs)."""
        return max(0, self.held - self.keep) if self.held + n > self.capacity else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        drop = self._drop(query_length)
        return self.held - drop + query_length, self.start + drop

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.check_device(key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, drop, held = key_states.shape[-2], self._drop(key_states.shape[-2]), self.held
        if drop:
            self.keys[:, :, : held - drop] = self.keys[:, :, drop:held].clone()
            self.values[:, :, : held - drop] = self.values[:, :, drop:held].clone()
            self.start += drop
            held -= drop
        if held + n <= self.capacity:
            self.keys[:, :, held : held + n] = key_states
            self.values[:, :, held : held + n] = value_states
            self.length += n
            return self.keys[:, :, : held + n], self.values[:, :, : held + n]
        # a block longer than the free room (a prefill chunk): attend over all of it, keep the last `keep`
        keys = torch.cat((self.keys[:, :, :held], key_states), dim=2)
        values = torch.cat((self.values[:, :, :held], value_states), dim=2)
        self.length += n
        self.start = self.length - self.keep
        self.keys[:, :, : self.keep] = keys[:, :, -self.keep :]
        self.values[:, :, : self.keep] = values[:, :, -self.keep :]
        return keys, values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.update(key_states, value_states)

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.held], self.values[:, :, : self.held]

    def crop(self, max_length: int) -> None:
        """transformers semantics in absolute tokens: keep ``max_length`` tokens, or drop ``-max_length``."""
        keep = self.length + max_length if max_length < 0 else max_length
        keep = max(0, min(self.length, keep))
        if keep == 0:
            self.reset()
            return
        if keep < self.start + min(self.window - 1, keep):
            raise RuntimeError(f"WindowLayer: rolling back to {keep} tokens needs entries before {self.start}, "
                               f"already dropped (keep {self.keep} is too small for this rollback)")
        self.length = keep

    def reset(self) -> None:
        self.length = self.start = 0

    def copy_from(self, source: WindowLayer | BufferLayer, upto: int) -> None:
        """Hold the entries of ``source`` for tokens ``[upto - keep, upto)`` (as many as it has)."""
        keys, values = source.valid()
        source_start = getattr(source, "start", 0)
        first = max(source_start, upto - self.keep)
        if upto - first < min(upto, self.window - 1):
            raise RuntimeError(f"WindowLayer.copy_from: the source holds tokens from {source_start}, the window up to "
                               f"{upto} needs them from {upto - self.window + 1}")
        self.reset()
        if upto > first:
            self.update(keys[:, :, first - source_start : upto - source_start],
                        values[:, :, first - source_start : upto - source_start])
        self.start, self.length = first, upto


class BufferCache(Cache):
    """A `Cache` of `BufferLayer`s: the full cache of Force 3 (capacity = prompt + new tokens + a draft).

    ``windows`` (one entry per layer, `compat.layer_windows`): a sliding layer of window ``W`` gets a
    `WindowLayer` keeping the last ``W - 1 + rollback`` tokens (what the model keeps, plus room to roll back
    ``rollback`` tokens), whatever this cache keeps for full-attention layers. ``length`` and the coordinates
    of this cache are those of its first full-attention layer (``reference``), else of its first layer.
    """

    layer_class: type[BufferLayer] = BufferLayer

    def __init__(self, num_layers: int, capacity: int, windows: list[int | None] | None = None,
                 rollback: int = 0) -> None:

        windows = list(windows) if windows is not None else [None] * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"BufferCache: {len(windows)} layer windows for {num_layers} layers")
        layers = [
            self.layer_class(capacity) if window is None
            else WindowLayer(window, window - 1 + rollback, window - 1 + rollback + max(64, rollback + 1))
            for window in windows
        ]
        super().__init__(layers=layers)
        self.capacity = capacity
        self.windows = windows
        self.reference = next((i for i, window in enumerate(windows) if window is None), 0)

    @property
    def length(self) -> int:
        return self.layers[self.reference].length

    def expect_devices(self, devices: list[torch.device | None]) -> BufferCache:
        """Allocate layer ``i`` on ``devices[i]`` (each decoder layer's execution device, `compat.layer_devices`)
        and refuse entries computed anywhere else (``None``: where its entries are computed)."""
        if len(devices) != len(self.layers):
            raise ValueError(f"{len(devices)} layer devices for a cache of {len(self.layers)} layers")
        for layer, device in zip(self.layers, devices):
            layer.expected_device = None if device is None else torch.device(device)
        return self

    def store_as(self, dtype: torch.dtype | None) -> BufferCache:
        """Keep every layer's entries in ``dtype`` (None: the dtype they are computed in), converted as written."""
        for layer in self.layers:
            layer.storage_dtype = dtype
        return self

    def devices(self) -> list[torch.device | None]:
        """The device each allocated layer lives on (None: not allocated yet)."""
        return [layer.keys.device if layer.is_initialized else None for layer in self.layers]

    def allow_growth(self) -> BufferCache:
        """Let its full-attention layers grow past their capacity (`BufferLayer.grow`) instead of raising: the cache
        a call returns, which the caller may hand to the next ``generate`` call with a longer sequence (sliding-window
        layers keep their window at any length). Nothing is copied until a write needs the room."""
        for layer in self.layers:
            layer.grows = True
        return self

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` entries of every layer."""
        for layer in self.layers:
            layer.crop(length)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' `Cache.crop`: drop the last ``-tokens_to_remove`` tokens (``0``: none), as its assisted
        loop calls it after each verification; a positive count is refused, as transformers' layers refuse it."""
        if tokens_to_remove > 0:
            raise ValueError(f"{type(self).__name__}.crop takes the negative number of tokens to remove, got "
                             f"{tokens_to_remove} (rollback(length) keeps the first length tokens)")
        self.rollback(self.length + tokens_to_remove)

    def keep_rows(self, first: int, rows: list[int]) -> None:
        """`BufferLayer.keep_rows` in every layer (``first`` in this cache's coordinates). Sliding-window layers
        keep other coordinates and are refused (candidate trees are not supported there)."""
        if any(window is not None for window in self.windows):
            raise ValueError("keep_rows: this cache has sliding-window layers; candidate trees are not supported")
        for layer in self.layers:
            layer.keep_rows(first, rows)

    def nbytes(self) -> int:
        """Bytes allocated by the buffers."""
        return sum(layer.nbytes() for layer in self.layers)

    def resident_bytes(self) -> int:
        """Bytes kept on the compute devices between forwards (an offloaded cache keeps its buffers on the host)."""
        return sum(layer.resident_bytes() for layer in self.layers)


# the caches `copy_prefix` takes, for the errors that refuse others
TAKEN_CACHES = ("a DynamicCache or StaticCache built for this model (its layers unquantized), or a cache TriForce "
                "returned")


def full_attention_layer(layer) -> bool:
    """Whether ``layer`` of a batch's ``cache=`` is a full-attention transformers cache layer with ``keys`` /
    ``values``: what a batch copies its rows' prefixes from."""
    return isinstance(layer, CacheLayerMixin) and not getattr(layer, "is_sliding", False) and hasattr(layer, "keys")


def check_taken(source: Cache, name: str = "cache=") -> None:
    """ValueError naming ``name`` (the argument that gave ``source``) unless `copy_prefix` can read ``source``: a
    `QuantizedCache`'s layers keep their entries quantized (their ``keys`` / ``values`` hold only the unquantized
    residual), so neither a copy of them nor their dequantized values is the cache plain ``generate`` decodes on;
    refused whether empty or filled."""
    for index, layer in enumerate(getattr(source, "layers", None) or []):
        if isinstance(layer, QUANTIZED_CACHE_LAYERS):
            raise ValueError(
                f"{name}: layer {index} is a {type(layer).__name__} (a QuantizedCache, given as cache= or by "
                f"cache_implementation='quantized'), which keeps its entries quantized; TriForce takes "
                f"{TAKEN_CACHES}"
            )


def prefix_rows(source: Cache) -> int:
    """The batch size of ``source``, a filled cache `check_taken` takes: its first layer's keys' rows (keys
    ``[batch, kv_heads, length, head_dim]``)."""
    return int(source.layers[0].keys.shape[0])


def copy_prefix(source: Cache, target: BufferCache) -> int:
    """Copy every layer of a filled transformers cache (one `check_taken` takes) into ``target``; returns the copied
    length."""
    check_taken(source)
    if len(source.layers) != len(target.layers):
        raise ValueError(f"cache=: it has {len(source.layers)} layers, the model has {len(target.layers)}")
    lengths = set()
    for index, (layer, into) in enumerate(zip(source.layers, target.layers)):
        sliding = bool(getattr(layer, "is_sliding", False))
        if not isinstance(layer, CacheLayerMixin) or sliding != bool(getattr(into, "is_sliding", False)):
            kind = "a sliding-window" if getattr(into, "is_sliding", False) else "a full-attention"
            raise ValueError(
                f"cache=: layer {index} is a {type(layer).__name__}; the model's layer {index} is {kind} layer "
                f"(TriForce takes {TAKEN_CACHES})"
            )
        n = int(layer.get_seq_length())
        lengths.add(n)
        if not n:
            continue
        if sliding:  # it holds the last entries only: place them at their absolute positions
            keys, values = layer.keys, layer.values
            # ours (a cache TriForce returned) says what it holds; a DynamicSlidingWindowLayer holds the last W - 1
            held = layer.held if hasattr(layer, "held") else keys.shape[2]
            if held < min(n, into.window - 1) or (not hasattr(layer, "held") and held != min(n, into.window - 1)):
                raise ValueError(f"cache=: sliding layer {index} ({type(layer).__name__}) holds {keys.shape[2]} "
                                 f"entries for {n} tokens; TriForce reads a DynamicCache's sliding layers (the last "
                                 f"{min(n, into.window - 1)} tokens) or a cache it returned")
            kept = min(held, into.keep)
            into.reset()
            into.update(keys[:, :, held - kept : held], values[:, :, held - kept : held])
            into.start, into.length = n - kept, n
        else:
            into.write(layer.keys[:, :, :n], layer.values[:, :, :n])
    if len(lengths) > 1:
        raise ValueError(f"cache=: its layers hold different lengths {sorted(lengths)}")
    return lengths.pop() if lengths else 0


def sync_free(device: torch.device) -> bool:
    """Whether to avoid host reads of tensor values on ``device`` (each is a synchronisation there)."""
    return device.type != "cpu"
