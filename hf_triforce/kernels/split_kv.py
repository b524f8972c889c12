"""Split-KV (FlashDecoding) attention: a few query rows over a long cache buffer, the buffer cut into spans.

One attention call parallelises over (batch, KV heads, query blocks), so a verification's few query rows over a long
cache make few work items (8 KV heads and 28 rows are 8 thread blocks on a 132-SM GPU; 3 KV heads are 3 work items
for 2 CPU threads). `split_kv_attention` cuts the buffer into ``parts`` equal spans laid along the batch dimension
(strided views, no copy), runs one call of a kernel that also returns each row's log-sum-exp, and merges the spans
exactly by it (`merge_by_lse`). The span length is a multiple of `SPAN_ALIGN`; the entries past ``parts`` spans take
one more call, which always runs. Every shape is fixed by the query's and the buffer's, so the function traces under
``torch.compile(fullgraph=True)`` and in a CUDA graph capture.

`split_parts` says how many spans pay on a device (on CUDA two thread blocks per SM, spans of at least `MIN_SPAN`;
on the CPU a span per thread where the KV heads alone leave threads idle), or 1 where one masked call is as fast.

Kernels: CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (an additive mask in the query's dtype; a row that
sees nothing comes back as 0 with log-sum-exp 0), CUDA ``aten._scaled_dot_product_efficient_attention`` with
``compute_log_sumexp=True`` (a 4-D bias in the query's dtype, last dim contiguous, other strides multiples of 8
elements; the log-sum-exp padded to a multiple of 32 rows). Neither kernel's log-sum-exp of a fully masked row is
trusted: the merge gives such a span weight exactly 0 from the mask itself (`SplitKVMask.seen`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# CUDA's memory-efficient kernel reads its bias in 16-byte vectors: every span starts, and the bias's rows are
# laid, at a multiple of 8 elements (8 bf16/fp16 values; a multiple of the 4 fp32 ones)
SPAN_ALIGN = 8
# CUDA: spans no shorter than this (each span's partial output and its merge cost as much as ~MIN_SPAN entries)
MIN_SPAN = 512
# CUDA: split buffers from this capacity on (below it one call's few blocks read the buffer about as fast)
CUDA_MIN_CAPACITY = 8192
# CUDA: thread blocks to aim for per SM (two resident blocks per SM hide each other's memory latency)
BLOCKS_PER_SM = 2
MAX_PARTS = 128
# CPU: split buffers from this capacity on (docs/experiments.md, "Verification attention: GQA-native, split ...")
CPU_MIN_CAPACITY = 8192


# CUDA's memory-efficient attention, which returns each row's log-sum-exp (compute_log_sumexp=True) and takes a bias
EFFICIENT_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)


def sdpa_with_lse():
    """ATen's CPU flash attention returning ``(out, logsumexp)``; None where this torch lacks it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def merge_by_lse(out: torch.Tensor, lse: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The exact softmax-weighted merge of partial attention results over disjoint sets of entries.

    ``out`` ``[spans, ..., rows, dv]``: each span's attention output (any dtype); ``lse`` ``[spans, ..., rows]``:
    its log-sum-exp (fp32); ``seen`` (bool, broadcastable to ``lse``): whether the row sees any entry of the
    span -- a span it does not see gets weight exactly 0 whatever its kernel returned for it (NaN, 0 or a finite
    log-sum-exp). Returns ``[..., rows, dv]`` in ``out``'s dtype, accumulated in fp32; a row that sees no entry
    of any span gets 0.
    """
    if seen is not None:
        lse = lse.masked_fill(~seen, float("-inf"))
    top = lse.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows that see nothing: no -inf - -inf
    weights = torch.exp(lse - top).unsqueeze(-1)  # the largest is exactly 1 where a row sees anything
    parts = torch.where(weights > 0, out.float(), torch.zeros((), dtype=torch.float32, device=out.device))
    total = weights.sum(0).clamp_min(1.0)  # >= 1 exactly where a row sees anything; 0 -> 1 leaves 0 / 1
    return ((parts * weights).sum(0) / total).to(out.dtype)


@torch.compiler.assume_constant_result
def _processors(device: torch.device) -> int:
    """What runs a call's work items in parallel: the SMs of a CUDA device, the threads of the CPU (read once
    while tracing: a compiled graph keeps the value it was traced with)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def split_parts(kv_heads: int, rows: int, capacity: int, device: torch.device | str,
                processors: int | None = None, head_dim: int = 128) -> int:
    """How many spans `split_kv_attention` cuts a ``capacity``-entry buffer into for ``rows`` query rows per KV
    head (a GQA group's query heads times the new tokens); 1: one masked call pays as well.

    ``processors``: SMs (CUDA) or threads (CPU); by default the device's. ``head_dim``: the values' head dim (CUDA's
    kernel takes 64 query rows per block up to 64, else 32). The capacity is only compared with thresholds, so a
    capacity compiled as a dynamic dimension (Force 3's cache, whose capacity changes between calls) keeps one graph
    per range of capacities.

    * CUDA: from `CUDA_MIN_CAPACITY` entries, while one call's blocks (``kv_heads`` times its query blocks) fill
      fewer than 80% of the SMs: enough spans for `BLOCKS_PER_SM` blocks per SM (at most `MAX_PARTS`), halved
      until each span holds at least `MIN_SPAN` entries;
    * CPU: one span per thread (at least 2) from `CPU_MIN_CAPACITY` entries, when the KV heads do not divide among
      the threads (`cpu_split_pays`).
    """
    device = torch.device(device)
    if processors is None:
        processors = _processors(device)
    if device.type == "cuda":
        blocks = kv_heads * -(-rows // (64 if head_dim <= 64 else 32))
        if capacity < CUDA_MIN_CAPACITY or blocks >= 0.8 * processors:
            return 1
        parts = min(-(-BLOCKS_PER_SM * processors // blocks), MAX_PARTS)
        while parts > 1 and parts * MIN_SPAN > capacity:  # comparisons only: a symbolic capacity stays symbolic
            parts //= 2
        return parts
    threads = max(2, processors)
    if capacity < max(CPU_MIN_CAPACITY, 16 * threads) or not cpu_split_pays(kv_heads, processors):
        return 1
    return threads


def cpu_split_pays(kv_heads: int, threads: int) -> bool:
    """Whether cutting a long cache across CPU threads can pay: KV heads that do not divide among the threads (ATen's
    kernel runs one work item per KV head and block of query rows, so 3 KV heads keep 2 threads 2/3 busy; elsewhere
    the split costs more than one call: docs/experiments.md, "Verification attention: GQA-native, split across threads
    only where it pays")."""
    return threads > 1 and kv_heads % threads != 0


class SplitKVMask(NamedTuple):
    """What `split_kv_attention` reads of a visibility mask, made once per forward by `split_kv_mask` and shared by
    every layer: ``bias`` ``[rows, capacity]`` (0 / -inf in the attention's dtype; its rows laid `SPAN_ALIGN`
    apart), ``seen`` ``[spans, 1, rows]`` bool (whether a row sees any entry of each span), ``parts``."""

    bias: torch.Tensor
    seen: torch.Tensor
    parts: int


def _span(capacity: int, parts: int) -> int:
    """The entries of each of ``parts`` spans: a multiple of `SPAN_ALIGN`, leaving at least one entry past the
    spans (the remainder's call always runs: a symbolic capacity needs no guard on whether it divides)."""
    return (capacity - 1) // parts // SPAN_ALIGN * SPAN_ALIGN


def split_kv_mask(visible: torch.Tensor, parts: int, dtype: torch.dtype) -> SplitKVMask:
    """`SplitKVMask` of ``visible`` (bool ``[rows, capacity]``, or with leading dims of size 1) for ``parts`` spans
    in the attention's ``dtype``."""
    if visible.dtype != torch.bool:
        raise ValueError(f"split_kv_mask: visible must be a bool tensor, got {visible.dtype}")
    visible = visible.reshape(visible.shape[-2:])
    rows, capacity = visible.shape
    span = _span(capacity, parts)
    if parts < 1 or span < 1:
        raise ValueError(f"split_kv_attention: parts must be between 1 and (capacity - 1) / {SPAN_ALIGN} "
                         f"({(capacity - 1) // SPAN_ALIGN} here), got {parts}")
    head = parts * span
    # the bias's rows laid SPAN_ALIGN apart: a view of a tensor padded to a multiple of SPAN_ALIGN entries
    padded = (capacity + SPAN_ALIGN - 1) // SPAN_ALIGN * SPAN_ALIGN
    bias = torch.full((rows, padded), float("-inf"), dtype=dtype, device=visible.device)[:, :capacity]
    bias.masked_fill_(visible, 0.0)
    seen = visible[:, :head].unflatten(1, (parts, span)).any(-1).T  # [parts, rows]
    seen = torch.cat((seen, visible[:, head:].any(-1)[None]))  # and the remainder
    return SplitKVMask(bias, seen[:, None], parts)


def _attend_with_lse(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One call returning ``(out [b, kv, rows, dv], lse [b, kv, rows] fp32)``; ``bias`` ``[b, kv, rows, keys]``."""
    if query.device.type == "cuda":
        out, lse = EFFICIENT_WITH_LSE(query, keys, values, bias, True, scale=scale)[:2]
        return out, lse[..., : query.shape[2]]  # padded to a multiple of 32 rows
    out, lse = sdpa_with_lse()(query, keys, values, attn_mask=bias, scale=scale)
    return out, lse.float()


def split_kv_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       visible: torch.Tensor | SplitKVMask, scale: float, parts: int) -> torch.Tensor:
    """Masked attention of a few rows over whole cache buffers, the buffers cut into ``parts`` spans.

    ``query`` ``[1, kv_heads, rows, d]`` (a GQA group's query heads laid out as rows of their KV head); ``keys`` /
    ``values`` ``[1, kv_heads, capacity, d | dv]`` (whole buffers, read in place); ``visible``: bool ``[rows,
    capacity]`` (or with leading dims of size 1) or the `SplitKVMask` `split_kv_mask` made of it for these
    ``parts`` and the query's dtype (once per forward, shared by the layers). Returns ``[1, kv_heads, rows, dv]`` in
    the query's dtype: what one masked SDPA call returns, up to rounding (the merge is exact; a row that sees no
    entry gets 0). CPU and CUDA; keys and values of one head dim on the CPU (ATen's flash kernel).
    """
    if query.device.type not in ("cpu", "cuda"):
        raise ValueError(f"split_kv_attention runs on the CPU or CUDA, got a query on {query.device}")
    mask = visible if isinstance(visible, SplitKVMask) else split_kv_mask(visible, parts, query.dtype)
    if mask.parts != parts:
        raise ValueError(f"split_kv_attention: the mask was made for {mask.parts} parts, called with {parts}")
    _, kv_heads, rows, _ = query.shape
    capacity = keys.shape[2]
    span = _span(capacity, parts)
    head = parts * span
    split_keys = keys[0, :, :head].unflatten(1, (parts, span)).transpose(0, 1)  # [parts, kv, span, d]
    split_values = values[0, :, :head].unflatten(1, (parts, span)).transpose(0, 1)
    bias = mask.bias[:, :head].unflatten(1, (parts, span)).transpose(0, 1)[:, None]  # [parts, 1, rows, span]
    out, lse = _attend_with_lse(query.expand(parts, -1, -1, -1), split_keys, split_values,
                                bias.expand(parts, kv_heads, rows, span), scale)
    tail = capacity - head
    tail_bias = mask.bias[None, None, :, head:].expand(1, kv_heads, rows, tail)
    tail_out, tail_lse = _attend_with_lse(query, keys[:, :, head:], values[:, :, head:], tail_bias, scale)
    out, lse = torch.cat((out, tail_out)), torch.cat((lse, tail_lse))
    return merge_by_lse(out, lse, mask.seen)[None]

