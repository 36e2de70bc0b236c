#!/usr/bin/env python3
"""How often feature heads (and standalone SSMs) guess the LLM's next token on a prompt set, without
timing anything: a quick way to compare drafters (seconds each instead of minutes of benchmark).

The LLM writes its greedy answers once, keeping its features (the teacher's batched decoder). Each
head then reads those answers teacher-forced, as serving would feed it: the LLM's feature at a position
and the token after it, guessing the token after that, for every answer token (the engine's prefill
stops before the last prompt token, so the head guesses the first answer token too). It
prints, per head, how often the LLM's next token is the head's first guess and among its first
``--top`` guesses over the draft vocabulary, and the τ a tree of one level of ``--top`` children would
reach on these answers: the answers walked step by step, one token per step plus one more when the
LLM's token was among the children, all answers' tokens over all their steps. That τ equals what `boosttune bench` measures with widths
[``--top``] when the features agree exactly (fp32: up to rounding between the batched decoder and the
engine's verification). With ``--second N`` it also gives each first-level child N children of its own,
drafted from the head's predicted feature as serving drafts depth 2 (``train/feature.py``
``second_step``): it prints how often the child that held the LLM's token also held the next one among
its N, and the τ of widths [``--top``, N].

A standalone SSM (a folder without ``feature_head.json``) reads the prompt and the answer
teacher-forced in one forward and is scored the same way: its guesses for answer token i are its
logits after ``prompt + answer[:i]``, and with ``--second N`` the child holding token i guesses token
i + 1 among its N from ``prompt + answer[:i + 1]``, as an SSM's chain drafts.

Usage:
    python scripts/head_acceptance.py runs/hour/ssms/feature runs/hour3/ssms/feature \\
        --questions ../shared/data/mt_bench/question.jsonl --limit 80 --draft-vocab 8192 --draft-ranking runs/hour \\
        [--second 1]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from boosttune.core.feature_head import teacher_forced_ranks
from boosttune.core.models import eos_token_ids, load_llm_and_ssms, model_vocab_size
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.core.ranks import NOT_DRAFTABLE
from boosttune.scheduler.offline.walk import Labels, walk
from boosttune.serving.draft_vocab import head_ids, ranking_for
from boosttune.serving.drafter import draft_ranks
from boosttune.train.batched_decode import decode_batch


def walked_steps(hits: list[bool], hits2: list[bool] | None = None) -> int:
    """LLM steps after the prefill to commit an answer: a step starting at answer token i commits it,
    plus the next one when the head's first-level children held token i (``hits[i]``), plus the one
    after that when the child holding token i also held token i + 1 among its own (``hits2[i]``).
    The scheduler's replay walks it (``scheduler/offline/walk.py``), the head as one drafter of depth 2."""
    one = np.asarray(hits, dtype=np.int64)
    two = one & np.asarray(hits2, dtype=np.int64) if hits2 is not None else np.zeros_like(one)
    return walk(Labels.drafters_only((one + two)[:, None]), [2]).steps


def head_hits(head, features: torch.Tensor, ids: list[int], prompt_len: int, rows: torch.Tensor, top: int,
              second: int = 0):
    """Per answer token i, as bool tensors: whether it is the head's first guess, among its ``top``
    guesses, and (``second`` > 0) whether token i + 1 is among the ``second`` guesses of the depth-2 node
    holding token i (False for the last token): ``teacher_forced_ranks``, the scheduler's labels too."""
    ranks1, ranks2 = teacher_forced_ranks(head, features.float(), ids, prompt_len, rows, second=bool(second))
    hits2 = ranks2 < second if ranks2 is not None else torch.zeros_like(ranks1, dtype=torch.bool)
    return ranks1 == 0, ranks1 < top, hits2


def ssm_hits(ssm, prompt: list[int], tokens: list[int], rows: torch.Tensor, top: int, second: int = 0):
    """:func:`head_hits` for a standalone SSM: ranks of each answer token among its logits after the
    true prefix (``draft_ranks``: one teacher-forced forward, as the scheduler's replay reads an SSM),
    the depth-2 hit of token i being token i + 1's rank below ``second``."""
    ranks = torch.from_numpy(draft_ranks(ssm, prompt, tokens, rows))
    nxt = torch.cat([ranks[1:], torch.tensor([NOT_DRAFTABLE])])
    return ranks == 0, ranks < top, nxt < second if second else torch.zeros_like(ranks, dtype=torch.bool)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("heads", nargs="+", help="feature-head or SSM folders (a run's ssms/feature, ssms/ssm-1, or a bundle's)")
    p.add_argument("--llm", default="default")
    p.add_argument("--questions", required=True)
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-vocab", type=int, default=0)
    p.add_argument("--draft-ranking", default=None, help="draft_vocab.json or its run (default: next to the first head)")
    p.add_argument("--top", type=int, default=3, help="children of the one-level tree (default 3)")
    p.add_argument("--second", type=int, default=0, metavar="N",
                   help="also a second level: N children under each first-level child (0: one level; default)")
    p.add_argument("--batch-size", type=int, default=96, help="answers written at once")
    args = p.parse_args(argv)
    if args.top < 1 or args.second < 0:
        p.error("--top must be >= 1 and --second >= 0")
    llm, heads = load_llm_and_ssms(args.llm, args.heads, torch.float32)
    vocab = model_vocab_size(llm.model)
    ranking = ranking_for(args.draft_vocab, args.draft_ranking, args.heads)
    rows = head_ids(ranking, args.draft_vocab, vocab) if args.draft_vocab else torch.arange(vocab)
    prompts = [encode_prompt(llm.tokenizer, q, chat=True) for q in read_prompts(args.questions)[: args.limit or None]]
    eos = frozenset(eos_token_ids(llm))
    answers = []
    for b in range(0, len(prompts), args.batch_size):
        batch = prompts[b : b + args.batch_size]
        out = decode_batch(llm.model, batch, args.max_new_tokens, eos, llm.tokenizer.pad_token_id or 0, features=True)
        answers += list(zip(batch, out.tokens, out.features, strict=True))
    print(f"{len(answers)} answers, {sum(len(t) for _, t, _ in answers)} tokens, draft vocabulary {args.draft_vocab or 'full'}")
    two = f" | depth 2 top-{args.second} after a hit | τ, widths {args.top},{args.second}" if args.second else ""
    print(f"| head | positions | top-1 | top-{args.top} | τ, one level of {args.top}{two} |\n"
          f"|---|---|---|---|---|{'---|---|' if two else ''}")
    total = sum(len(t) for _, t, _ in answers)
    for ref, h in zip(args.heads, heads, strict=True):
        h.model.eval()
        first = any_ = n = steps = hit = both = steps2 = 0
        for prompt, tokens, feats in answers:
            if tokens and len(prompt) >= 2:  # the first guess reads the token before the last
                if h.kind == "feature":  # the kind its directory declares (core/kind_file.py)
                    one, some, deep = head_hits(h.model, feats, list(prompt) + list(tokens), len(prompt), rows,
                                                args.top, args.second)
                else:
                    one, some, deep = ssm_hits(h.model, list(prompt), list(tokens), rows, args.top, args.second)
                first, any_, n = first + int(one.sum()), any_ + int(some.sum()), n + len(one)
                steps += walked_steps(some.tolist())
                hit, both = hit + int(some[:-1].sum()), both + int((some[:-1] & deep[:-1]).sum())
                steps2 += walked_steps(some.tolist(), deep.tolist())
        row = f"| {ref} | {n} | {first / max(n, 1):.3f} | {any_ / max(n, 1):.3f} | {total / max(steps, 1):.2f} |"
        if args.second:  # tokens per step, as `boosttune bench` counts
            row += f" {both / max(hit, 1):.3f} | {total / max(steps2, 1):.2f} |"
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
