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

``calibrate.py`` measures it with the engine itself (at training, and again at serve time on a forward
other than the one it was measured on: ``Scheduler.recosted``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from boosttune.scheduler.subsets import members
from boosttune.serving.lookup import lookup_tree
from boosttune.serving.tree import TreeConfig


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
