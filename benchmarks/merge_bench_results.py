"""Merge the results of several ``hf-triforce bench`` runs (one folder each) into one results.json, results.md and
results.png (speedup over the best plain decoding against context, `bench.plot`), plus a summary table of each
method's speedup per text, mode and context, and (with ``--target``) a detail table: each tier's share of a
TriForce call's decode seconds and the KV-cache memory of every method, the draft's own full cache of HF assisted
generation included (the design's other claim: vanilla speculative decoding keeps a second cache that grows with the
context; computed from the models' shapes, `hf_triforce.tools.project.MODELS`, for the methods whose caches the bench
does not see: plain, static, lookup and assisted).

    python benchmarks/merge_bench_results.py runs/qwen-python-2000 runs/qwen-python-8000 ... --out docs/bench/qwen \
        --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype float32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_triforce.tools.bench import plot, speedups
from hf_triforce.tools.project import model_shape


def summary(results: list[dict]) -> str:
    """Markdown: a row per (text, mode, method), a column per context, the speedup over the best plain decoding."""
    contexts = sorted({r["context"] for r in results})
    rows: dict[tuple, dict[int, float]] = {}
    for result in results:
        mode = "sampled" if result.get("sampling") else "greedy"
        for method, ratio in speedups(result).items():
            rows.setdefault((result.get("text"), mode, method), {})[result["context"]] = ratio
    lines = ["| text | mode | method | " + " | ".join(f"{c // 1000}k" for c in contexts) + " |",
             "|" + "---|" * (3 + len(contexts))]
    for (text, mode, method), ratios in rows.items():
        cells = [f"{ratios[c]:.2f}x" if c in ratios else "-" for c in contexts]
        lines.append(f"| {text} | {mode} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TIERS = ("force1", "force2", "force3", "retrieval")  # the `TriForceStats` seconds of the detail table's shares


def kv_megabytes(model: str, dtype: str, tokens: int) -> float:
    """A full KV cache of ``tokens`` tokens of preset ``model`` in ``dtype``, MiB."""
    return model_shape(model, dtype).kv_bytes_per_token * tokens / 2**20


def details(results: list[dict], target: str, draft: str | None, dtype: str) -> str:
    """Markdown: per context, mode and method, decode tok/s, speedup, acceptance, each tier's share of a TriForce
    call's decode seconds (Force 1 / Force 2 / Force 3 / retrieval selection) and KV-cache MiB."""
    lines = ["| context | mode | method | tok/s | vs best plain | F3 acc. | tok/F3 step | share F1/F2/F3/sel. | "
             "KV cache MiB |", "|" + "---|" * 9]
    for result in results:
        mode = "sampled" if result.get("sampling") else "greedy"
        ratios = speedups(result)
        for method, entry in result["methods"].items():
            stats, tokens = entry["stats"], result["context"] + entry["new_tokens"]
            if stats:
                spent = sum(stats[f"{tier}_seconds"] for tier in TIERS) or 1.0
                share = "/".join(f"{100 * stats[f'{tier}_seconds'] / spent:.0f}" for tier in TIERS) + " %"
                memory = (stats["full_cache_bytes"] + stats["retrieval_cache_bytes"] + stats["draft_cache_bytes"]
                          ) / 2**20
                cells = [f"{stats['force3_acceptance']:.2f}", f"{stats['tokens_per_force3_step']:.2f}", share,
                         f"{memory:.0f}"]
            else:
                second = draft if method.startswith("assisted") else None  # HF assisted: the draft's own full cache
                memory = kv_megabytes(target, dtype, tokens) + (kv_megabytes(second, dtype, tokens) if second else 0)
                cells = ["-", "-", "-", f"{memory:.0f}" + (" (target + draft)" if second else "")]
            lines.append(f"| {result['context']} | {mode} | {method} | {entry['decode_tokens_per_second']:.2f} | "
                         f"{ratios[method]:.2f}x | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+", help="bench --out folders (results.json, results.md)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", help="the target's preset name (hf_triforce.tools.project.MODELS): adds the "
                        "detail table")
    parser.add_argument("--draft", help="the draft model's preset name (HF assisted generation's second cache)")
    parser.add_argument("--dtype", default="float32", help="the runs' dtype (default float32)")
    args = parser.parse_args()
    results, tables = [], []
    for folder in args.folders:
        results += json.loads((folder / "results.json").read_text())
        tables.append((folder / "results.md").read_text().strip())
    results.sort(key=lambda r: (r.get("text") or "", bool(r.get("sampling")), r["context"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    table = summary(results)
    if args.target:
        table += "\n\nper method\n\n" + details(results, args.target, args.draft, args.dtype)
    (args.out / "results.md").write_text("speedup over the best plain decoding\n\n" + table + "\n\n"
                                         + "\n\n".join(tables) + "\n")
    print(table)
    if not plot(results, args.out / "results.png"):
        print("matplotlib is not installed (pip install hf-triforce[bench]): no results.png")


if __name__ == "__main__":
    main()
