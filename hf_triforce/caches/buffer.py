"""Preallocated KV buffers written by position: rollback is a length change (the Force-3 full cache)."""

from __future__ import annotations

import torch

from ..compat import Cache, CacheLayerMixin


class BufferLayer(CacheLayerMixin):
    """One layer's keys/values in a ``[batch, kv_heads, capacity, head_dim]`` buffer; ``length`` entries valid.

    The attention sees the valid prefix plus the new entries; every new query attends to all stored
    entries (the causal mask is laid in cache coordinates by transformers).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.expected_device: torch.device | None = None  # the layer's execution device, when known

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate on the layer's execution device when known (entries copied in from an offloaded cache
        arrive from the host), else where the entries are."""
        batch, heads, _, k_dim = key_states.shape
        device = self.expected_device if self.expected_device is not None else key_states.device
        self.keys = key_states.new_zeros((batch, heads, self.capacity, k_dim), device=device)
        self.values = value_states.new_zeros((batch, heads, self.capacity, value_states.shape[-1]), device=device)
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
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            raise RuntimeError(
                f"{type(self).__name__} overflow: {self.length} + {n} entries exceed its capacity {self.capacity}"
            )
        self.keys[:, :, self.length : self.length + n] = key_states
        self.values[:, :, self.length : self.length + n] = value_states
        self.length += n

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.check_device(key_states)
        self.write(key_states, value_states)
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

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


class BufferCache(Cache):
    """A `Cache` of `BufferLayer`s: the full cache of Force 3 (capacity = prompt + new tokens + a draft)."""

    layer_class: type[BufferLayer] = BufferLayer

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(layers=[self.layer_class(capacity) for _ in range(num_layers)])
        self.capacity = capacity

    @property
    def length(self) -> int:
        return self.layers[0].length

    def expect_devices(self, devices: list[torch.device | None]) -> BufferCache:
        """Allocate layer ``i`` on ``devices[i]`` (each decoder layer's execution device, `compat.layer_devices`)
        and refuse entries computed anywhere else (``None``: where its entries are computed)."""
        if len(devices) != len(self.layers):
            raise ValueError(f"{len(devices)} layer devices for a cache of {len(self.layers)} layers")
        for layer, device in zip(self.layers, devices):
            layer.expected_device = None if device is None else torch.device(device)
        return self

    def devices(self) -> list[torch.device | None]:
        """The device each allocated layer lives on (None: not allocated yet)."""
        return [layer.keys.device if layer.is_initialized else None for layer in self.layers]

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` entries of every layer."""
        for layer in self.layers:
            layer.crop(length)

    def nbytes(self) -> int:
        """Bytes allocated by the buffers."""
        return sum(layer.nbytes() for layer in self.layers)

    def resident_bytes(self) -> int:
        """Bytes kept on the compute devices between forwards (an offloaded cache keeps its buffers on the host)."""
        return sum(layer.resident_bytes() for layer in self.layers)


def copy_prefix(source: Cache, target: BufferCache) -> int:
    """Copy every layer of a filled transformers cache into ``target``; returns the copied length."""
    if len(source.layers) != len(target.layers):
        raise ValueError(f"cache=: it has {len(source.layers)} layers, the model has {len(target.layers)}")
    lengths = set()
    for index, layer in enumerate(source.layers):
        if getattr(layer, "is_sliding", False) or not isinstance(layer, CacheLayerMixin):
            raise ValueError(
                f"cache=: layer {index} is a {type(layer).__name__}; TriForce needs full-attention cache layers "
                "(DynamicCache or StaticCache)"
            )
        n = int(layer.get_seq_length())
        lengths.add(n)
        if n:
            target.layers[index].write(layer.keys[:, :, :n], layer.values[:, :, :n])
    if len(lengths) > 1:
        raise ValueError(f"cache=: its layers hold different lengths {sorted(lengths)}")
    return lengths.pop() if lengths else 0
