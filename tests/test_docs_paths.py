"""The documents cite only data that the tree holds: every path under ``docs/bench/`` named in README.md or a
document under docs/ exists (a citation of a folder: the folder; ``{a,b}`` alternatives: each), and the tracked files
under docs/ stay within 1 MB."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path under docs/bench/, up to the first character no path here contains (a backtick, a space, a bracket)
CITED = re.compile(r"docs/bench/[\w./{},-]*")
DOCS_BYTES = 1_000_000


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


def test_the_tracked_docs_stay_within_a_megabyte():
    listed = subprocess.run(["git", "ls-files", "-z", "docs"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [ROOT / name for name in listed.stdout.split("\0") if name]
    assert files, "git ls-files lists nothing under docs/"
    total = sum(path.stat().st_size for path in files if path.exists())
    largest = sorted(files, key=lambda path: -path.stat().st_size if path.exists() else 0)[:3]
    assert total <= DOCS_BYTES, (f"{total} bytes tracked under docs/, over {DOCS_BYTES}; the largest: "
                                 f"{[str(path.relative_to(ROOT)) for path in largest]}")
