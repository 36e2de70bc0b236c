#!/usr/bin/env python3
"""Is there anything to route per request kind? Feature heads specialised per kind, each the run's head
fine-tuned on its kind's training samples, against the run's head fine-tuned as long on every sample.

Routing pays only where drafters differ by request: a scheduler that sends coding requests to a coding head
can gain at most what that head covers beyond one general head on coding answers. This measures that room
with the cheapest drafters there are to specialise. On one finished run (its teacher samples, their
recorded LLM features and its feature head; nothing is generated again but the LLM's answers to
``--questions``):
- ``all``: the run's head trained ``--steps`` more steps on every training sample (the "as much training"
  baseline: a specialised head has had those steps too);
- ``kind:K``: the run's head trained ``--steps`` more steps on the training samples of category K alone
  (a run's prompts keep their category: the default seeds' writing, coding, math, qa, summarization,
  extraction, roleplay and translation, and the requests the LLM grew from them).
Each is scored teacher forced on the LLM's greedy answers to the questions, per question category
(``scripts/coverage.py``), and a router that knows each question's category and sends it to the head of
its kind (``--route``: question category = training kind) gets the top-k of those pairs, next to the
``all`` head's and the run's own. Measured: docs/measurements.md, "Routing among heads specialised by
kind".

Usage:
    python scripts/ablate_kinds.py runs/demo --questions ../shared/data/mt_bench/question.jsonl \\
        [--steps 100] [--lr 3e-3] [--out runs/demo-kinds]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from boosttune.config import load_config
from boosttune.core.feature_head import teacher_forced_ranks
from boosttune.core.models import load_model, model_vocab_size
from boosttune.core.rundir import RunDir
from boosttune.serving.draft_vocab import head_ids, load_ranking
from boosttune.train.coverage import coverage_by_category

ROUTE = {"coding": "coding", "math": "math", "writing": "writing", "roleplay": "roleplay",
         "extraction": "extraction", "stem": "qa", "humanities": "qa"}
"""MT-bench's categories -> the demo seeds' kinds (reasoning has no kind of its own: it stays with ``all``)."""


def parse_route(text: str) -> dict[str, str]:
    """``cat=kind,cat=kind`` -> {question category: training kind}."""
    out = {}
    for item in filter(None, text.split(",")):
        cat, sep, kind = item.partition("=")
        if not sep or not cat or not kind:
            raise ValueError(f"--route: {item!r} is not CATEGORY=KIND")
        out[cat.strip()] = kind.strip()
    return out


def routed_topk(tables: dict[str, dict[str, dict]], route: dict[str, str], fallback: str,
                hindsight: bool = False) -> float:
    """Top-k over every answer when each question category's answers are drafted by the head of the kind
    ``route`` names (``kind:K`` in ``tables``), the other categories' by ``fallback``; ``hindsight``: by
    whichever of the two covers that category more (a bound no router reaches). ``tables[head][category]``
    holds ``tokens`` and ``topk`` (:func:`coverage_by_category`, one drafter)."""
    base = tables[fallback]
    cats = [c for c in base if c != "all"]

    def drafted_by(cat: str) -> dict:
        head = tables.get(f"kind:{route[cat]}", base) if cat in route else base
        return max(head, base, key=lambda t: t[cat]["topk"][0]) if hindsight else head

    return sum(drafted_by(c)[c]["topk"][0] * base[c]["tokens"] for c in cats) / sum(base[c]["tokens"] for c in cats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished `boosttune train` run with a feature head")
    p.add_argument("--questions", required=True, help="JSONL questions with a category (MT-bench's question.jsonl)")
    p.add_argument("--limit", type=int, default=0, help="the first N questions (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="fine-tuning steps per head (default 100)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the fine-tuning (default 3e-3)")
    p.add_argument("--route", default=",".join(f"{c}={k}" for c, k in ROUTE.items()),
                   help="question category=training kind pairs (default: MT-bench's onto the demo seeds')")
    p.add_argument("--out", type=Path, default=None, help="where the figures (kinds.json) go (default RUN-kinds)")
    args = p.parse_args(argv)
    try:
        route = parse_route(args.route)
    except ValueError as e:
        p.error(str(e))
    if args.steps < 1 or args.lr <= 0 or args.limit < 0 or args.max_new_tokens < 1:
        p.error("--steps and --max-new-tokens must be >= 1, --lr > 0, --limit >= 0")
    run = RunDir(args.run)
    if not run.feature_head_dir(1).is_dir():
        p.error(f"{args.run}: no feature head (ssms/feature); train one with feature.enabled=true")
    from boosttune.train import pipeline
    from boosttune.train.feature import build_head, train_head

    cfg = load_config(args.run / "config.yaml")
    llm = load_model(cfg.llm.ref, torch.float32)
    data = pipeline.prompts_and_teacher(cfg, run, llm)  # a finished run's: read, not generated
    train, feats, _ = pipeline.recorded_features(run, cfg.teacher.shard_size, data.train, 0)
    if any(f is None for f in feats):
        p.error(f"{args.run}: the teacher did not record the LLM's features for every sample")
    kinds = [pr.category for pr in data.prompts[: len(train)]]
    vocab = model_vocab_size(llm.model)
    rows = head_ids(load_ranking(run.draft_vocab_path), cfg.feature.draft_vocab, vocab) if cfg.feature.draft_vocab \
        else torch.arange(vocab)  # as the run's head trained
    saved = load_model(str(run.feature_head_dir(1)), torch.float32).model
    fc = dataclasses.replace(cfg.feature, minutes=0.0, max_steps=args.steps, lr=args.lr)

    def fine_tuned(idx: list[int]) -> torch.nn.Module:
        head = build_head(llm.model, cfg.feature.layers)  # its trainable parts as training sets them
        head.load_state_dict(saved.state_dict())
        st = train_head(head, [train[i] for i in idx], [feats[i] for i in idx], rows, fc, seed=cfg.optim.seed)
        print(f"  {len(idx)} samples, {st['steps']} steps, {st['seconds']:.0f} s", flush=True)
        return head.eval()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ablate_heads  # the LLM's answers, as that ablation writes them

    answers, cats = ablate_heads.answers_and_categories(ablate_heads.script_module("coverage"), llm, args.questions,
                                                         args.limit, args.max_new_tokens)
    k = cfg.tree.widths[0]

    @torch.inference_mode()
    def table_of(head: torch.nn.Module) -> dict:
        ranks = [teacher_forced_ranks(head, f, pr + t, len(pr), rows)[0].numpy().astype(np.int64) for pr, t, f in answers]
        return coverage_by_category([ranks], cats, k)

    tables = {"run": table_of(saved.eval())}
    heads = {"all": list(range(len(train)))}
    heads.update({f"kind:{kd}": [i for i, c in enumerate(kinds) if c == kd] for kd in sorted(set(route.values()))})
    for name, idx in heads.items():
        if not idx:
            print(f"{name}: no training sample of this kind, left out")
            continue
        print(f"{name}:", flush=True)
        tables[name] = table_of(fine_tuned(idx))
    columns = list(tables["run"])
    print(f"top-{k} on {len(answers)} answers, per question category")
    print("| head | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for name, t in tables.items():
        print(f"| {name} | " + " | ".join(f"{t[c]['topk'][0]:.3f}" for c in columns) + " |")
    routed = {"all": tables["all"]["all"]["topk"][0], "routed": routed_topk(tables, route, "all"),
              "hindsight": routed_topk(tables, route, "all", hindsight=True)}
    print(f"routed by category ({args.route}): top-{k} {routed['routed']:.3f} against {routed['all']:.3f} for `all` "
          f"(the better of the two per category, in hindsight: {routed['hindsight']:.3f})")
    out = args.out or args.run.with_name(args.run.name + "-kinds")
    out.mkdir(parents=True, exist_ok=True)
    (out / "kinds.json").write_text(json.dumps({"run": str(args.run), "steps": args.steps, "lr": args.lr, "k": k,
                                                "route": route, "tables": tables, "routed": routed}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
