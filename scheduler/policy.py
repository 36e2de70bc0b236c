"""The policy: pick the SSM subset and tree depth that maximise predicted tokens per second.

Shape legend: N drafters, M = 2**N - 1 subsets, D label depth, K candidate depths, F features.

The drafters are named (``Scheduler.drafters``: the run's SSMs and, when ``prompt_lookup``, the
prompt-lookup drafter ``LOOKUP_NAME``); bit j of a subset's mask is ``drafters[j]``, and a choice
reaches the engine as a ``Plan`` naming its drafters and their trees. At depth k each SSM drafts
``widths[:k]`` (all of ``widths`` when k is larger: SSM depth saturates, while prompt lookup's nearly
free chains are worth drafting deeper) and prompt lookup a chain of up to k tokens. "SSM" below
means any of them.

Candidates are every (subset, depth) plus the empty subset (plain decoding: τ = 1). For a request
the acceptance model predicts each subset's survival curve u[m, d]; the predicted τ of (m, k) is
``1 + sum_{d<=k} u[m, d]`` and its cost per token ``step(m, k) / τ + prefill(m) / new_tokens``
(``costs.CostModel``); the policy takes the cheapest per token, unless it is predicted to beat the
fallback's cost for this request by less than ``margin`` (relative): with few training requests a
small predicted edge is mostly noise, so ties go to the best fixed choice. The safe fallback (the best fixed
candidate on the training requests) answers whenever the features are malformed, far from every
training request (``z_max`` standard deviations along a principal axis) or the predictions are
not finite.

Whenever the chosen subset includes prompt lookup, its chain length is then set per step by the
learned per-match table (``lookup_depths``, ``offline/stepwise.py``: short after a match of one token, long
after three), up to the label depth; the chosen depth still sets the SSMs' trees.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from boosttune.core.rundir import ssm_name
from boosttune.scheduler.costs import CostModel, depth_trees
from boosttune.scheduler.features import FeatureSpec, RequestFeatures, request_features
from boosttune.scheduler.model import LinearModel
from boosttune.scheduler.persist import SchedulerFileError, read_scheduler_file, write_scheduler_file
from boosttune.scheduler.subsets import all_masks, mask_of, members, monotone
from boosttune.serving.engine import Plan, Planner
from boosttune.serving.lookup import LOOKUP_NAME
from boosttune.serving.tree import MAX_TREE_DEPTH, MAX_TREE_NODES, TreeConfig, check_tree_limits

NOT_ADOPTED = "per-request choice not adopted (cross-validation)"
"""The fallback reason of every request when ``Scheduler.per_request`` is False."""


@dataclass(frozen=True)
class Candidate:
    """A subset (bitmask over SSM indices; 0 = plain decoding) and a tree depth (0 with mask 0).

    ``ngram_depths`` non-empty: prompt lookup (when in the subset) drafts per step the length this
    table gives for the match's n-gram length, up to the label depth (``offline/stepwise.py``), instead of
    ``depth``, which then applies to the SSMs only.
    """

    mask: int
    depth: int
    ngram_depths: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        if self.mask == 0:
            return "none"
        table = "/n" + ",".join(str(k) for k in self.ngram_depths) if self.ngram_depths else ""
        return "{" + ",".join(str(j) for j in members(self.mask)) + f"}}@{self.depth}{table}"

    def fixed(self) -> Candidate:
        """The same subset and depth without per-match lengths."""
        return Candidate(self.mask, self.depth)

    def drafter_depths(self, n: int, lookup: int, label_depth: int) -> list[int]:
        """Each of the ``n`` drafters' depth (0: not drafting); prompt lookup (index ``lookup``)
        drafts up to ``label_depth`` when ``ngram_depths`` sets its length per match."""
        depths = [self.depth if self.mask >> j & 1 else 0 for j in range(n)]
        if self.ngram_depths and 0 <= lookup < n and depths[lookup]:
            depths[lookup] = label_depth
        return depths


@dataclass(frozen=True)
class Choice:
    """What the scheduler decided for one request.

    Attributes:
        ssm_indices: SSMs to draft with (empty: plain decoding).
        depth: levels of the expansion widths each SSM drafts (0 for plain decoding).
        trees: each chosen drafter's tree by drafter index (None for plain decoding).
        plan: the same by drafter name: what the engine is handed.
        predicted_tau: predicted tokens committed per LLM forward (bonus included).
        predicted_tokens_per_s: predicted decoding speed (LLM prefill excluded).
        fallback: True when the safe fallback answered.
        reason: why the fallback answered ("" otherwise).
        seconds: wall time of the decision (features excluded when given).
    """

    ssm_indices: tuple[int, ...]
    depth: int
    trees: dict[int, TreeConfig] | None
    plan: Plan
    predicted_tau: float
    predicted_tokens_per_s: float
    fallback: bool = False
    reason: str = ""
    seconds: float = 0.0

    @property
    def candidate(self) -> Candidate:
        table = next((t.ngram_depths for t in (self.trees or {}).values() if t.ngram_depths), ())
        return Candidate(mask_of(self.ssm_indices), self.depth, table)


def default_drafters(n: int, prompt_lookup: bool) -> tuple[str, ...]:
    """The names of ``n`` drafters when none were recorded: ssm-1 .. ssm-K, then prompt lookup."""
    ssms = n - int(prompt_lookup)
    return tuple(ssm_name(k) for k in range(1, ssms + 1)) + ((LOOKUP_NAME,) if prompt_lookup else ())


def candidates(n_ssms: int, depths: Sequence[int]) -> list[Candidate]:
    """Plain decoding first, then every non-empty subset at every depth."""
    return [Candidate(0, 0)] + [Candidate(m, k) for m in all_masks(n_ssms) for k in depths]


def simplest_within(speeds: np.ndarray, cands: Sequence[Candidate], margin: float) -> int:
    """The index of the fixed choice among ``cands`` by their predicted ``speeds`` (tokens/s; -inf rules
    one out): of those within ``margin`` (relative) of the fastest, the one with the fewest drafters,
    then the shallowest, then the fastest.

    A drafter joins the fixed choice only where the costs give it ``margin`` more speed, the bar a
    learned part must clear too. Costs timed on a few prompts move a few per cent between calibrations,
    and on the demo the feature head with prompt lookup and prompt lookup alone came within 0.03 % of
    each other: which of them a run shipped then depended on the calibration (docs/measurements.md,
    *Calibration that repeats*). The simpler choice also has less to lose on a forward that verifies
    large trees dearer than the one timed (a compiled or quantized one).
    """
    speeds = np.asarray(speeds, dtype=float)
    best = float(np.max(speeds))
    near = [i for i in range(len(cands)) if np.isfinite(speeds[i]) and speeds[i] >= (1.0 - margin) * best]
    return min(near, key=lambda i: (len(members(cands[i].mask)), cands[i].depth, -speeds[i], i))


@dataclass(frozen=True)
class CandidateTable:
    """Everything about the C candidates that does not depend on the request (built once).

    Attributes:
        cands: the candidates (``candidates``), plain decoding first.
        select: (C, M * D) 0/1; ``1 + select @ survival.ravel()`` is each candidate's τ.
        step_s: (C,) seconds per step.
        prefill_s_per_token: (C,) SSM catch-up seconds per prompt token.
    """

    cands: list[Candidate]
    select: np.ndarray
    step_s: np.ndarray
    prefill_s_per_token: np.ndarray


def candidate_table(costs: CostModel) -> CandidateTable:
    depth = max(costs.depths)
    cands = candidates(costs.n_ssms, costs.depths)
    select = np.zeros((len(cands), len(all_masks(costs.n_ssms)) * depth))
    for c, cand in enumerate(cands):
        if cand.mask:
            start = (cand.mask - 1) * depth
            select[c, start : start + cand.depth] = 1.0
    index = {k: i for i, k in enumerate(costs.depths)}
    step = np.array([costs.step_cost(c.mask, index.get(c.depth, 0)) for c in cands])
    prefill = np.array([costs.prefill_cost(c.mask, 1) for c in cands])
    return CandidateTable(cands, select, step, prefill)


def seconds_per_token(
    survival: np.ndarray, table: CandidateTable, prompt_tokens: int, new_tokens: float
) -> tuple[np.ndarray, np.ndarray]:
    """Predicted (C,) τ and (C,) seconds per generated token of every candidate, from (M, D) survival."""
    tau = 1.0 + table.select @ survival.ravel()
    return tau, per_token_seconds(tau, table, prompt_tokens, new_tokens)


def per_token_seconds(tau: np.ndarray, table: CandidateTable, prompt_tokens: int, new_tokens: float) -> np.ndarray:
    """(C,) seconds per generated token of every candidate at (C,) ``tau``: its step over τ, plus its
    drafters' catch-up on the prompt spread over the request's tokens."""
    return table.step_s / tau + table.prefill_s_per_token * prompt_tokens / max(new_tokens, 1.0)


@dataclass
class Scheduler:
    """A trained scheduler: features → acceptance model → cost-aware choice.

    Attributes:
        spec: the feature layout.
        model: predicts the flattened (M, D) survival from the features.
        costs: the measured cost model.
        widths: expansion widths; depth k drafts ``widths[:k]``.
        expected_new_tokens: mean tokens generated per training request (amortises SSM prefill).
        z_max: fallback distance from the training requests, in standard deviations.
        fallback: the best fixed candidate on the training requests.
        meta: where it came from (LLM, SSM directories, label depth, ...), for reports.
        margin: relative predicted speed-up needed to leave the fallback candidate.
        draft_vocab: the draft vocabulary size of the chosen trees (0: whole; costs were measured so).
        prompt_lookup: one of the drafters is the prompt-lookup drafter (``LOOKUP_NAME``,
            ``serving/lookup.py``); an engine serving this scheduler needs it, drafting chains of up to
            ``lookup_length`` tokens (``boosttune/assemble.py`` builds it so).
        lookup_depths: prompt lookup's chain length per matched n-gram length (``offline/stepwise.py``),
            used whenever a choice includes prompt lookup; empty: the choice's depth.
        drafters: the names of the ``n_ssms`` drafters, bit j of a mask being ``drafters[j]``. Empty
            (files written before drafters were named): ssm-1 .. ssm-K, then prompt lookup.
        per_request: choose per request from the features; False (cross-validation on the training
            requests did not show the per-request choice faster, ``offline/crossval.py``): every
            request gets the fallback (with ``lookup_depths`` when it drafts with prompt lookup).
        fixed_tau: (C,) every candidate's mean τ over the training requests, replayed from their labels
            (``candidates`` order): what ``recosted`` weighs new costs with. Empty (files written before
            it): the model's prediction at the training features' mean, which can be far off (the
            demo: prompt lookup's τ 2.19 by it, 1.16 replayed on held-out requests).
    """

    spec: FeatureSpec
    model: LinearModel
    costs: CostModel
    widths: tuple[int, ...]
    expected_new_tokens: float
    z_max: float
    fallback: Candidate
    meta: dict = field(default_factory=dict)
    margin: float = 0.0
    draft_vocab: int = 0
    prompt_lookup: bool = False
    lookup_depths: tuple[int, ...] = ()
    drafters: tuple[str, ...] = ()
    per_request: bool = True
    fixed_tau: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n, d = self.costs.n_ssms, self.label_depth
        object.__setattr__(self, "drafters", tuple(self.drafters) or default_drafters(n, self.prompt_lookup))
        if len(self.drafters) != n or len(set(self.drafters)) != n:
            raise ValueError(f"scheduler: {n} distinct drafter names needed, got {list(self.drafters)}")
        if self.prompt_lookup != (LOOKUP_NAME in self.drafters):
            raise ValueError(f"scheduler: prompt_lookup={self.prompt_lookup} but the drafters are {list(self.drafters)}")
        if self.model.intercept.shape[0] != len(all_masks(n)) * d:
            raise ValueError(
                f"scheduler: the model predicts {self.model.intercept.shape[0]} outputs, "
                f"expected {len(all_masks(n))} subsets x {d} depths"
            )
        if self.model.n_features != self.spec.dim:
            raise ValueError(
                f"scheduler: the model takes {self.model.n_features} features, the spec has {self.spec.dim}"
            )
        if self.lookup_depths and (not self.prompt_lookup or min(self.lookup_depths) < 0):
            raise ValueError("scheduler: lookup_depths need prompt_lookup and lengths >= 0")
        if not self.widths or self.fallback not in self.candidates:  # builds the table: not on a request
            raise ValueError("scheduler: no expansion widths, or a fallback that is not a candidate")
        object.__setattr__(self, "fixed_tau", tuple(float(t) for t in self.fixed_tau))
        if self.fixed_tau and (len(self.fixed_tau) != len(self.candidates)
                               or not all(np.isfinite(t) and t >= 1.0 for t in self.fixed_tau)):
            raise ValueError(f"scheduler: fixed_tau needs one τ >= 1 per candidate ({len(self.candidates)}), "
                             f"got {len(self.fixed_tau)}")

    @property
    def n_ssms(self) -> int:
        """Drafters the scheduler chooses among (SSMs, and prompt lookup when ``prompt_lookup``)."""
        return self.costs.n_ssms

    @property
    def lookup_length(self) -> int:
        """The longest chain the prompt-lookup drafter is asked for (0: no prompt-lookup drafter)."""
        return self.label_depth if self.prompt_lookup else 0

    def check_drafters(self, ssm_names: Sequence[str]) -> None:
        """Refuse to serve with SSMs other than the ones the scheduler was trained with (by name)."""
        want = [d for d in self.drafters if d != LOOKUP_NAME]
        if sorted(ssm_names) != sorted(want):
            raise SchedulerFileError(
                f"the scheduler was trained for {len(want)} SSMs{' and prompt lookup' if self.prompt_lookup else ''}, "
                f"the bundle has {len(ssm_names)} ({', '.join(want)} vs {', '.join(ssm_names)}); retrain it with "
                "`boosttune train-scheduler RUN_DIR` and re-export"
            )

    @property
    def label_depth(self) -> int:
        return max(self.costs.depths)

    @property
    def candidates(self) -> list[Candidate]:
        return self.table.cands

    @functools.cached_property
    def table(self) -> CandidateTable:
        return candidate_table(self.costs)

    @property
    def lookup_index(self) -> int:
        """The prompt-lookup drafter's index in ``drafters`` (-1: none)."""
        return self.drafters.index(LOOKUP_NAME) if self.prompt_lookup else -1

    def trees(self, cand: Candidate) -> dict[int, TreeConfig] | None:
        """Each drafter of ``cand``'s tree: SSMs ``widths[:depth]``, prompt lookup a chain of ``depth``
        (of the label depth, cut per match by ``cand.ngram_depths`` when set)."""
        if not cand.mask:
            return None
        depths = cand.drafter_depths(self.n_ssms, self.lookup_index, self.label_depth)
        return depth_trees(depths, self.widths, self.draft_vocab, self.lookup_index, cand.ngram_depths)

    def plan(self, cand: Candidate) -> Plan:
        """``cand`` as the engine takes it: its drafters by name, each with its tree."""
        return Plan({self.drafters[j]: tree for j, tree in (self.trees(cand) or {}).items()})

    def with_table(self, cand: Candidate) -> Candidate:
        """``cand`` with the learned per-match lengths when it drafts with prompt lookup."""
        if self.lookup_depths and self.lookup_index in members(cand.mask):
            return Candidate(cand.mask, cand.depth, self.lookup_depths)
        return cand

    def survival(self, features: RequestFeatures) -> np.ndarray:
        """(M, D) predicted survival, projected onto valid curves."""
        raw = self.model.predict(features.vector()).reshape(len(all_masks(self.n_ssms)), self.label_depth)
        return monotone(raw, self.n_ssms)

    def decide(self, survival: np.ndarray, prompt_tokens: int) -> Choice:
        """The cheapest candidate per token under the cost model, given (M, D) survival."""
        cands = self.candidates
        tau, sec = seconds_per_token(survival, self.table, prompt_tokens, self.expected_new_tokens)
        if not np.isfinite(sec).all() or (sec <= 0).any():
            return self.fallback_choice("non-finite or non-positive predicted costs")
        best = int(np.argmin(sec))
        base = cands.index(self.fallback)
        if sec[best] > (1.0 - self.margin) * sec[base]:
            best = base
        return self._choice(cands[best], float(tau[best]), float(sec[best]))

    def choose(self, prompt_ids: Sequence[int], features: RequestFeatures) -> Choice:
        """The choice for one request (timed in ``Choice.seconds``)."""
        start = time.perf_counter()
        reason = "" if self.per_request else NOT_ADOPTED
        reason = reason or self._out_of_range(prompt_ids, features)
        if reason:
            choice = self.fallback_choice(reason)
        else:
            choice = self.decide(self.survival(features), len(prompt_ids))
        return dataclasses.replace(choice, seconds=time.perf_counter() - start)

    def planner(self, prompt_ids: Sequence[int], chat: bool, log: list[Choice] | None = None) -> Planner:
        """An engine ``Planner``: features from the prefill, then ``choose`` (appended to ``log``)."""

        def plan(hidden: torch.Tensor) -> Plan:
            start = time.perf_counter()
            if not self.per_request:  # the features would decide nothing
                choice = self.fallback_choice(NOT_ADOPTED)
            else:
                choice = self._planned(prompt_ids, hidden, chat)
            choice = dataclasses.replace(choice, seconds=time.perf_counter() - start)
            if log is not None:
                log.append(choice)
            return choice.plan

        return plan

    def _planned(self, prompt_ids: Sequence[int], hidden: torch.Tensor, chat: bool) -> Choice:
        """``choose`` on the features pooled from the prefill's hidden states."""
        try:
            return self.choose(prompt_ids, request_features(prompt_ids, hidden, chat, self.spec))
        except ValueError as e:  # e.g. hidden states of another width: never fail the request
            return self.fallback_choice(f"features: {e}")

    def recosted(self, costs: CostModel, prompt_tokens: int) -> Scheduler:
        """This scheduler over ``costs`` measured on the forward being served (``calibrate.py``; another
        machine, a quantized or compiled LLM): the same acceptance model, its fixed choice taken again as
        the cheapest per token for the mean training request (the model's prediction at the training
        features' mean, with ``prompt_tokens`` of prompt). The costs the scheduler was trained with rank
        the choices for the forward they were measured on: over compiled int8 products, where verifying 12
        tokens cost 3.4x a plain step against 1.2x in bf16 (AMX Xeon), the trained choice ran at 0.81x plain
        decoding, the recosted one at 0.97x (docs/measurements.md)."""
        if costs.n_ssms != self.n_ssms or tuple(costs.depths) != tuple(self.costs.depths):
            raise ValueError(f"recosted: costs for {costs.n_ssms} drafters at depths {list(costs.depths)}, the scheduler "
                             f"chooses among {self.n_ssms} at {list(self.costs.depths)}")
        new = dataclasses.replace(self, costs=costs)
        tau, sec = new.mean_request_costs(prompt_tokens)
        best = simplest_within(1.0 / sec, new.candidates, self.margin)
        fallback = new.candidates[best]
        was = {"mask": self.fallback.mask, "depth": self.fallback.depth}
        meta = {**self.meta, "recosted": {"fallback_before": was, "fallback": {"mask": fallback.mask, "depth": fallback.depth},
                                          "predicted_tau": float(tau[best]), "predicted_tokens_per_s": float(1.0 / sec[best])}}
        return dataclasses.replace(new, fallback=fallback, meta=meta)

    def mean_request_costs(self, prompt_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(C,) τ and seconds per token of every candidate for the mean training request with
        ``prompt_tokens`` of prompt: τ replayed on the training requests (``fixed_tau``), or in files
        without it the model's prediction at the training features' mean."""
        if self.fixed_tau:
            tau = np.asarray(self.fixed_tau)
            return tau, per_token_seconds(tau, self.table, prompt_tokens, self.expected_new_tokens)
        survival = self.model.predict(self.model.x_mean).reshape(len(all_masks(self.n_ssms)), self.label_depth)
        return seconds_per_token(monotone(survival, self.n_ssms), self.table, prompt_tokens, self.expected_new_tokens)

    def fallback_choice(self, reason: str) -> Choice:
        return dataclasses.replace(
            self._choice(self.fallback, float("nan"), float("nan")), fallback=True, reason=reason
        )

    def _choice(self, cand: Candidate, tau: float, sec: float) -> Choice:
        cand = self.with_table(cand)
        return Choice(members(cand.mask), cand.depth, self.trees(cand), self.plan(cand), tau,
                      1.0 / sec if sec > 0 else float("nan"))

    def _out_of_range(self, prompt_ids: Sequence[int], features: RequestFeatures) -> str:
        x = features.vector()
        if x.shape != (self.spec.dim,):
            return f"feature vector has shape {x.shape}, expected ({self.spec.dim},)"
        if not np.isfinite(x).all():
            return "non-finite features"
        if len(prompt_ids) < 2:
            return "no prefill (one-token prompt)"
        dist = self.model.distance(x)
        if dist > self.z_max:
            return (
                f"features {dist:.1f} standard deviations from the training requests (> z_max {self.z_max})"
            )
        return ""

    # -- persistence ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "type": "scheduler",
            "spec": self.spec.to_json(),
            "model": self.model.to_json(),
            "costs": self.costs.to_json(),
            "widths": list(self.widths),
            "expected_new_tokens": self.expected_new_tokens,
            "z_max": self.z_max,
            "fallback": {"mask": self.fallback.mask, "depth": self.fallback.depth},
            "meta": self.meta,
            "margin": self.margin,
            "draft_vocab": self.draft_vocab,
            "prompt_lookup": self.prompt_lookup,
            "lookup_depths": list(self.lookup_depths),
            "drafters": list(self.drafters),
            "per_request": self.per_request,
            "fixed_tau": list(self.fixed_tau),
        }

    @classmethod
    def from_json(cls, body: dict) -> Scheduler:
        """The scheduler a file's body describes; every field type-checked and every size bounded
        (``check_scheduler_body``) before anything is built from it."""
        check_scheduler_body(body)
        return cls(
            spec=FeatureSpec.from_json(body["spec"]),
            model=LinearModel.from_json(body["model"]),
            costs=CostModel.from_json(body["costs"]),
            widths=tuple(int(w) for w in body["widths"]),
            expected_new_tokens=float(body["expected_new_tokens"]),
            z_max=float(body["z_max"]),
            fallback=Candidate(int(body["fallback"]["mask"]), int(body["fallback"]["depth"])),
            meta=dict(body.get("meta", {})),
            margin=float(body["margin"]),
            draft_vocab=int(body.get("draft_vocab", 0)),  # absent in files written before it existed
            prompt_lookup=bool(body.get("prompt_lookup", False)),  # likewise
            lookup_depths=tuple(int(k) for k in body.get("lookup_depths", ())),  # likewise
            # files written before drafters were named kept their names as meta["ssms"] (or none)
            drafters=tuple(str(d) for d in body.get("drafters") or body.get("meta", {}).get("ssms") or ()),
            per_request=bool(body.get("per_request", True)),  # files before cross-validation chose per request
            fixed_tau=tuple(float(t) for t in body.get("fixed_tau", ())),  # files before it: the model's mean
        )

    def save(self, path: str | Path) -> None:
        write_scheduler_file(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Scheduler:
        """Load and validate a scheduler file; refuses tampered, wrong-version or unknown-type files."""
        body = read_scheduler_file(path)
        try:
            return cls.from_json(body)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            raise SchedulerFileError(
                f"{path}: malformed scheduler ({type(e).__name__}: {e}); "
                "retrain it with `boosttune train-scheduler RUN_DIR`"
            ) from None


MAX_SCHEDULER_DRAFTERS = 8
"""The most drafters a scheduler chooses among (it predicts 2**N - 1 subsets: 255 at 8; training writes
one per shipped SSM, plus prompt lookup)."""
MAX_FEATURE_WIDTH = 1 << 16
"""The widest LLM hidden state and the most n-gram buckets a feature spec may name."""

_NUMBER = (int, float)


def _typed(obj: dict, key: str, kind: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    """``obj[key]`` of JSON type ``kind`` (bools are not numbers), else a ``ValueError`` naming it."""
    if key not in obj or (optional and obj[key] is None):
        if optional:
            return None
        raise ValueError(f"{where}.{key} is missing")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"{where}.{key} must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def _int_list(obj: dict, key: str, where: str, lo: int, hi: int, optional: bool = False) -> list[int]:
    values = _typed(obj, key, list, where, optional) or []
    if len(values) > MAX_TREE_DEPTH or not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
                                               for v in values):
        raise ValueError(f"{where}.{key} must be at most {MAX_TREE_DEPTH} integers in {lo} .. {hi}")
    return values


def check_scheduler_body(body: dict) -> None:
    """Refuse a scheduler body whose fields have the wrong JSON types or ask for more than the limits
    allow (``serving/tree.py``'s tree limits for widths and depths, ``MAX_SCHEDULER_DRAFTERS``,
    ``MAX_FEATURE_WIDTH``): a ``ValueError`` naming the field. What the types cannot say (consistent
    shapes, finite costs) the components check as they are built."""
    where = "body"
    widths = _int_list(body, "widths", where, 1, MAX_TREE_NODES)
    check_tree_limits("expansion", tuple(widths), 1, 1, 1)
    spec = _typed(body, "spec", dict, where)
    for key in ("hidden_size", "ngram_buckets"):
        n = _typed(spec, key, int, f"{where}.spec")
        if not 0 <= n <= MAX_FEATURE_WIDTH:
            raise ValueError(f"{where}.spec.{key} must be in 0 .. {MAX_FEATURE_WIDTH}, got {n}")
    model = _typed(body, "model", dict, where)
    for key in ("x_mean", "x_scale", "pca_mean", "components", "pca_std", "coef", "intercept"):
        _typed(model, key, list, f"{where}.model")
    costs = _typed(body, "costs", dict, where)
    _int_list(costs, "depths", f"{where}.costs", 1, MAX_TREE_DEPTH)
    for key in ("nodes_per_ssm", "draft_s", "ssm_prefill_s_per_token", "verify_nodes", "verify_s", "overhead_s"):
        _typed(costs, key, list, f"{where}.costs")
    n = len(costs["draft_s"])
    if not 1 <= n <= MAX_SCHEDULER_DRAFTERS:
        raise ValueError(f"{where}.costs.draft_s must have 1 .. {MAX_SCHEDULER_DRAFTERS} drafters, got {n}")
    for key in ("expected_new_tokens", "z_max", "margin"):
        _typed(body, key, _NUMBER, where)
    fallback = _typed(body, "fallback", dict, where)
    _typed(fallback, "mask", int, f"{where}.fallback")
    _typed(fallback, "depth", int, f"{where}.fallback")
    _typed(body, "meta", dict, where, optional=True)
    _typed(body, "draft_vocab", int, where, optional=True)
    _typed(body, "prompt_lookup", bool, where, optional=True)
    _typed(body, "per_request", bool, where, optional=True)
    _int_list(body, "lookup_depths", where, 0, MAX_TREE_DEPTH, optional=True)
    fixed_tau = _typed(body, "fixed_tau", list, where, optional=True) or []
    most = 1 + ((1 << MAX_SCHEDULER_DRAFTERS) - 1) * MAX_TREE_DEPTH  # plain, every subset at every depth
    if len(fixed_tau) > most or not all(isinstance(t, _NUMBER) and not isinstance(t, bool) for t in fixed_tau):
        raise ValueError(f"{where}.fixed_tau must be a list of at most one number per candidate")
    drafters = _typed(body, "drafters", list, where, optional=True) or []
    if not all(isinstance(d, str) for d in drafters):
        raise ValueError(f"{where}.drafters must be a list of names")
