"""A lean forward for Llama-family decoders (Llama/SmolLM2, Mistral, Qwen2): the drafting tiers' and Force 3's.

Force 1 and Force 2 may run any model that hands up the exact law it drew from, a deterministic function of the
sequence so far; Force 3 computes the target itself (docs/exactness.md): by transformers' forward, or by this
forward's `LeanModel.verifying` view (the model's own weights read in place, activations rounded where its forward
rounds them, at fixed shapes a CUDA graph captures; the same values up to summation order). A drafting `LeanModel`
holds the target's (or a draft model's) weights copied once, run with little per-op overhead:

* fused projections: one matrix for Q, K and V (and their biases: Qwen2), one for gate and up;
* weights per `LEAN_PRECISIONS`: ``"lean"`` fp32, ``"lean-int8"`` weight-only int8 per output channel,
  ``"lean-int4"`` weight-only int4 (asymmetric, `INT4_GROUP_SIZE` inputs per scale and zero point) with an int8
  output layer, ``"native"`` the model's own weights in place. The quantized products take bf16 activations (this
  torch's CPU kernels for them are vectorized for bf16 only); the residual stream, norms and rotary stay fp32,
  attention and the cache run in the model's dtype;
* one ``F.rms_norm``, the rotary's cos/sin once per forward by the model's own rotary module, attention by SDPA over
  the cache's buffers (GQA-native; on the CPU the library's kernel, `cpu_attention`, where `attention_routes` timed
  it cheaper; at fixed shapes over a long buffer, `split_kv` where it pays), written through the same cache objects
  the eager forward uses (``cache.layers[i].update``).

Row independence (exactness): every product is weight-only, the norms act per row and attention is causal (the tree
mask inside a candidate tree; a batch's per-row mask), so a row's logits do not depend on the values of later rows or
of other batch rows (tests/test_lean.py checks bit-identity); they depend on how many rows a call has (kernel
blocking), which is fixed before the call's tokens are drawn.

This module computes only: which models the forward covers and which precision each tier runs are decided in
`hf_triforce.decoding.tiers`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .. import compat
from . import attention_routes, cpu_attention, ragged_attention
from .attention import _ACTIVE_RECORDER, RECORDER_KWARG
from .split_kv import split_kv_attention, split_kv_mask, split_parts
from .tree_attention import active_tree

PARTS = ("qkv", "o", "gate_up", "down", "head")  # the projections of a lean copy (qkv, gate_up: fused)
# TriForceConfig.draft_precision values served by this module -> the precision of each part. The output layer of
# "lean-int4" is int8: in int4 it costs far more agreement (docs/experiments.md, "Lean drafting tiers")
LEAN_PRECISIONS = {
    "lean": dict.fromkeys(PARTS, "fp32"),
    "lean-int8": dict.fromkeys(PARTS, "int8"),
    "lean-int4": {**dict.fromkeys(PARTS, "int4"), "head": "int8"},
    # the model's own weights, read in place (no copy, any device and dtype): what the tiers run on a GPU, where a
    # forward at fixed shapes is captured as a CUDA graph (`fixed_shape`, TriForceConfig.tier_compile="graph")
    "native": dict.fromkeys(PARTS, "model"),
}
# inputs per int4 scale/zero point: the smallest group the CPU kernel takes (32, 64, 128, 256; it must divide every
# input width); 64 costs far more agreement on the bundled SmolLM2, dequantized from blocks of 32 (docs/experiments.md,
# "Lean drafting tiers")
INT4_GROUP_SIZE = 32
INT4_INNER_K_TILES = 2  # the packing's inner tiles (CPU kernel: no measured difference between 1, 2, 4, 8)

# ATen's weight-only CPU kernels (None where this torch lacks them: `decoding.tiers.check_lean_eligible` says so)
INT8_MM = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
INT4_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)


@dataclass
class LeanOutput:
    """What the tiers read from a forward: ``logits`` ``[batch, keep, vocab]`` (fp32)."""

    logits: torch.Tensor


class Projection:
    """One (fused) linear layer ``x @ W.T + b`` in fp32, weight-only int8 or weight-only int4."""

    def __init__(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None | list, precision: str,
                 group_size: int = INT4_GROUP_SIZE, weight_left: bool = False) -> None:
        """``weight_left``: fp32 products of 2-16 rows run as ``(W @ x.T).T`` (the output layer: on every CPU measured
        its products were cheaper so, `linear_routes`, which times the target's own layers). ``"model"``: ``weight``
        and ``bias`` are lists of the model's own tensors (a fused projection's parts), read in place."""
        self.precision = precision
        self.weight_left = weight_left
        if precision == "model":
            self.weights = [w.detach() for w in weight]
            self.biases = [None if b is None else b.detach() for b in bias]
            self.out_features, self.in_features = sum(w.shape[0] for w in self.weights), self.weights[0].shape[1]
            self.weight = self.weights[0]  # its dtype and device
            return
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().clone()
        if precision == "fp32":
            self.weight = weight.contiguous()  # a fused matrix is new; a single layer's weight is shared
        elif precision == "int8":
            self.weight, self.scales = quantize_int8(weight)
        elif precision == "int4":
            if self.in_features % group_size:
                raise ValueError(f"int4 group size {group_size} does not divide the input width {self.in_features}")
            self.group_size = group_size
            self.weight, self.scales_zeros = quantize_int4(weight, group_size)
        else:
            raise ValueError(f"precision must be 'fp32', 'int8' or 'int4', got {precision!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in]`` (fp32, or bf16 for the quantized products) -> ``[rows, out]``: fp32 for fp32
        weights, bf16 for quantized ones (their kernels' output)."""
        if self.precision == "model":  # in the weights' dtype, each part of a fused projection by its own weight
            x = x.to(self.weight.dtype)
            outs = [F.linear(x, w, b) for w, b in zip(self.weights, self.biases)]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.precision == "fp32":
            if self.weight_left and 2 <= x.shape[0] <= 16:
                out = (self.weight @ x.T).T
                return out if self.bias is None else out + self.bias
            return F.linear(x, self.weight, self.bias)
        x = x.to(torch.bfloat16)
        if self.precision == "int8":
            out = INT8_MM(x, self.weight, self.scales)
        else:
            out = INT4_MM(x, self.weight, self.group_size, self.scales_zeros)
        return out if self.bias is None else out.float() + self.bias

    def nbytes(self, shared: set[int] = frozenset()) -> int:
        """Bytes of its tensors, except those whose storage is in ``shared`` (data pointers of the model's)."""
        if self.precision == "model":
            return sum(t.nbytes for t in (*self.weights, *self.biases) if t is not None and t.data_ptr() not in shared)
        tensors = [self.weight, self.bias, getattr(self, "scales", None), getattr(self, "scales_zeros", None)]
        return sum(t.nbytes for t in tensors if t is not None and t.data_ptr() not in shared)


def _bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """``x`` (positive, finite fp32) rounded to the nearest bf16 value no smaller than it."""
    rounded = x.to(torch.bfloat16)
    above = (rounded.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 up (positive values)
    return torch.where(rounded.float() < x, above, rounded)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``W ~ q * scale`` with ``|q| <= 127``; the scales are bf16 (the
    kernel's activation dtype) and rounded up before quantizing, so no weight is clipped."""
    scales = _bf16_at_least((weight.abs().amax(dim=1) / 127).clamp(min=1e-8))
    q = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of ``group_size`` inputs: ``W ~ (q - 8) * scale + zero`` with ``0 <= q <= 15``
    (the kernel's convention), ``zero = min + 8 * scale``; scales and zero points are bf16 and quantization
    uses the rounded values. Returns the packed weight and ``[in / group, out, 2]`` scales and zeros."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = _bf16_at_least(((high - low) / 15).clamp(min=1e-8))
    zeros = (low + 8 * scales.float()).to(torch.bfloat16)
    q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
    q = q.to(torch.int32).reshape(out_features, in_features)
    packed = INT4_PACK(q, INT4_INNER_K_TILES)
    scales_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
    return packed, scales_zeros


def _native(linears) -> Projection:
    """A ``"model"`` `Projection` over the ``nn.Linear`` modules ``linears`` (a fused projection's parts)."""
    return Projection([linear.weight for linear in linears], [linear.bias for linear in linears], "model")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class LeanLayer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection


class LeanModel:
    """The lean forward of one model at one precision (`decoding.tiers.lean_model` makes and caches it).

    Called like the transformers model by the tiers: ``model(input_ids=, cache=, position_ids=,
    attention_mask=None, use_cache=True, logits_to_keep=k)``; returns a `LeanOutput`. Every other attribute
    (``config``, ``dtype``, ``device``, ``get_decoder``...) is the original model's, so cache set-up (layer
    devices, the sink+window cache's re-rotations) reads the original.
    """

    def __init__(self, model: nn.Module, precision: str, parts: dict[str, str] | None = None,
                 group_size: int = INT4_GROUP_SIZE) -> None:
        """``parts``: per projection kind (``qkv``, ``o``, ``gate_up``, ``down``, ``head``) its precision; by
        default `LEAN_PRECISIONS` ``[precision]`` for every part."""
        self.original = model
        self.precision = precision
        self.parts = parts = {**LEAN_PRECISIONS[precision], **(parts or {})}
        self.group_size = group_size
        self.fixed_shape = None  # `compiled`: a `fixed_shape.FixedShapeForward` for the forwards it covers
        self._compiled_views: dict[str, LeanModel] = {}
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.cache_dtype = next(model.parameters()).dtype  # the entries it writes: the model's own dtype
        # the residual stream, norms and rotary: fp32 in a drafting copy; the model's dtype in Force 3's view
        # (`verifying`), which rounds as the model's own forward does
        self.activation_dtype = torch.float32
        config = model.config
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens
        self.rotary = compat.rotary_embedding(model)
        self.final_norm = decoder.norm.weight.detach().float().clone()
        self.eps = float(decoder.norm.variance_epsilon)
        first = decoder.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scaling = float(first.scaling)
        self.intermediate = config.intermediate_size
        self.layers = []
        native = precision == "native"
        for layer in decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            projections = (attention.q_proj, attention.k_proj, attention.v_proj)
            if native:
                self.layers.append(LeanLayer(
                    input_norm=layer.input_layernorm.weight.detach().float().clone(),
                    post_norm=layer.post_attention_layernorm.weight.detach().float().clone(),
                    qkv=_native(projections), o=_native((attention.o_proj,)),
                    gate_up=_native((mlp.gate_proj, mlp.up_proj)), down=_native((mlp.down_proj,))))
                continue
            qkv_bias = None
            if any(p.bias is not None for p in projections):
                qkv_bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                                      for p in projections])
            gate_up_bias = None
            if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
                gate_up_bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                                          for p in (mlp.gate_proj, mlp.up_proj)])
            self.layers.append(LeanLayer(
                input_norm=layer.input_layernorm.weight.detach().float().clone(),
                post_norm=layer.post_attention_layernorm.weight.detach().float().clone(),
                qkv=Projection(torch.cat([p.weight for p in projections]), qkv_bias, parts["qkv"], group_size),
                o=Projection(attention.o_proj.weight, attention.o_proj.bias, parts["o"], group_size),
                gate_up=Projection(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)), gate_up_bias,
                                   parts["gate_up"], group_size),
                down=Projection(mlp.down_proj.weight, mlp.down_proj.bias, parts["down"], group_size),
            ))
        head = model.get_output_embeddings()
        self.head = _native((head,)) if native else Projection(head.weight, head.bias, parts["head"], group_size,
                                                                weight_left=True)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "original":  # copy/pickle probes, or not initialized yet
            raise AttributeError(name)
        return getattr(self.original, name)

    def weight_bytes(self) -> int:
        """Bytes of the weights one forward reads: every projection and the output layer, shared or not."""
        return self.head.nbytes() + sum(p.nbytes() for layer in self.layers
                                        for p in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def nbytes(self) -> int:
        """Bytes this copy holds beyond the model's own tensors (quantized or fused weights, norms): the embedding
        table and fp32 weights used as they are (``"lean"``'s o, down and output layers) are the model's."""
        shared = {p.data_ptr() for p in self.original.parameters()}
        total = self.final_norm.nbytes + self.head.nbytes(shared)
        for layer in self.layers:
            total += layer.input_norm.nbytes + layer.post_norm.nbytes
            total += sum(p.nbytes(shared) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return total

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, use_cache: bool = True, logits_to_keep: int = 0,
                 **kwargs) -> LeanOutput:
        if kwargs.get(RECORDER_KWARG) is not None or _ACTIVE_RECORDER.get() is not None:
            raise RuntimeError("LeanModel does not record queries: run the model itself where queries are recorded")
        if cache is None or position_ids is None:
            raise ValueError("LeanModel runs on a cache at explicit positions (cache=, position_ids=)")
        batch, n = input_ids.shape
        mask = self._mask(attention_mask, batch, n)
        fixed = self.fixed_shape
        if fixed is not None and fixed.entry == "fixed_shape_layers" and (mask is None or isinstance(mask, int)) \
                and batch == 1 and fixed.covers(cache):
            hidden = fixed(self, input_ids, position_ids, cache)
        else:
            hidden = self._layers(input_ids, position_ids, self._cache_attention(cache.layers, mask))
        return self._logits(hidden, batch, n, logits_to_keep)

    def _layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend,
                queries: list | None = None) -> torch.Tensor:
        """The decoder: ``input_ids`` ``[batch, n]`` at ``position_ids`` -> the last hidden state ``[batch * n,
        hidden]`` (in `activation_dtype`). ``attend(index, query, keys, values)`` (``[batch, heads | kv_heads, n,
        dim]``, rotated) stores the new entries of layer ``index`` and returns its attention output ``[batch * n,
        heads * dim]``. ``queries``: each layer's rotated query ``[batch, heads, n, dim]`` is appended to it (the
        verifier's queries, Force 2's selection input)."""
        batch, n = input_ids.shape
        heads, kv_heads, dim, act = self.heads, self.kv_heads, self.head_dim, self.activation_dtype
        hidden = self.embed(input_ids).to(act).reshape(batch * n, -1)
        cos, sin = self.rotary(hidden, position_ids)  # [batch, n, dim], in the activations' dtype
        cos, sin = cos.to(act)[:, None], sin.to(act)[:, None]
        for index, layer in enumerate(self.layers):
            normed = self._norm(hidden, layer.input_norm)
            qkv = layer.qkv(normed).to(act).view(batch, n, heads + 2 * kv_heads, dim).transpose(1, 2)
            qk = qkv[:, : heads + kv_heads]
            qk = qk * cos + _rotate_half(qk) * sin
            if queries is not None:
                queries.append(qk[:, :heads])
            out = attend(index, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :])
            hidden = hidden + layer.o(out)
            normed = self._norm(hidden, layer.post_norm)
            gate, up = layer.gate_up(normed).split(self.intermediate, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return hidden

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``hidden`` ``[rows, width]`` by ``weight`` (fp32): in fp32 one ``F.rms_norm``; in a narrower
        `activation_dtype` as transformers' Llama-family norm computes it (normalized in fp32, rounded to the
        activations' dtype, then scaled by the weight in that dtype: the fp32 product of two bf16/fp16 values is
        exact, so one rounding gives the narrow product)."""
        if hidden.dtype == torch.float32:
            return F.rms_norm(hidden, hidden.shape[-1:], weight, self.eps)
        normed = F.rms_norm(hidden.float(), hidden.shape[-1:], None, self.eps).to(hidden.dtype)
        return (normed.float() * weight).to(hidden.dtype)

    def _cache_attention(self, layers, mask):
        """`_layers`' ``attend`` through the cache objects (``layers[i].update``) under ``mask`` (`_mask`)."""
        kv_heads, groups, dim = self.kv_heads, self.heads // self.kv_heads, self.head_dim

        def attend(index: int, query: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor):
            batch, heads, n, _ = query.shape
            keys, values = layers[index].update(new_keys.to(self.cache_dtype), new_values.to(self.cache_dtype))
            query = query.to(keys.dtype)  # a bf16 model's caches are bf16
            rows = ragged_attention.attend_rows(query, keys, values, self.scaling)  # a ragged batch's forward
            if rows is not None:
                return rows.reshape(batch * n, heads * dim).float()
            if (mask is None or isinstance(mask, int)) and attention_routes.takes_kernel(query, keys, values):
                return cpu_attention.attend(query, keys, values, self.scaling).reshape(n, heads * dim).float()
            if mask is None:  # one row per batch row seeing all its entries
                out = F.scaled_dot_product_attention(query.reshape(batch, kv_heads, groups, dim), keys, values,
                                                     scale=self.scaling)
                return out.reshape(batch * n, heads * dim).float()
            visible = mask if not isinstance(mask, int) else _bottom_right(n, keys.shape[2], query.device)
            out = F.scaled_dot_product_attention(
                query.reshape(batch, kv_heads, groups * n, dim), keys, values,
                attn_mask=visible.expand(batch, 1, n, keys.shape[2]).repeat(1, 1, groups, 1), scale=self.scaling)
            return out.reshape(batch, heads, n, dim).transpose(1, 2).reshape(batch * n, heads * dim).float()

        return attend

    def fixed_shape_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, write_index: torch.Tensor,
                           keys: list[torch.Tensor], values: list[torch.Tensor],
                           queries: list | None = None) -> torch.Tensor:
        """`_layers` on whole cache buffers, so that every shape is fixed by ``n`` and the buffers' capacity
        (what `fixed_shape.FixedShapeForward` compiles or captures): ``input_ids`` ``[1, n]`` at ``position_ids``
        ``[1, n]``; layer ``i``'s new entries are written into ``keys[i]`` / ``values[i]`` (``[1, kv_heads,
        capacity, dim]``) at the cache indices ``write_index`` ``[n]`` (increasing, consecutive), and query row
        ``r`` attends to the entries at indices ``<= write_index[r]`` -- exactly the entries the cache's own
        ``update`` would have shown it (the rest get probability exactly 0). A long buffer and few rows take
        `split_kv.split_kv_attention` where `split_kv.split_parts` says it pays (the buffer cut into spans merged by
        log-sum-exp: equal up to rounding), one masked SDPA call elsewhere. ``queries``: as `_layers`'."""
        kv_heads, groups, dim = self.kv_heads, self.heads // self.kv_heads, self.head_dim
        n = input_ids.shape[1]
        capacity = keys[0].shape[2]
        visible = torch.arange(capacity, device=write_index.device)[None, :] <= write_index[:, None]  # [n, capacity]
        visible = visible.repeat(groups, 1)  # [groups * n, capacity]: a group's query heads are rows of its KV head
        # a long buffer and few rows: the buffer cut into spans (split-KV), the mask's bias made once for every layer
        parts = split_parts(kv_heads, groups * n, capacity, write_index.device, head_dim=dim)
        split = split_kv_mask(visible, parts, keys[0].dtype) if parts > 1 else None

        def attend(index: int, query: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor):
            keys[index].index_copy_(2, write_index, new_keys.to(keys[index].dtype))
            values[index].index_copy_(2, write_index, new_values.to(values[index].dtype))
            rows = query.reshape(1, kv_heads, groups * n, dim).to(keys[index].dtype)
            if split is not None:
                out = split_kv_attention(rows, keys[index], values[index], split, self.scaling, parts)
            else:
                out = F.scaled_dot_product_attention(rows, keys[index], values[index], attn_mask=visible,
                                                     scale=self.scaling)
            # in the activations' dtype: Force 3's view (`verifying`) keeps the model's, where an fp32 copy would only
            # be cast back by the output projection
            return out.reshape(1, groups * kv_heads, n, dim).transpose(1, 2).reshape(n, groups * kv_heads * dim).to(
                self.activation_dtype)

        return self._layers(input_ids, position_ids, attend, queries)

    def fixed_shape_verify(self, input_ids: torch.Tensor, position_ids: torch.Tensor, write_index: torch.Tensor,
                           keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Force 3's verification on whole cache buffers (`fixed_shape_layers`' arguments): the logits ``[n,
        vocab]`` (fp32) of every row and each layer's rotated query, stacked ``[layers, 1, heads, n, dim]`` --
        outputs of the one region a compiler or a CUDA graph captures, so that no query is read on the host."""
        queries: list[torch.Tensor] = []
        hidden = self.fixed_shape_layers(input_ids, position_ids, write_index, keys, values, queries)
        return self._logits(hidden, 1, input_ids.shape[1], 0).logits[0], torch.stack(queries)

    def _logits(self, hidden: torch.Tensor, batch: int, n: int, logits_to_keep: int) -> LeanOutput:
        keep = n if not logits_to_keep else min(logits_to_keep, n)
        last = hidden.view(batch, n, -1)[:, n - keep :]
        last = self._norm(last.reshape(batch * keep, -1), self.final_norm)
        return LeanOutput(self.head(last).float().view(batch, keep, -1))

    def compiled(self, mode: str) -> LeanModel:
        """This copy (weights shared) whose forwards run `fixed_shape.FixedShapeForward` ``(mode)`` where it covers
        them (batch 1, no tree, no mask, a cache of plain `BufferLayer`s: Force 1's sink+window cache, Force 2's
        retrieval cache) and the eager lean forward elsewhere. Made once per mode and kept: what it compiled
        serves every later call."""
        if mode not in self._compiled_views:
            from .fixed_shape import FixedShapeForward

            self._compiled_views[mode] = self._view(fixed_shape=FixedShapeForward(mode))
        return self._compiled_views[mode]

    def verifying(self, mode: str) -> LeanModel:
        """This ``"native"`` copy as Force 3's verification forward (`verify`): activations in the model's dtype,
        rounded where the model's own forward rounds them (`_norm`), the forward at fixed shapes over the full
        cache's buffers run by `fixed_shape.FixedShapeForward` ``(mode)``, whose cache capacity (a call's
        ``max_length`` and room for its rows) is a dynamic dimension (and a row count above one): made once per mode
        and kept, what it compiled serves every later call and length."""
        if self.precision != "native":
            raise ValueError(f"Force 3 verifies with the model's own weights (precision 'native'); this copy has "
                             f"precision {self.precision!r}")
        key = f"verify {mode}"
        if key not in self._compiled_views:
            from .fixed_shape import FixedShapeForward

            self._compiled_views[key] = self._view(activation_dtype=self.cache_dtype, fixed_shape=FixedShapeForward(
                mode, entry="fixed_shape_verify", dynamic=True))
        return self._compiled_views[key]

    @torch.no_grad()
    def verify(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Force 3's forward (a `verifying` view): ``input_ids`` ``[1, n]`` at ``position_ids`` ``[1, n]`` after the
        entries of ``cache`` (plain `BufferLayer`s: `FixedShapeForward.covers`) -> ``(logits [n, vocab],
        queries [layers, 1, heads, n, dim])`` (`fixed_shape_verify`); the cache's layers grow by ``n`` entries."""
        if self.fixed_shape is None or self.fixed_shape.entry != "fixed_shape_verify":
            raise RuntimeError("LeanModel.verify runs on a view made by LeanModel.verifying")
        if not self.fixed_shape.covers(cache):
            raise RuntimeError("LeanModel.verify needs a cache of plain, allocated BufferLayers of one length")
        return self.fixed_shape(self, input_ids, position_ids, cache)

    def _view(self, **changes) -> LeanModel:
        """A copy sharing this one's layers, norms, rotary and embedding, with the attributes ``changes`` and no
        compiled views yet (a view compiles its own forwards)."""
        view = copy.copy(self)
        vars(view).update(_compiled_views={}, **changes)
        return view

    def _mask(self, attention_mask: torch.Tensor | None, batch: int, n: int):
        """None (one row per batch row, sees every entry), ``0`` (bottom-right causal, built per layer from the
        keys' length), or a ``[batch, 1, n, width]`` mask (a tree's, or the batch's per-row mask)."""
        tree = active_tree()
        if tree is not None:
            if batch != 1 or attention_mask is not None:
                raise RuntimeError("LeanModel: a candidate tree's forward has batch size 1 and no mask")
            return _TreeMask(tree)
        if attention_mask is not None:
            if attention_mask.dim() != 4:
                raise RuntimeError(f"LeanModel takes 4-D attention masks, got shape {tuple(attention_mask.shape)}")
            return attention_mask
        return None if n == 1 else 0


class _TreeMask:
    """The mask of a candidate tree's forward: every cached entry, then the block's visibility."""

    def __init__(self, visible: torch.Tensor) -> None:
        self.visible = visible

    def expand(self, batch: int, one: int, n: int, width: int) -> torch.Tensor:
        cached = torch.ones(n, width - n, dtype=torch.bool, device=self.visible.device)
        return torch.cat((cached, self.visible), dim=1).expand(batch, one, n, width)


def _bottom_right(n: int, width: int, device) -> torch.Tensor:
    return torch.ones(n, width, dtype=torch.bool, device=device).tril(width - n)
