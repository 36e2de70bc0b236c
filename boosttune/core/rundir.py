"""The run directory of `boosttune train`: where every artefact lives, and how to read it back.

Layout (everything a run makes; resuming trusts only what is complete)::

    RUN_DIR/
      config.yaml                 the resolved training config (every default filled in)
      prompts/                    prompt set: prompts.jsonl + complete.json (counts: all, train, held out)
      teacher/                    LLM continuations: shard-KKKKK.arrow (prompts K*S .. (K+1)*S - 1),
                                  stats-rankRRR.json (tokens and seconds of rank R)
      draft_vocab.json            the LLM's tokens ranked by frequency in the teacher's training outputs
                                  (serving/draft_vocab.py), for SSMs drafting over a cut vocabulary
      ssm-init/                   the SSMs' common starting weights; complete.json written last
      stages/stage-K/             work dir of boost-tuning stage K: checkpoints/last.ckpt, logs,
                                  match.json (pool and match flags), summary.json, NAME-rankRRR.json scores,
                                  ranks-{train,heldout}-rankRRR.json (ranks for the coverage figures)
      ssms/ssm-K/                 trained SSM K: HF save_pretrained (config.json, model.safetensors,
                                  tokenizer files) + stats.json + drafter.json (its kind,
                                  core/kind_file.py); complete.json written last
      ssms/feature/               the feature head (core/feature_head.py), laid out as an SSM, plus
                                  feature_head.json and feature_fc.safetensors
      ssms/feature-K/             feature head K >= 2 (``feature.heads``), laid out the same way
      eagle3/                     the EAGLE-3 head (``eagle3.enabled``, core/eagle3_head.py): config.json and
                                  model.safetensors in the Hugging Face EAGLE-3 layout, eagle3_head.json,
                                  the tokenizer, stats.json; complete.json written last
      report.json                 run report: llm, tree, teacher, one entry per stage, feature head,
                                  evaluation, scheduler; written when the run ends (and after each
                                  newly trained stage, so that a killed run lists the SSMs it finished)
      report.png                  the run's figure, written by `boosttune report RUN` (boosttune/report_plot.py)
      scheduler/                  the learned scheduler: scheduler.json; complete.json written last (it
                                  records the settings the scheduler was fitted with)
      scheduler_report.json/.png  every policy's τ and tokens/s on the evaluation requests
      scheduler_labels.jsonl      the labelled requests the scheduler was fitted on
      scheduler_costs.json        the measured cost table, reused by a later fit with the same settings

``report.json`` (format 1)::

    {"format": 1,
     "llm": {"ref": str, "path": str, "dtype": str},
     "tree": {TreeConfig fields},
     "teacher": {...},
     "stages": [{"stage": K, "ssm_dir": "ssms/ssm-K", "mode": str, "pool_before": int, "pool_after": int,
                 "match_rate": float, "ensemble_match_rate": float, "train_loss": float,
                 "union_coverage": float, "ssm_coverages": [float], ...}],
     "feature": {...} | null,
     "eagle3": {...} | null,      the EAGLE-3 head's training and held-out chain figures
     "evaluation": {...} | null,
     "scheduler": {...}}          only when `boosttune train` fitted one: scheduler_report.json's content

:class:`RunDir` names every one of these paths; no other module joins them by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from boosttune.core.files import MARKER, is_complete

REPORT_FORMAT = 1
DRAFT_VOCAB = "draft_vocab.json"
"""The draft vocabulary ranking's file name, in a run directory and next to SSMs and in bundles."""
PHRASES = "phrases.safetensors"
"""The LLM's phrase table's file name (``serving/phrases.py``), in a run directory and in bundles."""
FEATURE_NAME = "feature"
"""The feature head's name: its directory under ``ssms/`` and its drafter name in evaluations and bundles."""
SCHEDULER_FILE = "scheduler.json"
"""The learned scheduler's file in a scheduler directory (a run's, and the bundle's copy of it)."""


def feature_name(k: int) -> str:
    """The name of feature head k: ``feature`` for the first (a run's only one before ``feature.heads``),
    ``feature-K`` after it; its directory under ssms/ and its drafter name, as :func:`ssm_name`."""
    return FEATURE_NAME if k == 1 else f"{FEATURE_NAME}-{k}"


def ssm_name(k: int) -> str:
    """The name of stage k's SSM: its directory under ssms/, in a run and in its bundles, and its
    drafter name in engines and schedulers."""
    return f"ssm-{k}"


class RunDir:
    """A `boosttune train` run directory (the layout in the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def __str__(self) -> str:
        return str(self.root)

    def __fspath__(self) -> str:  # a RunDir is accepted wherever a run directory's path is
        return str(self.root)

    @classmethod
    def of_ssm(cls, ssm_dir: str | Path) -> RunDir:
        """The run an SSM directory ``RUN_DIR/ssms/ssm-K`` belongs to."""
        return cls(Path(ssm_dir).parent.parent)

    # -- the run as a whole -------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def report_path(self) -> Path:
        return self.root / "report.json"

    @property
    def report_plot(self) -> Path:
        """The run's figure (`boosttune report`): stages, drafters' τ and speed-up, coverage, scheduler choices."""
        return self.root / "report.png"

    @property
    def draft_vocab_path(self) -> Path:
        return self.root / DRAFT_VOCAB

    @property
    def phrases_path(self) -> Path:
        return self.root / PHRASES

    def relative(self, path: Path) -> str:
        """``path`` relative to the run, as report.json records it (POSIX separators)."""
        return path.relative_to(self.root).as_posix()

    # -- prompts and teacher ------------------------------------------------------------------
    @property
    def prompts_dir(self) -> Path:
        return self.root / "prompts"

    @property
    def prompts_file(self) -> Path:
        return self.prompts_dir / "prompts.jsonl"

    def prompts_info(self) -> dict | None:
        """The finished prompt set's counts (``count``, ``train``, ``held_out``, ...), None before."""
        marker = self.prompts_dir / MARKER
        return json.loads(marker.read_text()) if marker.is_file() else None

    @property
    def teacher_dir(self) -> Path:
        return self.root / "teacher"

    def teacher_shard(self, k: int) -> Path:
        return self.teacher_dir / f"shard-{k:05d}.arrow"

    def teacher_stats(self, rank: int) -> Path:
        return self.teacher_dir / f"stats-rank{rank:03d}.json"

    def teacher_stats_files(self) -> list[Path]:
        return sorted(self.teacher_dir.glob("stats-rank*.json"))

    # -- stages and SSMs ----------------------------------------------------------------------
    @property
    def ssm_init_dir(self) -> Path:
        return self.root / "ssm-init"

    def stage_dir(self, k: int) -> Path:
        return self.root / "stages" / f"stage-{k}"

    def stage_match(self, k: int) -> Path:
        return self.stage_dir(k) / "match.json"

    def stage_summary(self, k: int) -> Path:
        return self.stage_dir(k) / "summary.json"

    def stage_checkpoint(self, k: int) -> Path:
        return self.stage_dir(k) / "checkpoints" / "last.ckpt"

    def stage_scores(self, k: int, name: str, rank: int) -> Path:
        return self.stage_dir(k) / f"{name}-rank{rank:03d}.json"

    def stage_scores_files(self, k: int, name: str) -> list[Path]:
        return sorted(self.stage_dir(k).glob(f"{name}-rank*.json"))

    def ssm_dir(self, k: int) -> Path:
        return self.root / "ssms" / ssm_name(k)

    # -- the learned scheduler ----------------------------------------------------------------
    @property
    def scheduler_dir(self) -> Path:
        return self.root / "scheduler"

    @property
    def scheduler_file(self) -> Path:
        return self.scheduler_dir / SCHEDULER_FILE

    @property
    def scheduler_report(self) -> Path:
        return self.root / "scheduler_report.json"

    @property
    def scheduler_plot(self) -> Path:
        return self.root / "scheduler_report.png"

    @property
    def scheduler_labels(self) -> Path:
        return self.root / "scheduler_labels.jsonl"

    # -- reading ------------------------------------------------------------------------------
    def read_report(self) -> dict:
        """The run's report.json, with a clear error when the directory is not a training run."""
        path = self.report_path
        if not path.is_file():
            raise ValueError(f"{self.root}: no {path.name}; is this a `boosttune train` run directory?")
        report = json.loads(path.read_text())
        if report.get("format") != REPORT_FORMAT:
            raise ValueError(f"{path}: report format {report.get('format')!r}, expected {REPORT_FORMAT}")
        return report

    def llm_dir(self) -> Path:
        """The LLM the run trained against: its recorded directory when it exists here, else its
        reference (report.json's ``llm``) resolved."""
        from boosttune.core.models import resolve_model_path

        llm = self.read_report().get("llm") or {}
        ref, path = llm.get("ref"), llm.get("path")
        if not isinstance(ref, str) or not ref:
            raise ValueError(f"{self.report_path}: field 'llm.ref' is missing; is the run complete?")
        if isinstance(path, str) and Path(path).is_dir():
            return Path(path)
        return Path(resolve_model_path(ref))

    @property
    def feature_dir(self) -> Path:
        """The run's feature head (``feature.enabled``), a model folder like an SSM's."""
        return self.root / "ssms" / FEATURE_NAME

    @property
    def eagle3_dir(self) -> Path:
        """The run's EAGLE-3 head (``eagle3.enabled``)."""
        return self.root / "eagle3"

    def feature_head_dir(self, k: int) -> Path:
        """Feature head ``k`` (1-based; head 1 is :attr:`feature_dir`)."""
        return self.root / "ssms" / feature_name(k)

    def feature_dirs(self) -> list[Path]:
        """The run's complete feature heads in order, up to the first missing one."""
        out = []
        while is_complete(d := self.feature_head_dir(len(out) + 1)):
            out.append(d)
        return out

    def ssm_dirs(self) -> list[Path]:
        """The trained SSMs of the run, in stage order (only complete ones), as its report lists them
        (for readers of a run; `boosttune train` hands its stages on directly)."""
        dirs = [self.root / s["ssm_dir"] for s in self.read_report().get("stages", [])]
        return [d for d in dirs if is_complete(d)]
