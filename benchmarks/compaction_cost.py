"""What a compaction step would cost per batched step (per-row lengths vs compaction).

Compaction: after a step in which the rows accepted different numbers of tokens, realign them so that they
end at the same column again (each row's entries shifted right by its difference to the longest row: one copy
of its whole cache), so that the next forward needs no per-row lengths. Per-row lengths (what
`hf_triforce.caches.ragged` does) move no data: a row's rollback is its length. SmolLM2-135M's cache shapes
(30 layers, 3 KV heads of 64), fp32, random entries; accepted counts drawn from 0..gamma2.

    python benchmarks/compaction_cost.py --context 16000 --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--gamma2", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers, heads, dim, context = 30, 3, 64, args.context
    shape = (args.batch, heads, context + args.gamma2 + 1, dim)
    keys = [torch.randn(shape) for _ in range(layers)]
    values = [torch.randn(shape) for _ in range(layers)]
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(args.steps):
        accepted = torch.randint(0, args.gamma2 + 1, (args.batch,), generator=generator).tolist()
        shifts = [max(accepted) - count for count in accepted]
        start = time.perf_counter()
        for layer_keys, layer_values in zip(keys, values):
            for row, shift in enumerate(shifts):
                if shift:
                    layer_keys[row, :, shift:context] = layer_keys[row, :, : context - shift].clone()
                    layer_values[row, :, shift:context] = layer_values[row, :, : context - shift].clone()
        seconds.append(time.perf_counter() - start)
    print(f"compaction at {context} x {args.batch}: median {statistics.median(seconds):.3f} s per step "
          f"({args.steps} steps); per-row lengths: no copy")


if __name__ == "__main__":
    main()
