"""GPU attention without flash-attn: torch's own varlen FlashAttention kernels and FlexAttention.

flash-attn has no wheel on PyPI, so most CUDA installs lack it; these routes give the same mask-free, GQA-native
multi-token attention (Force 3's verification, chunked prefill, a candidate tree's cached prefix with its
log-sum-exp) from torch alone. What each op supports (torch 2.11 and 2.13 read; `tests/test_native_attention.py`
checks the CPU-visible parts, `tests/test_cuda.py` the kernels):

* ``torch.nn.attention.varlen.varlen_attn`` (a prototype API; `varlen_function` reads its signature): ATen's
  vendored FlashAttention 2, **CUDA only**, fp16/bf16, sm80 or newer, one head dim for q, k and v, a multiple of 8
  (these routes do not pad) and at most 256. GQA: fewer KV heads (2.13 wants ``enable_gqa=True``). Causal is
  ``window_size=(-1, 0)`` (a tuple, not a list), aligned bottom-right. ``return_aux=AuxRequest(lse=True)`` returns
  the fp32 log-sum-exp as ``[heads, total_q]`` (its fake implementation; the docstring's ``(T_q, H)`` is not
  followed: the CUDA test checks the values). No dropout.
* ``torch.nn.attention.flex_attention.flex_attention`` (torch >= 2.5): CUDA (Triton, compiled; `_flex`), CPU eagerly
  (unfused; compiled on the CPU it refuses the log-sum-exp), fp32/bf16/fp16, any mask as a ``mask_mod`` turned into
  a `BlockMask`, ``enable_gqa``, the natural-log log-sum-exp. Its short-query kernel needs a power-of-two GQA ratio,
  so a group's query heads are laid out as extra rows of their KV head here (SmolLM2's ratio is 3).

Dispatch (`attention.fused_route`), on CUDA, for the batch-1 multi-token calls of full-attention layers: flash-attn
when installed (fp16/bf16), then `varlen_attn` (fp16/bf16, nothing to compile), then FlexAttention (fp32, head dims
varlen refuses; compiled on first use, seconds per shape family), then the masked SDPA / matmul path. A route that
fails raises: pin another with `force_route` (tests, benchmarks, or a GPU whose compiler refuses a FlexAttention
kernel: ``force_route("sdpa")``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Any, NamedTuple

import torch

try:
    from torch.nn.attention import flex_attention as _fa
except ImportError:  # torch without FlexAttention
    _fa = None

# route names: `force_route` accepts these; "sdpa" is the masked SDPA / matmul path (no fused kernel)
ROUTES = ("flash_attn", "varlen", "flex", "flex_tree", "sdpa")
# aten::_flash_attention_forward: head dims up to 256 (SDPA's check_head_dim_size_flash), multiples of 8
VARLEN_MAX_HEAD_DIM = 256
# Triton's tl.dot needs inner dimensions of at least 16: smaller heads (a tiny test model's 8) take the masked
# path automatically (untested on a GPU below 16; a pinned route still tries)
FLEX_MIN_HEAD_DIM = 16

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("triforce_attention_route", default=None)


@contextlib.contextmanager
def force_route(name: str):
    """Within the block, every batch-1 multi-token attention call of a full-attention layer takes route ``name``
    (one of `ROUTES`; ``"flex_tree"``: FlexAttention, and a candidate tree as one FlexAttention call with the
    tree mask instead of prefix and block merged by log-sum-exp); a route that cannot run the call raises."""
    if name not in ROUTES:
        raise ValueError(f"attention route {name!r} is not one of {', '.join(ROUTES)}")
    token = _FORCED.set(name)
    try:
        yield name
    finally:
        _FORCED.reset(token)


def forced_route() -> str | None:
    return _FORCED.get()


# ---------------------------------------------------------------------------------------------------- varlen_attn


class Varlen(NamedTuple):
    call: Any  # torch.nn.attention.varlen.varlen_attn
    aux: Any  # its AuxRequest
    takes_gqa: bool  # the signature has enable_gqa (torch 2.13; 2.11 passes fewer KV heads to the kernel as is)


@functools.cache
def varlen_function() -> Varlen | None:
    """torch's ``varlen_attn`` where it takes what these routes pass (``return_aux``, ``scale``, ``window_size``:
    torch 2.11 and 2.13), else None."""
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:
        return None
    return adapt_varlen(varlen_attn, AuxRequest)


def adapt_varlen(fn, aux) -> Varlen | None:
    """``fn`` (a ``varlen_attn``) as these routes call it, read from its signature; None where it lacks a keyword
    they need."""
    params = inspect.signature(fn).parameters
    if not {"return_aux", "scale", "window_size"} <= set(params):
        return None
    return Varlen(fn, aux, "enable_gqa" in params)


def _varlen_device(query: torch.Tensor) -> bool:
    """ATen's FlashAttention 2: fp16/bf16 on CUDA, sm80 or newer."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(query.device) >= (8, 0))


def varlen_shapes(key: torch.Tensor, value: torch.Tensor) -> bool:
    dim = key.shape[-1]
    return value.shape[-1] == dim and dim % 8 == 0 and dim <= VARLEN_MAX_HEAD_DIM


def varlen_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return varlen_function() is not None and _varlen_device(query) and varlen_shapes(key, value)


def _varlen(q, k, v, causal: bool, scale: float | None, lse: bool):
    """One sequence through ``varlen_attn``: ``q`` ``[total_q, heads, d]``, ``k``/``v`` ``[total_k, kv_heads, d]``
    (last dim contiguous; other strides free)."""
    fn = varlen_function()
    bounds = _varlen_bounds(q.shape[0], k.shape[0], q.device)
    kwargs = dict(scale=scale, window_size=(-1, 0) if causal else (-1, -1))
    if fn.takes_gqa and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    if lse:
        kwargs["return_aux"] = fn.aux(lse=True)
    return fn.call(q, k, v, bounds[0], bounds[1], q.shape[0], k.shape[0], **kwargs)


@functools.lru_cache(maxsize=8)
def _varlen_bounds(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` of one sequence, queries ``[0, q_len]`` and keys ``[0, kv_len]`` (int32 ``[2, 2]``): made once per
    shape (every layer of a forward shares it) by a kernel, not copied from the host (a blocking copy to an
    accelerator waits for it)."""
    steps = torch.arange(2, dtype=torch.int32, device=device)
    return torch.stack((steps * q_len, steps * kv_len))


def varlen_verify(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Multi-token attention through ``varlen_attn``: GQA-native, bottom-right causal, no mask tensor, K/V read
    in place (as `attention.flash_verify`). ``query`` ``[1, heads, q, d]``, ``key``/``value`` ``[1, kv_heads, kv,
    d]`` (cached entries, then the q new ones); returns ``[1, q, heads, d]``. No dropout (`attention.fused_route`
    leaves training-mode dropout to flash-attn or SDPA)."""
    out = _varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), True, scaling, False)
    return out.unsqueeze(0), None


def varlen_prefix_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A candidate tree's prefix through ``varlen_attn``: ``query`` ``[heads, m, d]`` over ``keys``/``values``
    ``[kv, c, d]``, not causal, GQA-native; returns `tree_attention.prefix_attention`'s layout ``[1, kv, groups *
    m, d]`` and the fp32 log-sum-exp ``[1, kv, groups * m]`` (read from ``[heads, m]``, or ROCm's ``[1, heads,
    m]``)."""
    heads, m, _ = query.shape
    kv_heads = keys.shape[0]
    out, lse = _varlen(query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), False, scale, True)
    out = out.transpose(0, 1).reshape(kv_heads, heads // kv_heads * m, values.shape[-1])
    lse = lse.reshape(heads, -1)[:, :m].reshape(kv_heads, heads // kv_heads * m)
    return out[None], lse[None].float()


# ------------------------------------------------------------------------------------------------ flex_attention


def _flex_module():
    return _fa


@functools.cache
def _triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def flex_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """FlexAttention taken automatically: CUDA with Triton, head dims from `FLEX_MIN_HEAD_DIM`, one head dim for
    q, k and v (values of another width are untested there), unless an earlier automatic call failed."""
    return (query.is_cuda and _flex_module() is not None and _triton()
            and key.shape[-1] == value.shape[-1] >= FLEX_MIN_HEAD_DIM)


def flex_device(query: torch.Tensor) -> bool:
    """Where a pinned FlexAttention route can run: CUDA (compiled) or the CPU (eagerly: tests)."""
    return _flex_module() is not None and (query.device.type == "cpu" or (query.is_cuda and _triton()))


def _flex_out(q, k, v, block_mask, scale):
    return _fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale)


def _flex_out_lse(q, k, v, block_mask, scale):
    if hasattr(_fa, "AuxRequest"):  # torch >= 2.9; return_lse is deprecated there
        out, aux = _fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                      return_aux=_fa.AuxRequest(lse=True))
        return out, aux.lse
    return _fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_lse=True)


@functools.cache
def _compiled(fn):
    """``torch.compile`` of one of the two calls above (separate code objects: separate specializations; dynamic
    lengths after the first change of length)."""
    return torch.compile(fn)


def _flex(q, k, v, block_mask, scale: float | None, lse: bool):
    """FlexAttention compiled on CUDA (Triton), eager elsewhere (unfused, for tests on the CPU)."""
    fn = _flex_out_lse if lse else _flex_out
    return (_compiled(fn) if q.is_cuda else fn)(q, k, v, block_mask, scale)


@functools.lru_cache(maxsize=8)
def _causal_block_mask(q_len: int, groups: int, kv_len: int, device: torch.device):
    """``groups * q_len`` rows (the query heads of a KV head's group, each ``q_len`` rows) over ``kv_len`` keys,
    bottom-right causal: row ``r`` sees key ``j`` iff ``j <= r % q_len + kv_len - q_len``. Cached: every layer
    of a forward reuses it. The offsets are captured tensors (graph inputs, not constants: a compiled kernel is
    not recompiled as the cache grows)."""
    fa = _flex_module()
    rows, offset = torch.full((), q_len, device=device), torch.full((), kv_len - q_len, device=device)

    def bottom_right_causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx % rows + offset

    return fa.create_block_mask(bottom_right_causal, None, None, groups * q_len, kv_len, device=device)


def _tree_block_mask(visible: torch.Tensor, groups: int, cached: int, device: torch.device, derived: dict):
    """`_build_tree_block_mask`, built once per tree forward: ``derived`` is that forward's own cache
    (`tree_attention.tree_derived`: made with its block, shared by its layers, gone with it)."""
    key = ("flex_tree", groups, cached, device)
    if key not in derived:
        derived[key] = _build_tree_block_mask(visible, groups, cached, device)
    return derived[key]


def _build_tree_block_mask(visible: torch.Tensor, groups: int, cached: int, device: torch.device):
    """``groups * m`` rows over ``cached + m`` keys: every cached entry, then the block as ``visible`` (``[m, m]``
    bool) allows."""
    fa = _flex_module()
    m = visible.shape[0]
    visible = visible.to(device)
    rows, start = torch.tensor(m, device=device), torch.tensor(cached, device=device)
    last = torch.tensor(m - 1, device=device)

    def tree_mask(b, h, q_idx, kv_idx):
        inside = (kv_idx - start).clamp(min=0)
        return (kv_idx < start) | visible[q_idx % rows, torch.minimum(inside, last)]

    return fa.create_block_mask(tree_mask, None, None, groups * m, cached + m, device=device)


def _as_rows(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[1, heads, q, d]`` -> ``[1, kv_heads, groups * q, d]``: a group's query heads as rows of its KV head."""
    batch, heads, q_len, dim = query.shape
    return query.reshape(batch, kv_heads, heads // kv_heads * q_len, dim)


def flex_verify(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Multi-token attention through FlexAttention: bottom-right causal `BlockMask` (no ``[q, kv]`` mask tensor
    in the kernel), the query heads of a group as rows of their KV head (K/V read once per KV head). Shapes as
    `varlen_verify`; values may be narrower than keys."""
    batch, heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    mask = _causal_block_mask(q_len, groups, kv_len, query.device)
    out = _flex(_as_rows(query, kv_heads), key, value, mask, scaling, False)
    return out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def flex_prefix_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A candidate tree's prefix through FlexAttention (no mask), with its log-sum-exp: `varlen_prefix_attention`'s
    shapes and layout."""
    heads, m, dim = query.shape
    kv_heads = keys.shape[0]
    rows = query.reshape(1, kv_heads, heads // kv_heads * m, dim)
    out, lse = _flex(rows, keys[None], values[None], None, scale, True)
    return out, lse.float()


def flex_tree_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                   scale: float, derived: dict | None = None) -> torch.Tensor:
    """A whole tree forward's attention as one FlexAttention call: ``query`` ``[1, heads, m, d]`` over
    ``key``/``value`` ``[1, kv_heads, cached + m, d]``, every row seeing every cached entry and, inside the
    block, what ``visible`` ``[m, m]`` allows. Returns ``[1, m, heads, dv]`` (`tree_attention.tree_sdpa`'s
    result; here without the prefix/block split and its fp32 block). ``derived``: the forward's cache of masks
    built from ``visible`` (None: built for this call alone)."""
    _, heads, m, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    mask = _tree_block_mask(visible, groups, kv_len - m, query.device, {} if derived is None else derived)
    out = _flex(_as_rows(query, kv_heads), key, value, mask, scale, False)
    return out.reshape(1, heads, m, value.shape[-1]).transpose(1, 2).contiguous()
