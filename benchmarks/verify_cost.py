"""Cost of verifying k tokens on a full cache of L tokens vs a one-token decode (SmolLM2-135M shapes).

The KV buffer is filled with random values (attention cost does not depend on them), so 32k contexts
are measured without a 5-minute prefill. Compares transformers' SDPA path (K/V expanded to every query
head whenever a mask is given) with TriForce's GQA-native verification attention, as one SDPA call
(`gqa_sdpa`) and with the cache split across threads (`split_kv_sdpa`, what TriForce takes from
`SPLIT_KV_MIN_CACHED` cached entries on).

    python benchmarks/verify_cost.py --contexts 8192 16384 32768 --tokens 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest.mock import patch

import torch

from hf_triforce import assets
from hf_triforce.caches import BufferCache
from hf_triforce.integration import recording_attention
from hf_triforce.kernels import attention
from hf_triforce_bench import texts


def fill(model, cache: BufferCache, length: int) -> None:
    cfg = model.config
    shape = (1, cfg.num_key_value_heads, length, cfg.head_dim)
    for layer in cache.layers:
        layer.write(torch.randn(shape) * 0.5, torch.randn(shape) * 0.5)


def timed(model, cache, length, k, repeats) -> float:
    ids = torch.randint(0, 1000, (1, k))
    positions = torch.arange(length, length + k)[None]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=k)
        times.append(time.perf_counter() - start)
        cache.rollback(length)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, _ = assets.load_smollm2(**texts.yarn_rope(4.0))
    print(f"| context | decode 1 tok ms | verify {args.tokens} ms (transformers sdpa) | ratio | "
          f"verify {args.tokens} ms (GQA-native, one call) | ratio | verify {args.tokens} ms (split cache) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.contexts:
        cache = BufferCache(model.config.num_hidden_layers, length + args.tokens)
        fill(model, cache, length)
        one = timed(model, cache, length, 1, args.repeats)
        plain = timed(model, cache, length, args.tokens, args.repeats)
        with recording_attention(model):
            with patch.object(attention, "SPLIT_KV_MIN_CACHED", 1 << 40):  # one SDPA call
                native = timed(model, cache, length, args.tokens, args.repeats)
            with patch.object(attention, "SPLIT_KV_MIN_CACHED", 0):  # split cache at every length
                split = timed(model, cache, length, args.tokens, args.repeats)
        print(f"| {length} | {one * 1e3:.0f} | {plain * 1e3:.0f} | {plain / one:.2f}x | {native * 1e3:.0f} | "
              f"{native / one:.2f}x | {split * 1e3:.0f} | {split / one:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
