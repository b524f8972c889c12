"""The library's plain step against a static-cache ``generate`` step at the same length: what a Force-3 step costs
when the adaptive policy runs plain decoding (no candidates), beside transformers' best plain decoding on this CPU.

One prefill of a prompt about a natural text (SmolLM2-135M fp32, YaRN where the context needs it) is shared. Per
method, the ms of one decoded token is the difference of two calls that decode ``--tokens`` and 1 token, divided by
``--tokens - 1`` (the set-up of each call cancels): static-cache ``generate`` from a `StaticCache` copy of the prefix,
and ``TriForceConfig()`` with its policy held on the plain plan (every step one row on the full cache, with the
policy's own per-step work: choosing, the free lookups' counterfactual scoring, observing). Median over ``--repeats``
alternating rounds; greedy. Prints a markdown table; ``--out`` writes JSON.

    python benchmarks/plain_step.py --contexts 4000 8000 --tokens 33 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from hf_triforce import TriForceConfig, assets
from hf_triforce.decoding.policy import AdaptivePolicy, Plan
from hf_triforce.tools.prompts import document_prompt
from hf_triforce.tools.timing import prefill_prefix, static_copy
from hf_triforce_bench import texts


def static(model, ids: torch.Tensor, prefix, tokens: int):
    cache = static_copy(model, prefix, ids.shape[1] + tokens + 16)
    return model.generate(ids, cache=cache, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)


def plain_steps(model, ids: torch.Tensor, prefix, tokens: int):
    """``TriForceConfig()`` with every step's plan the plain one."""
    with mock.patch.object(AdaptivePolicy, "choose", lambda self, remaining=None: Plan(1)):
        return model.generate(ids, cache=prefix, triforce_config=TriForceConfig(), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, return_dict_in_generate=True)


def _seconds(call, model, ids: torch.Tensor, prefix, tokens: int) -> float:
    """Seconds of one call less the library's own copy of the prefix (static's copy is inside: the two calls of a
    difference both make it, so it cancels, as the library's would)."""
    start = time.perf_counter()
    out = call(model, ids, prefix, tokens)
    stats = getattr(out, "triforce_stats", None)
    return time.perf_counter() - start - (stats.detail.prefix_copy_seconds if stats is not None else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4000, 8000])
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text", choices=sorted(texts.TEXTS), default="shakespeare")
    parser.add_argument("--prompt", choices=("question", "continue"), default="continue")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for context in args.contexts:
        overrides = texts.yarn_rope(context / 8192 * 1.02) if context + args.tokens > 8192 else {}
        model, tokenizer = assets.load_smollm2(**overrides)
        ids = document_prompt(tokenizer, texts.TEXTS[args.text](), context, args.prompt)
        prefix = prefill_prefix(model, ids)

        per_token: dict[str, list[float]] = {"static": [], "library plain": []}
        for round_ in range(args.repeats + 1):  # the first round warms up
            for name, call in (("static", static), ("library plain", plain_steps)):
                seconds = (_seconds(call, model, ids, prefix, args.tokens)
                           - _seconds(call, model, ids, prefix, 1)) / (args.tokens - 1)
                if round_:
                    per_token[name].append(seconds)
        median = {name: statistics.median(values) * 1e3 for name, values in per_token.items()}
        rows.append({"context": context, "static_ms": median["static"], "plain_ms": median["library plain"],
                     "ratio": median["library plain"] / median["static"]})
        print(f"| {context} | {median['static']:.1f} | {median['library plain']:.1f} | "
              f"{median['library plain'] / median['static']:.2f}x |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"text": args.text, "prompt": args.prompt, "tokens": args.tokens,
                                        "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    print("| context | static-cache generate ms/token | library plain step ms/token | ratio |")
    print("|---|---|---|---|")
    main()
