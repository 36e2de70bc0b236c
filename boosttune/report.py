"""A training run summarised for people: what `boosttune report RUN` prints and `boosttune train` ends with.

:func:`collect` reads a run directory into one mapping shaped like report.json: the report itself when
there is one, completed by what an interrupted run left behind (the prompt set's counts, each finished
stage's ``summary.json``, the feature heads' ``stats.json``, a scheduler fitted on its own). The other
functions are pure: :func:`summary_lines` turns that mapping into text (stages, drafters' τ, c and
speed-up alone, with prompt lookup and merged, the scheduler's choices, the next commands) and
:func:`drafter_rows` gives the evaluation's drafters in order, for the text and the figure
(``boosttune/report_plot.py``).

Every key past report.json's fixed ones is optional (runs written before a key existed lack it):
``evaluation`` may be null, ``evaluation.feature_heads`` / ``feature_ensemble`` and ``feature.heads`` /
``feature.union_coverage`` exist only with several feature heads, ``scheduler`` only with a learned one.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from boosttune.config import ConfigError, TrainConfig, load_config
from boosttune.core.files import is_complete
from boosttune.core.rundir import RunDir, feature_name
from boosttune.core.table import text_table
from boosttune.serving.tree import TreeConfig


@dataclass(frozen=True)
class RunState:
    """A run's report (report.json's shape, completed from its files), its config when it reads, and
    what it has yet to do."""

    run: RunDir
    report: dict
    config: TrainConfig | None
    pending: tuple[str, ...] | None
    """What the config asks for that the run has not finished, in pipeline order (empty: finished; None:
    unknown, the config did not load)."""


# ------------------------------------------------------------------------------------------- reading
def _json(path: Path) -> dict | None:
    """A JSON object from ``path`` (None: missing or damaged, as a killed write can leave it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def collect(run: RunDir) -> RunState:
    """The run's report and state; a ``ValueError`` naming the directory when it is not a training run."""
    if not run.root.is_dir():
        raise ValueError(f"{run.root}: no such directory")
    report = _json(run.report_path)
    if report is None and not run.config_path.is_file():
        raise ValueError(f"{run.root} is not a `boosttune train` run directory (it has neither config.yaml "
                         "nor report.json)")
    report = dict(report or {})
    try:
        config = load_config(run.config_path) if run.config_path.is_file() else None
    except ConfigError:  # e.g. a file it names is not on this machine: the report reads without it
        config = None
    if not report.get("llm") and config is not None:  # report.json is written after the first stage
        report["llm"] = {"ref": config.llm.ref, "dtype": config.llm.eval_dtype}
        report["tree"] = asdict(config.tree)
    if not report.get("prompts"):
        report["prompts"] = run.prompts_info()
    if not report.get("teacher"):
        stats = [s for p in run.teacher_stats_files() if (s := _json(p)) is not None]
        report["teacher"] = {"tokens": sum(s.get("tokens", 0) for s in stats),
                             "seconds": max((s.get("seconds", 0.0) for s in stats), default=0.0)} if stats else None
    stages = list(report.get("stages") or [])
    while (summary := _json(run.stage_summary(len(stages) + 1))) is not None:  # finished after the report
        stages.append(summary)
    report["stages"] = stages
    if report.get("feature") is None:
        report["feature"] = _feature_from_heads(run)
    if report.get("eagle3") is None and is_complete(run.eagle3_dir):  # trained after the report was written
        report["eagle3"] = _json(run.eagle3_dir / "stats.json")
    report.setdefault("evaluation", None)
    if "scheduler" not in report and is_complete(run.scheduler_dir):  # fitted by `boosttune train-scheduler`
        scheduler = _json(run.scheduler_report)
        if scheduler is not None:
            report["scheduler"] = scheduler
    return RunState(run, report, config, _pending(report, config))


def _feature_from_heads(run: RunDir) -> dict | None:
    """The report's ``feature`` entry from the heads' own statistics (a run stopped before its report had it)."""
    stats = [s for d in run.feature_dirs() if (s := _json(d / "stats.json")) is not None]
    if not stats:
        return None
    out = {k: v for k, v in stats[0].items() if k not in ("held_out_ranks", "held_out_lookup_ranks")}
    if len(stats) > 1:
        out["heads"] = [{"head": s.get("head", feature_name(i)), "steps": (s.get("train") or {}).get("steps"),
                         "held_out_top1": (s.get("held_out") or {}).get("top1")} for i, s in enumerate(stats, start=1)]
    return out


def _pending(report: dict, config: TrainConfig | None) -> tuple[str, ...] | None:
    if config is None:
        return None
    out = []
    done = len(report["stages"])
    if done < config.boost.num_ssms:
        out.append(f"stages {done + 1}-{config.boost.num_ssms}" if done + 1 < config.boost.num_ssms
                   else f"stage {config.boost.num_ssms}")
    feature = report.get("feature")
    heads = len(feature.get("heads") or [feature]) if feature else 0
    if config.feature.enabled and heads < config.feature.heads:
        out.append("the feature heads" if config.feature.heads > 1 else "the feature head")
    if config.eagle3.enabled and not report.get("eagle3"):
        out.append("the EAGLE-3 head")
    if config.eval.enabled and report.get("evaluation") is None:
        out.append("the evaluation")
    if config.scheduler.prompts and "scheduler" not in report:
        out.append("the scheduler")
    return tuple(out)


# ------------------------------------------------------------------------------------------- text
def _num(x: object, fmt: str = ".3f", suffix: str = "") -> str:
    return "-" if not isinstance(x, (int, float)) or isinstance(x, bool) else f"{x:{fmt}}{suffix}"


@dataclass(frozen=True)
class DrafterRow:
    """One drafter option of the evaluation: its τ, relative cost c and speed-up, alone and with prompt lookup."""

    name: str
    tau: float | None
    c: float | None
    speedup: float | None
    lookup_tau: float | None
    lookup_speedup: float | None


def drafter_rows(evaluation: dict | None) -> list[DrafterRow]:
    """Each SSM, the SSMs merged, each feature head (or the one head) and the heads merged, as evaluated."""
    if not evaluation:
        return []
    named: list[tuple[str, dict]] = [(s.get("ssm", f"ssm-{i}"), s) for i, s in enumerate(evaluation.get("singles") or [], 1)]
    if evaluation.get("ensemble"):
        named.append(("SSMs merged", evaluation["ensemble"]))
    if evaluation.get("feature_heads"):
        named += [(h.get("drafter", feature_name(i)), h) for i, h in enumerate(evaluation["feature_heads"], 1)]
    elif evaluation.get("feature"):
        named.append((feature_name(1), evaluation["feature"]))
    if evaluation.get("feature_ensemble"):
        named.append(("heads merged", evaluation["feature_ensemble"]))
    rows = []
    for name, r in named:
        lookup = r.get("lookup") or {}
        rows.append(DrafterRow(name, r.get("tau"), r.get("c"), r.get("speedup"), lookup.get("tau"), lookup.get("speedup")))
    return rows


def _stage_lines(stages: Sequence[dict]) -> list[str]:
    if not stages:
        return ["stages: none finished yet"]
    k = next((s["coverage_k"] for s in stages if s.get("coverage_k")), None)
    cover = f"top-{k} cover" if k else "coverage"
    rows = [["stage", "pool", "match", "held-out top-1", "ensemble match", cover, f"union {cover}", "loss", "steps"]]
    for s in stages:
        pool = f"{s.get('pool_before', '-')} -> {s.get('pool_after', '-')}"
        rows.append([str(s.get("stage", "?")), pool, _num(s.get("match_rate")), _num(s.get("heldout_top1")),
                     _num(s.get("ensemble_match_rate")), _num(s.get("heldout_coverage")),
                     _num(s.get("union_coverage")), _num(s.get("train_loss")), _num(s.get("steps"), "d")])
    return text_table(rows)


def _feature_lines(feature: dict | None) -> list[str]:
    if not feature:
        return []
    heads = feature.get("heads") or [{"head": feature.get("head", feature_name(1)),
                                      "steps": (feature.get("train") or {}).get("steps"),
                                      "held_out_top1": (feature.get("held_out") or {}).get("top1")}]
    parts = [f"{h.get('head')} {_num(h.get('steps'), 'd')} steps, held-out top-1 {_num(h.get('held_out_top1'))}"
             for h in heads]
    line = "feature heads: " + "; ".join(parts)
    if feature.get("union_coverage") is not None:
        line += f"; union top-{feature.get('coverage_k', '?')} coverage {_num(feature['union_coverage'])}"
    return [line]


def _eagle3_lines(eagle3: dict | None) -> list[str]:
    if not eagle3:
        return []
    held = eagle3.get("held_out") or {}
    rates = held.get("accept_rate") or [None]
    layers = ", ".join(str(x) for x in eagle3.get("layers") or []) or "?"
    return [f"EAGLE-3 head: LLM layers {layers}, {_num((eagle3.get('train') or {}).get('steps'), 'd')} steps, held-out "
            f"chains of {held.get('depth', '?')}: τ {_num(held.get('tau'))}, first draft right {_num(rates[0])} "
            "(export --format gguf / hf for llama.cpp, vLLM, SGLang)"]


def _evaluation_lines(evaluation: dict | None, pending: Sequence[str] | None) -> list[str]:
    if not evaluation:
        return ["evaluation: " + ("none (eval.enabled is off)" if pending is not None and "the evaluation" not in pending
                                  else "not run yet")]
    plain = evaluation.get("plain") or {}
    head = (f"τ on {evaluation.get('prompts', '?')} prompts ({evaluation.get('dtype', '?')}, "
            f"{evaluation.get('max_new_tokens', '?')} new tokens; plain decoding "
            f"{_num(plain.get('tokens_per_s'), '.1f')} tok/s; speed-up: tokens/s over plain decoding's):")
    rows = [["drafter", "τ", "c", "speed-up", "τ with lookup", "speed-up with lookup"]]
    rows += [[r.name, _num(r.tau, ".2f"), _num(r.c, ".3f"), _num(r.speedup, ".2f", "x"), _num(r.lookup_tau, ".2f"),
              _num(r.lookup_speedup, ".2f", "x")] for r in drafter_rows(evaluation)]
    return [head, *text_table(rows)]


def scheduler_choices(scheduler: dict | None) -> dict[str, int]:
    """How often the learned policy chose each drafter set on the evaluation requests (replayed)."""
    learned = ((scheduler or {}).get("policies") or {}).get("learned") or {}
    return dict((learned.get("replay") or {}).get("choices") or {})


def _scheduler_lines(scheduler: dict | None) -> list[str]:
    if not scheduler:
        return []
    head = scheduler.get("headline") or {}
    fallback = (scheduler.get("model") or {}).get("fallback", "?")
    line = (f"scheduler: learned vs best fixed ({head.get('best_fixed_policy_replay', '?')}) "
            f"{_num(head.get('learned_vs_best_fixed_replay'))} replayed")
    if head.get("learned_vs_best_fixed_real") is not None:
        line += f", {_num(head['learned_vs_best_fixed_real'])} real"
    choices = scheduler_choices(scheduler)
    chosen = ", ".join(f"{name} x{n}" for name, n in choices.items()) or "-"
    return [line + f"; fallback {fallback}", f"  its choices on {sum(choices.values())} eval requests: {chosen}"]


def next_commands(state: RunState) -> list[str]:
    """The commands that take the run further, with its paths: resume it, or export, serve and bench it."""
    root = state.run.root
    run = shlex.quote(str(root))
    if state.pending:  # unknown (None): what a finished run would do next
        return [f"resume: boosttune train --config {shlex.quote(str(state.run.config_path))} --run-dir {run}"]
    bundle = shlex.quote(f"{root}-bundle")
    questions = _questions(state.config)
    return [f"export: boosttune export {run} --out {bundle}",
            f"serve:  boosttune serve {bundle} --port 8000",
            f"bench:  boosttune bench --bundle {bundle} --questions {questions} --limit 20 "
            f"--out {shlex.quote(f'{root}-bench')}",
            f"again:  boosttune report {run}   (this summary, and the figure {shlex.quote(str(state.run.report_plot))})"]


def _tree_label(tree: dict | None) -> str:
    """The tree's short name (``TreeConfig.label``), or '?' for a tree this version does not read."""
    try:
        return TreeConfig(**(tree or {})).label
    except (TypeError, ValueError):
        return "?"


def _questions(config: TrainConfig | None) -> str:
    """A prompt file the run itself names (its evaluation's, its scheduler's), else a placeholder."""
    if config is not None:
        for path in (config.eval.prompts, config.scheduler.eval_prompts, config.scheduler.prompts):
            if path:
                return shlex.quote(path)
    return "QUESTIONS.jsonl"


def summary_lines(state: RunState) -> list[str]:
    """The run's summary, as printed by `boosttune report` and at the end of `boosttune train`."""
    r = state.report
    status = ("state unknown: its config.yaml does not load" if state.pending is None else "finished"
              if not state.pending else "unfinished: " + ", ".join(state.pending) + " to go")
    lines = [f"run {state.run.root} ({status})"]
    llm = r.get("llm") or {}
    if llm:
        lines.append(f"LLM {llm.get('ref', '?')} ({llm.get('dtype', '?')}); each drafter's tree {_tree_label(r.get('tree'))}")
    p, t = r.get("prompts") or {}, r.get("teacher") or {}
    lines.append(f"prompts: {p.get('count', '-')} ({p.get('train', '-')} train, {p.get('held_out', '-')} held out); "
                 f"teacher: {t.get('tokens', '-')} tokens in {_num(t.get('seconds'), '.0f')} s" if p
                 else "prompts: not made yet")
    lines += _stage_lines(r["stages"])
    lines += _feature_lines(r.get("feature"))
    lines += _eagle3_lines(r.get("eagle3"))
    lines += _evaluation_lines(r.get("evaluation"), state.pending)
    lines += _scheduler_lines(r.get("scheduler"))
    lines += ["next:", *(f"  {c}" for c in next_commands(state))]
    return [line.rstrip() for line in lines]
