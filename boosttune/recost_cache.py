"""The served forward's costs kept on disk, so that a bundle served again on the same forward and machine
skips ``--recost``'s timing (15-40 s at every start of ``serve``, ``generate`` or ``bench`` with
``--quantize``) and takes the same fixed choice as the time before.

An entry is named by a digest of what the timings depend on: the scheduler's own costs and candidates
(which bundle), the forward served (``forward_label``: the LLM runner's dtype, quantization and
compilation), the calibration's prompts and length, torch's threads and version, the CPU (model and
flags) and the native kernels' source. Entries live in ``<cache>/recost`` (``core.models.cache_dir``);
``$BOOSTTUNE_RECOST_CACHE`` names another folder, and ``0`` turns the cache off. Deleting an entry or the
folder times the costs again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from boosttune.core.models import cache_dir
from boosttune.scheduler.costs import CostModel
from boosttune.scheduler.policy import Scheduler

FORMAT = 1


def folder() -> Path | None:
    """Where entries live; None: the cache is off (``BOOSTTUNE_RECOST_CACHE=0``)."""
    env = os.environ.get("BOOSTTUNE_RECOST_CACHE", "")
    if env == "0":
        return None
    return Path(env).expanduser() if env else cache_dir() / "recost"


def forward_label(runner: object) -> str:
    """The LLM runner's forward as the timings see it, e.g. "torch.float32 w8a8 compiled"."""
    quantized = getattr(runner, "quantized", None) or "unquantized"
    compiled = "compiled" if getattr(runner, "compiled", None) is not None else "eager"
    return f"{runner.model.dtype} {quantized} {compiled}"  # type: ignore[attr-defined]


def entry_key(sched: Scheduler, runner: object, prompts: Sequence[Sequence[int]], tokens: int) -> str:
    """The digest naming the entry for ``sched`` timed on ``runner``'s forward with ``prompts`` and ``tokens``."""
    from boosttune.serving import native

    source = native.SOURCE.read_bytes() if native.SOURCE.exists() else b""
    what = {
        "format": FORMAT, "costs": sched.costs.to_json(), "drafters": list(sched.drafters),
        "widths": list(sched.widths), "draft_vocab": sched.draft_vocab, "forward": forward_label(runner),
        "prompts": [list(p) for p in prompts], "tokens": tokens, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "cpu": native.cpu_digest(), "native": hashlib.sha256(source).hexdigest(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def load(key: str) -> tuple[CostModel, Path] | None:
    """The kept costs and their file, or None (no entry, the cache off, or an entry that does not read)."""
    where = folder()
    if where is None:
        return None
    path = where / f"{key}.json"
    try:
        return CostModel.from_json(json.loads(path.read_text())["costs"]), path
    except (OSError, ValueError, KeyError, TypeError):  # none, or torn or older: timed again, then rewritten
        return None


def save(key: str, costs: CostModel) -> Path | None:
    """Keep ``costs`` under ``key`` (written whole, then renamed); None where the cache is off or the folder
    cannot be written (serving goes on without it)."""
    where = folder()
    if where is None:
        return None
    path = where / f"{key}.json"
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "costs": costs.to_json()}))
        tmp.replace(path)
    except OSError:
        return None
    return path
