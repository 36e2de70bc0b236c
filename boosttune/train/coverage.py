"""Top-k coverage of the LLM's tokens by a set of drafters, teacher forced: what boosting works with.

A merged token tree accepts a position when *any* drafter's candidates hold the LLM's token, so what
an ensemble buys is its drafters' **union** coverage, not their average (DESIGN.md, "What boosting is
for"). Everything here starts from ranks: ``rank`` 0 is a drafter's argmax, a drafter with ``k``
candidates at a position covers the LLM's token there when its rank is below ``k``
(:func:`boosttune.core.ranks.token_ranks`; ``NOT_DRAFTABLE`` is never below any ``k``).

Shapes: S drafters, T tokens (every sample's continuation positions laid end to end), P samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from boosttune.core.ranks import NOT_DRAFTABLE
from boosttune.scheduler.offline.walk import Labels, walk
from boosttune.serving.lookup import lookup_positions
from boosttune.serving.tree import TreeConfig


def _ranks(ranks) -> np.ndarray:
    r = np.asarray(ranks)
    if r.ndim != 2:
        raise ValueError(f"ranks: expected (drafters, tokens), got shape {r.shape}")
    return r


def coverage(ranks, k: int) -> np.ndarray:
    """(S,) each drafter's top-``k`` coverage: the share of the T positions whose LLM token it ranks below ``k``.

    Args:
        ranks: (S, T) the rank of the LLM's token under each drafter.
        k: candidates per position (a tree's first width).
    """
    r = _ranks(ranks)
    return (r < k).mean(axis=1) if r.shape[1] else np.zeros(r.shape[0])  # (S,)


def union_coverage(ranks, k: int) -> float:
    """The share of the T positions that at least one drafter covers with ``k`` candidates ((S, T) ranks)."""
    r = _ranks(ranks)
    return float((r < k).any(axis=0).mean()) if r.shape[1] and r.shape[0] else 0.0


def coverage_summary(ranks, k: int) -> dict:
    """Top-1 and top-``k`` coverage per drafter and of their union, and the union's gain (in coverage,
    absolute) over the best single drafter; plain numbers (JSON types)."""
    r = _ranks(ranks)
    top1, topk = coverage(r, 1), coverage(r, k)
    best = float(topk.max()) if len(topk) else 0.0
    union = union_coverage(r, k)
    return {"k": int(k), "tokens": int(r.shape[1]), "top1": [float(x) for x in top1], "topk": [float(x) for x in topk],
            "union_top1": union_coverage(r, 1), "union_topk": union, "best_single_topk": best,
            "union_gain": union - best}


def sample_union_coverage(rows: Sequence[Sequence[Sequence[int]]], k: int) -> list[float]:
    """(P,) per sample, the share of its positions the union of the drafters covers.

    Args:
        rows: ``rows[s][p]``: drafter ``s``'s ranks of sample ``p``'s continuation tokens.
        k: candidates per position.
    """
    if not rows:
        raise ValueError("rows: need at least one drafter")
    out = []
    for per_drafter in zip(*rows, strict=True):
        hit = np.any([np.asarray(x) < k for x in per_drafter], axis=0)  # (len,)
        out.append(float(hit.mean()) if hit.size else 0.0)
    return out


def remove_best_covered(pool: Sequence[int], sample_cov: Sequence[float], share: float) -> list[int]:
    """``pool`` without its best-covered ``share`` (rounded half up): the samples with the highest
    ``sample_cov[i]`` leave, ties by the lower index first; the rest keep their order."""
    n_out = int(math.floor(share * len(pool) + 0.5))
    leave = set(sorted(pool, key=lambda i: (-sample_cov[i], i))[:n_out])
    return [i for i in pool if i not in leave]


def token_weights(rows: Sequence[Sequence[int]], k: int, covered_weight: float) -> list[list[float]]:
    """Per sample, per continuation token: ``covered_weight`` where the drafters so far cover the
    LLM's token (``rows[p]``: the union's rank there, the minimum over drafters), 1 elsewhere."""
    return [np.where(np.asarray(r) < k, covered_weight, 1.0).tolist() for r in rows]


def lookup_rank_rows(samples: Sequence) -> list[list[int]]:
    """Per sample (``.ids``: prompt then answer, ``.prompt_len``), prompt lookup's rank of each answer
    token, teacher forced as it drafts (``serving/lookup.py``): 0 where the first token it drafts there
    is the LLM's, ``NOT_DRAFTABLE`` where it drafts another or nothing. One candidate per position, so
    it covers a token at every ``k`` >= 1."""
    out = []
    for s in samples:
        accepted, _, _, _ = lookup_positions(s.ids[: s.prompt_len], s.ids[s.prompt_len :], 1)
        out.append(np.where(accepted >= 1, 0, NOT_DRAFTABLE).tolist())
    return out


def union_rank_rows(rows: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """Per sample, the union's rank of each token: the minimum over drafters (``rows[s][p]`` as in
    :func:`sample_union_coverage`)."""
    return [np.min(np.asarray(per, dtype=np.int64), axis=0).tolist() for per in zip(*rows, strict=True)]


def coverage_by_category(ranks: Sequence[Sequence[np.ndarray]], categories: Sequence[str], k: int) -> dict[str, dict]:
    """:func:`coverage_summary` over every answer (``"all"``) and over each category's answers.

    Args:
        ranks: ``ranks[s][a]``: (len_a,) drafter ``s``'s ranks of answer ``a``'s tokens.
        categories: (A,) each answer's category ("" counts as ``"uncategorised"``).
        k: candidates per position.
    """
    groups: dict[str, list[int]] = {"all": list(range(len(categories)))}
    for a, c in enumerate(categories):
        groups.setdefault(c or "uncategorised", []).append(a)
    out = {}
    for name in ["all", *sorted(g for g in groups if g != "all")]:
        flat = [np.concatenate([np.asarray(r[a], dtype=np.int64) for a in groups[name]] or [np.zeros(0, np.int64)])
                for r in ranks]
        out[name] = {"answers": len(groups[name]), **coverage_summary(np.stack(flat), k)}
    return out


def walked_tau(accepts: Sequence[np.ndarray], depths: Sequence[int] | None = None) -> float:
    """Tokens per LLM step over answers decoded greedily, walked as the scheduler's replay walks them
    (``scheduler/offline/walk.py``): a step that starts at an answer's position t commits the drafted
    tokens it accepts and the LLM's own next one, and the next step starts after them.

    Args:
        accepts: per answer, (T,) or (T, S) tokens each drafter would have had accepted at t.
        depths: per drafter, how deep it drafts (0: not at all); None: every drafter, to any depth.
    """
    cols = [a if a.ndim == 2 else a[:, None] for a in (np.asarray(x, dtype=np.int64) for x in accepts)]
    tokens = steps = 0
    for acc in cols:
        n = acc.shape[0]
        deep = list(depths) if depths is not None else [int(acc.max(initial=0)) + 1] * acc.shape[1]
        steps += walk(Labels.drafters_only(acc), deep).steps
        tokens += n
    return tokens / steps if steps else 1.0


def tree_taus(ranks: Sequence[Sequence[np.ndarray]], widths: Sequence[int]) -> dict:
    """Teacher-forced greedy τ of each drafter alone with an expansion tree of ``widths`` and of all of
    them merged, for drafters that read only tokens (SSMs: a node on the true path at level l holds the
    LLM's next token when the drafter ranks it below ``widths[l - 1]`` after the true prefix).

    Merged trees share the root and whatever prefixes their drafters share, so a step accepts the
    longest true path any one of them holds; deeper levels let the drafters' different coverage add up
    over the path, where one level caps a step at one drafted token.

    Args:
        ranks: ``ranks[s][a]``: (len_a,) drafter ``s``'s ranks of answer ``a``'s tokens.
        widths: children per node at each level.

    Returns:
        ``{"taus": [S floats], "merged": float, "gain_over_best_single": merged / max(taus) - 1}``.
    """
    tree = TreeConfig(widths=tuple(widths))
    accepts = [np.stack([tree.policy.accepts(tree, np.asarray(r, dtype=np.int64)) for r in per], axis=1)
               for per in zip(*ranks, strict=True)]  # per answer, (T, S)
    d, n = len(tree.widths), len(ranks)
    taus = [walked_tau(accepts, [d if i == j else 0 for i in range(n)]) for j in range(n)]
    merged = walked_tau(accepts, [d] * n)
    return {"taus": taus, "merged": merged, "gain_over_best_single": merged / max(taus) - 1.0}
