"""docs/design.md walks one step through the code by name: every ``Class.member`` and ``module.name`` it names in
backticks is defined in `hf_triforce` (read from the source, nothing imported), and so is every bare name it gives in
backticks that reads as code (a CamelCase class, a snake_case function, method or field), so a rename or a move
shows here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
QUALIFIED = re.compile(r"`(\w+)\.(\w+)(?:\([^`]*\))?`")  # `Force3.score`, `ChainVerifier.verify(proposals, r, q)`
BARE = re.compile(r"`([A-Z][a-z]+\w*|[a-z][a-z0-9]*_[a-z0-9_]+)(?:\([^`]*\))?`")  # `Candidates`, `force3_steps`
FILE_SUFFIXES = {"py", "md", "sh"}  # `config.py`: a file, not a name


def definitions(root: Path = ROOT / "hf_triforce") -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per class name, its members (methods, class-level fields, attributes set on ``self``); per module name (the
    file's stem), its top-level names."""
    classes: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = modules.setdefault(path.stem, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, ast.Assign):
                top |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                top.add(node.target.id)
            if isinstance(node, ast.ClassDef):
                members = classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        members |= {target.id for target in item.targets if isinstance(target, ast.Name)}
                members |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                            and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ast.Store)}
    return classes, modules


def unknown_names(text: str, classes: dict[str, set[str]], modules: dict[str, set[str]]) -> list[str]:
    """The names ``text`` gives in backticks that the package does not define."""
    missing = []
    for owner, name in QUALIFIED.findall(text):
        if name in FILE_SUFFIXES:
            continue
        if owner in classes:
            known = name in classes[owner]
        elif owner in modules:
            known = name in modules[owner]
        else:
            known = False
        if not known:
            missing.append(f"{owner}.{name}")
    everything = ({"hf_triforce"} | set(classes) | set(modules) | {name for names in modules.values() for name in names}
                  | {name for names in classes.values() for name in names})
    missing += [name for name in BARE.findall(text) if name not in everything]
    return sorted(set(missing))


def test_the_check_finds_a_renamed_member_and_a_missing_function():
    classes, modules = {"Force3": {"score"}}, {"levels": {"Candidates", "proposal_steps"}}
    text = ("`Force3.score`, `Force3.verify`, `levels.Candidates`, `levels.propose`, `Nowhere.x`, `config.py`, "
            "`proposal_steps`, `missing_function(a)`, `Candidates`, `Absent`, `plain words`, `score`, `levels`, "
            "`force3_gone`")
    assert unknown_names(text, classes, modules) == ["Absent", "Force3.verify", "Nowhere.x", "force3_gone",
                                                     "levels.propose", "missing_function"]


def test_every_name_the_design_walk_gives_is_defined():
    classes, modules = definitions()
    missing = unknown_names(DESIGN.read_text(), classes, modules)
    assert not missing, f"docs/design.md names what hf_triforce does not define (renamed or moved?): {missing}"
