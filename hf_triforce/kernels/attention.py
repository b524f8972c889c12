"""The paths a TriForce attention call may take, and the recorder of its queries.

`Cache.update` never sees the query, so Force 2's chunk selection gets it from the attention function
(`attention_function`): it records the post-RoPE query of each layer into the `QueryRecorder` passed to the model's
forward as ``triforce_recorder=`` (forward kwargs reach the attention function; one recorder per call, no shared
state), or set for the context (`recording`).

The paths, each GQA-native (K/V read once per KV head): `gqa_sdpa` (masked multi-token SDPA, the query heads of a
group as extra query rows), `split_kv_sdpa` (a few query rows over a long CPU cache, the cache split across threads and
merged by log-sum-exp), `one_row_sdpa` (a decoding step: no mask), and on CUDA the mask-free fused kernels
`fused_route` picks for a multi-token call (flash-attn's `flash_verify` where installed, else torch's own
`native_attention.varlen_verify` in fp16/bf16, else `native_attention.flex_verify`). `aten_attention` is ATen's route
for a bottom-right causal call, which `attention_routes` times against the library's CPU kernel. The ``_wants_*``
predicates say which calls a path may take.

Invariant relied upon (TriForce's caches guarantee it): batch size 1, no padding, and every new token is
appended after all cached entries, so the mask of a multi-token call of a full-attention layer is "all cached
entries, then causal among the new tokens" — bottom-right-aligned causal attention. Batches
(`hf_triforce.decoding.force3.RaggedForce3`) break it — rows of different lengths under a per-row 4-D mask — so
every path that skips the mask (`one_row_sdpa`, `split_kv_sdpa`, `cpu_attention.attend`, the fused routes) requires
batch size 1, and a batch takes `gqa_sdpa`, the model's own attention, or on the CPU each row as its batch-1 call
(`ragged_attention`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from . import native_attention, split_kv

RECORDER_KWARG = "triforce_recorder"
# the recorder of the forward running in this context: reaches the attention function also in models whose
# decoder layers do not pass forward kwargs on to their attention (StableLM)
_ACTIVE_RECORDER: contextvars.ContextVar[QueryRecorder | None] = contextvars.ContextVar("triforce_recorder",
                                                                                       default=None)


class QueryRecorder:
    """Collects the post-RoPE query of each layer during one forward: ``[batch, heads, q_len, head_dim]``.

    Pass it to a forward as ``model(..., triforce_recorder=recorder)`` while the model runs a ``triforce_*``
    attention implementation; each forward overwrites the layers it runs.
    """

    def __init__(self, keep_masks: bool = False) -> None:
        self.queries: dict[int, torch.Tensor] = {}
        # ``keep_masks``: also the attention mask each layer's attention function received (the preflight's probe)
        self.masks: dict[int, torch.Tensor | None] | None = {} if keep_masks else None

    def record(self, layer_idx: int, query: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        self.queries[layer_idx] = query.detach()
        if self.masks is not None:
            self.masks[layer_idx] = attention_mask

    def at(self, position: int) -> dict[int, torch.Tensor]:
        """Query at one position of the recorded forward per layer: ``[batch, heads, head_dim]``."""
        return {layer: q[:, :, position] for layer, q in self.queries.items()}


@contextlib.contextmanager
def recording(recorder: QueryRecorder | None):
    """Record into ``recorder`` during the block (for this context only: no state shared across threads)."""
    token = _ACTIVE_RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE_RECORDER.reset(token)


def gqa_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Multi-token masked SDPA that stays GQA-native: the query heads of a group become extra query rows.

    transformers' SDPA path expands K/V to every query head (``repeat_kv``) whenever a mask is given;
    here ``[b, kv_heads * g, q, d]`` queries are viewed as ``[b, kv_heads, g * q, d]`` and the mask is
    tiled ``g`` times, so K/V are read once per KV head. Returns ``[b, q, heads, dv]`` like transformers (``dv``
    the values' head dim: narrower than the keys' in multi-head latent attention).
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    mask = attention_mask.expand(batch, 1, q_len, attention_mask.shape[-1]).repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, groups * q_len, dim), key, value, attn_mask=mask,
        dropout_p=dropout if module.training else 0.0, scale=scaling,
    )
    return out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


# CPU verification: below this many cached entries one SDPA call is as fast or faster (`split_kv.CPU_MIN_CAPACITY`)
SPLIT_KV_MIN_CACHED = split_kv.CPU_MIN_CAPACITY
SPLIT_KV_MAX_QUERY = 64
_sdpa_with_lse = split_kv.sdpa_with_lse


def split_kv_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Multi-token CPU attention over a long cache, bottom-right causal, GQA-native, split across threads.

    One SDPA call parallelises over (batch, KV heads, query blocks): with 3 KV heads and a few query rows
    that is 3 work items, so 2 threads run at 2/3 occupancy. Here the cached entries are cut into
    ``parts`` equal spans laid along the batch dimension (``parts * kv_heads`` items, strided views, no
    copy); the remainder and the new tokens (causal among themselves) take one small masked call, and
    the partial results are merged exactly by their log-sum-exp. Returns ``[b, q, heads, dv]``. ATen's kernel
    needs values as wide as keys (`_wants_split_kv`).
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = query.reshape(kv_heads, groups * q_len, dim)
    parts = max(2, torch.get_num_threads())
    span = (kv_len - q_len) // parts
    head = parts * span
    attend = _sdpa_with_lse()
    split_keys = key[0, :, :head].unflatten(1, (parts, span)).transpose(0, 1)
    split_values = value[0, :, :head].unflatten(1, (parts, span)).transpose(0, 1)
    out, lse = attend(rows.expand(parts, -1, -1, -1), split_keys, split_values, scale=scaling)[:2]
    tail = kv_len - head
    visible = torch.ones(q_len, tail, dtype=torch.bool, device=query.device).tril(tail - q_len)
    bias = torch.zeros(q_len, tail, dtype=query.dtype, device=query.device).masked_fill_(~visible, float("-inf"))
    tail_out, tail_lse = attend(rows[None], key[:, :, head:], value[:, :, head:],
                                attn_mask=bias.repeat(groups, 1), scale=scaling)[:2]
    merged = split_kv.merge_by_lse(torch.cat((out, tail_out)), torch.cat((lse, tail_lse)))
    return merged.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def one_row_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One new query row over the whole cache (a decoding step): it sees every entry, so no mask; the query
    heads of a GQA group become rows of one KV head (K/V read once). On CPU, 1.8x cheaper than SDPA with
    ``enable_gqa`` at 8k cached entries and 1.9x at 32k (SmolLM2 shapes, 2 threads); not split across threads
    (`_split_pays`: a row's merge costs more than it balances). Returns ``[b, 1, heads, dv]`` (``dv`` the values'
    head dim)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, heads // kv_heads, dim), key, value,
        dropout_p=dropout if module.training else 0.0, scale=scaling,
    )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


@functools.cache
def flash_varlen():
    """flash-attn's ``flash_attn_varlen_func``, or None where it is not installed (CPU installs never need it)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def flash_verify(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Multi-token attention through flash-attn's varlen kernel: GQA-native, bottom-right causal, no mask tensor.

    ``query`` is ``[1, heads, q, d]``, ``key``/``value`` ``[1, kv_heads, kv, d]`` (cached entries, then the q
    new ones), read in place from the cache's buffers (varlen takes ``[tokens, heads, d]`` views, one sequence
    bounded by ``cu_seqlens``); returns ``[1, q, heads, d]`` like transformers' attention functions. flash-attn 2
    needs values as wide as keys (`fused_route`).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    bounds = torch.tensor([[0, q_len], [0, kv_len]], dtype=torch.int32, device=query.device)
    out = flash_varlen()(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        cu_seqlens_q=bounds[0], cu_seqlens_k=bounds[1], max_seqlen_q=q_len, max_seqlen_k=kv_len,
        dropout_p=dropout if module.training else 0.0, softmax_scale=scaling, causal=True,
    )
    return out.unsqueeze(0), None


def _flash_device(query: torch.Tensor) -> bool:
    """flash-attn runs fp16/bf16 on CUDA."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def same_head_dims(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Keys and values of the same head dim: what flash-attn 2 and ATen's CPU flash kernel take (multi-head latent
    attention has narrower values, DeepSeek-V3 128 against 192: those calls take SDPA or a matmul)."""
    return key.shape[-1] == value.shape[-1]


def mask_adds_bias(attention_mask) -> bool:
    """Whether ``attention_mask`` does more than mask: a float mask holding a finite value other than 0 above half the
    dtype's minimum (eager masks hold 0 and the minimum; ALiBi Falcon adds its per-key position bias to its mask,
    through transformers' AttentionInterface from 5.25). Boolean masks, None and FlexAttention's BlockMask only
    mask. A float mask is read whole, each call (a device sync on CUDA)."""
    if not isinstance(attention_mask, torch.Tensor) or not attention_mask.is_floating_point():
        return False
    lowest = torch.finfo(attention_mask.dtype).min / 2
    return bool(((attention_mask != 0) & (attention_mask > lowest)).any())


def _plain_masked(attention_mask, kwargs) -> bool:
    """Nothing but scaled attention under a mask transformers' SDPA masks build (boolean, or None): what every
    path that does not read the mask takes."""
    return (
        (attention_mask is None or attention_mask.dtype == torch.bool)
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and kwargs.get("sliding_window") is None
        and not kwargs.get("output_attentions", False)
    )


def _wants_fused(query, attention_mask, kwargs) -> bool:
    """A call a mask-free fused route may take: batch 1, several new rows, nothing but plain scaled attention. The
    mask must be one transformers' SDPA masks build (boolean, or None): a float mask under SDPA was changed by the
    model after it was built (ALiBi Falcon adds its position bias to it, transformers 5.25), and a mask-free route
    would drop what it added."""
    return query.shape[0] == 1 and query.shape[2] > 1 and _plain_masked(attention_mask, kwargs)


def fused_route(query, key, value, dropout: bool = False) -> str | None:
    """The fused kernel for a batch-1 multi-token call of a full-attention layer (verification, chunked prefill,
    a candidate tree's cached prefix), or None for the masked SDPA / matmul path. In order (reasons in
    `native_attention`'s header): flash-attn where installed (CUDA fp16/bf16), torch's ``varlen_attn`` (CUDA
    fp16/bf16), FlexAttention (CUDA: what varlen cannot take, fp32 included). ``dropout``: attention dropout
    in training mode, which only flash-attn applies. A route pinned by `native_attention.force_route` is
    returned as is where the call has one head dim for q, k and v (else None), or raises where it cannot run."""
    forced = native_attention.forced_route()
    if forced is not None:
        if forced == "sdpa" or not same_head_dims(key, value):
            return None
        runs = {"flash_attn": lambda: _flash_device(query) and flash_varlen() is not None,
                "varlen": lambda: native_attention.varlen_runs(query, key, value),
                "flex": lambda: native_attention.flex_device(query),
                "flex_tree": lambda: native_attention.flex_device(query)}[forced]
        if not runs():
            raise ValueError(f"attention route {forced!r} cannot run a {query.dtype} call on {query.device} with head "
                             f"dim {key.shape[-1]} here (flash_attn: flash-attn installed, CUDA fp16/bf16; varlen: "
                             "torch's varlen_attn, CUDA sm80+ fp16/bf16, head dim a multiple of 8 up to 256; flex: "
                             "FlexAttention on the CPU or on CUDA with Triton)")
        return forced
    if not same_head_dims(key, value):
        return None
    if _flash_device(query) and flash_varlen() is not None:
        return "flash_attn"
    if dropout:
        return None
    if native_attention.varlen_runs(query, key, value):
        return "varlen"
    if native_attention.flex_runs(query, key, value):
        return "flex"
    return None


def fused_verify(module, query, key, value, attention_mask, **kwargs):
    """`flash_verify`, `native_attention.varlen_verify` or `native_attention.flex_verify` as `fused_route`
    chooses; None where it chooses none (or an automatic FlexAttention call failed): the caller goes on."""
    dropout = bool(kwargs.get("dropout")) and module.training
    route = fused_route(query, key, value, dropout)
    if route == "flash_attn":
        return flash_verify(module, query, key, value, attention_mask, **kwargs)
    if route == "varlen":
        return native_attention.varlen_verify(module, query, key, value, attention_mask, **kwargs)
    if route in ("flex", "flex_tree"):
        return native_attention.flex_verify(module, query, key, value, attention_mask, **kwargs)
    return None


def _wants_gqa_sdpa(base: str, query, key, attention_mask, kwargs) -> bool:
    return (
        base == "sdpa"
        and query.shape[2] > 1
        and key.shape[1] < query.shape[1]
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.bool
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )


def _wants_one_row(base: str, query, attention_mask, kwargs) -> bool:
    return (
        base == "sdpa"
        and query.device.type in ("cpu", "cuda")
        and query.shape[0] == 1
        and query.shape[2] == 1
        and _plain_masked(attention_mask, kwargs)
    )


def _split_pays(query, key) -> bool:
    """Where splitting the cache across threads pays (`split_kv_sdpa`): several query rows, and KV heads that do not
    divide among the threads (`split_kv.cpu_split_pays`); one row's merge outweighs the balance (docs/experiments.md,
    "Verification attention: GQA-native, split across threads only where it pays")."""
    return query.shape[2] > 1 and split_kv.cpu_split_pays(key.shape[1], torch.get_num_threads())


def _wants_split_kv(query, key, value, dropout, module) -> bool:
    cached = key.shape[2] - query.shape[2]
    return (
        query.device.type == "cpu"
        and _split_pays(query, key)
        and same_head_dims(key, value)
        and query.shape[0] == 1  # batches (`force3.RaggedForce3`) carry per-row masks that only gqa_sdpa reads
        and query.shape[2] <= SPLIT_KV_MAX_QUERY
        and cached >= max(SPLIT_KV_MIN_CACHED, 16 * max(2, torch.get_num_threads()))
        and not (dropout and module.training)
        and _sdpa_with_lse() is not None
    )


_INFERENCE = torch.nn.Module().eval()  # a module in eval mode: the routes below read ``module.training``


def aten_attention(query, key, value, scaling=None) -> torch.Tensor:
    """ATen's route for a bottom-right causal call of a few new rows of a full-attention layer, batch 1: what the
    wrapper runs where the CPU kernel does not take the call. ``query`` ``[1, heads, new, dim]``, ``key``/``value``
    ``[1, kv_heads, kv_len, dim]`` (the last ``new`` entries the new tokens); returns ``[1, new, heads, dim]``.
    `one_row_sdpa` for one row; else `split_kv_sdpa` where it pays (`_wants_split_kv`), else `gqa_sdpa`."""
    new, kv_len = query.shape[2], key.shape[2]
    if new == 1:
        return one_row_sdpa(_INFERENCE, query, key, value, None, scaling=scaling)[0]
    if _wants_split_kv(query, key, value, 0.0, _INFERENCE):
        return split_kv_sdpa(_INFERENCE, query, key, value, None, scaling=scaling)[0]
    mask = torch.ones(1, 1, new, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - new)
    return gqa_sdpa(_INFERENCE, query, key, value, mask, scaling=scaling)[0]
