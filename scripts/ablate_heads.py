#!/usr/bin/env python3
"""Does boosting feature heads pay? N boost-tuned heads against the same N trained independently and
against one head trained N times as long, at equal training minutes, on one run's teacher data.

Every variant is a copy of a finished run (hard links: the prompts, the teacher's shards and the SSMs are
shared, nothing is generated again) in which `boosttune train` trains only the feature heads
(``feature.heads``, ``feature.minutes``, ``feature.boost``) and evaluates them; the learned scheduler is
left out (``scheduler.prompts=null``). The variants:
- ``weighted``: head k's loss weighted down where heads 1..k-1 already cover the LLM's token;
- ``independent``: the same N heads on the same data with other seeds (the ensemble baseline);
- ``single``: one head for N x the budget (the "more training" baseline); the source run's own head when
  it was trained that long, else trained here.
A head's budget is minutes (``--minutes``) or, where other work shares the CPU and minutes would buy
different numbers of steps, steps (``--steps``).

Then, on ``--questions`` (the LLM's greedy fp32 answers, written once for all variants), each head's
top-k coverage and each variant's union coverage, overall and per category (``scripts/coverage.py``),
next to what each variant's own evaluation measured (τ and speed-up of its heads merged, with prompt
lookup). ``OUT/ablation.json`` holds the figures, the boosted variant's report.json gains
``ensemble_gain_over_independent`` and ``ensemble_gain_over_longer_single`` (union top-k coverage on the
questions, relative) under ``feature``. The table also gives each variant's coverage with N x k candidates
in all, which for the single head means a tree as wide as an ensemble's merged first level. The
`boosttune export` / `boosttune bench` commands that measure each variant as served are printed.

Usage:
    python scripts/ablate_heads.py runs/demo --heads 2 --minutes 2.5 \\
        --questions ../shared/data/mt_bench/question.jsonl [--limit 80] [--out runs/demo-heads]
    python scripts/ablate_heads.py runs/demo --heads 2 --steps 400 --questions ...   (equal steps, not minutes)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from boosttune.core.files import atomic_write_text, is_complete
from boosttune.core.models import load_model, load_ssms, model_vocab_size
from boosttune.core.prompts import read_prompts
from boosttune.core.rundir import RunDir
from boosttune.serving.draft_vocab import head_ids, load_ranking
from boosttune.train.coverage import coverage_by_category
from boosttune.train.pipeline import link_or_copy


def script_module(name: str):
    """scripts/<name>.py as a module (coverage.py: its LLM answers and teacher-forced ranks)."""
    spec = importlib.util.spec_from_file_location(f"bt_{name}_script", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def answers_and_categories(cov_mod, llm, questions_file: str, limit: int, max_new: int) -> tuple[list, list[str]]:
    """The LLM's greedy answers to the first ``limit`` questions (0: all) that have a prompt of two or more
    tokens and an answer (``coverage.llm_answers``' tuples), and those questions' categories."""
    questions = read_prompts(questions_file)[: limit or None]
    print(f"the LLM's answers to {len(questions)} questions ...", flush=True)
    answers = cov_mod.llm_answers(llm, questions, max_new, None, 16)
    keep = [i for i, (prompt, tokens, _) in enumerate(answers) if tokens and len(prompt) >= 2]
    return [answers[i] for i in keep], [questions[i].category for i in keep]


def link_copy(src: Path, dst: Path) -> None:
    """``src`` as a new run ``dst`` sharing its files through hard links, without its feature heads, its
    scheduler and its report (the variant writes its own)."""
    skip = {"report.json", "scheduler", "scheduler_report.json", "scheduler_report.png", "scheduler_labels.jsonl",
            "scheduler_costs.json"}

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == src
        ssms = Path(folder) == src / "ssms"
        return {n for n in names if (top and n in skip) or (ssms and n.startswith(("feature", ".feature")))}

    shutil.copytree(src, dst, ignore=ignore, copy_function=link_or_copy)


def budget(minutes: float, steps: int, times: int = 1) -> list[str]:
    """The ``feature:`` overrides for one head's budget: ``times`` x ``steps`` steps, else x ``minutes``."""
    if steps:
        return ["feature.minutes=0", f"feature.max_steps={steps * times}"]
    return [f"feature.minutes={minutes * times}", "feature.max_steps=0"]


def train_variant(src: Path, dst: Path, heads: int, boost: str, limits: list[str], covered_weight: float = 0.1) -> dict:
    """Train the heads of one variant (a fresh copy; a finished one, with its report, is taken as it is);
    its report."""
    if (dst / "report.json").is_file():
        return json.loads((dst / "report.json").read_text())
    shutil.rmtree(dst, ignore_errors=True)
    link_copy(src, dst)
    cmd = [sys.executable, "-m", "boosttune.cli", "train", "--config", str(src / "config.yaml"), "--run-dir", str(dst),
           f"feature.heads={heads}", f"feature.boost={boost}", f"feature.covered_weight={covered_weight}", *limits,
           "scheduler.prompts=null"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((dst / "report.json").read_text())


def reusable_single(src: Path, minutes: float, steps: int) -> bool:
    """Whether the source run's own head is the ``single`` baseline: trained ``steps`` steps (when given,
    however its budget was set), else ``minutes``."""
    stats = src / "ssms" / "feature" / "stats.json"
    if not is_complete(src / "ssms" / "feature") or not stats.is_file():
        return False
    s = json.loads(stats.read_text())
    if steps:
        return int(s["train"]["steps"]) == steps
    return not s["config"].get("max_steps") and abs(float(s["config"]["minutes"]) - minutes) < 1e-6


def head_dirs(run: Path) -> list[Path]:
    return RunDir(run).feature_dirs()


def variant_row(name: str, run: Path, report: dict, cov: dict, names: list[str]) -> dict:
    """One variant's figures: its heads, their coverage on the questions, its own evaluation."""
    ev = report.get("evaluation") or {}
    merged = ev.get("feature_ensemble") or ev.get("feature") or {}
    look = merged.get("lookup") or {}
    heads = report.get("feature", {}).get("heads") or [{"head": "feature", **report.get("feature", {})}]
    return {"variant": name, "run": str(run), "heads": names,
            "minutes_each": float(report["feature"]["config"]["minutes"]),
            "seconds": [h.get("seconds", h.get("train", {}).get("seconds")) for h in heads],
            "steps": [h.get("steps", h.get("train", {}).get("steps")) for h in heads],
            "coverage": cov["all"]["topk"], "union_coverage": cov["all"]["union_topk"],
            "union_top1": cov["all"]["union_top1"],
            "per_category_union": {c: s["union_topk"] for c, s in cov.items() if c != "all"},
            "heldout_union_coverage": report["feature"].get("union_coverage"),
            "eval_tau": merged.get("tau"), "eval_speedup": merged.get("speedup"),
            "eval_tau_lookup": look.get("tau"), "eval_speedup_lookup": look.get("speedup")}


def format_rows(rows: list[dict], k: int) -> str:
    lines = [f"| variant | heads | steps | seconds | each head's top-{k} | union top-1 | union top-{k} | "
             "N x k candidates in all | held-out union | eval τ | eval τ + lookup | eval speed-up + lookup |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        each = " / ".join(f"{c:.3f}" for c in r["coverage"])
        held = f"{r['heldout_union_coverage']:.3f}" if r["heldout_union_coverage"] is not None else "-"

        def f(x, fmt="{:.3f}"):
            return fmt.format(x) if x is not None else "-"

        secs = "/".join(f"{x:.0f}" for x in r["seconds"] if x is not None)
        lines.append(f"| {r['variant']} | {len(r['heads'])} | {'/'.join(map(str, r['steps']))} | {secs} | "
                     f"{each} | {r['union_top1']:.3f} | {r['union_coverage']:.3f} | {r['union_same_candidates']:.3f} | {held} | {f(r['eval_tau'])} | "
                     f"{f(r['eval_tau_lookup'])} | {f(r['eval_speedup_lookup'], '{:.2f}x')} |")
    return "\n".join(lines)


def add_gains(report_path: Path, gains: dict, section: str = "feature") -> None:
    """A boosted variant's report.json gains the ablation's relative gains under ``section``."""
    report = json.loads(report_path.read_text())
    report[section] = {**(report.get(section) or {}), **gains}
    atomic_write_text(report_path, json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished `boosttune train` run (teacher shards and features)")
    p.add_argument("--heads", type=int, default=2, help="heads per ensemble (N)")
    p.add_argument("--minutes", type=float, default=0.0, help="training minutes per head (single: N x this)")
    p.add_argument("--steps", type=int, default=0, help="training steps per head instead of minutes (single: N x this); "
                   "fair where other work shares the CPU")
    p.add_argument("--covered-weight", type=float, default=0.1,
                   help="the boosted heads' loss weight of a token the earlier heads cover (feature.covered_weight)")
    p.add_argument("--questions", required=True, help="JSONL questions for the coverage figures (MT-bench's)")
    p.add_argument("--limit", type=int, default=0, help="the first N questions (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=0, help="candidates per position (0: the run's tree's first width)")
    p.add_argument("--out", type=Path, default=None, help="where the variants go (default: RUN-heads)")
    args = p.parse_args(argv)
    if not (args.run / "report.json").is_file() or not (args.run / "config.yaml").is_file():
        p.error(f"run: {args.run} is not a finished `boosttune train` run (no report.json / config.yaml)")
    if args.heads < 2 or args.minutes < 0 or args.steps < 0 or args.limit < 0 or args.top < 0:
        p.error("--heads must be >= 2, --minutes, --steps, --limit and --top >= 0")
    if not 0 <= args.covered_weight <= 1:
        p.error("--covered-weight must be in [0, 1]")
    if bool(args.minutes) == bool(args.steps):
        p.error("give one of --minutes and --steps (the budget of each head)")
    if not Path(args.questions).is_file():
        p.error(f"--questions: {args.questions} not found")
    out = args.out or args.run.with_name(args.run.name + "-heads")
    out.mkdir(parents=True, exist_ok=True)

    variants: dict[str, tuple[Path, dict]] = {}
    for mode in ("weighted", "independent"):
        d = out / mode
        weight = args.covered_weight if mode == "weighted" else 0.1  # the default: independent heads ignore it
        variants[mode] = (d, train_variant(args.run, d, args.heads, mode, budget(args.minutes, args.steps), weight))
    if reusable_single(args.run, args.heads * args.minutes, args.heads * args.steps):
        variants["single"] = (args.run, json.loads((args.run / "report.json").read_text()))
    else:
        d = out / "single"
        variants["single"] = (d, train_variant(args.run, d, 1, "weighted", budget(args.minutes, args.steps, args.heads)))

    cov_mod = script_module("coverage")
    llm = load_model(str(RunDir(args.run).llm_dir()), dtype=torch.float32)
    report0 = json.loads((args.run / "report.json").read_text())
    tree = report0.get("tree") or {}
    k = args.top or int((tree.get("widths") or [1])[0])
    dv = int(report0["feature"]["config"].get("draft_vocab") or 0)
    rows = head_ids(load_ranking(RunDir(args.run).draft_vocab_path), dv, model_vocab_size(llm.model)) if dv else None
    answers, categories = answers_and_categories(cov_mod, llm, args.questions, args.limit, args.max_new_tokens)

    table, figures = [], {}
    for name, (run, report) in variants.items():
        dirs = head_dirs(run) if name != "single" else [RunDir(run).feature_dir]
        models = load_ssms(llm, dirs, torch.float32)
        ranks = [cov_mod.drafter_ranks(m, answers, rows) for m in models]
        cov = coverage_by_category(ranks, categories, k)
        row = variant_row(name, run, report, cov, [d.name for d in dirs])
        # as many candidates as an ensemble's merged first level (N x k): the single head with a wider tree
        row["union_same_candidates"] = row["union_coverage"] if name != "single" else \
            coverage_by_category(ranks, categories, k * args.heads)["all"]["union_topk"]
        table.append(row)
        figures[name] = cov
    union = {r["variant"]: r["union_coverage"] for r in table}
    gains = {"ensemble_gain_over_independent": union["weighted"] / union["independent"] - 1,
             "ensemble_gain_over_longer_single": union["weighted"] / union["single"] - 1,
             "ablation_measure": f"union top-{k} coverage of the LLM's answers to {args.questions}"}
    add_gains(variants["weighted"][0] / "report.json", gains)
    atomic_write_text(out / "ablation.json", json.dumps({"k": k, "questions": args.questions, "answers": len(answers),
                                                         "rows": table, "coverage": figures, **gains}, indent=2) + "\n")
    print(f"\n{len(answers)} answers, top-{k}\n")
    print(format_rows(table, k))
    print(f"\nboosted union over independent {gains['ensemble_gain_over_independent']:+.1%}, "
          f"over one head {args.heads}x as long {gains['ensemble_gain_over_longer_single']:+.1%}")
    print("\nAs served (one run per variant, beside plain decoding):")
    for name, (run, _) in variants.items():
        names = ",".join(d.name for d in (head_dirs(run) if name != "single" else [RunDir(run).feature_dir]))
        print(f"  boosttune export {run} --out {out}/bundle-{name} --drafters {names} --prompt-lookup 8 --force && "
              f"boosttune bench --bundle {out}/bundle-{name} --questions {args.questions} --limit 80 "
              f"--max-new-tokens 128 --dtype bf16 --methods baseline,ours")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
