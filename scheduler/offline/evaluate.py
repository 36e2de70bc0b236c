"""Evaluating policies: full-information replay for all of them, real engine runs for some.

Replay (``replay``): a labelled request's per-position acceptances are walked step by step for any
(subset, depth), prompt lookup's per-match lengths included (``walk.py``); the cost model prices
each step: ``LLM prefill (measured) + SSM prefill + sum over steps of step(subset, depth, nodes)``.
Real runs run the engine with the policy's choice and time it; they include everything the replay
models away.

Policies: ``learned`` (the scheduler), ``learned_per_request`` (its choices without the per-match
prompt-lookup lengths, to show what each part adds), ``oracle`` (per request, the best candidate in hindsight by
replay), ``random`` (a seeded random non-empty subset at a random depth), ``none`` (plain
decoding), ``all`` (every SSM), ``single:K`` (SSM K alone) and ``best_fixed`` (the best candidate
on the training requests). Fixed policies use the depth that was best for their subset on the
training requests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from boosttune.scheduler.costs import CostModel
from boosttune.scheduler.offline.labels import RequestRecord
from boosttune.scheduler.offline.walk import walk, walk_seconds
from boosttune.scheduler.policy import Candidate, Choice, Scheduler, candidates, simplest_within
from boosttune.scheduler.subsets import all_masks, members
from boosttune.serving.engine import GenerationResult, SpeculativeEngine
from boosttune.serving.stops import StopCriteria

FIXED = ("none", "all", "best_fixed")


@dataclass(frozen=True)
class Outcome:
    """One request under one policy.

    Attributes:
        candidate: what the policy chose.
        new_tokens: tokens generated.
        tau: tokens per LLM forward (bonus included).
        wall_s: seconds for the request, prefill included.
        draft_s: seconds the SSMs spent drafting (prompt catch-up included).
        plan_s: seconds the scheduler took (learned policy, real runs).
        prefill_s: seconds of the LLM's prefill (real runs; the learned policy's also returns the
            hidden states its features pool).
    """

    candidate: Candidate
    new_tokens: int
    tau: float
    wall_s: float
    draft_s: float
    plan_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def replay(record: RequestRecord, cand: Candidate, costs: CostModel) -> Outcome:
    """The outcome ``cand`` would have had on a labelled request, under the cost model."""
    depths = cand.drafter_depths(costs.n_ssms, record.lookup, max(costs.depths))
    walked = walk(record.labels(), depths, record.lookup, cand.ngram_depths)
    decode_s, draft_s = walk_seconds(walked, costs, depths, record.lookup)
    if walked.steps == 0:  # nothing generated: one plain step decided that
        decode_s = costs.step_cost(0, 0)
    tau = record.new_tokens / walked.steps if walked.steps else 1.0
    prefill = costs.prefill_cost(cand.mask, record.prompt_tokens)
    wall = record.prefill_s + prefill + decode_s
    return Outcome(cand, record.new_tokens, tau, wall, draft_s + prefill, prefill_s=record.prefill_s)


def mean_tokens_per_s(records: Sequence[RequestRecord], cand: Candidate, costs: CostModel) -> float:
    return float(np.mean([replay(r, cand, costs).tokens_per_s for r in records]))


def best_depth(records: Sequence[RequestRecord], mask: int, costs: CostModel) -> Candidate:
    """The depth with the best mean replayed tokens/s for subset ``mask`` on ``records``."""
    if mask == 0:
        return Candidate(0, 0)
    return max((Candidate(mask, k) for k in costs.depths), key=lambda c: mean_tokens_per_s(records, c, costs))


def best_fixed(records: Sequence[RequestRecord], costs: CostModel, containing: int = -1, margin: float = 0.0) -> Candidate:
    """The single candidate with the best mean replayed tokens/s on ``records`` (the fallback; the simplest
    within ``margin`` of it, ``policy.simplest_within``); ``containing`` >= 0: among those that draft with
    that drafter."""
    cands = candidates(costs.n_ssms, costs.depths)
    return best_of(rates(records, cands, costs), cands, containing, margin)


def rates(records: Sequence[RequestRecord], cands: Sequence[Candidate], costs: CostModel) -> np.ndarray:
    """(R, C) replayed tokens/s of every request under every candidate: the best fixed choice of
    any subset of the requests is then a column mean away (cross-validation refits it per fold)."""
    return replayed(records, cands, costs)[0]


def replayed(records: Sequence[RequestRecord], cands: Sequence[Candidate], costs: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(R, C) replayed tokens/s and (R, C) τ of every request under every candidate, from one replay each."""
    out = [[replay(r, c, costs) for c in cands] for r in records]
    shape = (len(records), len(cands))
    return (np.array([[o.tokens_per_s for o in row] for row in out]).reshape(shape),
            np.array([[o.tau for o in row] for row in out]).reshape(shape))


def best_of(rates: np.ndarray, cands: Sequence[Candidate], containing: int = -1, margin: float = 0.0) -> Candidate:
    """The candidate with the best mean of (R, C) ``rates`` over its requests, or the simplest within
    ``margin`` of it (``policy.simplest_within``; with 0, the fewest drafters on ties); ``containing`` >= 0:
    among those that draft with that drafter."""
    means = rates.mean(axis=0)
    if containing >= 0:
        means = np.where([containing in members(c.mask) for c in cands], means, -np.inf)
    return cands[simplest_within(means, cands, margin)]


def fixed_policies(
    train: Sequence[RequestRecord], costs: CostModel, names: Sequence[str], margin: float = 0.0
) -> dict[str, Candidate]:
    """none, all, single:<name> per SSM and best_fixed (the fallback, ``best_fixed`` with ``margin``),
    each at its best depth on ``train``."""
    full = all_masks(costs.n_ssms)[-1]
    out = {"none": Candidate(0, 0), "all": best_depth(train, full, costs)}
    for j, name in enumerate(names):
        out[f"single:{name}"] = best_depth(train, 1 << j, costs)
    out["best_fixed"] = best_fixed(train, costs, margin=margin)
    return out


def oracle(record: RequestRecord, costs: CostModel) -> Candidate:
    return max(candidates(costs.n_ssms, costs.depths), key=lambda c: replay(record, c, costs).tokens_per_s)


def replay_policies(
    records: Sequence[RequestRecord],
    prompt_ids: Sequence[Sequence[int]],
    scheduler: Scheduler,
    fixed: dict[str, Candidate],
    seed: int,
) -> dict[str, list[Outcome]]:
    """Every policy replayed on every labelled request."""
    costs = scheduler.costs
    rng = random.Random(seed)
    spec = [c for c in candidates(costs.n_ssms, costs.depths) if c.mask]
    out: dict[str, list[Outcome]] = {"learned": [], "learned_per_request": [], "oracle": [], "random": []}
    out.update({name: [] for name in fixed})
    for rec, ids in zip(records, prompt_ids, strict=True):
        chosen = scheduler.choose(ids, rec.features).candidate
        out["learned"].append(replay(rec, chosen, costs))
        out["learned_per_request"].append(replay(rec, chosen.fixed(), costs))
        out["oracle"].append(replay(rec, oracle(rec, costs), costs))
        out["random"].append(replay(rec, rng.choice(spec), costs))
        for name, cand in fixed.items():
            out[name].append(replay(rec, cand, costs))
    return out


def real_outcome(res: GenerationResult, cand: Candidate) -> Outcome:
    draft = sum(sum(r.draft_s) for r in res.records)
    return Outcome(cand, len(res.tokens), res.tau, res.wall_time, draft, res.plan_s, res.prefill_s)


def run_policy(
    engine: SpeculativeEngine,
    ids: Sequence[int],
    stop: StopCriteria,
    policy: str,
    scheduler: Scheduler,
    fixed: dict[str, Candidate],
    chat: bool,
) -> tuple[Outcome, Choice | None]:
    """One real engine run of ``policy`` on one request."""
    if policy == "learned":
        log: list[Choice] = []
        res = engine.generate(ids, stop, planner=scheduler.planner(ids, chat, log), record=True)
        return real_outcome(res, log[0].candidate), log[0]
    cand = fixed[policy]
    res = engine.generate(ids, stop, plan=scheduler.plan(cand), record=True)
    return real_outcome(res, cand), None


def real_policies(
    engine: SpeculativeEngine,
    prompt_ids: Sequence[Sequence[int]],
    stop: StopCriteria,
    policies: Sequence[str],
    scheduler: Scheduler,
    fixed: dict[str, Candidate],
    chat: bool,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[Outcome]], list[Choice]]:
    """Real runs, interleaved per request so that machine drift hits every policy alike."""
    out: dict[str, list[Outcome]] = {p: [] for p in policies}
    choices: list[Choice] = []
    for i, ids in enumerate(prompt_ids):
        for p in policies:
            outcome, choice = run_policy(engine, ids, stop, p, scheduler, fixed, chat)
            out[p].append(outcome)
            if choice is not None:
                choices.append(choice)
        if progress is not None:
            progress(i)
    return out, choices


def summarize(outcomes: Sequence[Outcome]) -> dict:
    """τ (total tokens / total steps), tokens/s (mean over requests), draft cost, choices made."""
    tokens = sum(o.new_tokens for o in outcomes)
    steps = sum(o.new_tokens / o.tau for o in outcomes if o.tau > 0)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.candidate.name] = counts.get(o.candidate.name, 0) + 1
    return {
        "tau": tokens / steps if steps else 1.0,
        "tokens_per_s": float(np.mean([o.tokens_per_s for o in outcomes])) if outcomes else 0.0,
        "draft_s_per_request": float(np.mean([o.draft_s for o in outcomes])) if outcomes else 0.0,
        "draft_share": float(np.mean([o.draft_s / o.wall_s for o in outcomes if o.wall_s > 0]))
        if outcomes
        else 0.0,
        "prefill_s_per_request": float(np.mean([o.prefill_s for o in outcomes])) if outcomes else 0.0,
        "requests": len(outcomes),
        "choices": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
    }
