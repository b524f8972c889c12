"""The documents cite only data that the tree holds: every path under ``docs/bench/`` named in README.md or a
document under docs/ exists (a citation of a folder: the folder; ``{a,b}`` alternatives: each), and so does every file
of the code they name by its path (``hf_triforce/decoding/loop.py``); no raw result file of a
bench run is tracked (each published table's data is a small CSV, docs/bench/README.md); and the tracked files under
docs/ with every tracked result file elsewhere stay within 1 MB in all."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path under docs/bench/, up to the first character no path here contains (a backtick, a space, a bracket)
CITED = re.compile(r"docs/bench/[\w./{},-]*")
# a file of the code named by its path from the root (`hf_triforce/decoding/loop.py`, `tests/test_layering.py`)
CODE_FILE = re.compile(r"(?<![\w./-])((?:hf_triforce|hf_triforce_bench|tests|benchmarks|scripts|examples)/[\w./-]*"
                       r"\.(?:py|sh|md|txt|json|csv))")
DOCS_BYTES = 1_000_000  # docs/ and every tracked result file elsewhere, in all
RESULT_SUFFIXES = (".json", ".jsonl", ".csv", ".png", ".npz")  # a result file's, outside docs/
# what `hf-triforce-bench decode --out` and benchmarks/gpu_check.py write: the raw files, rerun to get them back (a
# results.md: in a bench folder; docs/results.md is the published document)
RAW_RESULTS = ("results.json", "results.png", "gpu_check.json")


def tracked(*paths: str) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return [name for name in listed.stdout.split("\0") if name]


def counted(names: list[str]) -> list[str]:
    """The tracked files the size cap counts: everything under docs/, and result files (`RESULT_SUFFIXES`) anywhere."""
    return [name for name in names if name.startswith("docs/") or name.endswith(RESULT_SUFFIXES)]


def raw_results(names: list[str]) -> list[str]:
    def raw(name: str) -> bool:
        base = name.rsplit("/", 1)[-1]
        return base in RAW_RESULTS or (base == "results.md" and name.startswith("docs/bench/"))
    return [name for name in names if raw(name)]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def alternatives(path: str) -> list[str]:
    """``path`` with each ``{a,b,...}`` expanded: ``x/{a,b}-y`` -> ``x/a-y``, ``x/b-y``."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [expanded for choice in match.group(1).split(",")
            for expanded in alternatives(path[:match.start()] + choice + path[match.end():])]


def cited_paths(text: str) -> list[str]:
    """The docs/bench/ paths ``text`` names, alternatives expanded, trailing punctuation and slashes dropped."""
    return [path.rstrip("/") for match in CITED.findall(text) for path in alternatives(match.rstrip(".,"))]


def test_every_code_file_the_documents_name_exists():
    assert CODE_FILE.findall("`hf_triforce/decoding/loop.py` (`Decoder._step`), scripts/test.sh; docs/x/tests/a.py") \
        == ["hf_triforce/decoding/loop.py", "scripts/test.sh"]
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in documents() for path in CODE_FILE.findall(doc.read_text())
               if not (ROOT / path).is_file()]
    assert not missing, f"named in the documents but not in the tree (moved or renamed?): {missing}"


def test_cited_paths_are_read_as_written():
    text = ("raw `docs/bench/x/{a,b}-c/`, then docs/bench/y/summary.csv. And (`docs/bench/z/`, the rest) "
            "`--out docs/bench/w`")
    assert cited_paths(text) == ["docs/bench/x/a-c", "docs/bench/x/b-c", "docs/bench/y/summary.csv", "docs/bench/z",
                                 "docs/bench/w"]


def test_every_docs_bench_path_the_documents_name_exists():
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in documents() for path in cited_paths(doc.read_text())
               if not (ROOT / path).exists()]
    assert not missing, ("named in the documents but not in the tree (cite what docs/bench/ holds, or the command "
                         f"that writes it): {missing}")


def test_the_cap_counts_docs_and_result_files_anywhere_and_raw_results_are_seen():
    names = ["docs/design.md", "docs/bench/x/summary.csv", "benchmarks/data/run.json", "tests/fixtures/t.csv",
             "README.md", "hf_triforce/config.py", "docs/bench/y/results.json", "out/results.png", "docs/results.md",
             "docs/bench/z/results.md", "docs/bench/gpu/gpu_check.json"]
    assert counted(names) == ["docs/design.md", "docs/bench/x/summary.csv", "benchmarks/data/run.json",
                              "tests/fixtures/t.csv", "docs/bench/y/results.json", "out/results.png", "docs/results.md",
                              "docs/bench/z/results.md", "docs/bench/gpu/gpu_check.json"]
    assert raw_results(names) == ["docs/bench/y/results.json", "out/results.png", "docs/bench/z/results.md",
                                  "docs/bench/gpu/gpu_check.json"]


def test_no_raw_result_file_is_tracked():
    raw = raw_results(tracked())
    assert not raw, (f"raw bench results tracked: {raw}; keep the published table's rows (`python -m "
                     "hf_triforce_bench.summaries FOLDER/results.json`, or FOLDER/gpu_check.json) and the "
                     "calibration's fields (`python -m hf_triforce_bench.calibration_runs FOLDER/results.json`) "
                     "instead")


def test_the_tracked_docs_and_result_files_stay_within_a_megabyte():
    files = [ROOT / name for name in counted(tracked())]
    assert any(path.is_relative_to(ROOT / "docs") for path in files), "git ls-files lists nothing under docs/"
    total = sum(path.stat().st_size for path in files if path.exists())
    largest = sorted(files, key=lambda path: -path.stat().st_size if path.exists() else 0)[:3]
    assert total <= DOCS_BYTES, (f"{total} bytes tracked under docs/ and in result files elsewhere, over "
                                 f"{DOCS_BYTES}; the largest: {[str(path.relative_to(ROOT)) for path in largest]}")
