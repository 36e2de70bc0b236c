"""A dependency's floor in pyproject.toml is a version the tests run, not an older one nobody tried."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def floor(package: str) -> Version:
    """The ``>=`` bound pyproject.toml's dependencies give ``package``."""
    m = re.search(rf'^\s*"{re.escape(package)}>=([0-9][^",<]*)', PYPROJECT.read_text(), re.MULTILINE)
    assert m, f"pyproject.toml: no {package}>= in dependencies"
    return Version(m.group(1))


def test_gguf_floor_is_the_tested_version() -> None:
    """Export's GGUF writer and transformers' GGUF loading are tested with the installed gguf only: the
    floor must not claim older releases work (raise it with the version the tests run)."""
    tested = Version(importlib.metadata.version("gguf"))
    assert floor("gguf").release[:2] == tested.release[:2], (floor("gguf"), tested)
