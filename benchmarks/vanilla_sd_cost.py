"""Per-forward costs of vanilla speculative decoding at a long context, without prefilling it: a draft model's
one-row decode step and the target's verification of ``rows`` rows, each on a StaticCache of ``--context`` entries.

The cost of a decoding forward does not depend on what its cache holds (the same bytes are read and the same dot
products computed), so the caches are left as allocated and the forwards are fed at position ``--context``: the
draft's step is what HF assisted generation pays per drafted token once its own full cache holds the prompt (the
design's "the draft's cache grows with the context"), minutes of prefill saved per point. With measured acceptance
(HF assisted generation at shorter contexts, `hf-triforce bench`) the usual expected-tokens arithmetic gives vanilla
speculative decoding's tokens/s there (`--acceptance`, `--gamma`). Prints JSON.

    python benchmarks/vanilla_sd_cost.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --context 32000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import StaticCache

from hf_triforce.decoding.policy import expected_tokens
from hf_triforce.tools import assets


@torch.no_grad()
def forward_seconds(model, context: int, rows: int, repeats: int) -> float:
    """Median seconds of a ``rows``-row forward at positions ``context..`` on a StaticCache of ``context + rows``."""
    cache = StaticCache(config=model.config, max_cache_len=context + rows)
    ids = torch.full((1, rows), 100, dtype=torch.long)
    positions = torch.arange(context, context + rows)
    seconds = []
    for _ in range(repeats + 1):  # the first call warms up (allocations), not counted
        began = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=32000)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gamma", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6],
                        help="drafted tokens per verification to price")
    parser.add_argument("--acceptance", type=float, default=None,
                        help="per-token acceptance of the draft by the target (measured elsewhere)")
    args = parser.parse_args()
    if args.context < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--context, --repeats and --threads must be positive")
    if args.acceptance is not None and not 0 <= args.acceptance <= 1:
        parser.error(f"--acceptance must be in [0, 1], got {args.acceptance}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, _ = assets.load_model(args.target, dtype=dtype)
    draft, _ = assets.load_model(args.draft, dtype=dtype)
    result = {"context": args.context, "dtype": args.dtype, "target": args.target, "draft": args.draft,
              "draft_step": forward_seconds(draft, args.context, 1, args.repeats),
              "target_rows": {rows: forward_seconds(target, args.context, rows, args.repeats)
                              for rows in [1] + [g + 1 for g in args.gamma]}}
    if args.acceptance is not None:
        plain = result["target_rows"][1]
        result["acceptance"] = args.acceptance
        result["vanilla_vs_plain_step"] = {
            gamma: expected_tokens(args.acceptance, gamma) * plain
            / (gamma * result["draft_step"] + result["target_rows"][gamma + 1]) for gamma in args.gamma}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
