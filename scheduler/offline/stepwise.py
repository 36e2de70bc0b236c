"""Prompt lookup's chain length per step, learned: how long to draft after a match of n tokens.

Shape legend: R training requests, G longest matched n-gram (3), D label depth.

A copy that starts from a 3-token match is far more likely to go on than one from a single shared
token, and a chain that fails costs verification time, so one length for every step wastes time
on weak matches or drafts too little on strong ones. The table ``lengths[n - 1]`` (0 .. D tokens
after an n-token match) is fitted to maximise the measure reports compare, the mean over the
training requests of tokens per second, each request replayed step by step under the measured
costs (``evaluate.replay``). The fit is coordinate ascent over non-decreasing tables (a longer
match is never trusted less, which keeps rare match lengths from being fitted to noise), started
from the fixed length and from D: for each n in turn, every length between its neighbours' is
replayed and the best kept, until a round changes nothing (each table is replayed once).
Choosing the speculation length per step from what is known at that step is also what DISCO
(Mamou et al., arXiv 2405.04304) and SpecDec++ (Huang et al., arXiv 2405.19715) learn for model
drafters; here the signal is the match length and the choice a table.
"""

from __future__ import annotations

from collections.abc import Sequence

from boosttune.scheduler.costs import CostModel
from boosttune.scheduler.offline.evaluate import mean_tokens_per_s
from boosttune.scheduler.offline.labels import RequestRecord
from boosttune.scheduler.policy import Candidate
from boosttune.scheduler.subsets import members


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
    seen: dict[tuple[int, ...], float] = {}

    def value(table: tuple[int, ...]) -> float:  # each table is replayed once: ascent revisits many
        if table not in seen:
            seen[table] = mean_tokens_per_s(records, Candidate(mask, depth, table), costs)
        return seen[table]

    start = (min(depth, top),) * g
    found = start
    for first in sorted({start, (top,) * g}):
        table = _ascend(value, first, top, rounds)
        if value(table) > value(found) * (1 + 1e-9):
            found = table
    return found if found != start else ()


def _ascend(value, table: tuple[int, ...], top: int, rounds: int) -> tuple[int, ...]:
    """Coordinate ascent of ``value`` over non-decreasing tables (a longer match is never trusted less)."""
    for _ in range(rounds):
        changed = False
        for i in range(len(table)):
            low = table[i - 1] if i else 0
            high = table[i + 1] if i + 1 < len(table) else top
            for k in range(low, high + 1):
                trial = (*table[:i], k, *table[i + 1 :])
                if value(trial) > value(table) * (1 + 1e-9):
                    table, changed = trial, True
        if not changed:
            break
    return table
