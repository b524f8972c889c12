"""A compact summary of a bench results file: one CSV row per context, text, mode and method of
``hf-triforce-bench decode``'s ``results.json`` (decode speed, its ratio to the best plain decoding, acceptance per
level, tokens per Force-3 step). The published tables cite these summaries; the raw files come back by rerunning the
command a table names (its ``--out`` folder).

    python -m hf_triforce_bench.summaries docs/bench/FOLDER/results.json [...]   # writes FOLDER/summary.csv
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from .compare import speedups

COLUMNS = ("context", "text", "prompt", "mode", "method", "decode_tokens_per_second", "vs_best_plain",
           "force2_acceptance", "force3_acceptance", "tokens_per_force3_step", "crashed")


def rows(results: list[dict]) -> list[dict]:
    """One row per result and method of ``results`` (the list `compare.to_json` entries form)."""
    out = []
    for result in results:
        ratios = speedups(result)
        for method, run in result["methods"].items():
            stats = run.get("stats") or {}
            speed = run.get("decode_tokens_per_second")
            out.append({"context": result["context"], "text": result.get("text"), "prompt": result.get("prompt"),
                        "mode": "sampled" if result.get("sampling") else "greedy", "method": method,
                        "decode_tokens_per_second": None if speed is None else round(speed, 3),
                        "vs_best_plain": round(ratios[method], 3) if method in ratios else None,
                        **{key: round(stats[key], 3) if key in stats else None
                           for key in ("force2_acceptance", "force3_acceptance", "tokens_per_force3_step")},
                        "crashed": run.get("crashed")})
    return out


def write_summary(results_file: Path) -> Path:
    """``summary.csv`` beside ``results_file``, from its `rows`."""
    path = results_file.with_name("summary.csv")
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows(json.loads(results_file.read_text())))
    return path


if __name__ == "__main__":
    for name in sys.argv[1:]:
        loaded = json.loads(Path(name).read_text())
        if not (isinstance(loaded, list) and all("methods" in result for result in loaded)):
            sys.exit(f"{name}: not a results.json of hf-triforce-bench decode (a list of results with 'methods')")
        print(write_summary(Path(name)))
