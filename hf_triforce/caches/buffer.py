"""Preallocated KV buffers written by position: rollback is a length change (the Force-3 full cache)."""

from __future__ import annotations

import torch

from ..compat import Cache, CacheLayerMixin
from .layer import BufferLayer
from .window import WindowLayer


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


def copy_prefix(source: Cache, target: BufferCache) -> int:
    """Copy every layer of a filled transformers cache into ``target``; returns the copied length."""
    if len(source.layers) != len(target.layers):
        raise ValueError(f"cache=: it has {len(source.layers)} layers, the model has {len(target.layers)}")
    lengths = set()
    for index, (layer, into) in enumerate(zip(source.layers, target.layers)):
        sliding = bool(getattr(layer, "is_sliding", False))
        if not isinstance(layer, CacheLayerMixin) or sliding != bool(getattr(into, "is_sliding", False)):
            kind = "a sliding-window" if getattr(into, "is_sliding", False) else "a full-attention"
            raise ValueError(
                f"cache=: layer {index} is a {type(layer).__name__}; the model's layer {index} is {kind} layer "
                "(pass the DynamicCache/StaticCache built for this model, or a cache TriForce returned)"
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
