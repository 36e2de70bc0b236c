"""Top-k coverage of the LLM's tokens by drafters and their union (boosttune/train/coverage.py), against
numbers worked out by hand; the pool and weights boosting derives from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from boosttune.core.ranks import NOT_DRAFTABLE
from boosttune.train.coverage import (
    coverage,
    coverage_summary,
    remove_best_covered,
    sample_union_coverage,
    token_weights,
    union_coverage,
    union_rank_rows,
)

# Three drafters, six positions. With k = 2 (rank 0 or 1 covers):
#   A covers positions 0, 1, 2      -> 3/6
#   B covers positions 2, 3         -> 2/6 (position 5 is outside its draft vocabulary)
#   C covers position 0             -> 1/6
#   union covers 0, 1, 2, 3         -> 4/6; best single A 3/6; gain 1/6
# top-1 (rank 0): A at 0 and 2, B at 3, C none; union 0, 2, 3 -> 3/6
RANKS = [[0, 1, 0, 5, 9, 2],
         [4, 3, 1, 0, 7, NOT_DRAFTABLE],
         [1, 2, 2, 6, 3, 8]]


def test_coverage_and_union_by_hand() -> None:
    np.testing.assert_allclose(coverage(RANKS, 2), [3 / 6, 2 / 6, 1 / 6])
    np.testing.assert_allclose(coverage(RANKS, 1), [2 / 6, 1 / 6, 0])
    assert union_coverage(RANKS, 2) == pytest.approx(4 / 6)
    assert union_coverage(RANKS, 1) == pytest.approx(3 / 6)
    s = coverage_summary(torch.tensor(RANKS), 2)  # tensors work as arrays do
    assert s["topk"] == pytest.approx([3 / 6, 2 / 6, 1 / 6]) and s["top1"] == pytest.approx([2 / 6, 1 / 6, 0])
    assert s["union_topk"] == pytest.approx(4 / 6) and s["union_top1"] == pytest.approx(3 / 6)
    assert s["best_single_topk"] == pytest.approx(3 / 6) and s["union_gain"] == pytest.approx(1 / 6)
    assert s["k"] == 2 and s["tokens"] == 6
    # a drafter that misses what another misses adds nothing; a large k covers all but the undraftable
    assert union_coverage([RANKS[0], RANKS[0]], 2) == pytest.approx(coverage(RANKS, 2)[0])
    assert union_coverage([RANKS[1]], 10**6) == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="ranks"):
        coverage([0, 1], 1)


def test_per_sample_union_coverage_and_union_ranks() -> None:
    # two samples (lengths 2 and 4) cut from RANKS's first two drafters
    rows = [[r[:2], r[2:]] for r in RANKS[:2]]
    # sample 0: A covers both -> 1; sample 1: positions 2, 3 covered of 2..5 -> 2/4
    assert sample_union_coverage(rows, 2) == pytest.approx([1.0, 0.5])
    assert union_rank_rows(rows) == [[0, 1], [0, 0, 7, 2]]


def test_quantile_pool_removes_the_best_covered_share() -> None:
    cov = {0: 0.9, 1: 0.1, 2: 0.5, 3: 0.5, 4: 0.8, 5: 0.0, 6: 0.3}  # sample index -> union coverage
    pool = [6, 1, 2, 3, 4, 0]
    # half of 6 leave: the best covered 0 (.9), 4 (.8), then 2 of the tie 2/3 (lower index first)
    assert remove_best_covered(pool, cov, 0.5) == [6, 1, 3]
    # 0.25 of 6 = 1.5, rounded half up: 2 leave
    assert remove_best_covered(pool, cov, 0.25) == [6, 1, 2, 3]
    assert remove_best_covered([5], cov, 0.4) == [5]  # 0.4 of one rounds to none
    assert remove_best_covered([], cov, 0.5) == []


def test_token_weights_count_covered_tokens_less() -> None:
    assert token_weights([[0, 3, 1], [NOT_DRAFTABLE]], 2, 0.1) == [[0.1, 1.0, 0.1], [1.0]]
