"""Decode speed of `TriForceConfig(loop="assisted")` (transformers' assisted loop verifying Force 2's tokens) beside the
library's own loop, plain ``generate`` and transformers' assisted generation with a small draft model, on one prompt.

The draft of transformers' assisted generation is the target's first ``--draft-layers`` decoder layers and its own
output layer (SmolLM2-135M is the smallest model of its vocabulary here). Plain ``generate`` and both TriForce loops
start from one shared prefill of the prompt but its last token (``cache=``, copied per call); transformers' assisted
generation cannot start from a filled cache (its first iteration feeds the whole prompt again), so its decode time is
its call's time less that of the same call for one new token. Prints JSON: decode tokens/s per method and mode, the
ratio to plain ``generate``, and whether each greedy output equals plain ``generate``'s.

    python benchmarks/assisted_loop.py --context 8000 --new-tokens 64
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from transformers import DynamicCache

from hf_triforce import TriForceConfig, assets
from hf_triforce.tools.prompts import document_prompt
from hf_triforce_bench import texts

SAMPLED = dict(do_sample=True, temperature=0.6, top_p=0.9)


def truncated_draft(model, layers: int):
    """A copy of ``model`` keeping its first ``layers`` decoder layers (same embeddings, norm and output layer)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    draft.config.layer_types = draft.config.layer_types[:layers] if getattr(draft.config, "layer_types", None) else None
    return draft


def timed(model, prompt, **kwargs) -> tuple[float, torch.Tensor]:
    """Seconds of ``model.generate(prompt, **kwargs)`` and its output."""
    began = time.perf_counter()
    out = model.generate(prompt, **kwargs)
    return time.perf_counter() - began, out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2()
    prompt = document_prompt(tokenizer, texts.tragedies(), args.context)
    draft = truncated_draft(model, args.draft_layers)
    new = args.new_tokens
    for config in (TriForceConfig(), TriForceConfig(loop="assisted")):  # lean copies and route timings, made once
        model.generate(prompt[:, :600], max_new_tokens=4, triforce_config=config)
    began = time.perf_counter()
    prefix = DynamicCache(config=model.config)
    model(prompt[:, :-1], cache=prefix)
    prefill = time.perf_counter() - began
    results = {"context": prompt.shape[1], "new_tokens": new, "threads": args.threads, "prefill_seconds": prefill}
    for mode, sampling in (("greedy", dict(do_sample=False)), ("sampled", SAMPLED)):
        row, outputs = {}, {}
        methods = {
            "generate": dict(),
            "triforce loop (TriForceConfig())": dict(triforce_config=TriForceConfig()),
            "assisted loop (TriForceConfig(loop='assisted'))": dict(triforce_config=TriForceConfig(loop="assisted")),
        }
        for name, extra in methods.items():
            torch.manual_seed(0)
            seconds, out = timed(model, prompt, cache=copy.deepcopy(prefix), max_new_tokens=new, min_new_tokens=new,
                                 **sampling, **extra)
            row[name] = new / seconds
            outputs[name] = out[0, prompt.shape[1]:].tolist()
        torch.manual_seed(0)
        one, _ = timed(model, prompt, assistant_model=draft, max_new_tokens=1, **sampling)
        full, out = timed(model, prompt, assistant_model=draft, max_new_tokens=new, min_new_tokens=new, **sampling)
        name = f"HF assisted generation (draft: first {args.draft_layers} layers)"
        row[name] = (new - 1) / max(full - one, 1e-9)
        outputs[name] = out[0, prompt.shape[1]:].tolist()
        results[mode] = {name: {"tokens_per_s": round(speed, 2), "x_generate": round(speed / row["generate"], 2),
                                "same_as_generate": outputs[name] == outputs["generate"] if mode == "greedy" else None}
                         for name, speed in row.items()}
        print(json.dumps({mode: results[mode]}), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
