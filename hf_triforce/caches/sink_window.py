"""`SinkWindowCache`: the constant-size Force-1 cache (attention sinks + a rolling recent window)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..compat import layer_rotary, num_layers, rotary_embedding
from .buffer import BufferCache, WindowLayer

Rerotate = Callable[[torch.Tensor, int], torch.Tensor]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Pairs ``(x0, x1), (x2, x3), ...`` rotated: ``(-x1, x0, -x3, x2, ...)`` (Cohere, GPT-J-style RoPE)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate_half_flipped(x: torch.Tensor) -> torch.Tensor:
    """`rotate_half` with the opposite sign (NanoChat rotates by minus the angle)."""
    return -rotate_half(x)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _twice(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x, x), dim=-1)


def _first_half_per_pair(x: torch.Tensor) -> torch.Tensor:
    """The rotary's ``cat(freqs, freqs)`` read as one angle per interleaved pair (Ernie 4.5, Helium)."""
    return x[..., : x.shape[-1] // 2].repeat_interleave(2, dim=-1)


# (pairing, cos/sin layout): halves (Llama), interleaved pairs (Cohere), halves with one angle per pair (GPT-OSS),
# interleaved pairs taking the first half of the angles (Ernie 4.5, Helium), halves rotated the other way (NanoChat)
ROTATIONS = {
    "half": (rotate_half, _same), "interleaved": (rotate_interleaved, _same), "half-pairs": (rotate_half, _twice),
    "interleaved-half-angles": (rotate_interleaved, _first_half_per_pair), "half-flipped": (rotate_half_flipped, _same),
}


def _rerotation(rotary: Callable, rotate: Callable, layout: Callable = _same) -> Rerotate:
    """Keys rotated at position ``t`` -> the same keys at ``t + delta``: rotation by ``cos(delta)/cos(0)``, the
    rotary's own output divided by its attention scaling (``cos(0)``), on its first ``rot_dim`` dims."""

    def rerotate(keys: torch.Tensor, delta: int) -> torch.Tensor:
        position = torch.tensor([[0, delta]], device=keys.device)
        cos, sin = rotary(keys.float(), position)  # [1, 2, rot_dim]
        cos, sin = layout(cos.float()), layout(sin.float())
        scale = cos[:, :1]
        cos, sin = (cos[:, 1:] / scale)[:, None], (sin[:, 1:] / scale)[:, None]
        rot = cos.shape[-1]
        if rot > keys.shape[-1]:
            raise _LayoutMismatch(f"{rot} rotary dims for keys of {keys.shape[-1]}")
        k = keys.float()
        k_rot = k[..., :rot] * cos + rotate(k[..., :rot]) * sin
        return torch.cat((k_rot, k[..., rot:]), dim=-1).to(keys.dtype)

    return rerotate


class _LayoutMismatch(ValueError):
    """A candidate cos/sin layout wider than the keys: not this layer's rotation."""


PROBE_DELTA = 5


@torch.no_grad()
def _probe_keys(model, positions: list[int]) -> list[list[torch.Tensor]]:
    """Per layer, the cached key of one token placed alone at each of ``positions`` (batch rows).

    One token with nothing cached attends to itself only, so every layer's input is the same at any
    position: the keys differ only by what the layer itself does with the position (its RoPE, or nothing)."""
    cache = BufferCache(num_layers(model.config), 1)
    token = torch.ones(len(positions), 1, dtype=torch.long, device=model.device)
    model(input_ids=token, cache=cache, position_ids=torch.tensor([[p] for p in positions], device=model.device),
          use_cache=True, logits_to_keep=1)
    return [[layer.keys[row, :, 0].float() for row in range(len(positions))] for layer in cache.layers]


def make_layer_rerotations(model) -> list[Rerotate | None]:
    """Per decoder layer, the function moving its cached keys by ``delta`` positions (``None``: the layer's keys do
    not depend on the position — NoPE layers, SmolLM3, Cohere 2's global layers — and stay as they are).

    Read from the model: each layer's rotary embedding (`compat.layer_rotary`: per-layer-type bases, Gemma 3),
    and a probe — one token at positions 0 and `PROBE_DELTA` — says which layers rotate, and whether by halves
    (Llama), by interleaved pairs (Cohere) or by halves with one angle per pair (GPT-OSS), partial rotary (Phi,
    StableLM, GPT-NeoX) included. A layer whose keys move in another way raises a ValueError naming it.
    """
    if rotary_embedding(model) is None:
        raise ValueError(
            f"{type(model).__name__} has no `rotary_emb` on its decoder: a model drafter (draft='self' or a draft "
            "model) runs on a sink+window cache, which re-rotates keys and needs rotary position embeddings; use "
            "draft='ngram' or draft='suffix' with this model"
        )
    probed = _probe_keys(model, [0, PROBE_DELTA])
    rerotations: list[Rerotate | None] = []
    for index, (at_zero, moved) in enumerate(probed):
        scale = float(at_zero.abs().max()) + 1e-12
        if float((moved - at_zero).abs().max()) <= 1e-4 * scale:
            rerotations.append(None)
            continue
        rotary = layer_rotary(model, index)
        for rotate, layout in ROTATIONS.values():
            candidate = _rerotation(rotary, rotate, layout)
            try:
                error = float((candidate(at_zero[None, :, None], PROBE_DELTA)[0, :, 0] - moved).abs().max())
            except _LayoutMismatch:
                continue
            if error <= 1e-2 * scale:
                rerotations.append(candidate)
                break
        else:
            raise ValueError(
                f"{type(model).__name__} as a drafter: the keys of decoder layer {index} change with the position "
                "in a way that is not a rotary embedding of its `rotary_emb` (halves or interleaved pairs); the "
                "sink+window cache cannot move them; use draft='ngram' or draft='suffix' with this model"
            )
    return rerotations


POSITIONS = ("slots", "absolute")


class SinkWindowCache(BufferCache):
    """``sink_tokens`` first entries + the last ``window`` entries.

    ``positions="slots"`` (TriForce's and StreamingLLM's layout): positions are slots, the next token is at position
    ``length``, so a short-context draft never sees a position beyond ``sink_tokens + window``; `make_room` evicts
    the oldest window entries before a forward and re-rotates the kept keys to their new slots (each layer with its
    own rotation; NoPE layers stay as they are). ``positions="absolute"``: every entry keeps its token's position in
    the sequence (the caller feeds tokens at their own positions), so eviction moves entries without re-rotating
    them and the window sees the sinks as far away as the full model does. Memory is independent of the context
    length either way (allocated for ``sink_tokens + window`` entries, or the fewer a call can reach: ``capacity``).
    Sliding-window layers keep the same layout: the model's sliding mask cuts them at its window
    in cache coordinates, so with ``window >= sliding_window`` they attend to the last ``sliding_window`` tokens, as
    the model does (a draft's output law never needs to be the target's).
    """

    def __init__(self, num_layers: int, sink_tokens: int, window: int,
                 rerotate: Rerotate | Sequence[Rerotate | None], positions: str = "slots",
                 capacity: int | None = None) -> None:
        """``capacity``: the entries allocated (default ``sink_tokens + window``; fewer for a call that never holds
        more, `decoding.sizing.sink_window_rows`). Eviction keeps ``sink_tokens + window`` entries whatever it is; a
        write past a smaller capacity raises (`BufferLayer.write`)."""
        limit = sink_tokens + window
        if capacity is not None and not 1 <= capacity <= limit:
            raise ValueError(f"SinkWindowCache: capacity must be in [1, sink_tokens + window = {limit}], got "
                             f"{capacity}")
        super().__init__(num_layers, limit if capacity is None else capacity)
        if callable(rerotate):
            rerotate = [rerotate] * num_layers
        if len(rerotate) != num_layers:
            raise ValueError(f"SinkWindowCache: {len(rerotate)} re-rotations for {num_layers} layers")
        if positions not in POSITIONS:
            raise ValueError(f"SinkWindowCache: positions must be one of {POSITIONS}, got {positions!r}")
        self.sink_tokens = sink_tokens
        self.window = window
        self.positions = positions
        self.rerotate = list(rerotate)  # per layer; None: keys that do not depend on the position (NoPE)
        self.evict_block = max(1, window // 16)

    def make_room(self, n: int) -> None:
        """Evict so that ``n`` new entries fit in ``sink_tokens + window`` (at least ``evict_block`` at a time,
        amortizing re-rotation)."""
        limit = self.sink_tokens + self.window
        room = limit - min(self.length, self.sink_tokens)
        if n > room:
            raise ValueError(f"SinkWindowCache: {n} new entries exceed the {room} free entries of sinks + window")
        excess = self.length + n - limit
        if excess <= 0:
            return
        excess = min(max(excess, self.evict_block), self.length - self.sink_tokens)
        s = self.sink_tokens
        for layer, rerotate in zip(self.layers, self.rerotate):
            end = layer.length
            kept_keys = layer.keys[:, :, s + excess : end].clone()
            if rerotate is not None and self.positions == "slots":
                kept_keys = rerotate(kept_keys, -excess)
            layer.keys[:, :, s : end - excess] = kept_keys
            layer.values[:, :, s : end - excess] = layer.values[:, :, s + excess : end].clone()
            layer.length = end - excess

    def copy_from(self, source: BufferCache, upto: int) -> None:
        """Hold what a fill with the first ``upto`` tokens would hold -- their first ``sink_tokens`` and last
        ``window - evict_block`` -- taken from ``source``, a full cache holding them at their absolute positions
        (`copy_refusal` says which can), instead of computed by a forward: the entries are the full model's (their
        keys and values saw the whole context), the window's keys re-rotated to their slots under
        ``positions="slots"``."""
        sink = min(self.sink_tokens, upto)
        window = min(self.window - self.evict_block, upto - sink)
        first = upto - window  # the window's first absolute position; its slot is `sink`
        self.rollback(0)
        for layer, held, rerotate in zip(self.layers, source.layers, self.rerotate):
            device = layer.expected_device if layer.expected_device is not None else held.keys.device
            window_keys = held.keys[:, :, first:upto].to(device)
            if rerotate is not None and self.positions == "slots" and first != sink:
                window_keys = rerotate(window_keys, sink - first)
            layer.write(torch.cat((held.keys[:, :, :sink].to(device), window_keys), dim=2),
                        torch.cat((held.values[:, :, :sink], held.values[:, :, first:upto]), dim=2).to(device))


def copy_refusal(source: BufferCache) -> str | None:
    """Why `SinkWindowCache.copy_from` cannot read ``source`` (None: it can): it reads full-attention layers holding
    every entry at its absolute position (a `BufferCache`, a batch's row of one, an offloaded one); a sliding-window
    layer keeps only its window."""
    if any(isinstance(layer, WindowLayer) for layer in source.layers):
        return "the full cache has sliding-window layers (they keep only their window)"
    return None
