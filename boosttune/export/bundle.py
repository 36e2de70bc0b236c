"""`boosttune export RUN_DIR --out BUNDLE`: a training run's servable parts as one bundle.

The bundle's layout and what loading checks are documented in ``serving/bundle.py``; its manifest is
a ``serving/manifest.py`` ``Manifest``, written by ``Manifest.write`` (the same class parses it back).
Export copies the SSMs' safetensors weights, configs and statistics, writes the LLM's tokenizer once,
copies the run's scheduler directory file for file, its draft vocabulary ranking and its phrase
table (when it has them), writes the run's tree (the training config's ``tree:`` section) as the
bundle's default, pins the LLM by a content hash and lists a sha256 for every file. Every SSM is checked
(``common.checked_ssm_dir``) before anything is written; ``ssm_entry`` is what the manifest records
of each. It writes into a temporary sibling directory and renames it into place at the end, so an
interrupted export never leaves a half bundle at ``--out``.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from boosttune.core.files import is_complete, sha256_file
from boosttune.core.rundir import FEATURE_NAME, RunDir
from boosttune.export.common import (
    STATS,
    CheckedSSM,
    atomic_dir,
    check_out,
    checked_ssm_dir,
    stage_entries,
    tree_bytes,
)
from boosttune.scheduler.persist import SchedulerFileError
from boosttune.scheduler.policy import Scheduler
from boosttune.serving import kinds
from boosttune.serving.bundle import llm_content_hash
from boosttune.serving.lookup import LOOKUP_NAME, lookup_tree
from boosttune.serving.manifest import (
    BUNDLE_FORMAT,
    SCHEDULER_DIR,
    SSMS_DIR,
    TOKENIZER_DIR,
    BundleError,
    DrafterEntry,
    FileEntry,
    LLMEntry,
    Manifest,
)
from boosttune.serving.tree import TreeConfig

# Each drafter's kind says which files of its directory a bundle carries (serving/kinds.py); the rest
# (tokenizer files, the completion marker) is either carried once for all or irrelevant to serving.
_PROFILE = "acceptance_profile.json"


@dataclass(frozen=True)
class ExportResult:
    """What export wrote: the bundle directory, its manifest, its size in bytes, why it ships the
    drafters it does when export chose them (``Choice``; None: all, or the ones asked for), and whether
    the shipped scheduler plans prompt lookup (the manifest then lists no lookup entry of its own)."""

    bundle: Path
    manifest: Manifest
    total_bytes: int
    choice: Choice | None = None
    scheduler_lookup: bool = False


@dataclass(frozen=True)
class Choice:
    """The drafters a run's own evaluation measured fastest (``train/evaluate.py``).

    Attributes:
        drafters: their names (one SSM, one feature head, every SSM merged or every head merged).
        speedup: their tokens/s over plain decoding's, in that evaluation.
        others: every other option's speed-up there, by label ("ssm-K", "feature", "ensemble", each
            also "+ lookup N" where the evaluation measured it merged with prompt lookup).
        prompt_lookup: the prompt-lookup chain length measured with them (0: without prompt lookup).
    """

    drafters: list[str]
    speedup: float
    others: dict[str, float]
    prompt_lookup: int = 0


def fastest_drafters(evaluation: dict | None, available: Sequence[str]) -> Choice | None:
    """The option of a run's evaluation with the highest speed-up whose drafters are all ``available``:
    each SSM alone, each feature head alone, the EAGLE-3 head alone, all SSMs merged (the ensemble) or all
    feature heads merged, each with or without prompt lookup where the evaluation measured both. None when the run was not evaluated
    (``eval.enabled: false``, or a report from before evaluation measured speed)."""
    if not isinstance(evaluation, dict):
        return None
    singles = [s for s in evaluation.get("singles", []) if isinstance(s, dict) and "speedup" in s]
    rows = {s["ssm"]: ([s["ssm"]], s) for s in singles}
    if isinstance(evaluation.get("feature"), dict) and "speedup" in evaluation["feature"]:
        rows[FEATURE_NAME] = ([FEATURE_NAME], evaluation["feature"])
    for h in evaluation.get("feature_heads") or []:
        if isinstance(h, dict) and isinstance(h.get("drafter"), str) and "speedup" in h:
            rows[h["drafter"]] = ([h["drafter"]], h)
    merged = evaluation.get("feature_ensemble")
    if isinstance(merged, dict) and "speedup" in merged and isinstance(merged.get("drafters"), list):
        rows["feature ensemble"] = ([str(n) for n in merged["drafters"]], merged)
    if isinstance(evaluation.get("eagle3"), dict) and "speedup" in evaluation["eagle3"]:
        rows["eagle3"] = (["eagle3"], evaluation["eagle3"])
    if isinstance(evaluation.get("ensemble"), dict) and "speedup" in evaluation["ensemble"]:
        rows["ensemble"] = ([s["ssm"] for s in singles], evaluation["ensemble"])
    options: dict[str, tuple[list[str], float, int]] = {}
    for label, (names, row) in rows.items():
        if not names or not set(names) <= set(available):
            continue
        options[label] = (names, float(row["speedup"]), 0)
        look = row.get("lookup")
        if isinstance(look, dict) and "speedup" in look and look.get("prompt_lookup"):
            n = int(look["prompt_lookup"])
            options[f"{label} + lookup {n}"] = (names, float(look["speedup"]), n)
    if not options:
        return None
    best = max(options, key=lambda label: options[label][1])
    names, speedup, lookup = options[best]
    return Choice(drafters=names, speedup=speedup, others={label: o[1] for label, o in options.items() if label != best},
                  prompt_lookup=lookup)


def _versions() -> dict[str, str]:
    import torch
    import transformers

    import boosttune

    return {
        "boosttune": boosttune.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
    }


def _tree(report: dict, run: RunDir) -> TreeConfig:
    raw = report.get("tree")
    if raw is None:
        return TreeConfig()
    try:
        return TreeConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{run.report_path}: field 'tree' is not a valid tree configuration: {e}") from None


def _copy_ssm(ssm: CheckedSSM, dest: Path, kind: kinds.DrafterKind) -> str | None:
    """Copy the files of one checked drafter that its kind ships (configs, safetensors weights, its own
    files) and its stats, and write its acceptance profile (from its stats) as a file of its own;
    returns the profile's file name (None: it has none)."""
    src = ssm.dir
    dest.mkdir(parents=True)
    for name in dict.fromkeys([*kind.ships(src), STATS]):
        shutil.copyfile(src / name, dest / name)
    profile = ssm.stats.get("acceptance_profile")
    if profile is None:
        return None
    (dest / _PROFILE).write_text(json.dumps(profile, indent=2) + "\n")
    return _PROFILE


def _checked_kind(src: Path) -> kinds.DrafterKind:
    """The kind ``src`` declares, with what that kind needs of the directory checked."""
    try:
        kind = kinds.kind(kinds.directory_kind(src))
        kind.check(src)
    except ValueError as e:
        raise ValueError(f"SSM {src}: {e}") from None
    return kind


def ssm_entry(ssm: CheckedSSM, rel: str, stage: dict, position: int, profile: str | None,
              kind: kinds.DrafterKind, tree: TreeConfig) -> DrafterEntry:
    """The manifest's entry for one drafter copied to ``rel`` (bundle-relative): the one place that says
    what the manifest records of a drafter.

    Args:
        ssm: the checked SSM directory it was copied from.
        rel: its directory in the bundle (``ssms/<name>``).
        stage: its stage entry in the run's report.json (empty when the report has none).
        position: its 1-based place among the bundle's SSMs, the stage recorded when ``stage`` has none.
        profile: its acceptance profile's file name in ``rel`` (None: it has none).
        kind: its kind.
        tree: the tree it drafts by default (as its training recorded it).
    """
    return DrafterEntry(
        name=ssm.dir.name, kind=kind.name, stage=int(stage.get("stage", position)), tree=tree, dir=rel,
        config=f"{rel}/config.json",
        weights=[f"{rel}/{w}" for w in ssm.weights], stats=f"{rel}/{STATS}",
        acceptance_profile=f"{rel}/{profile}" if profile else None, report=stage,
    )


def _copy_scheduler(src: Path, dest: Path) -> list[str]:
    """Copy every regular file under the run's scheduler directory (hidden temporaries skipped)."""
    names = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        names.append(rel.as_posix())
    return names


def _file_table(root: Path) -> dict[str, FileEntry]:
    return {
        p.relative_to(root).as_posix(): FileEntry(sha256_file(p), p.stat().st_size)
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def export_bundle(
    run_dir: str | Path, out: str | Path, force: bool = False, draft_vocab: int | None = None,
    prompt_lookup: int | None = None, drafters: Sequence[str] | None = None,
) -> ExportResult:
    """Write the bundle of a training run.

    Args:
        run_dir: a `boosttune train` run directory (report.json and at least one complete SSM).
        out: the bundle directory to create; must not exist (or be empty) unless ``force``.
        force: replace an existing ``out``.
        draft_vocab: the bundle tree's draft vocabulary size (None: the run's tree's; 0: whole).
        prompt_lookup: the bundle's default prompt-lookup chain length (``serving/lookup.py``), used
            when no learned scheduler decides (0: off; None: what the run's evaluation measured fastest
            with the drafters it shipped, when export chose them, else off).
        drafters: the run's drafters to ship, by name (ssm-K, and ``feature``, ``feature-K`` for the run's
            feature heads, ``eagle3`` for its EAGLE-3 head). None: with a learned scheduler, the drafters it was trained to choose among per
            request; drafters named here that differ from the ones the run's scheduler chooses among ship
            without it (it would be refused when the bundle loads: every request drafts with them all), but
            with the per-match prompt-lookup table it learned (``TreeConfig.ngram_depths``), if any;
            without one, every request drafts with every
            drafter shipped, so export ships what the run's evaluation measured fastest
            (:func:`fastest_drafters`), or every SSM and the feature head when the run was not evaluated.
    """
    from transformers import AutoTokenizer

    run = RunDir(run_dir)
    out = Path(out)
    report = run.read_report()
    stages = stage_entries(run, report)
    ssm_dirs = run.ssm_dirs()
    ssm_dirs += run.feature_dirs()
    if is_complete(run.eagle3_dir):
        ssm_dirs.append(run.eagle3_dir)
    choice = None
    scheduled: list[str] = []  # the drafters the learned scheduler chooses among, prompt lookup's name too
    if run.scheduler_file.is_file():
        try:
            scheduled = list(Scheduler.load(run.scheduler_file).drafters)
        except SchedulerFileError as e:
            raise ValueError(f"the run's learned scheduler cannot be read: {e}") from None
    if drafters is None and run.scheduler_file.is_file():
        ssm_dirs = [d for d in ssm_dirs if d.name in scheduled and d.name != LOOKUP_NAME]
    if drafters is None and not run.scheduler_file.is_file():
        choice = fastest_drafters(report.get("evaluation"), [d.name for d in ssm_dirs])
        if choice is not None:
            ssm_dirs = [d for d in ssm_dirs if d.name in choice.drafters]
    ship_scheduler = run.scheduler_dir.is_dir()
    lookup_depths: tuple[int, ...] = ()  # the scheduler's per-match prompt-lookup table, where it is left out
    if drafters is not None:
        known = [d.name for d in ssm_dirs]
        unknown = [n for n in drafters if n not in known]
        if unknown or not drafters:
            raise ValueError(f"--drafters: the run has {known}, got {list(drafters)}")
        ssm_dirs = [d for d in ssm_dirs if d.name in drafters]
        if run.scheduler_file.is_file():  # a scheduler for other drafters would be refused at load: left out
            ship_scheduler = sorted(n for n in scheduled if n != LOOKUP_NAME) == sorted(d.name for d in ssm_dirs)
            if not ship_scheduler:
                lookup_depths = tuple(Scheduler.load(run.scheduler_file).lookup_depths)
    if not ssm_dirs:
        raise ValueError(f"{run}: no complete SSM under ssms/ (no complete.json); finish `boosttune train` first")
    check_out(out, run, force)
    if prompt_lookup is None:
        prompt_lookup = choice.prompt_lookup if choice is not None else 0
    if prompt_lookup < 0:
        raise ValueError(f"--prompt-lookup must be >= 0 (0 = off), got {prompt_lookup}")
    tree = _tree(report, run)
    if draft_vocab is not None:
        try:
            tree = TreeConfig(**{**asdict(tree), "draft_vocab": int(draft_vocab)})
        except ValueError as e:
            raise ValueError(f"--draft-vocab: {e}") from None
    llm_dir = run.llm_dir()
    ranking = run.draft_vocab_path if run.draft_vocab_path.is_file() else None
    need = max([tree.draft_vocab] + [kinds.kind(kinds.directory_kind(d)).trained_tree(d, tree).draft_vocab
                                     for d in ssm_dirs if draft_vocab is None])
    if need and ranking is None:
        raise ValueError(f"--draft-vocab {need}: {run} has no teacher outputs to rank tokens by "
                         f"(no {run.draft_vocab_path.name}); export with --draft-vocab 0")
    try:
        llm_hash, llm_file_hashes = llm_content_hash(llm_dir)
    except BundleError as e:
        raise ValueError(str(e)) from None
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    vocab = tokenizer.get_vocab()
    checked = [checked_ssm_dir(src, lambda: vocab, require_stats=True) for src in ssm_dirs]
    ssm_kinds = [_checked_kind(src) for src in ssm_dirs]

    with atomic_dir(out) as tmp:
        tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
        drafters = []
        for position, (ssm, kind) in enumerate(zip(checked, ssm_kinds, strict=True), start=1):
            rel = f"{SSMS_DIR}/{ssm.dir.name}"
            profile = _copy_ssm(ssm, tmp / rel, kind)
            tree_of = kind.trained_tree(ssm.dir, tree) if draft_vocab is None else tree
            drafters.append(ssm_entry(ssm, rel, stages.get(str(ssm.dir), {}), position, profile, kind, tree_of))
        if prompt_lookup:
            drafters.append(DrafterEntry(name=LOOKUP_NAME, kind=kinds.PromptLookupKind.name, stage=0,
                                         tree=lookup_tree(int(prompt_lookup), lookup_depths)))
        if ranking is not None:
            shutil.copyfile(ranking, tmp / ranking.name)
        phrases = run.phrases_path if run.phrases_path.is_file() else None  # for prompt lookup, planned or listed
        if phrases is not None:
            shutil.copyfile(phrases, tmp / phrases.name)
        scheduler_files: list[str] = []
        if ship_scheduler:
            scheduler_files = [f"{SCHEDULER_DIR}/{f}" for f in _copy_scheduler(run.scheduler_dir, tmp / SCHEDULER_DIR)]
        llm = report["llm"]
        manifest = Manifest(
            format=BUNDLE_FORMAT,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            source_run=str(run.root.resolve()),
            versions=_versions(),
            llm=LLMEntry(ref=llm["ref"], path=str(llm_dir.resolve()), dtype=str(llm.get("dtype", "fp32")),
                         sha256=llm_hash, files=llm_file_hashes),
            tokenizer=TOKENIZER_DIR,
            drafters=drafters,
            scheduler_dir=SCHEDULER_DIR if ship_scheduler else None,
            scheduler_files=scheduler_files,
            files=_file_table(tmp),
            draft_vocab=ranking.name if ranking is not None else None,
            phrases=phrases.name if phrases is not None else None,
        )
        manifest.write(tmp)  # last: a bundle without it is refused
    return ExportResult(bundle=out, manifest=manifest, total_bytes=tree_bytes(out), choice=choice,
                        scheduler_lookup=ship_scheduler and LOOKUP_NAME in scheduled)
