"""Chains vs candidate trees (`TriForceConfig.tree_nodes`), side by side on one prefilled prompt.

SmolLM2-135M-Instruct fp32; a bundled text in the chat template followed by the bench's question
(`tools.prompts.document_prompt`); every method alternates on copies of one shared prefill, greedy and
sampled (temperature / top-p) rounds seeded per round; plain and static-cache `generate` as baselines.
Prints, per method: decode tok/s (median of the rounds) and its ratio to plain and static, tokens per
Force-3 step, Force-2 and Force-3 acceptance (proposals counted as tree depths), tree nodes per Force-3
step, and whether greedy output is identical to plain `generate`.

    python benchmarks/tree_vs_chain.py --context 8000 --new-tokens 64 --repeats 2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_triforce import TriForceConfig
from hf_triforce.tools import assets
from hf_triforce.tools.bench import Run, measure, prefill_prefix
from hf_triforce.tools.prompts import document_prompt

FIXED = dict(policy="fixed", retrieval_budget=512, chunk_size=8, sink_tokens=16, window=256)
CONFIGS = {
    "ngram chain, 2 levels (g 8)": dict(draft="ngram", levels=2, gamma1=3, gamma2=8),
    "ngram tree, 2 levels (16 nodes, branch 4)": dict(draft="ngram", levels=2, gamma1=3, gamma2=8, tree_nodes=16,
                                                       tree_branch=4),
    "ngram chain, 3 levels (g 3/8)": dict(draft="ngram", levels=3, gamma1=3, gamma2=8),
    "ngram tree, 3 levels (12 nodes, branch 4)": dict(draft="ngram", levels=3, gamma1=3, gamma2=8, tree_nodes=12,
                                                       tree_branch=4),
    "self chain, 2 levels (g 6)": dict(draft="self", levels=2, gamma1=2, gamma2=6),
    "self tree, 2 levels (12 nodes, branch 3)": dict(draft="self", levels=2, gamma1=2, gamma2=6, tree_nodes=12,
                                                      tree_branch=3),
}


def triforce_run(model, ids, prefix, config, new_tokens, sampling, seed, run: Run) -> None:
    kwargs = dict(sampling or {"do_sample": False})
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, cache=prefix,
                         triforce_config=config, return_dict_in_generate=True, **kwargs)
    run.seconds.append(time.perf_counter() - start)
    run.new_tokens, run.sequences, run.stats = out.sequences.shape[1] - ids.shape[1], out.sequences, out.triforce_stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--text", default="essays", choices=sorted(assets.TEXTS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--only", default=None, help="run only the configs whose name contains this")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2()
    ids = document_prompt(tokenizer, assets.TEXTS[args.text](), args.context, "question")
    start = time.perf_counter()
    prefix = prefill_prefix(model, ids)
    prefill_seconds = time.perf_counter() - start
    print(f"prompt {ids.shape[1]} tokens, prefill {prefill_seconds:.1f} s", flush=True)
    modes = {"greedy": None, f"T={args.temperature}/top-p {args.top_p}": dict(
        do_sample=True, temperature=args.temperature, top_p=args.top_p)}
    rows = []
    for mode, sampling in modes.items():
        chosen = [name for name in CONFIGS if args.only is None or args.only in name]
        runs = {name: Run(name) for name in ["plain", "static", *chosen]}
        for seed in range(args.repeats):
            for name, run in runs.items():
                if name in ("plain", "static"):
                    measure(model, ids, prefix, name, args.new_tokens, 512, run, prefill_seconds, sampling=sampling,
                            seed=seed)
                else:
                    triforce_run(model, ids, prefix, TriForceConfig(**{**FIXED, **CONFIGS[name]}), args.new_tokens,
                                 sampling, seed, run)
                print(f"  {mode} round {seed} {name}: {run.seconds[-1]:.2f} s", flush=True)
        plain, static = runs["plain"].tokens_per_second, runs["static"].tokens_per_second
        for name, run in runs.items():
            s = run.stats
            speed = run.tokens_per_second
            row = dict(mode=mode, method=name, tok_s=round(speed, 2), vs_plain=round(speed / plain, 2),
                       vs_static=round(speed / static, 2))
            if s is not None:
                row.update(tokens_per_force3_step=round(s.tokens_per_force3_step, 2),
                           force2_acceptance=round(s.force2_acceptance, 2) if s.force2_steps else None,
                           force3_acceptance=round(s.force3_acceptance, 2),
                           tree_nodes_per_step=round(s.tree_nodes / s.force3_steps, 1) if s.force3_steps else 0)
            if sampling is None:
                row["identical"] = bool(torch.equal(run.sequences, runs["plain"].sequences))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(context=ids.shape[1], text=args.text, new_tokens=args.new_tokens, repeats=args.repeats,
                           fixed=FIXED, configs=CONFIGS, prefill_seconds=prefill_seconds, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
