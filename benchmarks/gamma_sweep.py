"""TriForce (n-gram drafts, int8 tiers) at several (gamma1, gamma2) settings vs plain `generate`.

One prefill of SmolLM2-135M on the Shakespeare text, then rounds alternating plain `generate` and each
setting on copies of that prefix; prints per-round speeds and, per setting, the median speed, the ratio
to plain, whether the greedy output is identical, and the acceptance per tier.

    python benchmarks/gamma_sweep.py --context 8000 --offset 30000 --settings 2,6 3,8 3,10
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_triforce import assets
from hf_triforce.tools.timing import prefill_prefix
from hf_triforce_bench import texts
from hf_triforce_bench.compare import Run, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--offset", type=int, default=0, help="first token of the prompt in the text")
    parser.add_argument("--settings", nargs="+", default=["2,6", "3,8"], help="gamma1,gamma2 pairs")
    parser.add_argument("--method", default="triforce-ngram-int8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    settings = [tuple(int(g) for g in s.split(",")) for s in args.settings]
    torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2(**(texts.yarn_rope(4) if args.context > 8000 else {}))
    text = tokenizer(texts.TEXTS["shakespeare"](), return_tensors="pt").input_ids
    ids = text[:, args.offset : args.offset + args.context]
    start = time.perf_counter()
    prefix = prefill_prefix(model, ids)
    prefill_seconds = time.perf_counter() - start
    print(f"prefill {prefill_seconds:.1f} s", flush=True)
    runs = {"plain": Run("plain"), **{s: Run(args.method) for s in settings}}
    for round_index in range(args.repeats):
        for key, run in runs.items():
            measure(model, ids, prefix, run.method, args.new_tokens, args.budget, run,
                    gammas=(None, None) if key == "plain" else key)
        print("round", round_index, {k: round(v.tokens_per_second, 2) for k, v in runs.items()}, flush=True)
    base = runs["plain"]
    for key, run in runs.items():
        s = run.stats
        print(key, f"{run.tokens_per_second:.2f} tok/s", f"{run.tokens_per_second / base.tokens_per_second:.2f}x",
              "identical" if torch.equal(run.sequences, base.sequences) else "DIFFERENT",
              s and f"F2 {s.force2_acceptance:.2f} F3 {s.force3_acceptance:.2f} tok/F3 {s.tokens_per_force3_step:.2f}")


if __name__ == "__main__":
    main()
