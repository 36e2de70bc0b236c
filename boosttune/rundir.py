"""The run directory of `boosttune train`: where every artefact lives, and how to read it back.

Layout (everything a run makes; resuming trusts only what is complete)::

    RUN_DIR/
      config.yaml            the resolved training config (every default filled in)
      prompts/               prompt set: prompts.jsonl + complete.json
      teacher/               LLM continuations: shard-RRRRR-SSSSS.arrow (+ .done markers), meta.json
      stages/stage-K/        work dir of boost-tuning stage K (checkpoints, logs, match flags)
      ssms/ssm-K/            trained SSM K: HF save_pretrained (config.json, model.safetensors,
                             tokenizer files) + stats.json; complete.json written last
      draft_vocab.json       the LLM's tokens ranked by frequency in the teacher's training outputs
                             (serving/draft_vocab.py), for SSMs drafting over a cut vocabulary
      report.json            run report: llm, tree, teacher, one entry per stage, evaluation
      scheduler/             learned scheduler (issue 4) + scheduler_report.json/.png

``report.json`` (format 1)::

    {"format": 1,
     "llm": {"ref": str, "path": str, "dtype": str},
     "tree": {TreeConfig fields},
     "teacher": {...},
     "stages": [{"stage": K, "ssm_dir": "ssms/ssm-K", "pool_before": int, "pool_after": int,
                 "match_rate": float, "ensemble_match_rate": float, "train_loss": float, ...}],
     "evaluation": {...}}
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

REPORT = "report.json"
REPORT_FORMAT = 1
MARKER = "complete.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def mark_complete(directory: Path, info: dict | None = None) -> None:
    """Declare ``directory`` whole: its marker is the last file written."""
    atomic_write_json(directory / MARKER, info or {})


def is_complete(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def read_report(run_dir: str | Path) -> dict:
    """The run's report.json, with a clear error when the directory is not a training run."""
    path = Path(run_dir) / REPORT
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {REPORT}; is this a `boosttune train` run directory?")
    report = json.loads(path.read_text())
    if report.get("format") != REPORT_FORMAT:
        raise ValueError(f"{path}: report format {report.get('format')!r}, expected {REPORT_FORMAT}")
    return report


def ssm_dirs(run_dir: str | Path) -> list[Path]:
    """The trained SSMs of a run, in stage order (only complete ones)."""
    run = Path(run_dir)
    dirs = [run / s["ssm_dir"] for s in read_report(run).get("stages", [])]
    return [d for d in dirs if is_complete(d)]

