"""`PrefixStore`: prefilled caches kept in memory, keyed by the tokens they hold, reused by later prompts that share a
prefix with one of them; entries that start with the same tokens share those positions' tensors.

A prompt looks up the stored entry sharing its longest token prefix (the longest common prefix over all entries, as
vLLM's prefix caching matches a prompt block by block) and receives a cache of that entry's first ``m`` positions.

An entry is a list of chunks covering its positions in order, each chunk a (keys, values) pair per layer. A new
entry that shares ``m >= min_tokens`` tokens with a stored one takes that entry's chunks cut at ``m`` (slices: views
of the same tensors, no copy) and one new chunk, a copy of its own positions ``[m, n)``; the cache it came from is not
kept. So questions on one document hold the document once (vLLM shares blocks between requests the same way). The
byte budget counts each tensor storage once, however many entries reference it; evicting an entry frees only the
storages no other entry references.

Nothing ever writes into a stored tensor: extending a lookup's cache with ``model(..., past_key_values=cache)``
concatenates into new tensors (`DynamicLayer.update`), and ``generate(..., cache=cache)`` copies it into TriForce's
own cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

# per layer, (keys, values), each [batch, kv_heads, positions, head_dim]
Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Chunk:
    """Positions ``[start, start + length)`` of an entry: ``layers`` (`Layers`), tensors that other entries may
    reference too (the same tensors or slices of them)."""

    start: int
    layers: Layers

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[-2]

    def head(self, length: int) -> Chunk:
        """The chunk's first ``length`` positions, as slices of its tensors (no copy)."""
        return Chunk(self.start, [(keys[:, :, :length], values[:, :, :length]) for keys, values in self.layers])


def _storages(chunks: list[Chunk]) -> dict[int, int]:
    """The distinct storages the chunks' tensors live in: ``{data_ptr: nbytes}`` (a slice counts its whole storage,
    which it keeps alive)."""
    held = {}
    for chunk in chunks:
        for pair in chunk.layers:
            for tensor in pair:
                storage = tensor.untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
    return held


@dataclass
class StoredPrefix:
    """One entry: ``tokens`` ([n] int64, on the CPU) and the chunks holding their ``n`` positions in order;
    ``storages``: the distinct storages they live in (``{data_ptr: nbytes}``)."""

    tokens: torch.Tensor
    chunks: list[Chunk]
    storages: dict[int, int]

    def covering(self, length: int) -> list[Chunk]:
        """The chunks holding positions ``[0, length)``, the last one cut at ``length``: slices of the stored
        tensors (new tensor objects, no copy)."""
        kept = [chunk for chunk in self.chunks if chunk.start < length]
        return [*kept[:-1], kept[-1].head(length - kept[-1].start)]

    def spanned(self, length: int) -> int:
        """How many chunks positions ``[0, length)`` span."""
        return sum(chunk.start < length for chunk in self.chunks)

    def position_bytes(self) -> int:
        """Bytes of the entry's positions (what it would hold as a cache of its own)."""
        return sum(keys.nbytes + values.nbytes for chunk in self.chunks for keys, values in chunk.layers)


def cache_nbytes(cache: DynamicCache) -> int:
    """Bytes of a cache's key and value tensors."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two token vectors ([n], [m])."""
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def _cache_of(layers: Layers, model_config) -> DynamicCache:
    """A `DynamicCache` whose layers are ``layers``' tensors themselves (no copy)."""
    cache = DynamicCache(config=model_config)
    if len(cache.layers) != len(layers):
        raise ValueError(f"PrefixStore: the cache has {len(layers)} layers, the model {len(cache.layers)}")
    for into, (keys, values) in zip(cache.layers, layers):
        into.lazy_initialization(keys, values)
        into.keys, into.values = keys, values
    return cache


def _joined(chunks: list[Chunk]) -> Layers:
    """The chunks' positions as one (keys, values) per layer: the chunk's own tensors where there is one chunk, new
    tensors (`torch.cat`, a copy) where there are several."""
    if len(chunks) == 1:
        return chunks[0].layers
    return [(torch.cat([chunk.layers[i][0] for chunk in chunks], dim=-2),
             torch.cat([chunk.layers[i][1] for chunk in chunks], dim=-2)) for i in range(len(chunks[0].layers))]


def prefix_view(cache: DynamicCache, length: int, model_config) -> DynamicCache:
    """A `DynamicCache` of the first ``length`` positions of ``cache``, its layers slices of ``cache``'s tensors (no
    copy). Updating the view replaces its own tensors by concatenations and leaves ``cache``'s as they are."""
    return _cache_of([(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in cache.layers],
                     model_config)


class PrefixStore:
    """Prefilled caches keyed by their tokens, sharing the positions of common prefixes, within ``max_bytes`` (each
    storage counted once), evicted least recently used first.

    ``min_tokens``: the shortest prefix worth keeping, sharing and reusing; shorter ones cost more in lookups and
    copies than their prefill saves. Only models whose layers all attend to the full cache are supported (a
    sliding-window layer's cache holds its last positions only: a view of its first ``m`` would be wrong);
    `supports` says which. ``nbytes``: the bytes of the distinct storages the entries reference.
    """

    def __init__(self, max_bytes: int, min_tokens: int, model_config) -> None:
        if max_bytes < 0:
            raise ValueError(f"PrefixStore: max_bytes must be >= 0, got {max_bytes}")
        if min_tokens < 1:
            raise ValueError(f"PrefixStore: min_tokens must be >= 1, got {min_tokens}")
        self.max_bytes, self.min_tokens, self.model_config = max_bytes, min_tokens, model_config
        self._entries: OrderedDict[int, StoredPrefix] = OrderedDict()  # least recently used first
        self._next_key = 0
        self._lock = threading.Lock()
        self._users: dict[int, int] = {}  # storage data_ptr -> how many entries reference it
        self._sizes: dict[int, int] = {}  # storage data_ptr -> its bytes
        self.nbytes = 0

    @staticmethod
    def supports(model_config) -> str | None:
        """None where views of the model's caches are exact, else why not."""
        layers = DynamicCache(config=model_config).layers
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            return "the model has sliding-window layers, whose caches keep their last positions only"
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def _longest(self, tokens: torch.Tensor) -> tuple[int | None, int]:
        """``(key, m)``: the entry sharing the longest prefix ``m`` with ``tokens`` ([n]); among equally long ones,
        the one whose first ``m`` positions span the fewest chunks, then the least recently used. ``(None, 0)``
        where none shares a token. Called with the lock held."""
        best, best_length, best_spans = None, 0, 0
        for key, entry in self._entries.items():
            length = common_prefix(entry.tokens, tokens)
            if length == 0:
                continue
            spans = entry.spanned(length)
            if length > best_length or (length == best_length and spans < best_spans):
                best, best_length, best_spans = key, length, spans
        return best, best_length

    def lookup(self, tokens: torch.Tensor) -> tuple[DynamicCache | None, int]:
        """``(cache, m)``: a cache of the first ``m`` positions of the entry sharing the longest prefix with
        ``tokens`` ([n]), ``m <= n``; ``(None, 0)`` where no entry shares ``min_tokens`` or more. Where those
        positions lie in one chunk the cache's layers are slices of the stored tensors (no copy); where they span
        several, new tensors (their concatenation, a copy). The entry becomes the most recently used."""
        tokens = tokens.detach().to("cpu", torch.long)
        with self._lock:
            key, length = self._longest(tokens)
            if key is None or length < self.min_tokens:
                return None, 0
            self._entries.move_to_end(key)
            return _cache_of(_joined(self._entries[key].covering(length)), self.model_config), length

    def put(self, tokens: torch.Tensor, cache: DynamicCache) -> bool:
        """Keep ``cache`` (holding the positions of ``tokens``, [n]) as an entry; the caller never writes to it
        again. Where a stored entry shares ``m >= min_tokens`` tokens with it, the entry keeps that entry's first
        ``m`` positions (shared, no copy) and a copy of ``cache``'s positions ``[m, n)``, not ``cache`` itself; else
        ``cache``'s tensors. Entries whose tokens it extends are dropped (it holds all they hold), then the least
        recently used until the store's bytes fit ``max_bytes``. Returns whether it was kept: not when shorter than
        ``min_tokens``, when its own storages exceed the whole budget, or when an entry holds its tokens already."""
        tokens = tokens.detach().to("cpu", torch.long)
        n = tokens.shape[0]
        if int(cache.get_seq_length()) != n:
            raise ValueError(f"PrefixStore.put: the cache holds {int(cache.get_seq_length())} positions, "
                             f"the tokens are {n}")
        if n < self.min_tokens:
            return False
        if not all(layer.is_initialized for layer in cache.layers):
            raise ValueError("PrefixStore.put: every layer of the cache must hold the positions (one does not)")
        with self._lock:
            key, length = self._longest(tokens)
            if length == n:  # an entry holds these positions already
                self._entries.move_to_end(key)
                return False
            if key is not None and length >= self.min_tokens:
                rest = [(layer.keys[:, :, length:].clone(memory_format=torch.contiguous_format),
                         layer.values[:, :, length:].clone(memory_format=torch.contiguous_format))
                        for layer in cache.layers]
                chunks = [*self._entries[key].covering(length), Chunk(length, rest)]
            else:
                chunks = [Chunk(0, [(layer.keys, layer.values) for layer in cache.layers])]
            entry = StoredPrefix(tokens, chunks, _storages(chunks))
            if sum(entry.storages.values()) > self.max_bytes:
                return False
            for other, stored in list(self._entries.items()):
                if common_prefix(stored.tokens, tokens) == stored.tokens.shape[0]:  # this one holds all it holds
                    self._drop(other)
            while self.nbytes + self._added_bytes(entry) > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._add(entry)
            return True

    def _added_bytes(self, entry: StoredPrefix) -> int:
        """Bytes of the entry's storages that no stored entry references."""
        return sum(size for pointer, size in entry.storages.items() if pointer not in self._users)

    def _add(self, entry: StoredPrefix) -> None:
        self.nbytes += self._added_bytes(entry)
        for pointer, size in entry.storages.items():
            self._users[pointer] = self._users.get(pointer, 0) + 1
            self._sizes[pointer] = size
        self._entries[self._next_key] = entry
        self._next_key += 1

    def _drop(self, key: int) -> None:
        """Drop an entry; the storages no other entry references leave the count (and memory, once unreferenced
        elsewhere)."""
        for pointer in self._entries.pop(key).storages:
            self._users[pointer] -= 1
            if self._users[pointer] == 0:
                del self._users[pointer]
                self.nbytes -= self._sizes.pop(pointer)

    def describe(self) -> dict:
        """Entries, their positions and chunks, the store's bytes (``shared_bytes``: in storages two or more
        entries reference; ``unique_bytes``: in those one does; ``entry_bytes``: what the entries would take each as
        a cache of its own) and the budget."""
        with self._lock:
            shared = sum(self._sizes[pointer] for pointer, users in self._users.items() if users > 1)
            return {"entries": len(self._entries), "bytes": self.nbytes, "shared_bytes": shared,
                    "unique_bytes": self.nbytes - shared,
                    "entry_bytes": sum(entry.position_bytes() for entry in self._entries.values()),
                    "max_bytes": self.max_bytes, "min_tokens": self.min_tokens,
                    "positions": [int(entry.tokens.shape[0]) for entry in self._entries.values()],
                    "chunks": [len(entry.chunks) for entry in self._entries.values()]}
