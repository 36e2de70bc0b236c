"""The measured cost model: what one speculative step costs on this machine, per subset and budget.

Shape legend: N drafters (SSMs, and the prompt-lookup drafter when there is one: a drafter without a
model is priced the same way), K candidate depths, P points of the verification curve.

A step of subset ``S`` with trees cut to depth ``k`` costs (seconds)::

    step(S, k) = sum_{j in S} draft[j][k] + verify(nodes(S, k)) + overhead0 + overhead1 * |S|
    nodes(S, k) = sum_{j in S} nodes_per_ssm[j][k]   (an upper bound: merging shares common prefixes)

and each SSM in ``S`` also catches up on the prompt once per request (``ssm_prefill_s_per_token``
times the prompt length). ``verify`` interpolates the measured medians piecewise-linearly (the
LLM's cost is far from linear in tree size on a CPU) and extrapolates with the mean slope. The
empty subset is plain decoding: ``step = verify(0) + overhead0`` per token.

``calibrate`` measures it with the engine itself: every (SSM, depth) alone and plain decoding on a
few prompts, interleaved so that drift on a shared machine spreads over all of them, plus the
verification and overhead samples of the labelled runs (all SSMs merged: the large trees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from boosttune.scheduler.subsets import members
from boosttune.serving.builders import TreeConfig
from boosttune.serving.engine import GenerationResult, SpeculativeEngine
from boosttune.serving.lookup import PromptLookupDrafter, lookup_tree
from boosttune.serving.stops import StopCriteria


@dataclass(frozen=True)
class CostModel:
    """Seconds per step on the machine where it was measured.

    Attributes:
        depths: (K,) candidate tree depths (budgets), increasing.
        nodes_per_ssm: (N, K) mean nodes drafter j drafts per step at each depth, measured (an SSM's
            expansion tree has a fixed size; prompt lookup drafts a chain when it finds a match).
            A flat (K,) tuple (files written before drafters differed) is taken for every drafter.
        draft_s: (N, K) median seconds of one ``draft`` call of SSM j at depth k (prompt catch-up
            excluded).
        ssm_prefill_s_per_token: (N,) seconds per prompt token of SSM j's first catch-up.
        verify_nodes: (P,) tree sizes where verification was timed, increasing (0 = plain step).
        verify_s: (P,) median seconds of the LLM's verification forward at those sizes.
        overhead_s: (2,) per-step seconds outside drafting and verification: base, per active SSM.
    """

    depths: tuple[int, ...]
    nodes_per_ssm: tuple[tuple[float, ...], ...]
    draft_s: tuple[tuple[float, ...], ...]
    ssm_prefill_s_per_token: tuple[float, ...]
    verify_nodes: tuple[int, ...]
    verify_s: tuple[float, ...]
    overhead_s: tuple[float, float]

    def __post_init__(self) -> None:
        k = len(self.depths)
        if self.nodes_per_ssm and not isinstance(self.nodes_per_ssm[0], (tuple, list)):
            object.__setattr__(self, "nodes_per_ssm", (tuple(self.nodes_per_ssm),) * len(self.draft_s))
        object.__setattr__(self, "nodes_per_ssm", tuple(tuple(float(x) for x in r) for r in self.nodes_per_ssm))
        if len(self.nodes_per_ssm) != len(self.draft_s):
            raise ValueError("cost model: nodes_per_ssm needs one row per drafter")
        if any(len(r) != k for r in self.nodes_per_ssm) or any(len(row) != k for row in self.draft_s):
            raise ValueError(f"cost model: draft_s rows and nodes_per_ssm need one entry per depth ({k})")
        if len(self.ssm_prefill_s_per_token) != len(self.draft_s):
            raise ValueError("cost model: ssm_prefill_s_per_token needs one entry per SSM")
        if not self.verify_nodes or len(self.verify_nodes) != len(self.verify_s):
            raise ValueError("cost model: verify_nodes and verify_s must be non-empty and of equal length")
        if list(self.verify_nodes) != sorted(set(self.verify_nodes)):
            raise ValueError("cost model: verify_nodes must be strictly increasing")
        values = [
            *self.verify_s,
            *self.overhead_s,
            *self.ssm_prefill_s_per_token,
            *(x for r in self.nodes_per_ssm for x in r),
            *(x for r in self.draft_s for x in r),
        ]
        if not all(np.isfinite(v) and v >= 0 for v in values):
            raise ValueError("cost model: every cost must be a finite number of seconds >= 0")

    @property
    def n_ssms(self) -> int:
        return len(self.draft_s)

    def verify_cost(self, nodes: float) -> float:
        """Seconds of one verification forward over ``nodes`` tree nodes (plus the root)."""
        xs, ys = np.asarray(self.verify_nodes, float), np.asarray(self.verify_s, float)
        if nodes <= xs[-1] or len(xs) == 1:
            return float(np.interp(nodes, xs, ys))
        slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        return float(ys[-1] + slope * (nodes - xs[-1]))

    def step_cost(self, mask: int, depth_index: int) -> float:
        """Seconds of one step of subset ``mask`` at ``depths[depth_index]`` (mask 0: plain step)."""
        ssms = members(mask)
        draft = sum(self.draft_s[j][depth_index] for j in ssms)
        nodes = sum(self.nodes_per_ssm[j][depth_index] for j in ssms)
        return draft + self.verify_cost(nodes) + self.overhead_s[0] + self.overhead_s[1] * len(ssms)

    def prefill_cost(self, mask: int, prompt_tokens: int) -> float:
        """Seconds the SSMs of ``mask`` spend catching up on the prompt (once per request)."""
        return sum(self.ssm_prefill_s_per_token[j] for j in members(mask)) * prompt_tokens

    def to_json(self) -> dict:
        return {
            "type": "cost_model",
            "depths": list(self.depths),
            "nodes_per_ssm": [list(r) for r in self.nodes_per_ssm],
            "draft_s": [list(r) for r in self.draft_s],
            "ssm_prefill_s_per_token": list(self.ssm_prefill_s_per_token),
            "verify_nodes": list(self.verify_nodes),
            "verify_s": list(self.verify_s),
            "overhead_s": list(self.overhead_s),
        }

    @classmethod
    def from_json(cls, obj: dict) -> CostModel:
        return cls(
            depths=tuple(int(d) for d in obj["depths"]),
            nodes_per_ssm=tuple(
                tuple(float(x) for x in r) if isinstance(r, list) else float(r) for r in obj["nodes_per_ssm"]
            ),
            draft_s=tuple(tuple(float(x) for x in r) for r in obj["draft_s"]),
            ssm_prefill_s_per_token=tuple(float(x) for x in obj["ssm_prefill_s_per_token"]),
            verify_nodes=tuple(int(n) for n in obj["verify_nodes"]),
            verify_s=tuple(float(x) for x in obj["verify_s"]),
            overhead_s=(float(obj["overhead_s"][0]), float(obj["overhead_s"][1])),
        )


def depth_trees(
    depths: Sequence[int], widths: Sequence[int], draft_vocab: int, lookup: int, ngram_depths: tuple[int, ...] = ()
) -> dict[int, TreeConfig]:
    """The tree of every drafter j with ``depths[j]`` > 0: an SSM drafts ``widths[:depths[j]]``, the
    prompt-lookup drafter (index ``lookup``; -1: none) a chain of up to ``depths[j]`` tokens, cut per
    match by ``ngram_depths`` when set."""
    return {
        j: lookup_tree(k, ngram_depths) if j == lookup else TreeConfig(widths=tuple(widths[:k]), draft_vocab=draft_vocab)
        for j, k in enumerate(depths)
        if k > 0
    }


def tree_nodes(widths: Sequence[int], depth: int) -> int:
    """Nodes of an expansion tree cut to ``widths[:depth]`` (a node at depth d-1 has widths[d-1] children)."""
    total, level = 0, 1
    for w in widths[:depth]:
        level *= w
        total += level
    return total


@dataclass
class _Samples:
    """Raw timings gathered by ``calibrate`` before medians are taken."""

    draft: dict[tuple[int, int], list[float]]  # (ssm, depth) -> seconds of later-step drafts
    nodes: dict[tuple[int, int], list[int]]  # (ssm, depth) -> tree sizes of its solo steps
    prefill: dict[int, list[float]]  # ssm -> seconds per prompt token of the first catch-up
    verify: dict[int, list[float]]  # nodes -> seconds
    overhead: dict[int, list[float]]  # active SSMs -> seconds

    def add_run(self, res: GenerationResult, prompt_tokens: int, depth: int | None) -> None:
        """Fold one recorded run in; ``depth`` keys its draft times (None: merged run, skip them)."""
        active = res.active or []
        for i, rec in enumerate(res.records):
            self.verify.setdefault(rec.nodes, []).append(rec.verify_s)
            spent = rec.step_s - rec.verify_s - sum(rec.draft_s)
            self.overhead.setdefault(len(active), []).append(max(spent, 0.0))
            if depth is None:
                continue
            if len(active) == 1:
                self.nodes.setdefault((active[0], depth), []).append(rec.nodes)
            for j, s in zip(active, rec.draft_s, strict=True):
                # the first step also catches up on the prompt: only a one-step run keeps it
                if i > 0 or len(res.records) == 1:
                    self.draft.setdefault((j, depth), []).append(s)
        if depth is not None and len(res.records) > 1:
            for pos, j in enumerate(active):
                later = np.median([r.draft_s[pos] for r in res.records[1:]])
                extra = res.records[0].draft_s[pos] - later
                self.prefill.setdefault(j, []).append(max(extra, 0.0) / max(prompt_tokens, 1))


def calibrate(
    engine: SpeculativeEngine,
    prompts: Sequence[list[int]],
    widths: Sequence[int],
    depths: Sequence[int],
    tokens: int,
    merged_runs: Sequence[tuple[GenerationResult, int]] = (),
    draft_vocab: int = 0,
) -> CostModel:
    """Time every (SSM, depth) alone and plain decoding on ``prompts`` with the engine.

    Args:
        engine: the engine with every SSM (greedy decoding).
        prompts: token ids of the calibration prompts.
        widths: expansion widths; an SSM at depth k drafts ``widths[:k]``, prompt lookup a chain of k.
        depths: candidate depths.
        tokens: tokens generated per calibration run.
        merged_runs: recorded (result, prompt tokens) of labelled runs (every SSM merged), whose
            verification and overhead timings extend the curves to large trees.
        draft_vocab: the SSM trees' draft vocabulary size (0: whole), as they will be served.
    """
    depths = sorted(depths)
    n = len(engine.drafters)
    lookup = next((j for j, d in enumerate(engine.drafters) if isinstance(d, PromptLookupDrafter)), -1)
    samples = _Samples({}, {}, {}, {}, {})
    stop = StopCriteria(max_new_tokens=tokens)
    for ids in prompts:
        res = engine.generate(ids, stop, active=[], record=True)
        samples.add_run(res, len(ids), None)
        for k in depths:
            trees = depth_trees([k] * n, widths, draft_vocab, lookup)
            for j in range(n):
                res = engine.generate(ids, stop, active=[j], tree=trees, record=True)
                samples.add_run(res, len(ids), k)
    for res, prompt_tokens in merged_runs:
        samples.add_run(res, prompt_tokens, None)
    return _fit(samples, n, widths, depths)


def _fit(samples: _Samples, n: int, widths: Sequence[int], depths: Sequence[int]) -> CostModel:
    """Medians of the samples, made monotone where cost must grow (deeper, larger trees)."""
    draft = []
    for j in range(n):
        missing = [k for k in depths if not samples.draft.get((j, k))]
        if missing:
            raise ValueError(f"calibration has no draft timing for SSM {j} at depths {missing}")
        row = [float(np.median(samples.draft[(j, k)])) for k in depths]
        draft.append(tuple(np.maximum.accumulate(row).tolist()))
    nodes = sorted(samples.verify)
    verify = np.maximum.accumulate([float(np.median(samples.verify[x])) for x in nodes]).tolist()
    return CostModel(
        depths=tuple(depths),
        nodes_per_ssm=tuple(
            tuple(float(np.mean(samples.nodes.get((j, k)) or [tree_nodes(widths, k)])) for k in depths)
            for j in range(n)
        ),
        draft_s=tuple(draft),
        ssm_prefill_s_per_token=tuple(float(np.median(samples.prefill.get(j, [0.0]))) for j in range(n)),
        verify_nodes=tuple(nodes),
        verify_s=tuple(verify),
        overhead_s=_line(samples.overhead),
    )


def _line(points: dict[int, list[float]]) -> tuple[float, float]:
    """Least-squares (base, per active SSM) through the per-count medians, both clipped at 0."""
    xs = np.array(sorted(points), dtype=float)
    ys = np.array([np.median(points[int(x)]) for x in xs])
    if len(xs) < 2:
        return (float(ys[0]) if len(ys) else 0.0, 0.0)
    slope, base = np.polyfit(xs, ys, 1)
    slope = max(float(slope), 0.0)
    base = max(float(np.mean(ys - slope * xs)), 0.0)
    return base, slope
