"""Tree attention: one forward scores every node of a candidate tree (`tree.DraftTree`).

The new block of a tree forward is ``m`` rows (the uncached tail of the committed sequence, then the tree's nodes)
after ``cached`` entries. Every row sees every cached entry, and inside the block only what ``visible`` (``[m, m]``
bool, `block_visibility`) allows: the committed tail causally, a node its ancestors and itself. The attention is
computed in two parts merged exactly by their log-sum-exp:

* the cached prefix, unmasked: on CPU ATen's flash attention returning its log-sum-exp, the prefix split into spans
  along the batch dimension (as `attention.split_kv_sdpa`), GQA-native; on CUDA the route `attention.fused_route`
  picks (`flash_prefix_attention`, `native_attention.varlen_prefix_attention`,
  `native_attention.flex_prefix_attention`); elsewhere one matmul;
* the block, ``m x m``, with the tree mask, in fp32.

Pinned to ``"flex_tree"`` (`native_attention.force_route`), the whole tree is one FlexAttention call whose mask reads
``visible`` (`native_attention.flex_tree_sdpa`); the split stays the default (`benchmarks/gpu_check.py` times both).

No ``[m, cached]`` mask is ever built: the block mask reaches the attention function through a context (`tree_block`)
set around the forward by `decoding.tree_forward.tree_logits`, and the model's own causal mask is ignored while it is
set. Sliding-window layers, soft-capping and position biases are refused (their masks/scores are not this
computation).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ..verification.draft_tree import DraftTree
from . import attention, native_attention
from .split_kv import merge_by_lse, sdpa_with_lse

_ACTIVE_TREE: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("triforce_tree", default=None)
# what the layers of one tree forward derive from its block once and share (FlexAttention's BlockMask)
_TREE_DERIVED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("triforce_tree_derived", default=None)

# below this many cached entries per thread the prefix is one call (splitting buys nothing): as split_kv_sdpa
MIN_SPAN = 16


def block_visibility(uncached: int, tree: DraftTree, device: torch.device | None = None) -> torch.Tensor:
    """``[uncached + n, uncached + n]`` bool: the committed tail causal among itself, every node seeing the whole
    tail, its ancestors and itself."""
    m = uncached + len(tree)
    visible = torch.zeros(m, m, dtype=torch.bool)
    visible[:uncached, :uncached] = torch.ones(uncached, uncached, dtype=torch.bool).tril()
    visible[uncached:, :uncached] = True
    visible[uncached:, uncached:] = tree.visibility()
    return visible.to(device) if device is not None else visible


@contextlib.contextmanager
def tree_block(visible: torch.Tensor):
    """Attention functions of forwards run inside see the new block through ``visible`` (this context only)."""
    token, derived = _ACTIVE_TREE.set(visible), _TREE_DERIVED.set({})
    try:
        yield visible
    finally:
        _ACTIVE_TREE.reset(token)
        _TREE_DERIVED.reset(derived)


def active_tree() -> torch.Tensor | None:
    return _ACTIVE_TREE.get()


def tree_derived() -> dict | None:
    """The current tree forward's cache of what its layers derive from ``visible`` (None outside `tree_block`)."""
    return _TREE_DERIVED.get()


def flash_prefix_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix part through flash-attn's varlen kernel (CUDA, fp16/bf16): ``query`` ``[heads, m, d]`` over
    ``keys``/``values`` ``[kv, c, d]`` (read in place; flash-attn 2 needs values as wide as keys,
    `attention.fused_route`), one sequence, not causal, GQA-native. Returns `prefix_attention`'s layout:
    ``[1, kv, groups * m, dv]`` and the fp32 log-sum-exp ``[1, kv, groups * m]``
    (flash-attn 2 documents its ``softmax_lse`` as ``[heads, total_q]``; older releases pad it to ``[batch,
    heads, max_seqlen_q]``: with one sequence of ``m`` rows both read as ``[heads, m]``)."""
    heads, m, _ = query.shape
    kv_heads, cached = keys.shape[0], keys.shape[1]
    bounds = torch.tensor([[0, m], [0, cached]], dtype=torch.int32, device=query.device)
    out, lse, _ = attention.flash_varlen()(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), cu_seqlens_q=bounds[0],
        cu_seqlens_k=bounds[1], max_seqlen_q=m, max_seqlen_k=cached, softmax_scale=scale, causal=False,
        return_attn_probs=True,
    )  # out: [m, heads, d]
    out = out.transpose(0, 1).reshape(kv_heads, heads // kv_heads * m, values.shape[-1])
    lse = lse.reshape(heads, -1)[:, :m].reshape(kv_heads, heads // kv_heads * m)
    return out[None], lse[None].float()


def prefix_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of ``rows`` ``[kv, r, d]`` over ``keys`` ``[kv, c, d]`` and ``values`` ``[kv, c, dv]``:
    ``(out, lse)`` as ``[parts, kv, r, dv]`` and ``[parts, kv, r]`` partial results (fp32 lse), to be merged by
    log-sum-exp. ATen's CPU kernel needs values as wide as keys; narrower ones (multi-head latent attention)
    take the matmul."""
    attend = sdpa_with_lse() if rows.device.type == "cpu" and attention.same_head_dims(keys, values) else None
    if attend is None:
        scores = torch.matmul(rows.float(), keys.float().transpose(-1, -2)) * scale
        lse = torch.logsumexp(scores, -1)
        out = torch.matmul(torch.softmax(scores, -1), values.float())
        return out[None], lse[None]
    cached = keys.shape[1]
    parts = max(2, torch.get_num_threads())
    span = cached // parts if cached >= MIN_SPAN * parts else 0
    outs, lses = [], []
    if span:
        head = parts * span
        split_keys = keys[:, :head].unflatten(1, (parts, span)).transpose(0, 1)
        split_values = values[:, :head].unflatten(1, (parts, span)).transpose(0, 1)
        out, lse = attend(rows.expand(parts, -1, -1, -1), split_keys, split_values, scale=scale)[:2]
        outs.append(out)
        lses.append(lse)
    else:
        head = 0
    if head < cached:
        out, lse = attend(rows[None], keys[None, :, head:], values[None, :, head:], scale=scale)[:2]
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses).float()


def _prefix_route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """`attention.fused_route` for a tree's prefix (no dropout: `tree_attention` refuses it)."""
    return attention.fused_route(query, key, value)


def tree_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
              scaling: float | None = None) -> tuple[torch.Tensor, None]:
    """Attention of the ``m`` new rows of a tree forward: ``query`` ``[1, heads, m, d]``, ``key``/``value``
    ``[1, kv_heads, cached + m, d]`` (values ``dv`` wide: narrower than keys in multi-head latent attention);
    returns ``[1, m, heads, dv]`` like transformers' attention functions."""
    batch, heads, m, dim = query.shape
    if batch != 1 or visible.shape != (m, m):
        raise ValueError(f"tree attention: batch 1 and a [{m}, {m}] block mask needed, got batch {batch} and "
                         f"mask {tuple(visible.shape)}")
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups, cached = heads // kv_heads, kv_len - m
    scale = scaling if scaling is not None else dim**-0.5
    route = _prefix_route(query, key, value) if cached else None
    if route == "flex_tree":
        return native_attention.flex_tree_sdpa(query, key, value, visible, scale, tree_derived()), None
    rows = query[0].reshape(kv_heads, groups * m, dim)
    block_keys, block_values = key[0, :, cached:].float(), value[0, :, cached:].float()
    scores = torch.matmul(rows.float(), block_keys.transpose(-1, -2)) * scale  # [kv, groups * m, m]
    scores = scores.masked_fill(~visible.to(scores.device).repeat(groups, 1), float("-inf"))
    block_lse = torch.logsumexp(scores, -1)
    block_out = torch.matmul(torch.softmax(scores, -1), block_values)
    if cached:
        prefix = (query[0], key[0, :, :cached], value[0, :, :cached], scale)
        out, lse = None, None
        if route == "flash_attn":
            out, lse = flash_prefix_attention(*prefix)
        elif route == "varlen":
            out, lse = native_attention.varlen_prefix_attention(*prefix)
        elif route == "flex":
            out, lse = native_attention.flex_prefix_attention(*prefix)
        if out is None:
            out, lse = prefix_attention(rows, key[0, :, :cached], value[0, :, :cached], scale)
        merged = merge_by_lse(torch.cat((out.float(), block_out[None])), torch.cat((lse, block_lse[None])))
    else:
        merged = block_out
    return merged.to(query.dtype).reshape(1, heads, m, value.shape[-1]).transpose(1, 2).contiguous(), None


def tree_attention(module, query, key, value, visible, windowed: bool, **kwargs):
    """The attention function's tree path; refuses what it does not compute."""
    if windowed:
        raise ValueError("candidate trees are not supported on models with sliding-window layers "
                         f"(layer {getattr(module, 'layer_idx', '?')}): use chains (tree_nodes=0)")
    for unsupported in ("softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"candidate trees are not supported with attention {unsupported}: "
                             "use chains (tree_nodes=0)")
    if kwargs.get("dropout") and module.training:
        raise ValueError("candidate trees: attention dropout in training mode is not supported")
    return tree_sdpa(module, query, key, value, visible, scaling=kwargs.get("scaling"))
