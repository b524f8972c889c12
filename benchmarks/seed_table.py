"""The speed-up against context: static-cache `generate`, vanilla speculative decoding and TriForce, one line each.

Runs `hf-triforce-bench decode` once per context, each in its own process (a context past the model's trained positions
loads it with YaRN by the smallest power-of-two factor that holds it, said in the table), on one saved prefill per
prompt (``--prefill-dir``: a long prefill is computed once, then read back by every later run), then merges the
runs into one table, a per-tier breakdown and one plot (speed-up over the best plain decoding against context, a
line per method and mode). A context whose results exist in ``--out`` is not run again (``--again`` reruns it).

The real pair (what the README's table comes from)::

    python benchmarks/seed_table.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \\
        --contexts 2000 8000 16000 32000 64000 --out docs/bench/seed-table-qwen

methods with a draft model: ``static``, ``assisted`` (transformers' assisted generation), ``vanilla`` (the draft on
its own full cache on the library's loop and kernels), ``default`` (`TriForceConfig()`) and ``default-draft``
(`TriForceConfig(draft=<the draft>)``); without one, ``static`` and ``default``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from tqdm.auto import tqdm

from hf_triforce import assets
from hf_triforce_bench import texts
from hf_triforce_bench.compare import plot, speedups

DRAFT_METHODS = ("static", "assisted", "vanilla", "default", "default-draft")
SELF_METHODS = ("static", "default")


def rope_factor(context: int, new_tokens: int, positions: int) -> int | None:
    """The smallest power-of-two YaRN factor whose positions hold ``context + new_tokens`` (and the bench's 16 spare),
    None where the trained ``positions`` do."""
    needed = context + new_tokens + 16
    return None if needed <= positions else 2 ** math.ceil(math.log2(needed / positions))


def bench_command(args: argparse.Namespace, context: int, out: Path) -> list[str]:
    command = [sys.executable, "-m", "hf_triforce_bench", "decode", "--model", args.model, "--text", args.text,
               "--prompt", args.prompt, "--contexts", str(context), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--threads", str(args.threads), "--dtype", args.dtype,
               "--methods", *args.methods, "--modes", *args.modes, "--temperature", str(args.temperature),
               "--top-p", str(args.top_p), "--prefill-dir", str(args.prefill_dir), "--out", str(out)]
    if args.draft_model:
        command += ["--draft-model", args.draft_model]
    factor = rope_factor(context, args.new_tokens, assets.MODELS[args.model].positions)
    return command + (["--rope-factor", str(factor)] if factor else [])


def acceptance(stats: dict, level: str) -> str:
    """A level's acceptance and, where its rejections were counted, its acceptance per position in brackets."""
    per_position = stats.get(f"{level}_position_acceptance")
    return f"{stats[f'{level}_acceptance']:.2f}" + ("" if per_position is None else f" ({per_position:.2f})")


def breakdown(results: list[dict]) -> str:
    """Per TriForce method, context and mode: seconds per new token in each tier (Force 1's without a draft model's
    pass over the prompt), acceptance per level, tokens proposed to and committed by each Force-3 verification, and the
    plans' step counts (last round's call)."""
    lines = ["| context | mode | method | tok/s | vs best plain | F1 / F2 / F3 / retrieval s per token | "
             "F2 acc. (per position) | F3 acc. (per position) | proposed / committed per F3 step | "
             "steps plain/2/3 levels |",
             "|" + "---|" * 10]
    for result in results:
        mode = "sampled" if result.get("sampling") else "greedy"
        ratios = speedups(result)
        for name, method in result["methods"].items():
            stats = method["stats"]
            if not stats or not stats["force3_steps"]:
                continue
            tokens = max(stats["new_tokens"], 1)
            detail = stats["detail"]  # the draft's pass over the prompt apart
            decoding = (stats["force1_seconds"] - detail["draft_prefill_seconds"], stats["force2_seconds"],
                        stats["force3_seconds"], detail["retrieval_seconds"])
            seconds = " / ".join(f"{value / tokens:.3f}" for value in decoding)
            steps = "/".join(str(stats["plan_steps"].get(str(levels), stats["plan_steps"].get(levels, 0)))
                             for levels in (1, 2, 3))
            lines.append(f"| {result['context']} | {mode} | {name} | {method['decode_tokens_per_second']:.2f} | "
                         f"{ratios[name]:.2f}x | {seconds} | {acceptance(stats, 'force2')} | "
                         f"{acceptance(stats, 'force3')} | {stats['force3_proposed'] / stats['force3_steps']:.2f} / "
                         f"{stats['tokens_per_force3_step']:.2f} | {steps} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Speed-up over the best plain decoding: a row per context and mode, a column per method."""
    methods = list(dict.fromkeys(name for result in results for name in result["methods"]))
    lines = ["| context | mode | best plain tok/s | " + " | ".join(methods) + " | every greedy output identical |",
             "|" + "---|" * (len(methods) + 4)]
    for result in sorted(results, key=lambda r: (r["context"], bool(r.get("sampling")))):
        ratios = speedups(result)
        base = result["methods"][result["best_plain"] or "static"]["decode_tokens_per_second"]
        mode = "sampled" if result.get("sampling") else "greedy"
        rope = f" (YaRN {result['rope_factor']})" if result.get("rope_factor") else ""
        cells = [f"{ratios[m]:.2f}x" if m in ratios else "-" for m in methods]
        identical = "n/a" if result.get("sampling") else ("yes" if result.get("identical") else "NO")
        lines.append(f"| {result['context']}{rope} | {mode} | {base:.2f} | " + " | ".join(cells) + f" | {identical} |")
    return "\n".join(lines)


def merged(out: Path, contexts: list[int], new_tokens: int, positions: int) -> list[dict]:
    """Every context's results, each with its YaRN factor and whether each greedy output equals static's."""
    results = []
    for context in contexts:
        for result in json.loads((out / f"ctx-{context}" / "results.json").read_text()):
            result["rope_factor"] = rope_factor(context, new_tokens, positions)
            ids = [tuple(m["new_token_ids"]) for m in result["methods"].values() if m["decode_tokens_per_second"]]
            result["identical"] = len(set(ids)) == 1
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(assets.MODELS))
    parser.add_argument("--draft-model", default=None, choices=sorted(assets.MODELS))
    parser.add_argument("--contexts", type=int, nargs="+", default=[2000, 8000, 16000, 32000, 64000])
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"default {' '.join(DRAFT_METHODS)} with --draft-model, else {' '.join(SELF_METHODS)}")
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--text", default="essays", choices=sorted(texts.TEXTS))
    parser.add_argument("--prompt", default="question", choices=["question", "continue"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prefill-dir", type=Path, default=assets.cache_root() / "prefills")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--again", action="store_true", help="rerun contexts whose results exist")
    args = parser.parse_args(argv)
    if args.methods is None:
        args.methods = list(DRAFT_METHODS if args.draft_model else SELF_METHODS)
    for context in tqdm(args.contexts, desc="contexts", unit="context"):
        out = args.out / f"ctx-{context}"
        if (out / "results.json").exists() and not args.again:
            continue
        subprocess.run(bench_command(args, context, out), check=True)
    results = merged(args.out, args.contexts, args.new_tokens, assets.MODELS[args.model].positions)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    heading = (f"{args.model}" + (f" (draft {args.draft_model})" if args.draft_model else "")
               + f", {args.text} '{args.prompt}', {args.new_tokens} new tokens, median of {args.repeats}, "
               f"{args.dtype}, {args.threads} threads; sampled: temperature {args.temperature}, top-p {args.top_p}")
    (args.out / "results.md").write_text(f"## Speed-up over the best plain decoding\n\n{heading}\n\n{summary(results)}"
                                         f"\n\n## Per tier\n\n{breakdown(results)}\n")
    if not plot(results, args.out / "results.png"):
        print("matplotlib is not installed (pip install hf-triforce[bench]): no results.png")
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
