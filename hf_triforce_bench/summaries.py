"""A compact summary of a bench results file: one CSV row per context, text, mode and method of
``hf-triforce-bench decode``'s ``results.json`` (decode speed, its ratio to the best plain decoding, acceptance per
level, tokens per Force-3 step), or per library run of ``benchmarks/gpu_check.py``'s ``gpu_check.json`` (its
tokens/s, ratios to plain and static-cache decoding, identity with plain decoding, peak memory, acceptance per level).
The published tables cite these summaries; the raw files come back by rerunning the command a table names (its
``--out`` folder).

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
ACCEPTANCE = ("force2_acceptance", "force3_acceptance", "tokens_per_force3_step")
GPU_COLUMNS = ("model", "dtype", "context", "method", "new_tokens", "generated", "tok_s", "vs_plain", "vs_static",
               "identical", "identical_leading", "peak_gib", *ACCEPTANCE)


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
                        **{key: round(stats[key], 3) if key in stats else None for key in ACCEPTANCE},
                        "crashed": run.get("crashed")})
    return out


def gpu_rows(data: dict) -> list[dict]:
    """One row per library run of a ``gpu_check.json`` (its ``rows``), numbers to 3 decimals (peak memory to 2)."""
    def rounded(value, digits=3):
        return round(value, digits) if isinstance(value, float) else value

    out = []
    for row in data["rows"]:
        stats = row.get("stats") or {}
        out.append({**{key: rounded(row.get(key), 2 if key == "peak_gib" else 3) for key in GPU_COLUMNS[:12]},
                    **{key: rounded(stats.get(key)) for key in ACCEPTANCE}})
    return out


def write_summary(results_file: Path) -> Path:
    """``summary.csv`` beside ``results_file``, from its `rows` (a ``gpu_check.json``: its `gpu_rows`)."""
    loaded = json.loads(results_file.read_text())
    gpu = isinstance(loaded, dict) and isinstance(loaded.get("rows"), list)
    path = results_file.with_name("summary.csv")
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=GPU_COLUMNS if gpu else COLUMNS)
        writer.writeheader()
        writer.writerows(gpu_rows(loaded) if gpu else rows(loaded))
    return path


if __name__ == "__main__":
    for name in sys.argv[1:]:
        loaded = json.loads(Path(name).read_text())
        decode = isinstance(loaded, list) and all("methods" in result for result in loaded)
        if not (decode or (isinstance(loaded, dict) and isinstance(loaded.get("rows"), list))):
            sys.exit(f"{name}: neither a results.json of hf-triforce-bench decode (a list of results with 'methods') "
                     "nor a gpu_check.json (its 'rows')")
        print(write_summary(Path(name)))
