"""What the engine exports (``--format hf`` and ``--format gguf``) share: the run's SSMs and the
atomic output directory.

Both formats export every complete SSM of a run (``RunDir.ssm_dirs()``, the same ones the bundle
export carries), each checked before any file is written: safetensors weights, a config.json, and
the LLM's tokenizer. The output is written into a temporary sibling of ``--out`` and renamed into
place at the end, as ``export_bundle`` does, so an interrupted export never leaves half a folder.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from boosttune.core.rundir import RunDir

STATS = "stats.json"


@dataclass(frozen=True)
class RunSSM:
    """One complete SSM of a run, with what the run says about it."""

    name: str
    """Its name in the run (``ssm-K``): the export's folder or file name."""
    dir: Path
    """Its ``save_pretrained`` directory in the run."""
    stage: int
    """The boost-tuning stage that trained it."""
    report: dict = field(default_factory=dict)
    """Its stage entry in report.json (empty when the report has none)."""
    stats: dict = field(default_factory=dict)
    """Its stats.json (empty when absent)."""
    evaluation: dict = field(default_factory=dict)
    """Its entry in report.json's ``evaluation.singles`` (τ, speed-up; empty when not evaluated)."""


@dataclass(frozen=True)
class RunInfo:
    """A run's LLM and its complete SSMs, validated."""

    run: RunDir
    llm_ref: str
    llm_dir: Path
    report: dict
    ssms: list[RunSSM]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _check_ssm_files(src: Path) -> None:
    if not any(p.name.endswith(".safetensors") for p in src.iterdir() if p.is_file()):
        raise ValueError(
            f"SSM {src} has no *.safetensors weights; re-save it with save_pretrained(..., safe_serialization=True)"
        )
    if not (src / "config.json").is_file():
        raise ValueError(f"SSM {src} has no config.json; is it a transformers save_pretrained directory?")


def weight_files(src: Path) -> list[str]:
    """The safetensors weight files (and shard index) of a ``save_pretrained`` directory."""
    return sorted(p.name for p in src.iterdir()
                  if p.is_file() and p.name.endswith((".safetensors", ".safetensors.index.json")))


def read_run(run_dir: str | Path) -> RunInfo:
    """The run's LLM and complete SSMs, with a clear error for anything export cannot use."""
    from transformers import AutoTokenizer

    run = RunDir(run_dir)
    report = run.read_report()
    dirs = run.ssm_dirs()
    if not dirs:
        raise ValueError(f"{run}: no complete SSM under ssms/ (no complete.json); finish `boosttune train` first")
    llm_dir = run.llm_dir()
    stages = {str(run.root / s["ssm_dir"]): s for s in report.get("stages", []) if isinstance(s, dict) and "ssm_dir" in s}
    singles = (report.get("evaluation") or {}).get("singles") or []
    evaluated = {s.get("ssm"): s for s in singles if isinstance(s, dict)}
    llm_vocab = None
    ssms = []
    for k, src in enumerate(dirs, start=1):
        _check_ssm_files(src)
        if any((src / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            if llm_vocab is None:
                llm_vocab = AutoTokenizer.from_pretrained(llm_dir).get_vocab()
            if AutoTokenizer.from_pretrained(src).get_vocab() != llm_vocab:
                raise ValueError(f"SSM {src} has a different tokenizer from the LLM's; SSMs must use the LLM's tokenizer")
        stage = stages.get(str(src), {})
        ssms.append(RunSSM(name=src.name, dir=src, stage=int(stage.get("stage", k)), report=stage,
                           stats=_read_json(src / STATS), evaluation=evaluated.get(src.name, {})))
    return RunInfo(run=run, llm_ref=str(report["llm"]["ref"]), llm_dir=llm_dir, report=report, ssms=ssms)


def check_out(out: Path, run: RunDir, force: bool) -> None:
    """Refuse an ``--out`` that exists (unless ``force``) or lies inside the run."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory; choose another path")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and is not empty; choose another directory or pass --force")
    if out.resolve() == run.root.resolve() or run.root.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out} is inside the run directory; write the export elsewhere")


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write into; renamed to ``out`` (replacing it) when the block
    succeeds, removed when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tree_bytes(root: Path) -> int:
    """Total size of the regular files under ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
