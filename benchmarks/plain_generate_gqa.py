"""Why plain ``generate`` (a DynamicCache) decodes slower than static-cache ``generate`` on the CPU: its attention.

transformers' SDPA attention (5.24, ``integrations/sdpa_attention.py``) decodes one token of a grouped-query model
in one of two ways. A StaticCache decode passes a mask, so the query heads of each KV group are packed into rows
of their KV head (``pack_gqa``: K and V read once per KV head). A DynamicCache decode passes no mask, so it calls
``scaled_dot_product_attention(..., enable_gqa=True)``, whose CPU kernel is a different path. This times both on
caches of the given length, per layer, with the shapes of SmolLM2-135M and Qwen2.5-Coder-1.5B in fp32 and bf16
(random entries: a decode step's cost does not depend on what the cache holds). Prints JSON.

    python benchmarks/plain_generate_gqa.py --contexts 8000 32000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# name: (query heads, KV heads, head dim, layers)
SHAPES = {"smollm2-135m": (9, 3, 64, 30), "qwen2.5-coder-1.5b": (12, 2, 128, 28)}


def seconds(repeats: int, *inputs, **kwargs) -> float:
    """Median seconds of ``scaled_dot_product_attention(*inputs, **kwargs)`` after a warm-up call."""
    F.scaled_dot_product_attention(*inputs, **kwargs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        F.scaled_dot_product_attention(*inputs, **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 32000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, (heads, kv_heads, dim, layers) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for context in args.contexts:
                query = torch.randn(1, heads, 1, dim).to(dtype)
                keys, values = (torch.randn(1, kv_heads, context, dim).to(dtype) for _ in range(2))
                packed = query.reshape(1, kv_heads, heads // kv_heads, dim)
                gqa = seconds(args.repeats, query, keys, values, enable_gqa=True)
                pack = seconds(args.repeats, packed, keys, values)
                rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), "context": context,
                             "enable_gqa_ms_per_layer": 1e3 * gqa, "packed_ms_per_layer": 1e3 * pack,
                             "ratio": gqa / pack, "extra_ms_per_token": 1e3 * layers * (gqa - pack)})
    print(json.dumps({"threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
