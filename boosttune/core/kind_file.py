"""A drafter directory's declaration of its kind (``drafter.json``), and the migration for directories
written before kinds were declared.

Training writes the declaration when it publishes a drafter; ``boosttune.serving.kinds`` (the
registry) builds the drafter of the kind it names. A directory without one (a run from before kinds
were declared, or a hub SSM) is migrated here, explicitly: a feature head is recognised by its own
format file (``core/feature_head.py``), an EAGLE-3 head by its marker (``core/eagle3_head.py``),
anything else is an SSM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from boosttune.core.eagle3_head import SPEC_FILE as EAGLE3_FILE
from boosttune.core.feature_head import FEATURE_FILE

KIND_FILE = "drafter.json"
"""``{"kind": name}`` in a trained drafter's directory."""


def declare_kind(directory: str | Path, name: str) -> None:
    """Write ``directory``'s declaration that it holds a drafter of kind ``name``."""
    (Path(directory) / KIND_FILE).write_text(json.dumps({"kind": name}) + "\n", encoding="utf-8")


def declared_kind(directory: str | Path) -> str:
    """The kind ``directory`` declares, or the migrated one for directories without a declaration
    ("eagle3" where an EAGLE-3 head's marker is, "feature" where the feature head's format file is, else "ssm"). Whether the kind is registered
    is the registry's to say (``boosttune.serving.kinds.kind``)."""
    directory = Path(directory)
    declared = directory / KIND_FILE
    if not declared.is_file():
        if (directory / EAGLE3_FILE).is_file():
            return "eagle3"
        return "feature" if (directory / FEATURE_FILE).is_file() else "ssm"
    try:
        data: Any = json.loads(declared.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{declared}: not valid JSON ({e}); write {{\"kind\": name}} or remove it") from None
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str) or not data["kind"]:
        raise ValueError(f"{declared} must hold {{\"kind\": name}}, got {data!r}")
    return data["kind"]
