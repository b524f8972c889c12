"""docs/api.md is what `python scripts/api_reference.py` writes from this tree's docstrings (it cannot drift from
the code), and the script reads a dataclass's field docs from both places the code keeps them: a ``name: doc`` entry
of the class docstring (under its section heading) and the comments at the field's declaration."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def api():
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Sample:
    """A sample of the field docs the code keeps.

    Settings
    --------
    The first group.

    size: integer >= 1, default 4: how many;
        continued on an indented line.

    Tuning
    ------
    rate, scale: floats.
    """

    size: int = 4
    rate: float = 0.5
    scale: float = 1.0
    plain: int = 0
    # what a comment above the field says,
    # over two lines
    counts: dict = dataclasses.field(default_factory=dict)
    name: str = "x"  # a trailing comment

    def total(self, extra: int = 0) -> int:
        """The size plus ``extra``.

        Not this paragraph."""
        return self.size + extra


def test_field_docs_come_from_the_docstring_entries_and_the_comments(api):
    lines = api.fields_section(Sample)
    assert lines == ["", "*Settings*", "", "- `size: int = 4`: integer >= 1, default 4: how many; continued on an "
                     "indented line.", "", "*Tuning*", "", "- `rate: float = 0.5`: floats.",
                     "- `scale: float = 1.0`: floats.", "- `plain: int = 0`",
                     "- `counts: dict = dict()`: what a comment above the field says, over two lines",
                     "- `name: str = 'x'`: a trailing comment"]
    assert api.members_section(Sample) == ["- `total(extra: int = 0) -> int`: The size plus ``extra``."]


def test_docs_api_md_is_what_the_script_writes(api):
    published = (ROOT / "docs" / "api.md").read_text()
    assert published == api.reference(), ("docs/api.md differs from the docstrings: run `python "
                                         "scripts/api_reference.py` and commit docs/api.md")
    assert len(published.encode()) < 60_000  # a reference of first paragraphs, not the whole source
