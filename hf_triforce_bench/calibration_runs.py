"""The measured runs the projection's calibration reads (`benchmarks/project_calibration.py`), as one CSV: one row per
bench folder, result and method of ``hf-triforce-bench decode``'s ``results.json`` (or of a row of
``benchmarks/gpu_check.py``'s ``gpu_check.json``: a result of one method), holding only the fields the
calibration reads (the context, models, dtype, sampled or not, gammas and budget; each method's new tokens and decode
speed; its tier seconds, forwards, proposals, drafting precision, cache sizes and plain steps). Numbers are written
as Python writes them (``repr``), so that a run reads back with the same values and types as its ``results.json``.

    python -m hf_triforce_bench.calibration_runs docs/bench/FOLDER/results.json [...]   # or FOLDER/gpu_check.json
        # adds (or replaces) FOLDER's rows in docs/bench/calibration/runs.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
RUNS = BENCH / "calibration" / "runs.csv"
ENTRY = ("context", "model", "draft_model", "dtype")  # a result's own fields, kept as they are
# the statistics kept: of `TriForceStats`' top level (with its derived tokens_per_force3_step) and of its detail
TOP = ("force1_seconds", "force2_seconds", "force3_seconds", "force3_proposed", "force3_steps", "force3_tokens",
       "tokens_per_force3_step")
DETAIL = ("retrieval_seconds", "force1_proposed", "force2_steps", "draft_precision", "draft_cache_bytes",
          "full_cache_bytes")
STATS = TOP + DETAIL
COLUMNS = ("folder", "result", *ENTRY, "sampled", "gammas_model", "gammas_ngram", "budget", "method", "new_tokens",
           "decode_tokens_per_second", *STATS, "draft_filled_by_forward", "plain_steps", "plain_tokens_per_second")
FILLED = "filled by a forward"  # how `TriForceDetail.draft_caches` says a drafter's cache was filled by a forward
INTEGER = re.compile(r"-?\d+")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def _value(cell: str):
    """A cell back as its value: ``""`` None, digits an int, any other number a float, else the string."""
    if cell == "":
        return None
    if INTEGER.fullmatch(cell):
        return int(cell)
    try:
        return float(cell)
    except ValueError:
        return cell


def gpu_check_results(data: dict) -> list[dict]:
    """The library runs of a ``gpu_check.json`` (``{"rows": [...]}``, `benchmarks/gpu_check.py`) as results of one
    method each: its model, dtype (``"bf16"``, ``"fp32"``: as the file names them), context, new tokens, tokens/s and
    statistics."""
    return [{"context": row["context"], "model": row["model"], "dtype": row["dtype"],
             "methods": {row["method"]: {"new_tokens": row["new_tokens"], "decode_tokens_per_second": row["tok_s"],
                                         "stats": row.get("stats")}}} for row in data["rows"]]


def results_of(loaded, name: str) -> list[dict]:
    """A bench file's results: ``hf-triforce-bench decode``'s list as it is, a ``gpu_check.json`` by
    `gpu_check_results`; anything else is refused."""
    if isinstance(loaded, list) and all(isinstance(r, dict) and "methods" in r for r in loaded):
        return loaded
    if isinstance(loaded, dict) and isinstance(loaded.get("rows"), list):
        return gpu_check_results(loaded)
    raise ValueError(f"{name}: neither a results.json of hf-triforce-bench decode (a list of results with "
                     "'methods') nor a gpu_check.json (its 'rows')")


def rows(folder: str, results: list[dict]) -> list[dict]:
    """The CSV rows of one bench folder's ``results.json`` (a list of results with ``methods``)."""
    out = []
    for index, result in enumerate(results):
        gammas = result.get("gammas") or {}
        ngram = gammas.get("ngram") or gammas.get("lookup")
        for method, run in result["methods"].items():
            stats = run.get("stats") or {}
            detail = stats.get("detail") or {}
            plans = detail.get("plans") or {}
            plain = plans.get("plain")
            caches = detail.get("draft_caches") or {}
            out.append({
                "folder": folder, "result": index, **{key: result.get(key) for key in ENTRY},
                "sampled": bool(result.get("sampling")), "gammas_model": gammas.get("model"), "gammas_ngram": ngram,
                "budget": (result.get("budgets") or [None])[0], "method": method, "new_tokens": run["new_tokens"],
                "decode_tokens_per_second": run.get("decode_tokens_per_second"),
                **{key: stats.get(key) for key in TOP}, **{key: detail.get(key) for key in DETAIL},
                "draft_filled_by_forward": any(FILLED in how for how in caches.values()) if caches else None,
                "plain_steps": None if plain is None else plain["steps"],
                "plain_tokens_per_second": None if plain is None else plain.get("measured_tokens_per_second")})
    return out


def read(path: Path = RUNS) -> dict[str, list[dict]]:
    """Each folder's results as the calibration reads them: a list of results, each with its ``methods`` (new tokens,
    decode speed and the ``stats`` fields `rows` keeps) in the order of its ``results.json``."""
    folders: dict[str, dict[int, dict]] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            value = {key: _value(cell) for key, cell in row.items()}
            results = folders.setdefault(row["folder"], {})
            if value["result"] not in results:
                gammas = {kind: [int(g) for g in row[f"gammas_{kind}"].split()]
                          for kind in ("model", "ngram") if row[f"gammas_{kind}"]}
                results[value["result"]] = {
                    **{key: value[key] for key in ENTRY}, "sampling": bool(value["sampled"]) or None,
                    "gammas": gammas or None, "budgets": None if value["budget"] is None else [value["budget"]],
                    "methods": {}}
            detail = {key: value[key] for key in DETAIL if value[key] is not None}
            stats = {**{key: value[key] for key in TOP if value[key] is not None}, "detail": detail}
            if value["draft_filled_by_forward"] is not None:
                detail["draft_caches"] = {"draft": FILLED if value["draft_filled_by_forward"] else "a copy"}
            if value["plain_steps"] is not None:
                plain = {"steps": value["plain_steps"]}
                if value["plain_tokens_per_second"] is not None:
                    plain["measured_tokens_per_second"] = value["plain_tokens_per_second"]
                detail["plans"] = {"plain": plain}
            results[value["result"]]["methods"][row["method"]] = {
                "new_tokens": value["new_tokens"], "decode_tokens_per_second": value["decode_tokens_per_second"],
                "stats": stats}
    return {folder: [results[i] for i in sorted(results)] for folder, results in folders.items()}


def write(folder_rows: dict[str, list[dict]], path: Path = RUNS) -> None:
    """``path`` with each folder of ``folder_rows`` holding those rows (added, or replacing its rows there), the other
    folders' rows kept, in the file's order."""
    kept = []
    if path.exists():
        with path.open(newline="") as handle:
            kept = [row for row in csv.DictReader(handle) if row["folder"] not in folder_rows]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
        writer.writerows({key: _cell(row[key]) for key in COLUMNS} for rows_ in folder_rows.values()
                         for row in rows_)


def folder_of(results_file: Path, bench: Path = BENCH) -> str:
    """The bench folder of a ``results.json`` under ``bench``: its parent, relative to ``bench``."""
    parent = results_file.resolve().parent
    if not parent.is_relative_to(bench.resolve()):
        raise ValueError(f"results_file must lie under {bench} (its folder names the run): got {results_file}")
    return parent.relative_to(bench.resolve()).as_posix()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="results.json, gpu_check.json files under docs/bench/")
    parser.add_argument("--out", type=Path, default=RUNS, help=f"the CSV (default {RUNS})")
    args = parser.parse_args(argv)
    added = {}
    for name in args.results:
        try:
            results = results_of(json.loads(name.read_text()), str(name))
        except ValueError as error:
            raise SystemExit(str(error)) from error
        added[folder_of(name)] = rows(folder_of(name), results)
    write(added, args.out)
    print(f"wrote {args.out}: {', '.join(added)}")


if __name__ == "__main__":
    main()
