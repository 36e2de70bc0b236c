#!/usr/bin/env python3
"""Whether a set of drafters complement each other: top-1 and top-k coverage of the LLM's answers by each
drafter of a bundle or a training run, by their union, and the union's gain over the best single one,
over all answers and per request category.

A merged tree accepts a position when any drafter's candidates hold the LLM's token, so the union's
coverage is what an ensemble can buy, and coverage that differs by category is what routing can use
(DESIGN.md, "What boosting is for"). Nothing is timed: each drafter reads the LLM's answers teacher
forced, as the scheduler's replay does (an SSM: one forward over prompt + answer, ``draft_ranks``; a
feature head: the LLM's features and the next token, ``teacher_forced_ranks``); a position is covered
when the LLM's token ranks below ``--top`` among the drafter's logits over its draft vocabulary (the
bundle's trees' ``draft_vocab``, else the run's tree's). Prompt lookup, which has no model, is scored
with ``--lookup``: one candidate, the first token it drafts at each position (``train/coverage.py``
``lookup_rank_rows``), counted in the union as a bundle merges it with the others. A run's EAGLE-3 head
(``RUN/eagle3``, ``eagle3.enabled``) is scored too, at its first draft step over its own draft
vocabulary, from the LLM's layer inputs (``eagle3_ranks``).

``--trees W [W ...]`` (e.g. ``3 3,1 2,2,1``) also gives, per expansion tree shape, each SSM's
teacher-forced greedy τ alone and the SSMs' τ merged (``train/coverage.py`` ``tree_taus``): one level caps
a step at one drafted token, so coverage gained by an ensemble shows in τ more with deeper trees. SSMs only:
a feature head's deeper levels read its own predicted features, which a teacher-forced pass does not have
(``head_acceptance.py --second`` scores a head's two levels), and prompt lookup and an EAGLE-3 head are
left out too.

The LLM writes its greedy answers (fp32) to the questions' first turns, or ``--answers`` reads them from
a `boosttune bench` output (``DIR/<method>.jsonl``, matched by ``question_id``; the answer text is
tokenised again, which can differ from the tokens generated where the text does not round-trip).

Usage:
    python scripts/coverage.py runs/demo-bundle --questions ../shared/data/mt_bench/question.jsonl
    python scripts/coverage.py runs/demo --questions ../shared/data/mt_bench/question.jsonl --limit 40 \\
        [--top 3] [--answers bench/ours.jsonl] [--json coverage.json] [--lookup] [--trees 3 3,1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from boosttune.core.feature_head import teacher_forced_ranks
from boosttune.core.files import is_complete
from boosttune.core.models import LoadedModel, eos_token_ids, load_model, load_ssms, model_vocab_size
from boosttune.core.prompts import Prompt, encode_prompt, read_prompts
from boosttune.core.rundir import RunDir
from boosttune.serving.draft_vocab import head_ids, load_ranking
from boosttune.serving.drafter import draft_ranks
from boosttune.serving.lookup import LOOKUP_NAME
from boosttune.train.batched_decode import decode_batch
from boosttune.train.coverage import coverage_by_category, lookup_rank_rows, tree_taus
from boosttune.train.distill import Sample

MODEL_KINDS = ("ssm", "feature")
"""Drafter kinds scored here: those that rank the LLM's token among logits."""


def load_drafters(source: Path, llm_ref: str | None) -> tuple[LoadedModel, list[tuple[str, LoadedModel, torch.Tensor | None]], int]:
    """The LLM, the drafters with a model (name, model, draft vocabulary rows or None) and the first tree
    width, from a bundle (``manifest.json``) or a run directory (``report.json``)."""
    if (source / "manifest.json").is_file():
        from boosttune.serving.bundle import load_bundle

        b = load_bundle(source, llm=llm_ref)
        vocab = model_vocab_size(b.llm.model)
        drafters = []
        for entry in b.manifest.drafters:
            if b.models.get(entry.name) is None or entry.kind not in MODEL_KINDS:
                continue
            dv = entry.tree.draft_vocab
            rows = head_ids(b.ranking, dv, vocab) if dv and b.ranking is not None else None
            b.models[entry.name].kind = entry.kind
            drafters.append((entry.name, b.models[entry.name], rows))
        widths = [e.tree.widths for e in b.manifest.drafters if e.kind in MODEL_KINDS and e.tree.widths]
        return b.llm, drafters, widths[0][0] if widths else 1
    run = RunDir(source)
    report = run.read_report()
    llm = load_model(llm_ref or str(run.llm_dir()), dtype=torch.float32)
    dirs = run.ssm_dirs() + run.feature_dirs()
    if not dirs:
        raise SystemExit(f"{source}: no finished drafter (ssms/ssm-K or ssms/feature)")
    loaded = load_ssms(llm, dirs, torch.float32)
    tree = report.get("tree") or {}
    dv = int(tree.get("draft_vocab") or 0)
    rows = head_ids(load_ranking(run.draft_vocab_path), dv, model_vocab_size(llm.model)) if dv else None
    widths = tree.get("widths") or [1]
    return llm, [(d.name, m, rows) for d, m in zip(dirs, loaded, strict=True)], int(widths[0])


def read_answers(path: Path) -> dict[str, str]:
    """question_id -> the first turn's answer text of a `boosttune bench` output file."""
    out = {}
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            rec = json.loads(line)
            out[str(rec["question_id"])] = rec["choices"][0]["turns"][0]
    return out


@torch.inference_mode()
def llm_answers(llm: LoadedModel, questions: list[Prompt], max_new: int, answers_file: Path | None,
                batch_size: int) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Per question: (prompt ids, answer ids, the LLM's (len - 1, H) features of prompt + answer)."""
    prompts = [encode_prompt(llm.tokenizer, q, chat=True) for q in questions]
    if answers_file is None:
        eos, out = frozenset(eos_token_ids(llm)), []
        pad = llm.tokenizer.pad_token_id or 0
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            dec = decode_batch(llm.model, batch, max_new, eos, pad, features=True)
            out += [(list(p), list(t), f) for p, t, f in zip(batch, dec.tokens, dec.features, strict=True)]
        return out
    texts = read_answers(answers_file)
    missing = [q.id for q in questions if q.id not in texts]
    if missing:
        raise SystemExit(f"--answers {answers_file}: no answer for question_id {missing[0]} ({len(missing)} missing)")
    out = []
    for q, p in zip(questions, prompts, strict=True):
        tokens = llm.tokenizer(texts[q.id], add_special_tokens=False)["input_ids"][:max_new]
        ids = torch.tensor([[*p, *tokens][:-1]])  # the last token is never read
        feats = llm.model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0].float()
        out.append((list(p), list(tokens), feats))
    return out


@torch.inference_mode()
def drafter_ranks(model: LoadedModel, answers, rows: torch.Tensor | None) -> list[np.ndarray]:
    """(len_a,) ranks of each answer's tokens under one drafter, teacher forced as serving drafts."""
    model.model.eval()
    out = []
    for prompt, tokens, feats in answers:
        if model.kind == "feature":  # the kind its directory declares (core/kind_file.py)
            r = teacher_forced_ranks(model.model, feats, prompt + tokens, len(prompt), rows)[0].numpy()
        else:
            r = draft_ranks(model.model, prompt, tokens, rows)
        out.append(np.asarray(r, dtype=np.int64))
    return out


@torch.inference_mode()
def eagle3_answer_ranks(llm: LoadedModel, head_dir: Path, answers) -> list[np.ndarray]:
    """(len_a,) ranks of each answer's tokens under a run's EAGLE-3 head at its first draft step."""
    from boosttune.core.eagle3_head import load_head
    from boosttune.train.eagle3 import eagle3_ranks, layer_features

    head = load_head(head_dir, llm.model.get_input_embeddings().weight).eval()
    out = []
    for prompt, tokens, _ in answers:
        ids = prompt + tokens
        aux = layer_features(llm.model, [Sample(ids=ids, prompt_len=len(prompt))], head.spec.layers)[0].aux
        out.append(eagle3_ranks(head, aux.float(), ids, len(prompt)).numpy().astype(np.int64))
    return out


def format_table(names: list[str], table: dict[str, dict]) -> str:
    """A markdown table: per category, a row per drafter and one for their union."""
    k = table["all"]["k"]
    lines = [f"| category | drafter | answers | positions | top-1 | top-{k} | gain over best single |",
             "|---|---|---|---|---|---|---|"]
    for cat, s in table.items():
        for i, name in enumerate(names):
            lines.append(f"| {cat} | {name} | {s['answers']} | {s['tokens']} | {s['top1'][i]:.3f} | {s['topk'][i]:.3f} | |")
        lines.append(f"| {cat} | **union** | {s['answers']} | {s['tokens']} | {s['union_top1']:.3f} | "
                     f"{s['union_topk']:.3f} | {s['union_gain']:+.3f} |")
    return "\n".join(lines)


def widths_arg(text: str) -> tuple[int, ...]:
    """``"3,1"`` → (3, 1): an expansion tree's children per level, each >= 1."""
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--trees: {text!r} is not a comma-separated list of widths (e.g. 3,1)") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"--trees: {text!r} needs widths >= 1 (e.g. 3,1)")
    return widths


def trees_table(names: list[str], trees: dict[str, dict]) -> str:
    """A markdown table: per tree shape, each SSM's τ alone, merged, and the merged τ's gain over the best."""
    lines = [f"| tree | {' | '.join(names)} | merged | merged / best single |", "|---" * (len(names) + 3) + "|"]
    for label, t in trees.items():
        taus = " | ".join(f"{x:.3f}" for x in t["taus"])
        lines.append(f"| {label} | {taus} | {t['merged']:.3f} | {1 + t['gain_over_best_single']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path, help="a bundle directory or a `boosttune train` run directory")
    p.add_argument("--questions", required=True, help="JSONL questions (MT-bench's question.jsonl: rows with a category)")
    p.add_argument("--limit", type=int, default=0, help="the first N questions (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=0, help="candidates per position (0: the tree's first width)")
    p.add_argument("--answers", type=Path, default=None, help="a `boosttune bench` output (.jsonl) to read the answers from")
    p.add_argument("--llm", default=None, help="the LLM (default: the bundle's or the run's)")
    p.add_argument("--batch-size", type=int, default=32, help="answers written at once")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument("--lookup", action="store_true", help="also score prompt lookup (its first drafted token) "
                   "and count it in the union")
    p.add_argument("--trees", nargs="+", type=widths_arg, default=[], metavar="W",
                   help="expansion tree shapes (e.g. 3 3,1 2,2,1): each SSM's teacher-forced τ alone and merged")
    args = p.parse_args(argv)
    if args.top < 0 or args.limit < 0 or args.max_new_tokens < 1:
        p.error("--top and --limit must be >= 0, --max-new-tokens >= 1")
    llm, drafters, width = load_drafters(args.source, args.llm)
    if not drafters:
        p.error(f"{args.source}: no drafter with a model ({', '.join(MODEL_KINDS)})")
    ssms = [i for i, (_, m, _) in enumerate(drafters) if m.kind != "feature"]
    if args.trees and not ssms:  # before the LLM writes its answers
        p.error(f"--trees: {args.source} has no SSM (feature heads are left out of it)")
    k = args.top or width
    questions = read_prompts(args.questions)[: args.limit or None]
    answers = [a for a in llm_answers(llm, questions, args.max_new_tokens, args.answers, args.batch_size)]
    keep = [i for i, (prompt, tokens, _) in enumerate(answers) if tokens and len(prompt) >= 2]
    answers = [answers[i] for i in keep]
    categories = [questions[i].category for i in keep]
    ranks = [drafter_ranks(m, answers, rows) for _, m, rows in drafters]
    names = [n for n, _, _ in drafters]
    if not (args.source / "manifest.json").is_file() and is_complete(RunDir(args.source).eagle3_dir):
        names.append("eagle3")
        ranks.append(eagle3_answer_ranks(llm, RunDir(args.source).eagle3_dir, answers))
    if args.lookup:
        names.append(LOOKUP_NAME)
        samples = [Sample(ids=prompt + tokens, prompt_len=len(prompt)) for prompt, tokens, _ in answers]
        ranks.append([np.asarray(r, dtype=np.int64) for r in lookup_rank_rows(samples)])
    table = coverage_by_category(ranks, categories, k)
    trees = {",".join(map(str, w)): tree_taus([ranks[i] for i in ssms], w) for w in args.trees}
    print(f"{len(answers)} answers, {table['all']['tokens']} tokens, {len(names)} drafters, top-{k}")
    print(format_table(names, table))
    if trees:
        print(f"\nteacher-forced greedy τ by tree shape (SSMs only), {table['all']['tokens']} tokens")
        print(trees_table([names[i] for i in ssms], trees))
    if args.json is not None:
        args.json.write_text(json.dumps({"source": str(args.source), "questions": str(args.questions), "k": k,
                                         "drafters": names, "categories": table, "trees": trees}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
