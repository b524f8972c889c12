"""`SinkWindowCache`: the constant-size Force-1 cache (attention sinks + a rolling recent window)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..compat import rotary_embedding
from .buffer import BufferCache

Rerotate = Callable[[torch.Tensor, int], torch.Tensor]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def make_rerotate(model) -> Rerotate:
    """A function moving RoPE-rotated keys by ``delta`` positions, from the model's own rotary embedding.

    Works for any model whose decoder has a standard ``rotary_emb`` (Llama, Qwen2, Mistral, Gemma, ...):
    rotating by ``delta`` composes with the rotation already applied, so keys move without recomputation.
    """
    rotary = rotary_embedding(model)
    if rotary is None:
        raise ValueError(
            f"draft model {type(model).__name__} has no `rotary_emb` on its decoder: the sink+window cache "
            "re-rotates keys and needs standard rotary position embeddings"
        )
    scale = float(getattr(rotary, "attention_scaling", 1.0))

    def rerotate(keys: torch.Tensor, delta: int) -> torch.Tensor:
        position = torch.tensor([[delta]], device=keys.device)
        cos, sin = rotary(keys.float(), position)  # [1, 1, rot_dim]
        cos, sin = (cos[:, None] / scale).float(), (sin[:, None] / scale).float()
        rot = cos.shape[-1]
        k = keys.float()
        k_rot = k[..., :rot] * cos + rotate_half(k[..., :rot]) * sin
        return torch.cat((k_rot, k[..., rot:]), dim=-1).to(keys.dtype)

    return rerotate


class SinkWindowCache(BufferCache):
    """``sink_tokens`` first entries + the last ``window`` entries, at in-cache positions.

    Positions are slots: the next token is at position ``length``, so a short-context draft never sees a
    position beyond ``sink_tokens + window``. `make_room` evicts the oldest window entries before a forward
    and re-rotates the kept keys to their new slots. Memory is independent of the context length.
    """

    def __init__(self, num_layers: int, sink_tokens: int, window: int, rerotate: Rerotate) -> None:
        super().__init__(num_layers, sink_tokens + window)
        self.sink_tokens = sink_tokens
        self.window = window
        self.rerotate = rerotate
        self.evict_block = max(1, window // 16)

    def make_room(self, n: int) -> None:
        """Evict so that ``n`` new entries fit (at least ``evict_block`` at a time, amortizing re-rotation)."""
        room = self.capacity - min(self.length, self.sink_tokens)
        if n > room:
            raise ValueError(f"SinkWindowCache: {n} new entries exceed the {room} free entries of sinks + window")
        excess = self.length + n - self.capacity
        if excess <= 0:
            return
        excess = min(max(excess, self.evict_block), self.length - self.sink_tokens)
        s = self.sink_tokens
        for layer in self.layers:
            end = layer.length
            kept_keys = layer.keys[:, :, s + excess : end].clone()
            layer.keys[:, :, s : end - excess] = self.rerotate(kept_keys, -excess)
            layer.values[:, :, s : end - excess] = layer.values[:, :, s + excess : end].clone()
            layer.length = end - excess

    def next_positions(self, n: int, device: torch.device | None = None) -> torch.Tensor:
        """Position ids ``[1, n]`` for the next ``n`` tokens (call `make_room` first)."""
        return torch.arange(self.length, self.length + n, device=device).unsqueeze(0)
