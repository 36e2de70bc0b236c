"""Replaying a policy step by step over position-level labels (``labels.py``, each drafter's ``replay``).

Shape legend: T generated tokens, N drafters, S steps of the replayed walk.

A step that starts at position t with drafter j drafting to depth k_j accepts
``max_j min(accepted[t, j], k_j)`` tokens and commits one more (the LLM's own token), so the next
step starts after them. Prompt lookup drafts ``min(k, chain[t])`` nodes, where k is its depth, or
the per-match length ``ngram_depths[ngram[t] - 1]`` when the policy sets one (``lookup.chain_length``),
plus the phrase table's branch where the labels have one: it accepts its own tokens and adds the nodes
it does not share with the chain as cut (``lookup.lookup_positions``). The walk keeps, per step, how
many nodes prompt lookup drafted (the verification cost depends on it) and the seconds come from the
measured cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from boosttune.scheduler.costs import CostModel
from boosttune.serving.lookup import chain_length


@dataclass(frozen=True)
class Labels:
    """Position-level labels of one request.

    Attributes:
        accepted: (T, N) tokens drafter j would have had accepted by a step starting at t (at the
            label depth; prompt lookup's is also capped by its chain).
        ngram: (T,) prompt lookup's matched n-gram length at t (0: no match; zeros without lookup).
        chain: (T,) tokens prompt lookup's chain holds at t (label depth at most).
        branch: (T, 3) prompt lookup's phrase-table branch at t: accepted tokens, length, prefix shared
            with the chain (None: no table).
    """

    accepted: np.ndarray
    ngram: np.ndarray
    chain: np.ndarray
    branch: np.ndarray | None = None

    @classmethod
    def drafters_only(cls, accepted: np.ndarray) -> Labels:
        """Labels of (T, N) model drafters and no prompt lookup (no match, empty chain, no table)."""
        zeros = np.zeros(accepted.shape[0], dtype=np.int64)
        return cls(accepted, zeros, zeros)


@dataclass(frozen=True)
class Walked:
    """One replayed request: S steps, T tokens.

    Attributes:
        steps: S, LLM forwards after the prefill.
        lookup_nodes: (S,) nodes prompt lookup drafted at each step (zeros without lookup).
        starts: (S,) the output position each step started at.
    """

    steps: int
    lookup_nodes: np.ndarray
    starts: np.ndarray


def walk(
    labels: Labels, depths: Sequence[int], lookup: int = -1, ngram_depths: Sequence[int] = ()
) -> Walked:
    """Steps of a policy that drafts with drafter j to ``depths[j]`` (0: not drafting).

    ``lookup`` is prompt lookup's index (-1: none), whose depth ``ngram_depths`` refines per match.
    """
    acc, t_out = labels.accepted, labels.accepted.shape[0]
    active = [j for j, k in enumerate(depths) if k > 0 and j != lookup]
    caps = np.array([depths[j] for j in active], dtype=np.int64)
    use_lookup = 0 <= lookup < len(depths) and depths[lookup] > 0
    t, steps, nodes, starts = 0, 0, [], []
    while t < t_out:
        starts.append(t)
        got = int(np.minimum(acc[t, active], caps).max()) if active else 0
        drafted = 0
        if use_lookup:
            k = chain_length(int(labels.ngram[t]), depths[lookup], tuple(ngram_depths))
            drafted = min(k, int(labels.chain[t]))
            got = max(got, min(int(acc[t, lookup]), drafted))
            if labels.branch is not None:
                b_acc, b_len, b_shared = (int(x) for x in labels.branch[t])
                got = max(got, b_acc)
                drafted += b_len - min(b_shared, drafted)
        nodes.append(drafted)
        t += got + 1
        steps += 1
    return Walked(steps, np.asarray(nodes, dtype=np.int64), np.asarray(starts, dtype=np.int64))


def walk_seconds(
    walked: Walked, costs: CostModel, mask_depths: Sequence[int], lookup: int = -1
) -> tuple[float, float]:
    """(decoding seconds, drafting seconds) of a walk under the measured costs.

    ``mask_depths`` are the walk's per-drafter depths; each must be one of ``costs.depths`` (or 0).
    SSMs draft their measured tree size at their depth; prompt lookup the walk's own node counts.
    """
    active = [j for j, k in enumerate(mask_depths) if k > 0]
    index = {k: i for i, k in enumerate(costs.depths)}
    draft = sum(costs.draft_s[j][index[mask_depths[j]]] for j in active)
    fixed_nodes = sum(costs.nodes_per_ssm[j][index[mask_depths[j]]] for j in active if j != lookup)
    overhead = costs.overhead_s[0] + costs.overhead_s[1] * len(active)
    if walked.steps == 0:
        return 0.0, 0.0
    node_counts, how_many = np.unique(walked.lookup_nodes, return_counts=True)
    verify = sum(c * costs.verify_cost(fixed_nodes + float(x)) for x, c in zip(node_counts, how_many, strict=True))
    return float(verify + walked.steps * (draft + overhead)), float(walked.steps * draft)
