"""A ragged batch's attention row by row on the CPU kernel.

A batched forward on a `RaggedBufferCache` (`forwards.forward.ragged_forward`: Force 3's rows, and the rows of a
Force-2 or Force-1 cache shared in lockstep) feeds row ``b`` ``counts[b]`` real tokens after its ``lengths[b]``
entries, padded with dummies to the widest row; its real query ``i`` sees exactly columns ``[0, lengths[b] + i]``
of its row. That is the bottom-right causal call of batch size 1 over the row's first ``lengths[b] + counts[b]``
columns, which `cpu_attention.attend` computes without a mask. Within `rows_of(lengths, counts)`, `attend_rows`
runs each row as that batch-1 call (views of the shared buffers: nothing is copied), where every row's call is one
the kernel takes and was timed cheaper for (`attention_routes.takes_kernel`, the same choice as the row alone);
otherwise it returns None and the layer takes its masked path for all rows.

Exactness: a row's output is the batch-1 kernel's over the same entries, bit for bit what the row's batch-1 call
computes where that call takes the kernel. Dummy queries and rows without tokens get zeros: their entries are not
written (`RaggedBufferCache.writing`) and their logits not kept, so nothing reads them.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from . import attention_routes, cpu_attention

# per row, (real tokens, columns its real queries see) of the ragged forward running in this context
_ROWS: contextvars.ContextVar[tuple[tuple[int, int], ...] | None] = contextvars.ContextVar("triforce_ragged_rows",
                                                                                          default=None)


@contextlib.contextmanager
def rows_of(lengths: list[int], counts: list[int]):
    """Within: the forward of a ragged batch whose row ``b`` holds ``lengths[b]`` entries and feeds ``counts[b]``
    real tokens (``0``: the row takes no part)."""
    token = _ROWS.set(tuple((count, length + count) for length, count in zip(lengths, counts)))
    try:
        yield
    finally:
        _ROWS.reset(token)


def attend_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float | None) -> torch.Tensor | None:
    """The attention of a ragged forward's layer, row by row on the kernel: ``query`` ``[batch, heads, n, dim]``,
    ``key``/``value`` ``[batch, kv_heads, width, dim]`` (the shared buffers' first ``width`` columns) -> ``[batch, n,
    heads, dim]`` (transformers' layout); None outside `rows_of`, or where a row's call does not take the kernel."""
    rows = _ROWS.get()
    if rows is None or query.device.type != "cpu":
        return None
    if len(rows) != query.shape[0] or key.shape[2] != max(visible for _, visible in rows):
        raise RuntimeError(f"ragged_attention: a forward of {query.shape[0]} rows over {key.shape[2]} columns under "
                           f"rows {rows}")
    calls = [(b, query[b : b + 1, :, :count], key[b : b + 1, :, :visible], value[b : b + 1, :, :visible])
             for b, (count, visible) in enumerate(rows) if count]
    if not calls or not all(attention_routes.takes_kernel(q, k, v) for _, q, k, v in calls):
        return None
    batch, heads, n, dim = query.shape
    out = query.new_zeros(batch, n, heads, dim)
    for b, q, k, v in calls:
        out[b, : q.shape[2]] = cpu_attention.attend(q, k, v, scaling)[0]
    return out
