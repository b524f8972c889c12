"""Merge the results of several ``hf-triforce bench`` runs (one folder each) into one results.json, results.md and
results.png (speedup over the best plain decoding against context, `bench.plot`), plus a summary table of each
method's speedup per text, mode and context.

    python benchmarks/merge_bench_results.py runs/qwen-python-2000 runs/qwen-python-8000 ... --out docs/bench/qwen
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_triforce.tools.bench import plot, speedups


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+", help="bench --out folders (results.json, results.md)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results, tables = [], []
    for folder in args.folders:
        results += json.loads((folder / "results.json").read_text())
        tables.append((folder / "results.md").read_text().strip())
    results.sort(key=lambda r: (r.get("text") or "", bool(r.get("sampling")), r["context"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    table = summary(results)
    (args.out / "results.md").write_text("speedup over the best plain decoding\n\n" + table + "\n\n"
                                         + "\n\n".join(tables) + "\n")
    print(table)
    if not plot(results, args.out / "results.png"):
        print("matplotlib is not installed (pip install hf-triforce[bench]): no results.png")


if __name__ == "__main__":
    main()
