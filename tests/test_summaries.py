"""`hf_triforce_bench.summaries`: the published table's rows of a bench file, a decode results.json's or a GPU check's
gpu_check.json's, written as summary.csv beside it."""

from __future__ import annotations

import csv
import json

from hf_triforce_bench import summaries


def test_a_gpu_check_json_gives_one_row_per_library_run(tmp_path):
    data = {"environment": {}, "rows": [
        {"model": "qwen2.5-1.5b", "dtype": "fp32", "context": 32768, "method": "plain", "new_tokens": 64,
         "generated": 64, "tok_s": 12.34567, "vs_plain": 1.0, "vs_static": 0.41234, "identical": True,
         "identical_leading": 64, "peak_gib": 7.1234, "seconds": 5.2},
        {"model": "qwen2.5-1.5b", "dtype": "fp32", "context": 32768, "method": "triforce-ngram", "new_tokens": 64,
         "generated": 64, "tok_s": 20.0, "vs_plain": 1.6201, "vs_static": 0.668, "identical": False,
         "identical_leading": 4, "peak_gib": 7.5,
         "stats": {"force2_acceptance": 0.92857, "force3_acceptance": 1.0, "tokens_per_force3_step": 7.0}}]}
    path = tmp_path / "gpu" / "gpu_check.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    written = summaries.write_summary(path)
    assert written == path.with_name("summary.csv")
    with written.open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(summaries.GPU_COLUMNS)
    assert rows[0]["tok_s"] == "12.346" and rows[0]["peak_gib"] == "7.12" and rows[0]["force3_acceptance"] == ""
    assert rows[1]["identical"] == "False" and rows[1]["identical_leading"] == "4"
    assert rows[1]["force2_acceptance"] == "0.929" and rows[1]["tokens_per_force3_step"] == "7.0"


def test_a_decode_results_json_keeps_its_columns(tmp_path):
    results = [{"context": 8000, "text": "essays", "prompt": "question", "sampling": None, "methods": {
        "static": {"decode_tokens_per_second": 8.5},
        "default": {"decode_tokens_per_second": 9.25, "stats": {"force3_acceptance": 0.5}}}}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    with summaries.write_summary(path).open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(summaries.COLUMNS)
    assert [(r["method"], r["mode"], r["force3_acceptance"]) for r in rows] == [("static", "greedy", ""),
                                                                             ("default", "greedy", "0.5")]
