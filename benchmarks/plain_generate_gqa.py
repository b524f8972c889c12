"""Why plain ``generate`` (a DynamicCache) decodes slower than static-cache ``generate`` on the CPU: what it adds.

transformers' SDPA attention (5.24, ``integrations/sdpa_attention.py``) decodes one token of a grouped-query model
in one of two ways. A StaticCache decode passes a mask, so the query heads of each KV group are packed into rows
of their KV head (``pack_gqa``: K and V read once per KV head). A DynamicCache decode passes no mask, so it calls
``scaled_dot_product_attention(..., enable_gqa=True)``, whose CPU kernel is a different path. A DynamicCache also
grows by ``torch.cat`` (``DynamicLayer.update``): every step copies every layer's keys and values into new tensors.

This times, for one decoded token (every layer, each with its own cache tensors, as a decode reads them: a layer's
entries do not stay in the L3 cache from one timing to the next), with the shapes of SmolLM2-135M and
Qwen2.5-Coder-1.5B in fp32 and bf16 (random entries: a step's cost does not depend on what the cache holds):

- ``packed``: the static decode's attention (the packed query over K/V);
- ``enable_gqa``: plain ``generate``'s attention;
- ``cat``: DynamicCache's update (keys and values of every layer replaced by their concatenation with one new entry,
  the old tensors freed, step after step: a one-off concatenation whose result is dropped pays page faults that
  this steady replacement does not, 3-10x in fp32 here).

``benchmarks/project_calibration.py`` fits the projection's ``gqa_attention_flops`` and ``copy_bandwidth``
(`hf_triforce_bench.roofline.Device`) on these. Prints JSON (``--out`` also writes it).

    python benchmarks/plain_generate_gqa.py --contexts 2000 8000 16000 32000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# name: (query heads, KV heads, head dim, layers)
SHAPES = {"smollm2-135m": (9, 3, 64, 30), "qwen2.5-coder-1.5b": (12, 2, 128, 28)}


def seconds(repeats: int, step) -> float:
    """Least seconds of ``step()`` over ``repeats`` calls after a warm-up call (the least: the CPU here is shared with
    other work, which only ever adds time)."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def time_token(heads: int, kv_heads: int, dim: int, layers: int, dtype: torch.dtype, context: int,
               repeats: int) -> dict[str, float]:
    """Seconds of one token's ``packed`` / ``enable_gqa`` attention and ``cat`` update over ``layers`` caches."""
    query = torch.randn(1, heads, 1, dim).to(dtype)
    packed = query.reshape(1, kv_heads, heads // kv_heads, dim)
    new = torch.randn(1, kv_heads, 1, dim).to(dtype)
    cache = [[torch.randn(1, kv_heads, context, dim).to(dtype) for _ in range(2)] for _ in range(layers)]

    def attend(q, **kwargs):
        for keys, values in cache:
            F.scaled_dot_product_attention(q, keys, values, **kwargs)

    def grow():  # as DynamicLayer.update: each layer's tensors replaced by one entry longer (the old ones freed)
        for layer in cache:
            layer[0], layer[1] = torch.cat((layer[0], new), dim=-2), torch.cat((layer[1], new), dim=-2)

    return {"packed": seconds(repeats, lambda: attend(packed)),
            "enable_gqa": seconds(repeats, lambda: attend(query, enable_gqa=True)),
            "cat": seconds(repeats, grow)}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2000, 8000, 16000, 32000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, (heads, kv_heads, dim, layers) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for context in args.contexts:
                timed = time_token(heads, kv_heads, dim, layers, dtype, context, args.repeats)
                rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), "context": context,
                             "layers": layers, **{f"{k}_ms_per_token": 1e3 * v for k, v in timed.items()},
                             "enable_gqa_over_packed": timed["enable_gqa"] / timed["packed"]})
                print(json.dumps(rows[-1]), flush=True)
    out = json.dumps({"threads": args.threads, "repeats": args.repeats, "rows": rows}, indent=1)
    print(out)
    if args.out is not None:
        args.out.write_text(out + "\n")


if __name__ == "__main__":
    main()
