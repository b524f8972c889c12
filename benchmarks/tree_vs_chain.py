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
from dataclasses import fields

import torch

from hf_triforce import TriForceConfig, assets
from hf_triforce.stats import TriForceStats
from hf_triforce.tools.prompts import document_prompt
from hf_triforce.tools.timing import prefill_prefix
from hf_triforce_bench import texts
from hf_triforce_bench.compare import Run, measure

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
    "self chain, 3 levels (g 2/6)": dict(draft="self", levels=3, gamma1=2, gamma2=6),
    "self, 3 levels, Force 2 tree (12 nodes, branch 3)": dict(draft="self", levels=3, gamma1=2, gamma2=6,
                                                               force2_tree_nodes=12, tree_branch=3),
    "ngram, 3 levels, Force 2 tree (14 nodes, branch 3)": dict(draft="ngram", levels=3, gamma1=3, gamma2=8,
                                                                force2_tree_nodes=14, tree_branch=3),
    # the library default (policy="auto", its own budget and gammas), without and with tree plans beside chains
    "TriForceConfig() (auto, chains)": dict(policy="auto", retrieval_budget=4096),
    "auto with trees (8 nodes, Force 2 tree 12, branch 3)": dict(policy="auto", retrieval_budget=4096, tree_nodes=8,
                                                                 tree_branch=3, force2_tree_nodes=12),
}


def triforce_run(model, ids, prefix, config, new_tokens, sampling, seed, run: Run, pooled: list) -> None:
    kwargs = dict(sampling or {"do_sample": False})
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, cache=prefix,
                         triforce_config=config, return_dict_in_generate=True, **kwargs)
    run.seconds.append(time.perf_counter() - start)
    run.new_tokens, run.sequences = out.sequences.shape[1] - ids.shape[1], out.sequences
    pooled.append(out.triforce_stats)  # every round's stats: `table_row` pools them


def pool(stats: list[TriForceStats]) -> TriForceStats:
    """The rounds' counts and seconds added up (acceptances and tokens per step over every round)."""
    total = TriForceStats()
    for held, rows in ((total, stats), (total.detail, [s.detail for s in stats])):
        for f in fields(held):
            if isinstance(value := getattr(held, f.name), (int, float)) and not isinstance(value, bool):
                setattr(held, f.name, sum(getattr(row, f.name) for row in rows))
    return total


def table_row(mode: str, name: str, run: Run, stats: list[TriForceStats], plain: float, static: float) -> dict:
    speed = run.tokens_per_second
    row = dict(mode=mode, method=name, tok_s=round(speed, 2), vs_plain=round(speed / plain, 2),
               vs_static=round(speed / static, 2))
    if stats:
        s = pool(stats)
        steps = max(s.force3_steps, 1)
        row.update(tokens_per_force3_step=round(s.tokens_per_force3_step, 2),
                   force2_acceptance=round(s.force2_acceptance, 2) if s.detail.force2_steps else None,
                   force3_acceptance=round(s.force3_acceptance, 2),
                   tree_nodes_per_step=round(s.detail.tree_nodes / steps, 1), side_accepts_per_step=round(
                       s.detail.tree_side_accepts / steps, 2),
                   ms_per_step={tier: round(1000 * seconds / steps) for tier, seconds in (
                       ("force1", s.force1_seconds), ("force2", s.force2_seconds), ("force3", s.force3_seconds),
                       ("retrieval", s.detail.retrieval_seconds))})
        plans: dict[str, int] = {}  # policy="auto": steps per plan over the rounds
        for round_stats in stats:
            for plan, record in (round_stats.detail.plans or {}).items():
                plans[plan] = plans.get(plan, 0) + record["steps"]
        if plans:
            row["plan_steps"] = dict(sorted(plans.items(), key=lambda item: -item[1]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--text", default="essays", choices=sorted(texts.TEXTS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--only", default=None, help="run only the configs whose name contains this")
    parser.add_argument("--configs", nargs="+", default=None, choices=sorted(CONFIGS), metavar="NAME",
                        help=f"run only these configs (default: all): {sorted(CONFIGS)}")
    parser.add_argument("--rope-factor", type=float, default=None,
                        help="YaRN factor (default: none up to 8192 tokens, 2 up to 16384, else 4)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    factor = args.rope_factor or (None if args.context <= 8192 else 2.0 if args.context <= 16384 else 4.0)
    model, tokenizer = assets.load_smollm2(**(texts.yarn_rope(factor) if factor else {}))
    ids = document_prompt(tokenizer, texts.TEXTS[args.text](), args.context, "question")
    start = time.perf_counter()
    prefix = prefill_prefix(model, ids)
    prefill_seconds = time.perf_counter() - start
    print(f"prompt {ids.shape[1]} tokens, prefill {prefill_seconds:.1f} s", flush=True)
    modes = {"greedy": None, f"T={args.temperature}/top-p {args.top_p}": dict(
        do_sample=True, temperature=args.temperature, top_p=args.top_p)}
    rows = []
    for mode, sampling in modes.items():
        chosen = [name for name in CONFIGS if (args.only is None or args.only in name)
                  and (args.configs is None or name in args.configs)]
        runs = {name: Run(name) for name in ["plain", "static", *chosen]}
        pooled: dict[str, list[TriForceStats]] = {name: [] for name in runs}
        for seed in range(args.repeats):
            for name, run in runs.items():
                if name in ("plain", "static"):
                    measure(model, ids, prefix, name, args.new_tokens, 512, run, sampling=sampling,
                            seed=seed)
                else:
                    triforce_run(model, ids, prefix, TriForceConfig(**{**FIXED, **CONFIGS[name]}), args.new_tokens,
                                 sampling, seed, run, pooled[name])
                print(f"  {mode} round {seed} {name}: {run.seconds[-1]:.2f} s", flush=True)
        plain, static = runs["plain"].tokens_per_second, runs["static"].tokens_per_second
        for name, run in runs.items():
            row = table_row(mode, name, run, pooled[name], plain, static)
            if sampling is None:
                row["identical"] = bool(torch.equal(run.sequences, runs["plain"].sequences))
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.out:  # after each mode: a long run keeps what it measured
            with open(args.out, "w") as f:
                json.dump(dict(context=ids.shape[1], text=args.text, rope_factor=factor, new_tokens=args.new_tokens,
                               repeats=args.repeats, fixed=FIXED, configs={name: CONFIGS[name] for name in chosen},
                               prefill_seconds=prefill_seconds, rows=rows), f, indent=1)

if __name__ == "__main__":
    main()
