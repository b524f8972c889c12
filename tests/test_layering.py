"""Kernels only compute: which model and forward each tier runs is decided in `hf_triforce.decoding.tiers`.

* no module of `hf_triforce.kernels` imports what decides (the decoding package, the configuration, the drafters,
  which import the decoding package), at the top or inside a function;
* each decision has one home: no function of `decoding.tiers` is also reachable from `kernels.lean`.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import hf_triforce.kernels
from hf_triforce.decoding import tiers
from hf_triforce.kernels import lean

DECIDING = ("hf_triforce.decoding", "hf_triforce.config", "hf_triforce.drafters")
KERNELS = sorted(Path(hf_triforce.kernels.__file__).parent.glob("*.py"))


def imported_modules(source: str, package: str) -> set[str]:
    """Every module a file of ``package`` imports (relative imports made absolute; ``from a import b`` counts
    ``a`` and ``a.b``, which may be a module), wherever the import statement sits."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def deciding_imports(source: str, package: str = "hf_triforce.kernels") -> list[str]:
    return sorted(name for name in imported_modules(source, package)
                  if any(name == deciding or name.startswith(f"{deciding}.") for deciding in DECIDING))


def test_the_import_check_sees_imports_anywhere_in_a_file():
    """The check below can fail: a relative import inside a function, an absolute one, ``from .. import config``."""
    planted = "def f():\n    from ..decoding.tiers import tier_model\n"
    assert deciding_imports(planted) == ["hf_triforce.decoding.tiers", "hf_triforce.decoding.tiers.tier_model"]
    assert deciding_imports("import hf_triforce.drafters.registry\n") == ["hf_triforce.drafters.registry"]
    assert deciding_imports("from .. import compat, config\n") == ["hf_triforce.config"]
    assert deciding_imports("from .. import compat\nfrom .attention import recording\n") == []


@pytest.mark.parametrize("path", KERNELS, ids=lambda path: path.name)
def test_kernels_do_not_import_what_decides(path):
    assert deciding_imports(path.read_text()) == []


def test_each_tier_decision_has_one_home():
    decisions = [name for name, value in inspect.getmembers(tiers, inspect.isfunction)
                 if value.__module__ == tiers.__name__]
    assert {"resolve_draft_precision", "lean_support", "tier_model", "lean_model"} <= set(decisions)
    assert [name for name in decisions if hasattr(lean, name)] == []
