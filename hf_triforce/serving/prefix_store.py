"""`PrefixStore`: prefilled caches kept in memory, keyed by the tokens they hold, reused by later prompts that share a
prefix with one of them.

A prompt looks up the stored entry sharing its longest token prefix (the longest common prefix over all entries, as
vLLM's prefix caching matches a prompt block by block) and receives a read-only view of that entry's first ``m``
positions: a `DynamicCache` whose layers are slices of the stored tensors. Nothing ever writes into a stored tensor:
extending a view with ``model(..., past_key_values=view)`` concatenates into new tensors (`DynamicLayer.update`), and
``generate(..., cache=view)`` copies the view into TriForce's own cache. Entries are whole prefilled caches, bounded
by a byte budget and evicted least recently used first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class StoredPrefix:
    """One entry: ``tokens`` ([n] int64, on the CPU) and the cache that holds their ``n`` positions."""

    tokens: torch.Tensor
    cache: DynamicCache
    nbytes: int


def cache_nbytes(cache: DynamicCache) -> int:
    """Bytes of a cache's key and value tensors."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two token vectors ([n], [m])."""
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def prefix_view(cache: DynamicCache, length: int, model_config) -> DynamicCache:
    """A `DynamicCache` of the first ``length`` positions of ``cache``, its layers slices of ``cache``'s tensors (no
    copy). Updating the view replaces its own tensors by concatenations and leaves ``cache``'s as they are."""
    view = DynamicCache(config=model_config)
    if len(view.layers) != len(cache.layers):
        raise ValueError(f"prefix_view: the cache has {len(cache.layers)} layers, the model {len(view.layers)}")
    for into, layer in zip(view.layers, cache.layers):
        into.lazy_initialization(layer.keys, layer.values)
        into.keys, into.values = layer.keys[:, :, :length], layer.values[:, :, :length]
    return view


class PrefixStore:
    """Prefilled caches keyed by their tokens, within ``max_bytes``, evicted least recently used first.

    ``min_tokens``: the shortest prefix worth keeping and reusing; shorter ones cost more in lookups and copies
    than their prefill saves. Only models whose layers all attend to the full cache are supported (a sliding-window
    layer's cache holds its last positions only: a view of its first ``m`` would be wrong); `supports` says which.
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

    def lookup(self, tokens: torch.Tensor) -> tuple[DynamicCache | None, int]:
        """``(view, m)``: a view of the first ``m`` positions of the entry sharing the longest prefix with
        ``tokens`` ([n]), ``m <= n``; ``(None, 0)`` where no entry shares ``min_tokens`` or more. The entry
        becomes the most recently used."""
        with self._lock:
            best, best_length = None, 0
            for key, entry in self._entries.items():
                length = common_prefix(entry.tokens, tokens)
                if length > best_length:
                    best, best_length = key, length
            if best is None or best_length < self.min_tokens:
                return None, 0
            self._entries.move_to_end(best)
            return prefix_view(self._entries[best].cache, best_length, self.model_config), best_length

    def put(self, tokens: torch.Tensor, cache: DynamicCache) -> bool:
        """Keep ``cache`` (holding the positions of ``tokens``, [n]) as an entry; the caller never writes to it
        again. Entries whose tokens it extends are dropped (it holds all they hold). Returns whether it was
        kept: not when shorter than ``min_tokens``, larger than the whole budget, or already held by an entry."""
        tokens = tokens.detach().to("cpu", torch.long)
        if int(cache.get_seq_length()) != tokens.shape[0]:
            raise ValueError(f"PrefixStore.put: the cache holds {int(cache.get_seq_length())} positions, "
                             f"the tokens are {tokens.shape[0]}")
        nbytes = cache_nbytes(cache)
        if tokens.shape[0] < self.min_tokens or nbytes > self.max_bytes:
            return False
        with self._lock:
            for key, entry in list(self._entries.items()):
                length = common_prefix(entry.tokens, tokens)
                if length == tokens.shape[0]:  # an entry holds these positions already
                    self._entries.move_to_end(key)
                    return False
                if length == entry.tokens.shape[0]:  # this one holds all that entry holds
                    self._drop(key)
            while self.nbytes + nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[self._next_key] = StoredPrefix(tokens, cache, nbytes)
            self._next_key += 1
            self.nbytes += nbytes
            return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def describe(self) -> dict:
        """Entries, their positions and bytes, and the budget."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "min_tokens": self.min_tokens,
                    "positions": [int(entry.tokens.shape[0]) for entry in self._entries.values()]}
