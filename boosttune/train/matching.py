"""Whether an SSM reproduces the LLM's continuation of a sample: the boost-tuning criterion.

Under teacher forcing (the SSM reads the prompt and the LLM's tokens), the SSM's greedy token at
each continuation position is compared with the LLM's next token. Over the first ``k`` positions
(fewer when the continuation is shorter):
- ``prefix``: matched when all of them agree (the SSM alone would draft those ``k`` tokens and have
  them all accepted by greedy verification);
- ``fraction``: matched when at least ``fraction`` of them agree.
SpecInfer (arXiv 2305.09781, §4.2) removes the samples an SSM already "matches" before training
the next one; the paper leaves the precise criterion open, hence both, configurable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from boosttune.config import MatchConfig
from boosttune.train.distill import Sample, collate, plan_batches


def agreement_rows(hits: torch.Tensor, lengths: Sequence[int]) -> list[list[bool]]:
    """Split the flat per-position hits (row-major over loss positions) back into samples."""
    out, start = [], 0
    for n in lengths:
        out.append(hits[start : start + n].tolist())
        start += n
    return out


def is_match(agree: Sequence[bool], cfg: MatchConfig) -> bool:
    window = list(agree[: cfg.k])
    if not window:
        return False
    if cfg.kind == "prefix":
        return all(window)
    return sum(window) / len(window) >= cfg.fraction


@torch.inference_mode()
def teacher_forced_agreement(model, samples: Sequence[Sample], pad_id: int, batch_tokens: int = 8192,
                             autocast: bool = False) -> list[list[bool]]:
    """Per sample, per continuation position: does the SSM's argmax equal the LLM's token?"""
    return teacher_forced_scores(model, samples, pad_id, batch_tokens, autocast)[0]


@torch.inference_mode()
def teacher_forced_scores(model, samples: Sequence[Sample], pad_id: int, batch_tokens: int = 8192,
                          autocast: bool = False) -> tuple[list[list[bool]], list[list[int]]]:
    """Per sample, per continuation position, from one teacher-forced forward: whether the SSM's argmax
    is the LLM's token (the match criterion's input), and the LLM's token's rank among the SSM's logits
    (0: none higher; what top-k coverage is counted from, ``boosttune/train/coverage.py``)."""
    model.eval()
    device = next(model.parameters()).device
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    agree: list[list[bool] | None] = [None] * len(samples)
    ranks: list[list[int] | None] = [None] * len(samples)
    for idx in plan_batches([len(s.ids) for s in samples], batch_tokens, seed=None):
        b = collate([samples[i] for i in idx], pad_id)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = base.get_decoder()(input_ids=b["input_ids"].to(device),
                                        attention_mask=b["attention_mask"].to(device)).last_hidden_state
            mask = b["loss_mask"].to(device)
            logits = base.get_output_embeddings()(hidden[mask])  # (n, V)
            pred = logits.argmax(-1)
        targets = b["targets"].to(device)[mask]
        hits = (pred == targets).cpu()
        rank = (logits > logits.gather(1, targets[:, None])).sum(1).cpu()  # (n,) as token_ranks counts
        lengths = [len(samples[i].ids) - samples[i].prompt_len for i in idx]
        for i, row, r in zip(idx, agreement_rows(hits, lengths), agreement_rows(rank, lengths), strict=True):
            agree[i], ranks[i] = row, r
    return agree, ranks  # type: ignore[return-value]


def summarize_agreement(rows: Sequence[Sequence[bool]]) -> dict[str, float]:
    """Token-level top-1 agreement and mean matched-prefix length over samples."""
    total = sum(len(r) for r in rows)
    hits = sum(sum(r) for r in rows)
    prefix = [next((i for i, h in enumerate(r) if not h), len(r)) for r in rows]
    return {"top1": hits / total if total else 0.0, "mean_prefix": sum(prefix) / len(prefix) if prefix else 0.0}
