"""Where a model drafter's tree branches: shallowest positions first vs least certain positions
(`hf_triforce.drafters.branching`), and, when sampling, top-k point-mass siblings vs siblings sampled without
replacement.

Counts only (tokens per Force-3 step, Force-2 / Force-3 acceptance, tree nodes per Force-3 step), no timing:
the rules are compared on the verifier's work they save, so the machine may be busy. SmolLM2-135M-Instruct
fp32; a bundled text in the chat template followed by the bench's question (`tools.prompts.document_prompt`);
every method decodes from copies of one shared prefill, greedy once and sampled (temperature / top-p) once per
seed; sampled rows sum the counts over the seeds. Greedy rows also check identity with plain `generate`.

    PYTHONPATH=. python benchmarks/tree_branching.py --context 4096 --new-tokens 96 --seeds 3 --threads 1

The variants are registered as extra drafters (`register_drafter`) for this script only:
``self-sampled``: least certain positions (`hf_triforce.drafters.branching`), siblings sampled without replacement when
sampling; ``self-topk``: the same positions, top-k point-mass siblings; ``self-shallowest``: shallowest first (top-k
alternatives at the shallowest positions while the budget lasts). Chains use ``self``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from hf_triforce import TriForceConfig, assets
from hf_triforce.drafters.model import ModelDrafter
from hf_triforce.drafters.registry import register_drafter
from hf_triforce.forwards.forward import run_inline
from hf_triforce.kernels.quantized import drafting_model
from hf_triforce.stats import TriForceStats
from hf_triforce.tools.prompts import document_prompt
from hf_triforce.tools.timing import prefill_prefix
from hf_triforce.verification.draft_tree import DraftTree, TreeBuilder
from hf_triforce_bench import texts

FIXED = dict(policy="fixed", retrieval_budget=512, chunk_size=8, sink_tokens=16, window=256)
LEVELS = {"2 levels (g 6)": dict(levels=2, gamma1=2, gamma2=6),
          "3 levels (g 6/12)": dict(levels=3, gamma1=6, gamma2=12)}
RULES = {"shallowest, top-k": "self-shallowest", "least certain, top-k": "self-topk",
         "least certain, sampled": "self-sampled"}
COUNTED = ("force3_tokens", "force3_steps", "force2_accepted", "force3_proposed", "force3_accepted")
COUNTED_DETAIL = ("force1_proposed", "force2_steps", "tree_nodes", "tree_side_accepts")


class ShallowestFirst(ModelDrafter):
    """Shallowest first, the rule `branching` replaces: the chain, then the draft's next most likely tokens at each
    position from the shallowest down until ``nodes`` is spent (point masses)."""

    def propose_tree(self, sequence: torch.Tensor, depth: int, nodes: int, branch: int) -> DraftTree:
        tokens, rows, probs = run_inline(self._draft_steps(sequence, min(depth, nodes)))
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens  # a tree holds ints, as the library's
        self.drafted = (sequence.shape[1], tokens)
        builder = TreeBuilder(nodes, branch)
        parent, chain = -1, []
        for token, law in zip(tokens, probs if self.do_sample else [None] * len(tokens)):
            parent = builder.add_child(parent, token, law)
            chain.append(parent)
        for parent, token, scores in zip([-1] + chain[:-1], tokens, rows):
            ranked = scores.argsort(descending=True)[:branch].tolist()
            for alternative in [t for t in ranked if t != token and scores[t] > -float("inf")][: branch - 1]:
                if builder.add_child(parent, alternative) is None:
                    break
        return builder.tree()


def _variant(cls, **kwargs):
    def build(context):
        config = context.config
        return cls(drafting_model(context.target, config.draft_precision), config.sink_tokens, config.window,
                   context.processors, context.do_sample, context.sampler, **kwargs)
    return build


register_drafter("self-shallowest", _variant(ShallowestFirst, sampled_siblings=False), "model",
                 "benchmark only: shallowest-first branching", trees=True)
register_drafter("self-sampled", _variant(ModelDrafter, sampled_siblings=True), "model",
                 "benchmark only: least certain positions, siblings sampled without replacement", trees=True)
register_drafter("self-topk", _variant(ModelDrafter, sampled_siblings=False), "model",
                 "benchmark only: least certain positions, top-k siblings", trees=True)


def decode(model, ids, prefix, config, new_tokens, sampling, seed):
    torch.manual_seed(seed)
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, cache=prefix,
                         triforce_config=config, return_dict_in_generate=True, **(sampling or {"do_sample": False}))
    return out.sequences, out.triforce_stats


def row(mode, level, method, total: TriForceStats) -> dict:
    steps, detail = total.force3_steps, total.detail
    out = dict(mode=mode, levels=level, method=method, force3_steps=steps,
               tokens_per_force3_step=round(total.tokens_per_force3_step, 3),
               force3_acceptance=round(total.force3_acceptance, 3),
               nodes_per_force3_step=round(detail.tree_nodes / steps, 1) if steps else 0,
               side_accepts=detail.tree_side_accepts)
    if total.detail.force2_steps:
        out["force2_acceptance"] = round(total.force2_acceptance, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--text", default="essays", choices=sorted(texts.TEXTS))
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--branches", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), choices=list(LEVELS))
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--chains", action="store_true", help="also run each level's chain (tree_nodes=0)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2()
    ids = document_prompt(tokenizer, texts.TEXTS[args.text](), args.context, "question")
    prefix = prefill_prefix(model, ids)
    print(f"prompt {ids.shape[1]} tokens", flush=True)
    sampled = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    rows = []
    plain = None
    for mode in args.modes:
        sampling, seeds = (None, [0]) if mode == "greedy" else (sampled, list(range(args.seeds)))
        if mode == "greedy":
            plain = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   past_key_values=copy.deepcopy(prefix), do_sample=False)
        for level in args.levels:
            level_config = LEVELS[level]
            methods = {"chain": dict(draft="self")} if args.chains else {}
            for branch in args.branches:
                for rule in args.rules:
                    draft = RULES[rule]
                    if mode == "greedy" and rule.endswith("sampled"):
                        continue  # greedy siblings are top-k whatever the rule
                    methods[f"{rule}, branch {branch}"] = dict(draft=draft, tree_nodes=args.nodes,
                                                               tree_branch=branch)
            for method, method_config in methods.items():
                config = TriForceConfig(**{**FIXED, **level_config, **method_config})
                total, identical, start = TriForceStats(), True, time.perf_counter()
                for seed in seeds:
                    sequences, stats = decode(model, ids, prefix, config, args.new_tokens, sampling, seed)
                    for name in COUNTED:
                        setattr(total, name, getattr(total, name) + getattr(stats, name))
                    for name in COUNTED_DETAIL:
                        setattr(total.detail, name, getattr(total.detail, name) + getattr(stats.detail, name))
                    if mode == "greedy":
                        identical = bool(torch.equal(sequences, plain))
                result = row(mode, level, method, total)
                if mode == "greedy":
                    result["identical"] = identical
                rows.append(result)
                print(json.dumps(result), f"({time.perf_counter() - start:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(context=ids.shape[1], text=args.text, new_tokens=args.new_tokens, seeds=args.seeds,
                           temperature=args.temperature, top_p=args.top_p, nodes=args.nodes, fixed=FIXED,
                           levels=LEVELS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
