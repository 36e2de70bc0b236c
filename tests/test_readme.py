"""The README and docs/ say only what the code does: a short README, commands and flags the CLI
accepts, config fields that exist, links that resolve, CI's test command, no tracker numbers.

Cheap by design (no model, no training, ~2 s with torch's import): the CLI's argparse parsers are
built in-process (``boosttune.cli._build``) and configs are parsed by the typed config
(``from_dict``: field names, types and each section's own checks; files and models are not opened).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

from boosttune.cli import _build
from boosttune.config import TrainConfig, apply_override, from_dict

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 300

FENCE = re.compile(r"^```([\w+-]*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# `boosttune SUB`, `.venv/bin/boosttune SUB`, `python -m boosttune.cli SUB`
COMMAND = re.compile(r"(?<![\w.-])boosttune(?:\.cli)?[ \t]+([a-z][\w-]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
OVERRIDE = re.compile(r"^[a-z_]+(?:\.[a-z_]+)+=")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
TRACKER = re.compile(r"#\d{2}|\bissues? \d", re.I)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def code_commands(text: str) -> list[tuple[str, bool]]:
    """Every command in ``text``'s code, and whether it is a whole fenced line (else an inline span, maybe
    a fragment): backslash continuations joined, comments cut, lines cut at ``&&``, ``;`` and pipes."""
    pieces = [(re.sub(r"(^|\s)#.*$", "", line), True)
              for _, body in fenced_blocks(text) for line in body.replace("\\\n", " ").splitlines()]
    pieces += [(span, False) for span in INLINE.findall(FENCE.sub("", text))]
    return [(part, whole) for piece, whole in pieces for part in re.split(r"&&|;| \| ", piece)]


def invocations(text: str) -> list[tuple[str, str, bool]]:
    """(subcommand, the rest of its command, whether that is whole) for each `boosttune SUB ...` in code."""
    return [(m.group(1), cmd[m.end():], whole)
            for cmd, whole in code_commands(text) for m in COMMAND.finditer(cmd)]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser, _ = _build()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


def test_readme_commands_and_flags_exist() -> None:
    parsers = subparsers()
    calls = invocations(README.read_text())
    walk = {"train", "export", "serve", "generate", "bench"}
    assert walk <= {sub for sub, _, _ in calls}, f"the README shows each of {sorted(walk)}"
    for sub, rest, whole in calls:
        assert sub in parsers, f"README.md names `boosttune {sub}`, which the CLI lacks ({sorted(parsers)})"
        accepted = set(parsers[sub]._option_string_actions)
        for flag in FLAG.findall(rest):
            assert flag in accepted, f"README.md passes {flag} to `boosttune {sub}`, which does not take it"
        if whole:  # the whole command parses, [optional] parts included: argument order, value types
            words = [w for w in shlex.split(rest.replace("[", " ").replace("]", " ")) if w != "..."]
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    parsers[sub].parse_args(words)
                except SystemExit:
                    pytest.fail(f"`boosttune {sub}{rest}` does not parse: {err.getvalue().strip()}")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_commands_and_flags_exist(doc: Path) -> None:
    """docs/ keep the commands that measured each figure: their subcommands and flags still exist."""
    parsers = subparsers()
    for sub, rest, _ in invocations(doc.read_text()):
        assert sub in parsers, f"{doc.name} names `boosttune {sub}`, which the CLI lacks ({sorted(parsers)})"
        for flag in FLAG.findall(rest):
            assert flag in parsers[sub]._option_string_actions, f"{doc.name}: `boosttune {sub}` lacks {flag}"


def test_readme_train_overrides_name_config_fields() -> None:
    """`boosttune train --config FILE ... section.field=value`: every field exists and takes its value."""
    trains = [rest for sub, rest, _ in invocations(README.read_text()) if sub == "train"]
    assert trains
    for rest in trains:
        words = shlex.split(rest)
        config = REPO / words[words.index("--config") + 1] if "--config" in words else None
        data = yaml.safe_load(config.read_text()) if config is not None and config.is_file() else {}
        for item in (w for w in words if OVERRIDE.match(w)):
            apply_override(data, item)
        from_dict(TrainConfig, data)


def test_readme_yaml_blocks_are_configs() -> None:
    blocks = [body for lang, body in fenced_blocks(README.read_text()) if lang == "yaml"]
    assert blocks, "the README shows a config for your own LLM"
    for body in blocks:
        from_dict(TrainConfig, yaml.safe_load(body))


def test_readme_test_command_is_ci() -> None:
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    blocks = fenced_blocks(README.read_text())
    readme = [line for _, body in blocks for line in body.splitlines() if "pytest" in line]
    assert len(ci) == 1 and readme, "one pytest line in .ci/run, and the README shows it"
    assert readme[0] == ci[0], f"README's test command {readme[0]!r} differs from .ci/run's {ci[0]!r}"


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the Markdown headings of ``text``."""
    heads = re.findall(r"^#+\s+(.*)$", FENCE.sub("", text), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in heading_anchors(dest.read_text()), f"{doc.name} links to {target}: no heading"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_no_tracker_numbers(doc: Path) -> None:
    hits = [line for line in doc.read_text().splitlines() if TRACKER.search(line)]
    assert not hits, f"{doc.name} cites tracker numbers (say what, not which ticket): {hits[:3]}"
