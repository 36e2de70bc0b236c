"""Plain-text tables for command output: each column padded to its widest cell, a dashed rule under
the header row."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a table whose first row is the header; every row has the header's length."""
    assert rows and all(len(r) == len(rows[0]) for r in rows), "rows of unequal length"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
