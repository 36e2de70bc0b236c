"""Prompt lookup's chain length per step, learned: how long to draft after a match of n tokens.

Shape legend: R training requests, G longest matched n-gram (3), D label depth.

A copy that starts from a 3-token match is far more likely to go on than one from a single shared
token, and a chain that fails costs verification time, so one length for every step wastes time
on weak matches or drafts too little on strong ones. The table ``lengths[n - 1]`` (0 .. D tokens
after an n-token match) is fitted to maximise the measure reports compare, the mean over the
training requests of tokens per second, each request replayed step by step (``walk.py``) under
the measured costs. The fit is coordinate ascent over non-decreasing tables (a longer match is
never trusted less, which keeps rare match lengths from being fitted to noise), started from the
fixed length and from D: for each n in turn, every length between its neighbours' is replayed and
the best kept, until a round changes nothing (at most G x (D + 1) replays of R requests a round). Choosing the speculation length per step from what is known at that
step is also what DISCO (Mamou et al., arXiv 2405.04304) and SpecDec++ (Huang et al., arXiv
2405.19715) learn for model drafters; here the signal is the match length and the choice a table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from boosttune.scheduler.costs import CostModel
from boosttune.scheduler.labels import RequestRecord
from boosttune.scheduler.subsets import members
from boosttune.scheduler.walk import walk, walk_seconds


def _walk_depths(mask: int, depth: int, lookup: int, costs: CostModel) -> list[int]:
    depths = [depth if j in members(mask) else 0 for j in range(costs.n_ssms)]
    depths[lookup] = max(costs.depths)  # the table decides, up to the label depth
    return depths


def tokens_per_second(
    records: Sequence[RequestRecord], costs: CostModel, mask: int, depth: int, lookup: int, table: Sequence[int]
) -> float:
    """Mean over ``records`` of tokens per second (LLM prefill, SSM catch-up and decoding, as
    ``evaluate.replay`` prices them) with SSMs at ``depth`` and prompt lookup's lengths ``table``."""
    depths = _walk_depths(mask, depth, lookup, costs)
    rates = []
    for r in records:
        decode = walk_seconds(walk(r.labels(), depths, lookup, tuple(table)), costs, depths, lookup)[0]
        seconds = r.prefill_s + costs.prefill_cost(mask, r.prompt_tokens) + decode
        rates.append(r.new_tokens / seconds if seconds > 0 else 0.0)
    return float(np.mean(rates)) if rates else 0.0


def fit_ngram_depths(
    records: Sequence[RequestRecord], costs: CostModel, mask: int, depth: int, lookup: int, rounds: int = 4
) -> tuple[int, ...]:
    """The per-match length table for subset ``mask`` (SSMs at ``depth``) on ``records``.

    Starts from ``depth`` for every match length seen in the labels (1 .. G); returns () when no
    table beats that fixed length on ``records``.
    """
    if lookup not in members(mask) or not records:
        return ()
    g = max((int(r.labels().ngram.max(initial=0)) for r in records), default=0)
    if g == 0:
        return ()
    top = max(costs.depths)
    start = (min(depth, top),) * g
    base = tokens_per_second(records, costs, mask, depth, lookup, start)
    found, found_value = start, base
    for first in sorted({start, (top,) * g}):
        table, best = _ascend(records, costs, mask, depth, lookup, list(first), rounds)
        if best > found_value * (1 + 1e-9):
            found, found_value = table, best
    return found if found != start else ()


def _ascend(records, costs, mask, depth, lookup, table: list[int], rounds: int) -> tuple[tuple[int, ...], float]:
    """Coordinate ascent over non-decreasing tables (a longer match is never trusted less)."""
    best = tokens_per_second(records, costs, mask, depth, lookup, table)
    top = max(costs.depths)
    for _ in range(rounds):
        changed = False
        for i in range(len(table)):
            low = table[i - 1] if i else 0
            high = table[i + 1] if i + 1 < len(table) else top
            for k in range(low, high + 1):
                trial = [*table[:i], k, *table[i + 1 :]]
                value = tokens_per_second(records, costs, mask, depth, lookup, trial)
                if value > best * (1 + 1e-9):
                    table, best, changed = trial, value, True
        if not changed:
            break
    return tuple(table), best
