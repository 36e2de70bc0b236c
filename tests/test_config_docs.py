"""docs/config.md is generated from the typed config (scripts/config_docs.py) and must stay current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import load_script

from boosttune.config import TrainConfig


@pytest.fixture(scope="module")
def config_docs():
    """scripts/config_docs.py (not a package), loaded from its file."""
    return load_script("config_docs")


def test_docs_config_md_is_current(config_docs) -> None:
    written = config_docs.DOC.read_text(encoding="utf-8") if config_docs.DOC.is_file() else ""
    assert written == config_docs.render(), (
        f"docs/config.md is stale (the config dataclasses changed): regenerate it with `{config_docs.COMMAND}`")


def test_every_field_of_every_section_is_documented(config_docs) -> None:
    tables = {s.path: [r.name for r in s.rows] for s in config_docs.sections()}
    for f in dataclasses.fields(TrainConfig):
        assert [g.name for g in dataclasses.fields(getattr(TrainConfig(), f.name))] == tables[f.name], f.name
    assert tables["boost.match"] == ["kind", "k", "fraction"] and "prompts.sources" in tables
    assert config_docs.undocumented() == [], "give these fields a docstring in their dataclass"


def test_rows_carry_type_default_and_description(config_docs) -> None:
    rows = {(s.path, r.name): r for s in config_docs.sections() for r in s.rows}
    lr = rows["optim", "lr"]
    assert (lr.type, lr.default) == ("float", "`0.0008`") and "learning rate" in lr.description
    assert rows["optim", "loss"].type == "one of `ce`, `ce+kl`, `ce+tv`"
    assert rows["scheduler", "widths"].type == "list of int or null" and rows["scheduler", "widths"].default == "`null`"
    assert rows["feature", "heads"].description.startswith("how many feature heads")  # from `Attributes:`
    assert rows["prompts", "sources"].default == "`[{kind: default}]`"
    assert "\n" not in rows["boost", "mode"].description and "`quantile`" in rows["boost", "mode"].description


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(config_docs, tmp_path: Path, capsys) -> None:
    out = tmp_path / "config.md"
    assert config_docs.main(["--check", "--out", str(out)]) == 1  # missing
    out.write_text(config_docs.render().replace("| `lr` |", "| `learning_rate` |"), encoding="utf-8")
    assert config_docs.main(["--check", "--out", str(out)]) == 1
    assert config_docs.COMMAND in capsys.readouterr().err
    assert config_docs.main(["--out", str(out)]) == 0
    assert config_docs.main(["--check", "--out", str(out)]) == 0
