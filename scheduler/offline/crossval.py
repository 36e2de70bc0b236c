"""Cross-validated adoption: serve a learned refinement only where held-out requests show it pays.

Shape legend: R training requests, K folds.

The learned parts of a scheduler (the per-request choice, the per-match prompt-lookup table) are
fitted on a few dozen requests at most, often ten; a fit that wins on its own requests can lose on
the next ones. Measured on the demo run (10 training requests; 80 MT-bench questions served, bf16,
128 tokens): one fit chose prompt lookup alone, without the feature head, for 25 of the 80 questions
and served τ 1.73, 1.53x; the same bundle with its per-request choice refused by this check served
τ 1.98, 1.63x. So each part is checked before it is served: the training
requests are split into K folds, the part is refitted without each fold and replayed on it
(``evaluate.replay``) beside what it would replace, and it is kept only when the held-out mean
tokens/s is at least ``margin`` faster and the 95 % bootstrap interval of that ratio lies above 1
(``report.paired_ratio_ci``). Otherwise the scheduler serves the best fixed choice, which is what
a request gets anyway whenever the learned choice is not predicted to beat it by ``margin``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from boosttune.scheduler.offline.evaluate import Outcome
from boosttune.scheduler.offline.report import paired_ratio_ci

# (indices fitted on, indices held out) -> (learned outcomes, replaced outcomes) on the held-out ones
FoldReplay = Callable[[list[int], list[int]], tuple[list[Outcome], list[Outcome]]]


@dataclass(frozen=True)
class Verdict:
    """Whether a learned part is served, and the held-out evidence.

    Attributes:
        adopted: serve it.
        ratio: held-out mean tokens/s of the learned part over that of what it replaces (nan: not checked).
        low: lower end of the ratio's 95 % bootstrap interval.
        high: upper end.
        share_faster: share of held-out requests on which it was faster.
        requests: held-out requests compared (0: not checked).
    """

    adopted: bool
    ratio: float = float("nan")
    low: float = float("nan")
    high: float = float("nan")
    share_faster: float = float("nan")
    requests: int = 0

    def to_json(self) -> dict:
        """As JSON (None where not checked)."""
        def num(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {"adopted": self.adopted, "ratio": num(self.ratio), "low": num(self.low), "high": num(self.high),
                "share_faster": num(self.share_faster), "requests": self.requests}


def folds(n: int, k: int) -> list[list[int]]:
    """``k`` (at most ``n``) folds of ``range(n)``, dealt round-robin; [] when fewer than 2."""
    k = min(k, n)
    return [list(range(i, n, k)) for i in range(k)] if k >= 2 else []


def cross_validate(n: int, k: int, fold_replay: FoldReplay, min_fit: int = 1) -> tuple[list[Outcome], list[Outcome]]:
    """Each of ``n`` requests' outcome under the learned part fitted without its fold, and under what
    it replaces; folds that would leave fewer than ``min_fit`` requests to fit on are skipped (with
    too few requests nothing is compared, and ``verdict`` then serves nothing)."""
    learned: list[Outcome] = []
    replaced: list[Outcome] = []
    for held in folds(n, k):
        out = set(held)
        rest = [i for i in range(n) if i not in out]
        if len(rest) < min_fit:
            continue
        a, b = fold_replay(rest, held)
        learned.extend(a)
        replaced.extend(b)
    return learned, replaced


def verdict(learned: Sequence[Outcome], replaced: Sequence[Outcome], margin: float) -> Verdict:
    """Adopt when the held-out ratio is at least ``1 + margin`` and its 95 % interval lies above 1."""
    ci = paired_ratio_ci(list(learned), list(replaced))
    if not ci:
        return Verdict(adopted=False)
    ok = ci["ratio"] >= 1.0 + margin and ci["low"] > 1.0
    return Verdict(ok, ci["ratio"], ci["low"], ci["high"], ci["share_faster"], len(learned))
