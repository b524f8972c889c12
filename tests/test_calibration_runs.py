"""The calibration's runs as one CSV (`hf_triforce_bench.calibration_runs`): a run reads back with the values and types
of its results.json for every field the calibration reads; a folder's rows are added or replaced, the others kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_triforce_bench import calibration_runs as runs

TOP = dict(force1_seconds=0.5, force2_seconds=1.25, force3_seconds=3.0, force3_proposed=30, force3_steps=9,
           force3_tokens=63, tokens_per_force3_step=7.0)
DETAIL = dict(retrieval_seconds=0.0, force1_proposed=40, force2_steps=16, draft_precision="lean-int4",
              draft_cache_bytes=1_474_560, full_cache_bytes=1_480_919_040)
STATS = {**TOP, "detail": DETAIL}  # `TriForceStats.to_dict`'s layout, the fields the calibration reads
RESULTS = [
    {"context": 8000, "model": "qwen2.5-coder-1.5b", "draft_model": "qwen2.5-coder-0.5b", "dtype": "bfloat16",
     "sampling": {"temperature": 0.6, "top_p": 0.9}, "gammas": {"lookup": [3, 8], "model": [2, 6]},
     "budgets": [4096], "text": "python", "prefill_seconds": 12.5,
     "methods": {
         "static": {"decode_tokens_per_second": 5.0, "new_tokens": 64, "seconds": [1.0], "stats": None},
         "triforce-draft": {"decode_tokens_per_second": 6.123456789012345, "new_tokens": 64,
                            "stats": {**TOP, "force2_acceptance": 0.7, "detail": {**DETAIL, "draft_caches": {
                                "draft": "absolute positions, filled by a forward of 1040"}}}},
         "default": {"decode_tokens_per_second": 7.5, "new_tokens": 64,
                     "stats": {**TOP, "detail": {**DETAIL, "plans": {
                         "plain": {"steps": 6, "tokens": 6, "measured_tokens_per_second": 4.25},
                         "ngram g1": {"steps": 3}}}}}}},
    {"context": 1024, "sampling": None, "methods": {
        "default": {"decode_tokens_per_second": 9.0, "new_tokens": 32,
                    "stats": {**TOP, "detail": {**DETAIL, "plans": {}}}},
        "triforce-self": {"decode_tokens_per_second": 8.0, "new_tokens": 32, "stats": {**TOP, "detail": {
            **DETAIL, "draft_caches": {"self": "a copy of the full cache's entries"}}}}}},
]


def read_back(tmp_path: Path, folders: dict) -> dict:
    path = tmp_path / "runs.csv"
    runs.write({folder: runs.rows(folder, results) for folder, results in folders.items()}, path)
    return runs.read(path)


def test_a_run_reads_back_with_the_fields_the_calibration_reads(tmp_path):
    back = read_back(tmp_path, {"calibration/host/8k": RESULTS})["calibration/host/8k"]
    assert len(back) == 2
    first, second = back
    assert {k: first[k] for k in ("context", "model", "draft_model", "dtype", "budgets")} == {
        "context": 8000, "model": "qwen2.5-coder-1.5b", "draft_model": "qwen2.5-coder-0.5b", "dtype": "bfloat16",
        "budgets": [4096]}
    assert first["sampling"] and first["gammas"] == {"model": [2, 6], "ngram": [3, 8]}  # lookup read as ngram
    assert list(first["methods"]) == ["static", "triforce-draft", "default"]  # the results' order
    assert first["methods"]["static"] == {"new_tokens": 64, "decode_tokens_per_second": 5.0,
                                          "stats": {"detail": {}}}
    draft = first["methods"]["triforce-draft"]
    assert draft["decode_tokens_per_second"] == 6.123456789012345  # every digit
    kept = {**{k: draft["stats"][k] for k in TOP}, **{k: draft["stats"]["detail"][k] for k in DETAIL}}
    expected = {**TOP, **DETAIL}
    assert kept == expected and [type(v) for v in kept.values()] == [type(v) for v in expected.values()]
    assert "filled by a forward" in draft["stats"]["detail"]["draft_caches"]["draft"]
    assert first["methods"]["default"]["stats"]["detail"]["plans"] == {
        "plain": {"steps": 6, "measured_tokens_per_second": 4.25}}
    assert second["sampling"] is None and second["gammas"] is None and second["budgets"] is None
    assert "plans" not in second["methods"]["default"]["stats"]["detail"]  # no plain steps recorded: none read back
    assert "filled by a forward" not in second["methods"]["triforce-self"]["stats"]["detail"]["draft_caches"]["draft"]


def test_a_folder_written_again_replaces_its_rows_and_keeps_the_others(tmp_path):
    path = tmp_path / "runs.csv"
    runs.write({"a": runs.rows("a", RESULTS), "b": runs.rows("b", RESULTS[1:])}, path)
    runs.write({"a": runs.rows("a", RESULTS[:1])}, path)
    back = runs.read(path)
    assert set(back) == {"a", "b"}
    assert [r["context"] for r in back["a"]] == [8000] and [r["context"] for r in back["b"]] == [1024]


def test_a_results_file_outside_the_bench_folder_is_refused(tmp_path):
    bench = tmp_path / "bench"
    (bench / "x" / "16k").mkdir(parents=True)
    assert runs.folder_of(bench / "x" / "16k" / "results.json", bench) == "x/16k"
    with pytest.raises(ValueError, match="results_file must lie under"):
        runs.folder_of(tmp_path / "elsewhere" / "results.json", bench)


def test_a_gpu_check_run_reads_back_as_a_result_of_its_one_method(tmp_path):
    data = {"environment": {"gpu": "H200"}, "rows": [
        {"model": "smollm2-135m", "dtype": "bf16", "context": 32768, "method": "static", "new_tokens": 64,
         "tok_s": 40.1, "identical": True},
        {"model": "smollm2-135m", "dtype": "bf16", "context": 32768, "method": "triforce-ngram", "new_tokens": 64,
         "tok_s": 45.25, "stats": STATS}]}
    back = read_back(tmp_path, {"gpu-h200": runs.results_of(data, "gpu_check.json")})["gpu-h200"]
    assert [list(result["methods"]) for result in back] == [["static"], ["triforce-ngram"]]
    assert back[1]["dtype"] == "bf16" and back[1]["context"] == 32768
    assert back[1]["methods"]["triforce-ngram"]["decode_tokens_per_second"] == 45.25
    assert back[1]["methods"]["triforce-ngram"]["stats"] == STATS
    with pytest.raises(ValueError, match="neither a results.json"):
        runs.results_of({"tiers": {}}, "llama-3.1-8b.json")
