"""What every exporter (``bundle``, ``hf``, ``gguf``) shares: the run's SSM directories, each checked
by one function, and the atomic output directory.

``checked_ssm_dir`` is the one check of an SSM directory, called by every exporter for every SSM it
writes, before any file is written: the completion marker, safetensors weights (exports never carry
pickled weights), a config.json, a readable stats.json (required by the bundle, whose manifest lists
it), and the LLM's tokenizer. ``read_run`` gives the engine exports (``hf``, ``gguf``) every complete
SSM of a run (``RunDir.ssm_dirs()``, the same ones the bundle export carries), checked. The output is
written into a temporary sibling of ``--out`` and renamed into place at the end, so an interrupted
export never leaves half a folder.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from boosttune.core.files import MARKER, is_complete
from boosttune.core.low_rank import DELTA_FILE
from boosttune.core.rundir import RunDir

STATS = "stats.json"
"""An SSM's training statistics, written by its stage beside the weights."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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


@dataclass(frozen=True)
class CheckedSSM:
    """An SSM directory that ``checked_ssm_dir`` accepted: what an exporter copies from it."""

    dir: Path
    """The ``save_pretrained`` directory in the run."""
    weights: list[str]
    """Its safetensors files (and shard index), sorted (``weight_files``)."""
    stats: dict
    """Its stats.json (empty when absent, or when it holds no JSON object)."""


def weight_files(src: Path) -> list[str]:
    """The safetensors weight files (and shard index) of a ``save_pretrained`` directory (not an SSM's
    low-rank factors, ``core/low_rank.py``: its weights already hold them)."""
    return sorted(p.name for p in src.iterdir()
                  if p.is_file() and p.name.endswith((".safetensors", ".safetensors.index.json")) and p.name != DELTA_FILE)


def checked_ssm_dir(src: Path, llm_vocab: Callable[[], dict[str, int]], require_stats: bool = False) -> CheckedSSM:
    """Check that ``src`` is an SSM directory an export can use; raise ValueError naming it and the fix.

    The one check of an SSM directory that every exporter runs, so that a bundle, a Hugging Face
    folder and a GGUF file refuse the same damaged SSM with the same message.

    Args:
        src: the SSM's ``save_pretrained`` directory in the run (an ``ssm-K`` or the feature head).
        llm_vocab: the LLM tokenizer's vocabulary, called only when ``src`` carries tokenizer files
            (loading a tokenizer takes a while; callers pass one cached loader for all their SSMs).
        require_stats: refuse an SSM without stats.json (the bundle lists it in its manifest; the
            engine exports only quote it in model cards).
    """
    from transformers import AutoTokenizer

    if not is_complete(src):
        raise ValueError(f"SSM {src} is not complete (no {MARKER}); finish `boosttune train` (it resumes) first")
    weights = weight_files(src)
    if not any(w.endswith(".safetensors") for w in weights):
        raise ValueError(
            f"SSM {src} has no *.safetensors weights (exports never carry pickled weights); "
            "re-save it with save_pretrained(..., safe_serialization=True)"
        )
    if not (src / "config.json").is_file():
        raise ValueError(f"SSM {src} has no config.json; is it a transformers save_pretrained directory?")
    stats_file = src / STATS
    if require_stats and not stats_file.is_file():
        raise ValueError(f"SSM {src} has no {STATS}; the run's stage did not finish writing it")
    stats: dict = {}
    if stats_file.is_file():
        try:
            data = json.loads(stats_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{stats_file}: not valid JSON ({e})") from None
        stats = data if isinstance(data, dict) else {}
    if any((src / n).is_file() for n in _TOKENIZER_FILES):
        if AutoTokenizer.from_pretrained(src).get_vocab() != llm_vocab():
            raise ValueError(f"SSM {src} has a different tokenizer from the LLM's; SSMs must use the LLM's tokenizer")
    return CheckedSSM(dir=src, weights=weights, stats=stats)


def llm_vocab_loader(llm_dir: Path) -> Callable[[], dict[str, int]]:
    """The LLM tokenizer's vocabulary, loaded on the first call only (``checked_ssm_dir``'s argument)."""

    @functools.cache
    def load() -> dict[str, int]:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(llm_dir).get_vocab()

    return load


def stage_entries(run: RunDir, report: dict) -> dict[str, dict]:
    """The run report's stage entries, by the SSM directory each trained (as ``str(run.root / ssm_dir)``)."""
    return {str(run.root / s["ssm_dir"]): s for s in report.get("stages", []) if isinstance(s, dict) and "ssm_dir" in s}


def read_run(run_dir: str | Path) -> RunInfo:
    """The run's LLM and complete SSMs, with a clear error for anything export cannot use."""
    run = RunDir(run_dir)
    report = run.read_report()
    dirs = run.ssm_dirs()
    if not dirs:
        raise ValueError(f"{run}: no complete SSM under ssms/ (no complete.json); finish `boosttune train` first")
    llm_dir = run.llm_dir()
    stages = stage_entries(run, report)
    singles = (report.get("evaluation") or {}).get("singles") or []
    evaluated = {s.get("ssm"): s for s in singles if isinstance(s, dict)}
    llm_vocab = llm_vocab_loader(llm_dir)
    ssms = []
    for k, src in enumerate(dirs, start=1):
        checked = checked_ssm_dir(src, llm_vocab)
        stage = stages.get(str(src), {})
        ssms.append(RunSSM(name=src.name, dir=src, stage=int(stage.get("stage", k)), report=stage,
                           stats=checked.stats, evaluation=evaluated.get(src.name, {})))
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
