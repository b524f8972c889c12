"""Every script under benchmarks/ reproduces a figure the docs publish: each is named with its command in README.md
or docs/*.md (where the figures are published; the raw folders under docs/bench/ do not count), and every script the
docs, the scripts or the tests name is in the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a command line: ``python`` or ``python3``, then the script's path
COMMAND = re.compile(r"\bpython3?\s+benchmarks/(\w+\.py)\b")
NAMED = re.compile(r"\bbenchmarks/(\w+\.py)\b")


def published_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_benchmark_is_named_with_its_command_in_a_published_doc():
    commands = {name for doc in published_docs() for name in COMMAND.findall(doc.read_text())}
    scripts = sorted(path.name for path in (ROOT / "benchmarks").glob("*.py"))
    assert scripts, "no benchmarks found"
    uncited = [name for name in scripts if name not in commands]
    assert not uncited, (f"named with no command (`python benchmarks/<name>.py ...`) in README.md or docs/*.md: "
                         f"{uncited}; cite each beside the figure it reproduces, or remove it")


def test_every_named_benchmark_is_in_the_tree():
    texts = [*published_docs(), *(ROOT / "docs").rglob("*.md"), *(ROOT / "scripts").glob("*.sh"),
             *(ROOT / "tests").glob("*.py"), *(ROOT / "hf_triforce").rglob("*.py")]
    missing = sorted({(name, str(path.relative_to(ROOT))) for path in set(texts)
                      for name in NAMED.findall(path.read_text()) if not (ROOT / "benchmarks" / name).is_file()})
    assert not missing, f"named but not under benchmarks/ (script, where named): {missing}"
