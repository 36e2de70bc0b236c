"""Write docs/config.md, the reference of `boosttune train`'s YAML, from the typed config dataclasses.

Every section of :class:`boosttune.config.TrainConfig` (``llm:``, ``prompts:``, ... ``scheduler:``) gets a
table of its fields: name, type, default, and the field's description from its class's docstring
(``Attributes:`` section) or the docstring written under the field. Nested sections (``boost.match``,
``prompts.sources``) get tables of their own. The dataclasses are the one source of truth; the file is
never edited by hand.

    .venv/bin/python scripts/config_docs.py            # (re)write docs/config.md
    .venv/bin/python scripts/config_docs.py --check    # exit 1 when docs/config.md is not what it would write
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from boosttune.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"
COMMAND = "python scripts/config_docs.py"

HEADER = f"""\
# `boosttune train` configuration

<!-- Generated from boosttune/config.py by `{COMMAND}`; edit the dataclasses' docstrings, not this file. -->

A config is a YAML mapping of the sections below (`configs/*.yaml` are examples: `configs/tiny.yaml` runs
in a minute on a laptop, `configs/smollm2-demo.yaml` is the demo). Any field can also be set on the command
line as `section.field=value`, the value read as YAML:

```
boosttune train --config configs/tiny.yaml --run-dir runs/t optim.lr=3e-4 boost.num_ssms=5 \\
    prompts.sources='[{{kind: default}}]'
```

Unknown fields, wrong types and bad values fail at start, naming the field. A run directory keeps its
resolved config (`RUN_DIR/config.yaml`, every default filled in); resuming checks the new one against it.
"""


@dataclass(frozen=True)
class Row:
    """One field of a section's table."""

    name: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    """One table: a dataclass reached from :class:`TrainConfig` at ``path`` (``boost.match``, ...)."""

    path: str
    cls: type
    intro: str
    rows: list[Row]


# ------------------------------------------------------------------------------------------- docstrings
def attributes_section(doc: str) -> dict[str, str]:
    """Field descriptions of a Google-style ``Attributes:`` section: ``name: text``, continuation lines
    indented deeper than the names."""
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:") + 1
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    indent: int | None = None
    name = None
    for line in lines[start:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:  # the section ended
            break
        match = re.match(r"(\w+)\s*:\s*(.*)", line.strip())
        if depth == indent and match:
            name = match.group(1)
            out[name] = match.group(2)
        elif name is not None:
            out[name] += " " + line.strip()
    return out


def field_docstrings(cls: type) -> dict[str, str]:
    """The string literal written under each annotated field of ``cls`` (attribute docstrings)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]  # the class definition's statements
    out = {}
    for node, following in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            out[node.target.id] = inspect.cleandoc(following.value.value)
    return out


@functools.cache  # reading a class's source parses its whole module
def descriptions(cls: type) -> dict[str, str]:
    """Each field's description: its entry under ``Attributes:``, else the docstring under it."""
    return {**field_docstrings(cls), **attributes_section(cls.__doc__ or "")}


def summary(cls: type) -> str:
    """A class docstring's text before its ``Attributes:`` section ('' for the generated default)."""
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):  # dataclasses write their signature where a class has none
        return ""
    return inspect.cleandoc(doc).split("Attributes:")[0].strip()


def markdown(text: str) -> str:
    """Docstring text as one table cell: one line, RST literals as Markdown code, pipes escaped."""
    text = re.sub(r"``([^`]+)``", r"`\1`", " ".join(text.split()))
    return text.replace("|", "\\|")


# ------------------------------------------------------------------------------------------- values
def type_name(tp: Any) -> str:
    """An annotation as a reader of YAML would say it."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin in (list, tuple):
        item = type_name(args[0]) if args else "any"
        return f"list of {item}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(tp, getattr(tp, "__name__", str(tp)))


def default_of(f: dataclasses.Field) -> Any:
    """The field's default value (a factory's product)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"{f.name} has no default: every config field needs one")


def yaml_value(value: Any) -> str:
    """``value`` as it would be written in a config (YAML flow style)."""
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=10**6, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def _plain(value: Any) -> Any:
    """``value`` with dataclasses as mappings and tuples as lists (what YAML writes)."""
    if dataclasses.is_dataclass(value):  # the fields set otherwise than by default; else the first (its kind)
        fields = dataclasses.fields(value)
        changed = {f.name: getattr(value, f.name) for f in fields if getattr(value, f.name) != default_of(f)}
        return _plain(changed or {fields[0].name: getattr(value, fields[0].name)})
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ------------------------------------------------------------------------------------------- sections
def _nested(tp: Any) -> type | None:
    """The dataclass a field holds, directly or as a list's items (None: a plain value)."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (list, tuple) and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def sections(cls: type = TrainConfig, path: str = "", intro: str = "") -> Iterator[Section]:
    """The tables of ``cls`` (a section at ``path``) and of the sections nested in it, depth first."""
    hints = typing.get_type_hints(cls)
    docs = descriptions(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        sub = _nested(tp)
        where = f"{path}.{f.name}" if path else f.name
        if sub is not None:
            nested.append((sub, where, docs.get(f.name, "")))
        if path:  # the top level's fields are the sections themselves
            default = f"see `{where}`" if dataclasses.is_dataclass(tp) else f"`{yaml_value(default_of(f))}`"
            rows.append(Row(f.name, type_name(tp), default, markdown(docs.get(f.name, ""))))
    if path:
        yield Section(path, cls, intro, rows)
    for sub, where, doc in nested:
        yield from sections(sub, where, doc)


def undocumented() -> list[str]:
    """Dotted names of the fields without a description (each should have one)."""
    return [f"{s.path}.{r.name}" for s in sections() for r in s.rows if not r.description]


def render() -> str:
    """The whole of docs/config.md."""
    parts = [HEADER]
    listed = list(sections())
    parts.append("Sections: " + ", ".join(f"[`{s.path}`](#{s.path.replace('.', '')})" for s in listed) + ".\n")
    for s in listed:
        source = Path(inspect.getfile(s.cls)).resolve().relative_to(ROOT).as_posix()
        parts.append(f"## {s.path}\n")
        parts.append(f"`{s.cls.__name__}` in `{source}`.\n")
        text = " ".join(t for t in (markdown(summary(s.cls)), markdown(s.intro)) if t)
        if text:
            parts.append(text + "\n")
        parts.append("| field | type | default | description |\n| --- | --- | --- | --- |")
        parts.extend(f"| `{r.name}` | {r.type} | {r.default} | {r.description or '—'} |" for r in s.rows)
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the file is out of date")
    p.add_argument("--out", type=Path, default=DOC, help=f"the file (default {DOC.relative_to(ROOT)})")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} is out of date with boosttune/config.py: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    missing = undocumented()
    if missing:
        print(f"fields without a description: {', '.join(missing)}", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
