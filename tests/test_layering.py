"""The package is layered, and kernels only compute.

* `LAYERS`, top to bottom: a module imports only from its own layer's package or from layers below it, at the top,
  inside a function or under ``TYPE_CHECKING``; no import circle anywhere;
* no module of `hf_triforce.kernels` imports what decides which model and forward each tier runs (the decoding
  package, the configuration, the drafters);
* each decision has one home: no function of `decoding.tiers` is also reachable from `kernels.lean`;
* the measurement bench (``hf_triforce_bench``) sits beside the package, above it: no module of the package imports it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import hf_triforce
import hf_triforce.kernels
from hf_triforce.decoding import tiers
from hf_triforce.kernels import lean

DECIDING = ("hf_triforce.decoding", "hf_triforce.config", "hf_triforce.drafters")
KERNELS = sorted(Path(hf_triforce.kernels.__file__).parent.glob("*.py"))
PACKAGE = Path(hf_triforce.__file__).parent

# Top to bottom; the packages (or modules) of one entry are independent of each other.
LAYERS = (
    ("hf_triforce", "hf_triforce.__main__"),  # the package, python -m hf_triforce
    ("hf_triforce.tools",),  # the CLI, the demo and its timing
    ("hf_triforce.serving",),  # a server
    ("hf_triforce.continuous",),  # requests joining and leaving one batch
    ("hf_triforce.integration",),  # generate(triforce_config=), custom_generate
    ("hf_triforce.assisted",),  # TriForceConfig(loop="assisted")
    ("hf_triforce.candidates",),  # the CandidateGenerator, transformers' candidate_generator= factory
    ("hf_triforce.request",),  # validation, padding, prefix cache, output classes
    ("hf_triforce.decoding",),  # the hierarchy, the loop, levels, Force 3, the policy
    ("hf_triforce.config",),
    ("hf_triforce.drafters",),
    ("hf_triforce.forwards",),  # a forward on a cache, forward requests, the clock
    ("hf_triforce.kernels",),
    ("hf_triforce.verification", "hf_triforce.caches"),
    ("hf_triforce.assets",),  # the bundled models and texts, the library's cache folder
    ("hf_triforce.compat", "hf_triforce.digests", "hf_triforce.stats", "hf_triforce.tokens"),
)


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


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = package_modules()


def module_imports(name: str) -> set[str]:
    """The package's modules that module ``name`` imports, wherever the import statement sits (``from a import b``:
    ``a.b`` where that is a module, else ``a``)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found.update(f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
                         for alias in node.names)
    return {imported for imported in found if imported in MODULES and imported != name}


def layer_of(name: str) -> int:
    """The index in `LAYERS` of module ``name`` (the longest prefix that names it)."""
    matches = [(len(prefix), index) for index, layer in enumerate(LAYERS) for prefix in layer
               if name == prefix or name.startswith(f"{prefix}.")]
    assert matches, f"{name} is in no layer: add it to LAYERS"
    return max(matches)[1]


def import_graph() -> dict[str, set[str]]:
    return {name: module_imports(name) for name in MODULES}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a module from a higher layer, or from another package of its own layer."""
    wrong = []
    for importer, imported in sorted((a, b) for a, targets in graph.items() for b in targets):
        here, there = layer_of(importer), layer_of(imported)
        sibling = here == there and _top(importer, here) != _top(imported, there)
        if there < here or sibling:
            wrong.append((importer, imported))
    return wrong


def _top(name: str, layer: int) -> str:
    return max((prefix for prefix in LAYERS[layer] if name == prefix or name.startswith(f"{prefix}.")), key=len)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_layer_checks_see_a_circle_and_an_arrow_up():
    """The checks below can fail: a planted import of the loop from a drafter is an arrow up and closes a circle."""
    graph = import_graph()
    graph["hf_triforce.drafters.model"] = graph["hf_triforce.drafters.model"] | {"hf_triforce.decoding.loop"}
    assert ("hf_triforce.drafters.model", "hf_triforce.decoding.loop") in upward_imports(graph)
    assert any("hf_triforce.drafters.model" in circle for circle in circles(graph))
    assert layer_of("hf_triforce.decoding.tiers") > layer_of("hf_triforce.request") > layer_of("hf_triforce")


def test_every_module_imports_from_its_own_package_or_below():
    assert upward_imports(import_graph()) == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def bench_imports(source: str, package: str = "hf_triforce") -> list[str]:
    return sorted(name for name in imported_modules(source, package)
                  if name == "hf_triforce_bench" or name.startswith("hf_triforce_bench."))


def test_the_package_never_imports_the_bench():
    """The bench depends on the package, never the reverse (the check can fail: a planted import is seen)."""
    assert bench_imports("def f():\n    from hf_triforce_bench.compare import compare\n") == [
        "hf_triforce_bench.compare", "hf_triforce_bench.compare.compare"]
    assert {path.name: bench_imports(path.read_text(), name) for name, path in MODULES.items()
            if bench_imports(path.read_text(), name)} == {}
