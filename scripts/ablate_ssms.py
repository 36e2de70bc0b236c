#!/usr/bin/env python3
"""Does boost-tuning SSMs pay? N SSMs boost-tuned in each ``boost.mode`` against the same N trained
independently and against one SSM trained N times as many steps, on one run's teacher data.

Every variant is a new run that reuses the source run's prompts and teacher shards
(``teacher.reuse_from``: hard links, nothing is generated again) and trains only SSMs: no feature head,
no EAGLE-3 head, no scheduler. Stage 1 trains on every sample with the same seed in every mode, so the
source run's stage 1 is linked in and only stages 2..N train, except where stage 1's record decides
stage 2's pool (``quantile``; and ``match`` when the source ran another mode): there it trains again.
The variants:
- each of ``--modes`` (``match``: the samples no earlier SSM matched, SpecInfer's pool; ``quantile``: the
  pool without its best-covered share; ``weighted``: every sample, tokens the earlier SSMs cover weighted
  down; see ``boost.mode`` in docs/config.md); the source run itself where it trained in that mode with N
  SSMs and the same steps;
- ``independent``: the same N on every sample with other seeds (the ensemble baseline);
- ``single``: one SSM for N x the steps (the "more training" baseline).
Steps, not minutes, are held equal (``optim.max_steps`` per SSM): fair where other work shares the CPU.

Then, on ``--questions`` (the LLM's greedy fp32 answers, written once for all variants), each SSM's
top-k coverage and each variant's union coverage, overall and per category (``scripts/coverage.py``),
next to what each variant's own evaluation measured (τ of each SSM alone and of all merged, on the run's
held-out requests). ``OUT/ablation.json`` holds the figures; each boosted variant's report.json gains
``ensemble_gain_over_independent`` and ``ensemble_gain_over_longer_single`` (union top-k coverage on the
questions, relative; ``..._same_candidates``: against the single SSM's N x k candidates), ``tau_gain_over_*`` (the
runs' merged τ, relative) and ``ensemble_gain_over_best_single_questions`` under ``evaluation``.

Usage:
    python scripts/ablate_ssms.py runs/demo --questions ../shared/data/mt_bench/question.jsonl \\
        [--modes match,quantile,weighted] [--ssms 3] [--steps 30] [--limit 80] [--out runs/demo-ssms] \\
        [--warm-start] [--delta-rank 32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from boosttune.core.files import atomic_write_text
from boosttune.core.models import load_model, load_ssms, model_vocab_size
from boosttune.core.rundir import RunDir
from boosttune.serving.draft_vocab import head_ids, load_ranking
from boosttune.train.coverage import coverage_by_category
from boosttune.train.pipeline import link_or_copy

MODES = ("match", "quantile", "weighted")
"""The boosting modes compared (``independent`` and ``single`` always run: they are the baselines)."""


def ablate_heads_module():
    """scripts/ablate_heads.py (the helpers both ablations share), imported from this script's folder."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ablate_heads

    return ablate_heads


def source_settings(src: Path) -> dict:
    """The source run's mode, SSM count and steps per SSM (its config.yaml)."""
    from boosttune.config import load_config

    cfg = load_config(src / "config.yaml")
    return {"mode": cfg.boost.mode, "ssms": cfg.boost.num_ssms, "steps": cfg.optim.max_steps,
            "quantile": cfg.boost.quantile, "covered_weight": cfg.boost.covered_weight,
            "warm_start": cfg.boost.warm_start, "delta_rank": cfg.boost.delta_rank}


def keeps_stage_one(mode: str, source_mode: str) -> bool:
    """Whether a variant in ``mode`` can take the source's stage 1 as it is: stage 1 always trains on every
    sample with the same seed, but its record of what it leaves is the next stage's pool in ``quantile``
    and ``match`` modes, so there it must have been made in the same mode."""
    return mode in ("weighted", "independent") or mode == source_mode


def link_stage_one(src: Path, dst: Path) -> None:
    """Hard-link the source's initial SSM, stage 1 and SSM 1 into the new run ``dst``."""
    s, d = RunDir(src), RunDir(dst)
    for a, b in ((s.ssm_init_dir, d.ssm_init_dir), (s.stage_dir(1), d.stage_dir(1)), (s.ssm_dir(1), d.ssm_dir(1))):
        if a.is_dir() and not b.exists():
            b.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(a, b, copy_function=link_or_copy, ignore=shutil.ignore_patterns("checkpoints"))


def train_variant(src: Path, dst: Path, mode: str, ssms: int, steps: int, stage_one: Path | None,
                  extra: list[str]) -> dict:
    """Train one variant's SSMs, its stage 1 linked from the run ``stage_one`` where given (a finished
    variant, with its report, is taken as it is); its report."""
    if (dst / "report.json").is_file():
        return json.loads((dst / "report.json").read_text())
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    if stage_one is not None:
        link_stage_one(stage_one, dst)
    cmd = [sys.executable, "-m", "boosttune.cli", "train", "--config", str(src / "config.yaml"), "--run-dir", str(dst),
           f"teacher.reuse_from={src}", f"boost.mode={mode}", f"boost.num_ssms={ssms}", f"optim.max_steps={steps}",
           "feature.enabled=false", "eagle3.enabled=false", "scheduler.prompts=null", *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((dst / "report.json").read_text())


def variant_row(name: str, run: Path, report: dict, cov: dict, names: list[str], wide: float) -> dict:
    """One variant's figures: its SSMs, their coverage on the questions, its own evaluation."""
    ev = report.get("evaluation") or {}
    stages = report.get("stages") or []
    merged = ev.get("ensemble") or (ev.get("singles") or [{}])[0]
    return {"variant": name, "run": str(run), "ssms": names,
            "steps": [s.get("steps") for s in stages], "pools": [s.get("pool_before") for s in stages],
            "seconds": [s.get("train_seconds") for s in stages],
            "coverage": cov["all"]["topk"], "union_coverage": cov["all"]["union_topk"],
            "union_top1": cov["all"]["union_top1"], "union_same_candidates": wide,
            "per_category_union": {c: s["union_topk"] for c, s in cov.items() if c != "all"},
            "heldout_union_coverage": stages[-1].get("union_coverage") if stages else None,
            "eval_tau_each": [s.get("tau") for s in ev.get("singles") or []],
            "eval_tau": merged.get("tau"), "eval_tau_lookup": (merged.get("lookup") or {}).get("tau")}


def format_rows(rows: list[dict], k: int) -> str:
    def f(x, fmt="{:.3f}"):
        return fmt.format(x) if x is not None else "-"

    lines = [f"| variant | SSMs | steps | pools | each SSM's top-{k} | union top-1 | union top-{k} | N x k candidates "
             "in all | held-out union | eval τ each | eval τ merged | + lookup |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {len(r['ssms'])} | {'/'.join(map(str, r['steps']))} | {'/'.join(map(str, r['pools']))} | "
            f"{' / '.join(f'{c:.3f}' for c in r['coverage'])} | {r['union_top1']:.3f} | {r['union_coverage']:.3f} | "
            f"{r['union_same_candidates']:.3f} | {f(r['heldout_union_coverage'])} | "
            f"{' / '.join(f(t, '{:.2f}') for t in r['eval_tau_each'])} | {f(r['eval_tau'])} | {f(r['eval_tau_lookup'])} |")
    return "\n".join(lines)


def gains_of(rows: list[dict]) -> dict[str, dict]:
    """Per boosted variant: its union coverage relative to the independent ensemble's, to the longer single
    SSM's and to its own best SSM's; relative to the longer single SSM given as many candidates as the
    union holds (N x k: what one wider level of that SSM would verify); and, where the rows have the runs'
    own evaluation, its merged τ relative to both baselines' (the figure a served tree turns coverage into)."""
    by = {r["variant"]: r for r in rows}
    ind, single = by["independent"], by["single"]
    out = {}
    for r in rows:
        if r["variant"] in ("independent", "single"):
            continue
        g = {"ensemble_gain_over_independent": r["union_coverage"] / ind["union_coverage"] - 1,
             "ensemble_gain_over_longer_single": r["union_coverage"] / single["union_coverage"] - 1,
             "ensemble_gain_over_best_single_questions": r["union_coverage"] / max(r["coverage"]) - 1}
        if single.get("union_same_candidates"):
            g["ensemble_gain_over_longer_single_same_candidates"] = (
                r["union_coverage"] / single["union_same_candidates"] - 1)
        for name, base in (("independent", ind), ("longer_single", single)):
            if r.get("eval_tau") and base.get("eval_tau"):
                g[f"tau_gain_over_{name}"] = r["eval_tau"] / base["eval_tau"] - 1
        out[r["variant"]] = g
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished `boosttune train` run (its prompts and teacher shards)")
    p.add_argument("--modes", default=",".join(MODES), help=f"boosting modes to compare, of {', '.join(MODES)}")
    p.add_argument("--ssms", type=int, default=0, help="SSMs per ensemble (N; 0: the run's boost.num_ssms)")
    p.add_argument("--steps", type=int, default=0, help="steps per SSM (0: the run's optim.max_steps); single: N x this")
    p.add_argument("--quantile", type=float, default=0.5, help="quantile mode's share that leaves each pool")
    p.add_argument("--covered-weight", type=float, default=0.1, help="weighted mode's weight of a covered token")
    p.add_argument("--warm-start", action="store_true",
                   help="boosted SSM k > 1 starts from SSM k-1 (boost.warm_start; variants named MODE-warm)")
    p.add_argument("--delta-rank", type=int, default=0,
                   help="boosted SSMs 2.. cut to SSM 1 plus rank-R deltas (boost.delta_rank; variants named MODE-rR)")
    p.add_argument("--questions", required=True, help="JSONL questions for the coverage figures (MT-bench's)")
    p.add_argument("--limit", type=int, default=0, help="the first N questions (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=0, help="candidates per position (0: the run's tree's first width)")
    p.add_argument("--out", type=Path, default=None, help="where the variants go (default: RUN-ssms)")
    args = p.parse_args(argv)
    if not (args.run / "report.json").is_file() or not (args.run / "config.yaml").is_file():
        p.error(f"run: {args.run} is not a finished `boosttune train` run (no report.json / config.yaml)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: {bad[0] if bad else 'nothing'} is not one of {', '.join(MODES)}")
    if args.ssms == 1 or args.ssms < 0 or args.steps < 0 or args.limit < 0 or args.top < 0 or args.delta_rank < 0:
        p.error("--ssms must be >= 2 (or 0), --steps, --limit, --top and --delta-rank >= 0")
    if not 0 < args.quantile < 1 or not 0 <= args.covered_weight <= 1:
        p.error("--quantile must be in (0, 1), --covered-weight in [0, 1]")
    if not Path(args.questions).is_file():
        p.error(f"--questions: {args.questions} not found")
    src = source_settings(args.run)
    n, steps = args.ssms or src["ssms"], args.steps or src["steps"]
    out = args.out or args.run.with_name(args.run.name + "-ssms")
    out.mkdir(parents=True, exist_ok=True)

    variants: dict[str, tuple[Path, dict]] = {}
    def settings(mode: str) -> dict:
        boosted = mode != "independent"
        return {"quantile": args.quantile, "covered_weight": args.covered_weight,
                "warm_start": args.warm_start and boosted, "delta_rank": args.delta_rank if boosted else 0}

    def overrides(mode: str) -> list[str]:  # settings(mode) as `boosttune train` overrides
        return [f"boost.{key}={str(v).lower() if isinstance(v, bool) else v}" for key, v in settings(mode).items()]

    def name(mode: str) -> str:
        cfg = settings(mode)
        return mode + ("-warm" if cfg["warm_start"] else "") + (f"-r{cfg['delta_rank']}" if cfg["delta_rank"] else "")

    # a run whose stage 1 (trained for ``steps`` steps, in its mode) later variants may link
    first: tuple[Path, str] | None = (args.run, src["mode"]) if steps == src["steps"] else None
    for mode in sorted([*modes, "independent"], key=lambda m: m not in ("weighted", "independent")):
        if mode == src["mode"] and (n, steps) == (src["ssms"], src["steps"]) \
                and all(src[key] == v for key, v in settings(mode).items()):  # the source run is this variant
            variants[name(mode)] = (args.run, json.loads((args.run / "report.json").read_text()))
            continue
        link = first[0] if first is not None and keeps_stage_one(mode, first[1]) else None
        d = out / name(mode)
        variants[name(mode)] = (d, train_variant(args.run, d, mode, n, steps, link, overrides(mode)))
        first = first or (d, mode)
    variants = {name(m): variants[name(m)] for m in [*modes, "independent"]}  # the table's order
    d = out / "single"
    variants["single"] = (d, train_variant(args.run, d, "independent", 1, n * steps, None, overrides("independent")))

    heads = ablate_heads_module()
    cov_mod = heads.script_module("coverage")
    llm = load_model(str(RunDir(args.run).llm_dir()), dtype=torch.float32)
    report0 = json.loads((args.run / "report.json").read_text())
    tree = report0.get("tree") or {}
    k = args.top or int((tree.get("widths") or [1])[0])
    dv = int(tree.get("draft_vocab") or 0)
    rows = head_ids(load_ranking(RunDir(args.run).draft_vocab_path), dv, model_vocab_size(llm.model)) if dv else None
    answers, categories = heads.answers_and_categories(cov_mod, llm, args.questions, args.limit, args.max_new_tokens)

    table, figures = [], {}
    for name, (run, report) in variants.items():
        dirs = [d for d in RunDir(run).ssm_dirs() if d.name.startswith("ssm-")]
        models = load_ssms(llm, dirs, torch.float32)
        ranks = [cov_mod.drafter_ranks(m, answers, rows) for m in models]
        cov = coverage_by_category(ranks, categories, k)
        # as many candidates as an ensemble's merged first level (N x k): the single SSM with a wider tree
        wide = cov["all"]["union_topk"] if name != "single" else \
            coverage_by_category(ranks, categories, k * n)["all"]["union_topk"]
        table.append(variant_row(name, run, report, cov, [d.name for d in dirs], wide))
        figures[name] = cov
    gains = gains_of(table)
    measure = f"union top-{k} coverage of the LLM's answers to {args.questions}"
    for name, g in gains.items():
        if variants[name][0] != args.run:  # the source run's report stays as `boosttune train` wrote it
            heads.add_gains(variants[name][0] / "report.json", {**g, "ablation_measure": measure}, "evaluation")
    atomic_write_text(out / "ablation.json", json.dumps({"k": k, "ssms": n, "steps": steps, "questions": args.questions,
                                                         "answers": len(answers), "measure": measure, "rows": table,
                                                         "coverage": figures, "gains": gains}, indent=2) + "\n")
    print(f"\n{len(answers)} answers, top-{k}, {n} SSMs of {steps} steps (single: {n * steps})\n")
    print(format_rows(table, k))
    for name, g in gains.items():
        print(f"{name}: union over independent {g['ensemble_gain_over_independent']:+.1%}, over one SSM {n}x as long "
              f"{g['ensemble_gain_over_longer_single']:+.1%} ({n * k} candidates: "
              f"{g.get('ensemble_gain_over_longer_single_same_candidates', float('nan')):+.1%}), over its best SSM "
              f"{g['ensemble_gain_over_best_single_questions']:+.1%}; merged τ over independent "
              f"{g.get('tau_gain_over_independent', float('nan')):+.1%}, over one SSM {n}x as long "
              f"{g.get('tau_gain_over_longer_single', float('nan')):+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
