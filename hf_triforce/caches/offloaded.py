"""`OffloadedBufferCache`: Force 3's full cache kept in host memory, streamed to the compute device per layer.

TriForce's offloading setting (``TriForceConfig(full_cache_device="cpu")``): the full cache, the one that
grows with the context, lives in host memory (pinned when the compute device is a GPU, so copies run
asynchronously); the retrieval and draft caches, which Force 1 and Force 2 run on every step, stay on the
device. Force 3 verifies once per step: each layer's entries are copied to that layer's execution device
when its attention needs them, and while layer ``i`` computes, the entries of layer ``i + 1`` are already
being copied (a side CUDA stream; on the CPU the same code runs as plain copies). The new entries of a
forward are written back to host memory as they are computed. Between forwards nothing of this cache stays
on the device; during one, at most two layers' entries do (the current one and the prefetched next one).

Exactness: a copy moves values unchanged, so attention sees the same keys and values as with an on-device
cache and the output is identical (tests/test_offloaded_cache.py).
"""

from __future__ import annotations

import torch

from .buffer import BufferCache, BufferLayer

HOST = torch.device("cpu")


class LayerStream:
    """Double-buffered host -> device copies, one layer ahead of the layer being computed."""

    def __init__(self, layers: list[OffloadedLayer]) -> None:
        self.layers = layers
        self.staged: dict[int, tuple[torch.Tensor, torch.Tensor, int, object]] = {}
        self.copies = 0  # layer copies to the device (prefetched or not), for tests and statistics
        self.prefetched = 0
        self.streams: dict[torch.device, object] = {}

    def _side_stream(self, device: torch.device):
        """One copy stream per CUDA device (None on the CPU)."""
        if device.type != "cuda":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def stage(self, index: int, room: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, object]:
        """Start copying layer ``index``'s valid entries into a fresh buffer on ``device`` with ``room`` entries
        to spare; returns ``(keys, values, staged entries, event)``."""
        layer = self.layers[index]
        n = layer.length
        shape = (*layer.keys.shape[:2], n + room)
        keys = torch.empty((*shape, layer.keys.shape[-1]), dtype=layer.keys.dtype, device=device)
        values = torch.empty((*shape, layer.values.shape[-1]), dtype=layer.values.dtype, device=device)
        side, event = self._side_stream(device), None
        self.copies += 1
        if side is None:  # CPU: plain copies
            keys[:, :, :n].copy_(layer.keys[:, :, :n])
            values[:, :, :n].copy_(layer.values[:, :, :n])
        else:
            side.wait_stream(torch.cuda.current_stream(device))  # the buffers were allocated on the main stream
            with torch.cuda.stream(side):
                keys[:, :, :n].copy_(layer.keys[:, :, :n], non_blocking=True)
                values[:, :, :n].copy_(layer.values[:, :, :n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            # a buffer dropped before use (a stale prefetch) is not reused while the side stream still writes it
            keys.record_stream(side)
            values.record_stream(side)
        return keys, values, n, event

    def fetch(self, index: int, start: int, key_states: torch.Tensor,
              value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s entries ``[0, start)`` on its device followed by the new ones; prefetches the next
        layer for the same number of new entries."""
        n = key_states.shape[-2]
        if index == 0:
            self.staged.clear()  # a forward starts (an interrupted one may have left a prefetch behind)
        staged = self.staged.pop(index, None)
        if staged is None or staged[2] != start or staged[0].shape[2] < start + n:
            staged = self.stage(index, n, key_states.device)
        else:
            self.prefetched += 1
        keys, values, _, event = staged
        if event is not None:
            torch.cuda.current_stream(keys.device).wait_event(event)
        keys[:, :, start : start + n] = key_states
        values[:, :, start : start + n] = value_states
        if index + 1 < len(self.layers) and self.layers[index + 1].is_initialized:
            following = self.layers[index + 1].expected_device  # its execution device (None: same as this one)
            self.staged[index + 1] = self.stage(index + 1, n, following or key_states.device)
        return keys[:, :, : start + n], values[:, :, : start + n]


class OffloadedLayer(BufferLayer):
    """A `BufferLayer` whose buffers live in host memory; ``update`` returns entries on the compute device."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.stream: LayerStream | None = None
        self.index = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, filled: int = 0) -> None:
        """Host buffers, all zeroed (``filled`` is not used: the saving matters for the in-memory full cache)."""
        batch, heads, _, k_dim = key_states.shape
        pin = key_states.device.type == "cuda" or (
            self.expected_device is not None and self.expected_device.type == "cuda")
        self.keys = torch.zeros((batch, heads, self.capacity, k_dim), dtype=key_states.dtype, device=HOST,
                                pin_memory=pin)
        self.values = torch.zeros((batch, heads, self.capacity, value_states.shape[-1]), dtype=value_states.dtype,
                                  device=HOST, pin_memory=pin)
        self.device = HOST
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.check_device(key_states)
        start = self.length
        self.write(key_states, value_states)  # the new entries go to host memory ...
        return self.stream.fetch(self.index, start, key_states, value_states)  # ... and attention runs on device

    def resident_bytes(self) -> int:
        return 0  # nothing stays on the compute device between forwards


class OffloadedBufferCache(BufferCache):
    """The full cache in host memory, streamed layer by layer (see the module docstring)."""

    layer_class = OffloadedLayer

    def __init__(self, num_layers: int, capacity: int, windows: list[int | None] | None = None,
                 rollback: int = 0) -> None:
        if windows is not None and any(window is not None for window in windows):
            raise ValueError("full_cache_device='cpu' does not support models with sliding-window layers yet "
                             "(config.layer_types); use full_cache_device=None")
        super().__init__(num_layers, capacity)
        self.stream = LayerStream(self.layers)
        for index, layer in enumerate(self.layers):
            layer.stream, layer.index = self.stream, index
