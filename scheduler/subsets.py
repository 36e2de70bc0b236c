"""SSM subsets as bitmasks, and the survival arithmetic the acceptance model learns.

Shape legend: T labelled positions of one request, N drafters, M = 2**N - 1 non-empty subsets, D label depth.

A subset is a bitmask over drafter indices (bit j = drafter j), M of them, mask m at row m - 1. With
greedy merged trees the accepted length of a step is the maximum over the drafters' branches, and a
tree cut to depth k accepts ``min(a, k)`` of a branch that accepted ``a`` at the label depth (the
branch's first k levels are the same nodes). So for any subset and budget::

    accepted draft tokens per step ≈ mean over positions of max_{j in mask} min(a_j, k)
                                   = sum_{d <= k} P(max_{j in mask} a_j >= d)

which the policy predicts per request from the survival ``P(...)``. The approximation (steps start
at some positions, not all) is only the prediction's; replays walk the steps (``offline/walk.py``).
"""

from __future__ import annotations

import numpy as np


def all_masks(n: int) -> list[int]:
    """The M non-empty subsets of n SSMs, as bitmasks 1 .. 2**n - 1."""
    return list(range(1, 1 << n))


def members(mask: int) -> tuple[int, ...]:
    """SSM indices in ``mask``, increasing."""
    return tuple(j for j in range(mask.bit_length()) if mask >> j & 1)


def mask_of(indices: tuple[int, ...] | list[int]) -> int:
    out = 0
    for j in indices:
        out |= 1 << int(j)
    return out


def union_accepts(accepts: np.ndarray, mask: int) -> np.ndarray:
    """(T, N) per-position branch acceptances → (T,) what the merged tree of ``mask`` accepts."""
    cols = list(members(mask))
    if not cols or accepts.shape[0] == 0:
        return np.zeros(accepts.shape[0], dtype=np.int64)
    return accepts[:, cols].max(axis=1)


def union_survival(accepts: np.ndarray, n: int, depth: int) -> np.ndarray:
    """(T, N) acceptances → (M, D): share of positions whose subset accepted at least d = 1..D tokens."""
    out = np.zeros((len(all_masks(n)), depth))
    if accepts.shape[0] == 0:
        return out
    levels = np.arange(1, depth + 1)
    for row, mask in enumerate(all_masks(n)):
        out[row] = (union_accepts(accepts, mask)[:, None] >= levels[None, :]).mean(axis=0)
    return out


def monotone(survival: np.ndarray, n: int) -> np.ndarray:
    """Project predicted (M, D) survival onto what survival can be: in [0, 1], non-increasing in
    d, and never lower for a subset than for any subset of it (adding an SSM never hurts)."""
    u = np.minimum.accumulate(np.clip(survival, 0.0, 1.0), axis=1)
    for mask in sorted(all_masks(n), key=lambda m: bin(m).count("1")):
        for j in members(mask):
            sub = mask & ~(1 << j)
            if sub:
                u[mask - 1] = np.maximum(u[mask - 1], u[sub - 1])
    return u
