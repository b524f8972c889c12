"""When does splitting a long cache across CPU threads pay (`kernels.attention._split_pays`)?

Times `attention.split_kv_sdpa` (the cached entries cut into one span per thread along the batch dimension, merged
by log-sum-exp) against one call of ATen's CPU flash kernel over the whole cache (bottom-right causal among the new
rows), for 1-7 query rows at 8k-32k cached entries, on random K/V (the cost does not depend on the values), for
SmolLM2-135M's attention shape (3 KV heads of 64, fp32) and Qwen2.5-Coder-1.5B's (2 KV heads of 128, bf16).
The two routes alternate within each setting; medians of ``--repeats``.

``--buffer``: the fixed-shape forward's attention instead (`LeanModel.fixed_shape_layers`: the new rows over a
whole cache buffer, entries past each row's own masked out), `split_kv.split_kv_attention` with
`split_kv.split_parts` spans (at least 2) against one masked SDPA call; the mask made once, outside the timing,
as the forward makes it once for all its layers. ``--rows`` counts new tokens; each is a group's query heads.

    python benchmarks/split_kv_cost.py --threads 2
    python benchmarks/split_kv_cost.py --threads 2 --buffer --rows 1 2 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from hf_triforce.kernels import attention, split_kv

SHAPES = {"smollm2-135m": (3, 3, 64, torch.float32), "qwen2.5-coder-1.5b": (2, 6, 128, torch.bfloat16)}


def one_call(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The whole cache in one flash call, GQA-native (a group's query heads as rows of its KV head)."""
    _, heads, rows, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    if rows == 1:
        return torch.nn.functional.scaled_dot_product_attention(query.reshape(1, kv_heads, groups, dim), keys, values,
                                                                scale=0.1)
    visible = torch.ones(rows, length, dtype=torch.bool).tril(length - rows)
    bias = torch.zeros(rows, length, dtype=query.dtype).masked_fill_(~visible, float("-inf"))
    return attention._sdpa_with_lse()(query.reshape(1, kv_heads, groups * rows, dim), keys, values,
                                      attn_mask=bias.repeat(groups, 1), scale=0.1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 7])
    parser.add_argument("--buffer", action="store_true", help="the fixed-shape forward's masked whole-buffer attention")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.buffer:
        return buffer_costs(args)
    module = nn.Module().eval()
    for name, (kv_heads, groups, dim, dtype) in SHAPES.items():
        for length in args.lengths:
            keys = torch.randn(1, kv_heads, length, dim, dtype=dtype)
            values = torch.randn_like(keys)
            for rows in args.rows:
                query = torch.randn(1, kv_heads * groups, rows, dim, dtype=dtype)
                routes = {"one call": one_call,
                          "split": lambda q, k, v: attention.split_kv_sdpa(module, q, k, v, None, scaling=0.1)}
                seconds: dict[str, list[float]] = {route: [] for route in routes}
                for _ in range(args.repeats):
                    for route, run in routes.items():
                        began = time.perf_counter()
                        run(query, keys, values)
                        seconds[route].append(time.perf_counter() - began)
                one, split = (statistics.median(seconds[route]) * 1e3 for route in routes)
                print(f"{name} {length} cached, {rows} rows: one call {one:.2f} ms, split {split:.2f} ms "
                      f"({split / one:.2f}x)", flush=True)


def buffer_costs(args) -> None:
    """`split_kv.split_kv_attention` against one masked SDPA call over a whole buffer (`--buffer`)."""
    for name, (kv_heads, groups, dim, dtype) in SHAPES.items():
        for length in args.lengths:
            keys = torch.randn(1, kv_heads, length, dim, dtype=dtype)
            values = torch.randn_like(keys)
            for tokens in args.rows:
                rows = groups * tokens
                query = torch.randn(1, kv_heads, rows, dim, dtype=dtype)
                write = torch.arange(length - 64 - tokens, length - 64)  # the last 64 entries are stale, masked
                visible = (torch.arange(length)[None] <= write[:, None]).repeat(groups, 1)
                parts = max(2, split_kv.split_parts(kv_heads, rows, length, "cpu"))
                mask = split_kv.split_kv_mask(visible, parts, dtype)
                args_ = (query, keys, values)
                routes = {"one call": lambda a=args_, v=visible: torch.nn.functional.scaled_dot_product_attention(
                              *a, attn_mask=v, scale=0.1),
                          "split": lambda a=args_, m=mask, p=parts: split_kv.split_kv_attention(*a, m, 0.1, p)}
                seconds: dict[str, list[float]] = {route: [] for route in routes}
                for _ in range(args.repeats):
                    for route, run in routes.items():
                        began = time.perf_counter()
                        run()
                        seconds[route].append(time.perf_counter() - began)
                one, split = (statistics.median(seconds[route]) * 1e3 for route in routes)
                fastest = {route: min(seconds[route]) * 1e3 for route in routes}
                print(f"{name} buffer {length}, {tokens} tokens ({rows} rows), {parts} spans: one call {one:.2f} ms, "
                      f"split {split:.2f} ms ({split / one:.2f}x); fastest {fastest['one call']:.2f} / "
                      f"{fastest['split']:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
