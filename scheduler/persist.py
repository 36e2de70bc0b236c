"""The scheduler file: plain JSON with a format version, an allow-list of types and a sha256 self-check.

Nothing loaded at serve time is unpickled. The file is::

    {"format": "boosttune.scheduler", "version": 1, "sha256": "<hex>", "body": {"type": "scheduler", ...}}

``sha256`` is the digest of the body's canonical JSON (sorted keys, no spaces, no NaN). Every
object in the body that carries a ``"type"`` must name an allowed type. A file that is not JSON,
names another format or version, fails the digest (altered or corrupted) or holds an unknown type
is refused with a ``SchedulerFileError`` that says what to do. The digest detects corruption and
careless edits, not a deliberate forgery (the bundle's manifest hashes guard the whole bundle).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from boosttune.core.files import atomic_write_text
from boosttune.serving.manifest import MAX_JSON_DEPTH, json_depth

FORMAT = "boosttune.scheduler"
VERSION = 1
ALLOWED_TYPES = frozenset({"scheduler", "feature_spec", "linear_model", "cost_model"})
_RETRAIN = "retrain it with `boosttune train-scheduler RUN_DIR`"
MAX_SCHEDULER_BYTES = 64 << 20
"""Larger scheduler files are refused unread (one holds a linear model over the LLM's hidden width: a few
MiB for a 4096-wide LLM)."""


class SchedulerFileError(ValueError):
    """A scheduler file that must not be used (its message says why and what to do)."""


def canonical(body: Any) -> str:
    """The body's canonical JSON text (what the digest covers)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)


def digest(body: Any) -> str:
    return hashlib.sha256(canonical(body).encode("utf-8")).hexdigest()


def write_scheduler_file(path: str | Path, body: dict) -> None:
    """Write ``body`` (a JSON tree whose root has type "scheduler") atomically, with its digest."""
    check_types(body)
    envelope = {"format": FORMAT, "version": VERSION, "sha256": digest(body), "body": body}
    atomic_write_text(Path(path), json.dumps(envelope, allow_nan=False) + "\n")


def read_scheduler_file(path: str | Path) -> dict:
    """The verified body of a scheduler file; refuses anything not written by this version."""
    p = Path(path)
    if not p.is_file():
        raise SchedulerFileError(f"{p}: no scheduler file there; {_RETRAIN}")
    size = p.stat().st_size
    if size > MAX_SCHEDULER_BYTES:
        raise SchedulerFileError(f"{p}: {size} bytes, more than a scheduler file may have ({MAX_SCHEDULER_BYTES}); "
                                 f"{_RETRAIN}")
    try:
        envelope = json.loads(p.read_bytes().decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise SchedulerFileError(
            f"{p}: not a JSON scheduler file ({e}); pickle/skops files are never loaded; {_RETRAIN}"
        ) from None
    except RecursionError:  # json recurses once per nesting level
        raise SchedulerFileError(f"{p}: JSON nested too deeply for a scheduler file; {_RETRAIN}") from None
    if json_depth(envelope) > MAX_JSON_DEPTH:  # before anything recurses over it (check_types, digest)
        raise SchedulerFileError(f"{p}: JSON nested deeper than {MAX_JSON_DEPTH} levels; {_RETRAIN}")
    if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
        got = envelope.get("format") if isinstance(envelope, dict) else type(envelope).__name__
        raise SchedulerFileError(f"{p}: format {got!r} is not {FORMAT!r}; {_RETRAIN}")
    if envelope.get("version") != VERSION:
        raise SchedulerFileError(
            f"{p}: scheduler file version {envelope.get('version')!r}, "
            f"this boosttune reads version {VERSION}; {_RETRAIN}"
        )
    body = envelope.get("body")
    if not isinstance(body, dict) or envelope.get("sha256") != digest(body):
        raise SchedulerFileError(f"{p}: failed its sha256 self-check (altered or corrupted); {_RETRAIN}")
    try:
        check_types(body)
    except ValueError as e:
        raise SchedulerFileError(f"{p}: {e}; {_RETRAIN}") from None
    return body


def check_types(obj: Any, where: str = "body") -> None:
    """Refuse any object whose ``type`` is not in ``ALLOWED_TYPES`` (the root must be a scheduler)."""
    if where == "body" and (not isinstance(obj, dict) or obj.get("type") != "scheduler"):
        raise ValueError("the body's type must be 'scheduler'")
    if isinstance(obj, dict):
        if "type" in obj and obj["type"] not in ALLOWED_TYPES:
            raise ValueError(f"unknown type {obj['type']!r} at {where}; allowed: {sorted(ALLOWED_TYPES)}")
        for key, value in obj.items():
            check_types(value, f"{where}.{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            if isinstance(value, (dict, list)):
                check_types(value, f"{where}[{i}]")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a scheduler file may hold")
