"""Calibration: the cost model (``scheduler/costs.py``) measured with the engine itself.

Shape legend: N drafters, K candidate depths.

Every (drafter, depth) alone and plain decoding run on a few prompts, interleaved so that drift on a
shared machine spreads over all of them; the verification and overhead samples of the labelled runs
(every drafter merged: the large trees) extend the verification curve. Medians, made monotone where
cost must grow with depth and tree size by a least-squares fit weighted by how many timings each median
has (``monotone_fit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from boosttune.scheduler.costs import CostModel, depth_trees, tree_nodes
from boosttune.serving.engine import GenerationResult, Plan, SpeculativeEngine
from boosttune.serving.lookup import LOOKUP_NAME
from boosttune.serving.stops import StopCriteria


@dataclass
class _Samples:
    """Raw timings gathered by ``calibrate`` before medians are taken; drafters by index in ``names``."""

    names: list[str]  # the engine's drafters
    draft: dict[tuple[int, int], list[float]]  # (ssm, depth) -> seconds of later-step drafts
    nodes: dict[tuple[int, int], list[int]]  # (ssm, depth) -> tree sizes of its solo steps
    prefill: dict[int, list[float]]  # ssm -> seconds per prompt token of the first catch-up
    verify: dict[int, list[float]]  # nodes -> seconds
    overhead: dict[int, list[float]]  # active SSMs -> seconds

    def add_run(self, res: GenerationResult, prompt_tokens: int, depth: int | None) -> None:
        """Fold one recorded run in; ``depth`` keys its draft times (None: merged run, skip them)."""
        active = [self.names.index(name) for name in res.active or []]
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
        engine: the engine with every drafter the scheduler chooses among (greedy decoding).
        prompts: token ids of the calibration prompts.
        widths: expansion widths; an SSM at depth k drafts ``widths[:k]``, prompt lookup a chain of k.
        depths: candidate depths.
        tokens: tokens generated per calibration run.
        merged_runs: recorded (result, prompt tokens) of labelled runs (every SSM merged), whose
            verification and overhead timings extend the curves to large trees.
        draft_vocab: the SSM trees' draft vocabulary size (0: whole), as they will be served.
    """
    depths = sorted(depths)
    names = list(engine.drafters)
    n = len(names)
    lookup = names.index(LOOKUP_NAME) if LOOKUP_NAME in names else -1
    samples = _Samples(names, {}, {}, {}, {}, {})
    stop = StopCriteria(max_new_tokens=tokens)
    for ids in prompts:
        res = engine.generate(ids, stop, plan=Plan(), record=True)
        samples.add_run(res, len(ids), None)
        for k in depths:
            trees = depth_trees([k] * n, widths, draft_vocab, lookup)
            for j in range(n):
                res = engine.generate(ids, stop, plan=Plan({names[j]: trees[j]}), record=True)
                samples.add_run(res, len(ids), k)
    for res, prompt_tokens in merged_runs:
        samples.add_run(res, prompt_tokens, None)
    return _fit(samples, n, widths, depths)


def served_costs(
    engine: SpeculativeEngine, drafters: Sequence[str], prompts: Sequence[list[int]], widths: Sequence[int],
    depths: Sequence[int], tokens: int, draft_vocab: int = 0,
) -> CostModel:
    """``calibrate`` on the engine as it serves now (a quantized or compiled forward), over ``drafters`` (by
    name, in the scheduler's order), with one run per prompt of every drafter merged at the deepest depth
    for the verification curve's large trees; a first run, not timed, pays for lazy initialisation."""
    sub = SpeculativeEngine(engine.llm, {name: engine.drafters[name] for name in drafters}, Plan())
    names = list(drafters)
    lookup = names.index(LOOKUP_NAME) if LOOKUP_NAME in names else -1
    trees = depth_trees([max(depths)] * len(names), widths, draft_vocab, lookup)
    merged_plan = Plan({names[j]: tree for j, tree in trees.items()})
    stop = StopCriteria(max_new_tokens=tokens)
    sub.generate(prompts[0], stop, plan=merged_plan)
    merged = [(sub.generate(ids, stop, plan=merged_plan, record=True), len(ids)) for ids in prompts]
    return calibrate(sub, prompts, widths, depths, tokens, merged, draft_vocab)


def _fit(samples: _Samples, n: int, widths: Sequence[int], depths: Sequence[int]) -> CostModel:
    """Medians of the samples, made monotone where cost must grow (deeper, larger trees)."""
    draft = []
    for j in range(n):
        missing = [k for k in depths if not samples.draft.get((j, k))]
        if missing:
            raise ValueError(f"calibration has no draft timing for SSM {j} at depths {missing}")
        draft.append(tuple(monotone_fit([samples.draft[(j, k)] for k in depths])))
    nodes = sorted(samples.verify)
    verify = monotone_fit([samples.verify[x] for x in nodes])
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


def monotone_fit(groups: Sequence[Sequence[float]]) -> list[float]:
    """Per group, its median, fitted non-decreasing over the groups' order (isotonic least squares, each
    median weighted by its group's size).

    A running maximum of the medians let one small group's slow median lift every later group: one
    calibration of the demo timed 19 verifications of 1 drafted token at 59.0 ms, above the 57.3 ms that
    608 of 3 tokens took, and so charged 3-token trees 59.0 ms; in repeated calibrations that choice of
    fixed drafters flipped with such medians (docs/measurements.md, *Calibration that repeats*). Here a
    small group that breaks the order is pooled with its neighbours, in proportion to the timings behind
    each.
    """
    from sklearn.isotonic import IsotonicRegression

    medians = [float(np.median(g)) for g in groups]
    if len(medians) < 2:
        return medians
    x = np.arange(len(medians), dtype=float)
    fit = IsotonicRegression(increasing=True).fit(x, medians, sample_weight=[len(g) for g in groups])
    return [float(v) for v in fit.predict(x)]


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
