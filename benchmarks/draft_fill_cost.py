"""What a draft model's Force-1 cache costs to fill, by its lean drafting copy and by its own weights.

A draft model cannot copy the target's entries, so its first use in a call fills its sink + window cache (1040
rows with the default window) by a forward. `ModelDrafter` runs that fill by the draft model's own weights and drafts
by its lean copy (`hf_triforce/drafters/model.py`); this times both ways of filling, and one drafted token, on a
prompt of ``--context`` tokens of the bundled Python source. Prints JSON.

    python benchmarks/draft_fill_cost.py --draft qwen2.5-coder-0.5b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LogitsProcessorList

from hf_triforce import assets
from hf_triforce.config import TriForceConfig
from hf_triforce.decoding.tiers import resolve_draft_precision, tier_model
from hf_triforce.drafters.model import ModelDrafter
from hf_triforce_bench import texts


@torch.no_grad()
def timed_fill(drafting, fill_model, prompt: torch.Tensor, config: TriForceConfig, repeats: int) -> dict:
    """Median seconds of a fresh drafter's fill, and of one drafted token after it."""
    fills, drafts = [], []
    for _ in range(repeats + 1):  # the first round warms up (allocations, kernel packing), not counted
        drafter = ModelDrafter(drafting, config.sink_tokens, config.window, LogitsProcessorList(), False, None,
                               positions="absolute", fill_model=fill_model)
        began = time.perf_counter()
        drafter.prefill(prompt)
        fills.append(time.perf_counter() - began)
        began = time.perf_counter()
        drafter.propose(prompt, 1)
        drafts.append(time.perf_counter() - began)
    return {"fill_seconds": statistics.median(fills[1:]), "drafted_token_seconds": statistics.median(drafts[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if min(args.context, args.threads, args.repeats) < 1:
        parser.error("--context, --threads and --repeats must be positive")
    torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_model(args.draft, dtype=getattr(torch, args.dtype))
    model.eval()
    config, why = resolve_draft_precision(TriForceConfig(), model)  # the default's drafting precision here
    prompt = tokenizer(texts.python_source(), return_tensors="pt").input_ids[:, : args.context]
    drafting = tier_model(model, config.draft_precision, 1)
    result = {"draft": args.draft, "dtype": args.dtype, "draft_precision": config.draft_precision, "why": why,
              "rows_filled": min(prompt.shape[1] - 1, config.sink_tokens + config.window), "threads": args.threads,
              "by_lean_copy": timed_fill(drafting, None, prompt, config, args.repeats),
              "by_own_weights": timed_fill(drafting, model, prompt, config, args.repeats)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
