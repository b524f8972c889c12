"""Write docs/api.md, the API reference of `hf_triforce`, from the code's own docstrings.

Every public name (``hf_triforce.__all__``, in that order): where it is defined, its signature and the first paragraph
of its docstring; for a dataclass, each of its own fields with its default and its doc (the class docstring's
``name: ...`` entry, under the docstring's section heading, else the field's comments in the source); for a class, its
public methods and properties. Deterministic (the same tree gives the same bytes) and cheap (imports only the package).

    python scripts/api_reference.py           # writes docs/api.md
    python scripts/api_reference.py --check   # exits 1 where docs/api.md is not what it would write
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
COMMAND = "python scripts/api_reference.py"
HEADING = re.compile(r"^-{3,}$")  # the underline of a docstring section heading
ENTRY = re.compile(r"^(\w+(?:, \w+)*): (.*)$")  # a ``name: doc`` (or ``name, other: doc``) entry of a class docstring


def paragraphs(doc: str | None) -> list[str]:
    """``doc``'s paragraphs (cleaned of indentation), each on one line."""
    text = inspect.cleandoc(doc or "")
    return [" ".join(line.strip() for line in block.splitlines()) for block in re.split(r"\n\s*\n", text)
            if block.strip()]


def first_paragraph(obj) -> str:
    found = paragraphs(inspect.getdoc(obj))
    return found[0] if found else "(no docstring)"


def annotation(value) -> str:
    text = value if isinstance(value, str) else inspect.formatannotation(value)
    return text.replace("typing.", "")


def default(value) -> str:
    if value is dataclasses.MISSING:
        return ""
    text = repr(value)
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def signature(obj, skip_self: bool = False) -> str:
    """``obj``'s parameters as written in the source (annotations unquoted, no object addresses)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts, star = [], False
    params = list(sig.parameters.values())[1 if skip_self else 0:]
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            star = True
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        text = prefix + p.name
        if p.annotation is not p.empty:
            text += f": {annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f"{' = ' if p.annotation is not p.empty else '='}{default(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (params.index(p) + 1 == len(params)
                                           or params[params.index(p) + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    returned = "" if sig.return_annotation is sig.empty else f" -> {annotation(sig.return_annotation)}"
    return f"({', '.join(parts)}){returned}"


def docstring_entries(cls, names: set[str]) -> dict[str, tuple[str, str]]:
    """The ``name: doc`` entries of ``cls``'s docstring for ``names`` (an entry ``a, b: doc`` documents both): name ->
    (its section heading, its doc)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    out, section, current = {}, "", []
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and HEADING.match(lines[i + 1].strip()) and line.strip():
            section, current = line.strip(), []
            continue
        if HEADING.match(line.strip()):
            continue
        match = ENTRY.match(line)
        if match and set(match.group(1).split(", ")) <= names:
            current = match.group(1).split(", ")
            out.update({name: (section, match.group(2).strip()) for name in current})
        elif current and line.startswith((" ", "\t")) and line.strip():
            out.update({name: (section, f"{out[name][1]} {line.strip()}") for name in current})
        else:
            current = []
    return out


def source_comments(cls, names: set[str]) -> dict[str, str]:
    """Each of ``names``' comments in ``cls``'s source: the comment lines just above its declaration and the one
    after it on its line."""
    try:
        source = inspect.cleandoc("\n" + inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for number, line in enumerate(lines, start=1):
        match = re.match(r"^\s+(\w+)\s*:", line)
        if not match or match.group(1) not in names or match.group(1) in out:
            continue
        above, n = [], number - 1
        while n in comments and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        after = [comments[number]] if number in comments else []
        out[match.group(1)] = " ".join(above + after)
    return out


def fields_section(cls) -> list[str]:
    """``cls``'s own dataclass fields: ``name: type = default``, its doc; grouped by the docstring's sections."""
    own = [f for f in dataclasses.fields(cls) if f.name in cls.__dict__.get("__annotations__", {})]
    names = {f.name for f in own}
    entries, comments = docstring_entries(cls, names), source_comments(cls, names)
    out, section = [], None
    for f in own:
        heading, doc = entries.get(f.name, (section, comments.get(f.name, "")))
        if heading != section and heading:
            out += ["", f"*{heading}*", ""]
        section = heading
        value = "" if f.default is dataclasses.MISSING else f" = {default(f.default)}"
        if f.default_factory is not dataclasses.MISSING:
            value = f" = {f.default_factory.__name__}()"
        out.append(f"- `{f.name}: {annotation(f.type)}{value}`" + (f": {doc}" if doc else ""))
    return out


def members_section(cls) -> list[str]:
    """``cls``'s own public methods and properties (in the source's order), each with its first paragraph."""
    field_names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name in field_names:
            continue
        if isinstance(value, property):
            out.append(f"- `{name}` (property): {first_paragraph(value)}")
        elif isinstance(value, (staticmethod, classmethod)):
            out.append(f"- `{name}{signature(value.__func__, isinstance(value, classmethod))}`"
                       f" ({type(value).__name__}): {first_paragraph(value.__func__)}")
        elif inspect.isfunction(value):
            out.append(f"- `{name}{signature(value, skip_self=True)}`: {first_paragraph(value)}")
    return out


def where(obj) -> str:
    module = sys.modules[obj.__module__]
    path = Path(inspect.getfile(module)).resolve().relative_to(ROOT).as_posix()
    return f"`{obj.__module__}.{obj.__qualname__}` ({path})"


def entry(name: str, obj) -> list[str]:
    lines = [f"## `{name}`", "", where(obj), ""]
    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj):
            lines.append(first_paragraph(obj))
            fields = fields_section(obj)
            if fields:
                lines += ["", "Fields:", *([""] if fields[0] else []), *fields]
        else:
            lines += [f"`{name}{signature(obj)}`", "", first_paragraph(obj)]
        members = members_section(obj)
        if members:
            lines += ["", "Methods and properties:", "", *members]
    else:
        lines += [f"`{name}{signature(obj)}`", "", first_paragraph(obj)]
    return lines + [""]


def reference() -> str:
    """docs/api.md as this tree's docstrings give it."""
    import hf_triforce

    lines = ["# API reference", "",
             "The public names of `hf_triforce` (`hf_triforce.__all__`), generated from their docstrings by "
             f"`{COMMAND}` (tests/test_api_reference.py checks that this file is its output: rerun it after "
             "changing a public docstring, signature or field). Each entry: where it is defined, its signature and "
             "the first paragraph of its docstring; the full text is in the source. How the parts fit: "
             "docs/design.md; the configuration in depth: docs/config.md.", ""]
    lines += [f"- [`{name}`](#{name.lower()})" for name in hf_triforce.__all__] + [""]
    for name in hf_triforce.__all__:
        lines += entry(name, getattr(hf_triforce, name))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help=f"compare with {OUT.relative_to(ROOT)}, write nothing")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the file written (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    text = reference()
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else f'differs from what {COMMAND} writes'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
