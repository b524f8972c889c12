"""Short answers: the whole ``generate`` call of ``TriForceConfig()`` against static-cache ``generate`` when the
answer is a few tokens (extractive questions, classification, tool calls), where the per-call set-up counts.

One prefill of a question prompt about a natural text (SmolLM2-135M, the chat template, YaRN where the context needs
it) is shared: static-cache ``generate`` decodes from a `StaticCache` copy of it (made before the clock), TriForce
from the prefix itself (its own copy, ``prefix_copy_seconds``, subtracted: both methods' copies are outside the
clock, as in ``hf-triforce-bench decode``). Per context and answer length: median seconds of the whole call over
``--repeats`` alternating rounds, the ratio, and the plans TriForce ran. Prints a markdown table; ``--out`` writes
JSON.

    python benchmarks/short_answers.py --contexts 8000 16000 --tokens 1 4 16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_triforce import TriForceConfig, assets
from hf_triforce.tools.prompts import document_prompt
from hf_triforce.tools.timing import prefill_prefix, static_copy
from hf_triforce_bench import texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[16000])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--text", choices=sorted(texts.TEXTS), default="shakespeare")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for context in args.contexts:
        overrides = texts.yarn_rope(context / 8192 * 1.02) if context + max(args.tokens) > 8192 else {}
        model, tokenizer = assets.load_smollm2(**overrides)
        ids = document_prompt(tokenizer, texts.TEXTS[args.text](), context, "question")
        prefix = prefill_prefix(model, ids)
        for tokens in args.tokens:
            kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            seconds: dict[str, list[float]] = {"static": [], "triforce": []}
            plans = {}
            for round_ in range(args.repeats + 1):  # the first round warms up (kernels, the model's probes)
                cache = static_copy(model, prefix, ids.shape[1] + tokens + 16)
                start = time.perf_counter()
                model.generate(ids, cache=cache, **kwargs)
                static = time.perf_counter() - start
                start = time.perf_counter()
                out = model.generate(ids, cache=prefix, triforce_config=TriForceConfig(),
                                     return_dict_in_generate=True, **kwargs)
                triforce = time.perf_counter() - start - out.triforce_stats.detail.prefix_copy_seconds
                if round_:
                    seconds["static"].append(static)
                    seconds["triforce"].append(triforce)
                    plans = out.triforce_stats.plan_steps
            median = {name: statistics.median(values) for name, values in seconds.items()}
            rows.append({"context": context, "tokens": tokens, "static_s": median["static"],
                         "triforce_s": median["triforce"], "ratio": median["triforce"] / median["static"],
                         "plan_steps": plans})
            print(f"| {context} | {tokens} | {median['static']:.3f} | {median['triforce']:.3f} | "
                  f"{median['triforce'] / median['static']:.2f}x | {plans} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"text": args.text, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    print("| context | new tokens | static-cache generate s | TriForceConfig() s | ratio | TriForce plan steps |")
    print("|---|---|---|---|---|---|")
    main()
