"""What Force 2 runs at long contexts: `TriForceConfig()` with Force 2 on the target's int4, int8 or fp32 lean copy, and
its retrieval cache in bf16 or fp32, beside static-cache `generate`, rounds interleaved in one process; and
(``int4-pairs``) the default with the CPU attention kernel taking a verification's rows in pairs, as a decoding step's
(`cpu_attention.NARROW_ROWS` above any row count), to measure its four-row path at the decode's scale.

One saved prefill of a question prompt about a natural text (SmolLM2 fp32, the chat template, YaRN where the context
needs it, ``--prefill-dir``), then per mode (greedy, sampled at T=0.6 / top-p 0.9) a warm-up call of each variant
(its weight copies made, its routes timed) and ``--repeats`` rounds of static-cache `generate` and each variant in
turn. Per variant: decode tokens/s (median), the ratio to static, whether the greedy output is identical, each level's
acceptance per chain and per position (`TriForceStats.force2_position_acceptance`), tokens per Force-3 step, the
plans' step counts and each tier's milliseconds per new token. Force 1 runs `TriForceConfig()`'s lean-int4 copy in
every variant; only Force 2's weights (`hf_triforce.decoding.tiers.FORCE2_PRECISION`) or the dtype its cache keeps
change (``retrieval_dtype``: bf16 by default here, fp32 in ``int4-fp32-cache``;
`hf_triforce.decoding.levels.RETRIEVAL_STORAGE`), or in ``int4-pairs`` the attention kernel's path for many rows.

    python benchmarks/force2_variants.py --context 32000 --rope-factor 4 --prefill-dir prefills
    python benchmarks/force2_variants.py --context 64000 --rope-factor 8 --prefill-dir prefills
    python benchmarks/force2_variants.py --context 32000 --rope-factor 4 --variants int4 int4-pairs \
        --prefill-dir prefills
    python benchmarks/force2_variants.py --context 8000 --text shakespeare --gguf-stored-width \
        --variants int4 int4-fp32-cache --prefill-dir prefills
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_triforce import assets, attach_gguf
from hf_triforce.decoding import levels, tiers
from hf_triforce.kernels import cpu_attention
from hf_triforce.tools.prompts import document_prompt
from hf_triforce_bench import texts
from hf_triforce_bench.compare import Run, measure, saved_prefix

# Force 2's weights beside Force 1's int4, its cache entries' dtype (None: the model's), and the attention kernel's
# narrow rows (`cpu_attention.NARROW_ROWS`; PAIRS: every row count in pairs)
PAIRS = 1 << 20
VARIANTS = {"int4": ("lean-int4", torch.bfloat16, cpu_attention.NARROW_ROWS),
            "int4-fp32-cache": ("lean-int4", None, cpu_attention.NARROW_ROWS),
            "int8": ("lean-int8", torch.bfloat16, cpu_attention.NARROW_ROWS),
            "fp32": ("lean", torch.bfloat16, cpu_attention.NARROW_ROWS),
            "int4-pairs": ("lean-int4", torch.bfloat16, PAIRS)}
SAMPLED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}


def run_variant(name: str, model, ids, prefix, new_tokens: int, run: Run, sampling, seed: int) -> None:
    """One call of ``name`` (``"static"`` or a `VARIANTS` key) timed into ``run``."""
    kept = tiers.FORCE2_PRECISION["lean-int4"], levels.RETRIEVAL_STORAGE["bfloat16"], cpu_attention.NARROW_ROWS
    (tiers.FORCE2_PRECISION["lean-int4"], levels.RETRIEVAL_STORAGE["bfloat16"],
     cpu_attention.NARROW_ROWS) = VARIANTS.get(name, VARIANTS["int4"])
    try:
        measure(model, ids, prefix, run.method, new_tokens, 4096, run, sampling=sampling, seed=seed,
                cache_tokens=64)
    finally:
        tiers.FORCE2_PRECISION["lean-int4"], levels.RETRIEVAL_STORAGE["bfloat16"], cpu_attention.NARROW_ROWS = kept


def row(name: str, run: Run, base: Run, greedy: bool) -> dict:
    s, tokens = run.stats, max(run.new_tokens, 1)
    out = {"variant": name, "tokens_per_second": run.tokens_per_second,
           "vs_static": run.tokens_per_second / base.tokens_per_second, "seconds": run.seconds,
           "identical": bool(torch.equal(run.sequences, base.sequences)) if greedy else None}
    if s is not None:
        out.update(force2_acceptance=s.force2_acceptance, force2_position_acceptance=s.force2_position_acceptance,
                   force3_acceptance=s.force3_acceptance, force3_position_acceptance=s.force3_position_acceptance,
                   tokens_per_force3_step=s.tokens_per_force3_step, plan_steps=s.plan_steps,
                   retrieval_dtype=s.detail.retrieval_dtype,
                   ms_per_token={tier: 1000 * seconds / tokens for tier, seconds in (
                       ("force1", s.force1_seconds), ("force2", s.force2_seconds), ("force3", s.force3_seconds),
                       ("retrieval", s.detail.retrieval_seconds))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32000)
    parser.add_argument("--rope-factor", type=float, default=None)
    parser.add_argument("--text", choices=sorted(texts.TEXTS), default="essays")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-dir", default="prefills", help="folder of saved prefills (read back where saved)")
    parser.add_argument("--gguf-stored-width", action="store_true",
                        help="the target reads its bundled GGUF's blocks at their stored width (static: its fp32 "
                        "values)")
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2(**(texts.yarn_rope(args.rope_factor) if args.rope_factor else {}))
    ids = document_prompt(tokenizer, texts.TEXTS[args.text](), args.context)
    prefix, seconds, source = saved_prefix(model, ids, Path(args.prefill_dir))
    print(f"prefill: {source} ({seconds:.1f} s)", flush=True)
    if args.gguf_stored_width:
        print(f"GGUF blocks attached: {attach_gguf(model, assets.gguf_path(assets.SMOLLM2))}", flush=True)
    rows = []
    for mode, sampling in (("greedy", None), ("sampled", SAMPLED)):
        names = ["static", *args.variants]
        runs = {name: Run("static" if name == "static" else "default") for name in names}
        for name, run in runs.items():  # warm-up: weight copies, routes
            run_variant(name, model, ids, prefix, 8, Run(run.method), sampling, 0)
        for seed in range(args.repeats):
            for name, run in runs.items():
                run_variant(name, model, ids, prefix, args.new_tokens, run, sampling, seed)
        for name, run in runs.items():
            rows.append({"context": args.context, "text": args.text, "mode": mode,
                         **row(name, run, runs["static"], sampling is None)})
            r = rows[-1]
            tiers_ms = " / ".join(f"{v:.1f}" for v in r.get("ms_per_token", {}).values())
            acceptance = "" if "plan_steps" not in r else (
                f" F2 {r['force2_acceptance']:.2f} ({r['force2_position_acceptance']:.2f}) F3 "
                f"{r['force3_acceptance']:.2f} ({r['force3_position_acceptance']:.2f}) tok/F3 "
                f"{r['tokens_per_force3_step']:.2f} plans {r['plan_steps']} ms/token F1/F2/F3/selection {tiers_ms} "
                f"F2 cache {r['retrieval_dtype']}")
            print(f"{args.context} {mode} {name:6s} {r['tokens_per_second']:6.2f} tok/s {r['vs_static']:.2f}x "
                  f"identical {r['identical']}{acceptance}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
