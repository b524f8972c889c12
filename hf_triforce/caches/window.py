"""`WindowLayer`: the cache layer of a sliding-window attention layer — what the model itself keeps, plus rollback room.

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

from .layer import BufferLayer


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

    def get_seq_length(self) -> int:
        return self.length

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
