"""Tree-building policies and the merge of several SSMs' trees: short pure functions.

Shape legend: F frontier nodes (nodes being expanded at one depth), W children per node,
V vocabulary, N tree nodes.

Policies (``TREE_POLICIES``, a registry keyed by ``TreeConfig.kind``; a drafter asks its tree's
policy how wide each depth is, which frontier nodes to expand and what to keep at the end):
- ``expansion``: SpecInfer's expansion-based tree, a width per depth (the paper's ⟨1,1,3,1,1,1,1,1⟩,
  arXiv 2305.09781 §3): every node of depth d-1 gets ``widths[d-1]`` children.
- ``dynamic``: EAGLE-2's context-aware tree (arXiv 2406.16858): at each depth expand only the
  ``topk`` frontier nodes with the largest cumulative draft probability, each with ``topk``
  children; at the end re-rank all nodes by cumulative probability and keep ``budget`` of them.
  The re-rank prunes siblings by their sampled values, which would bias stochastic verification,
  so it runs for greedy decoding only (the expansion step itself is safe, see verify_stochastic).

Children are the top-W tokens of q for greedy decoding, and W draws *without replacement* from q
(Gumbel-top-k) for sampling: deterministic top-k children would break exactness under sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from boosttune.serving.tree import TokenTree


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the token tree each SSM drafts.

    Attributes:
        kind: "expansion" (fixed width per depth) or "dynamic" (EAGLE-2 style re-ranking).
        widths: expansion only: children per node at each depth; its length is the tree depth.
        topk: dynamic only: frontier nodes expanded per depth, and children per expanded node.
        depth: dynamic only: number of draft depths.
        budget: dynamic only: nodes kept after re-ranking (greedy decoding).
        min_prob: stop expanding a node whose cumulative draft probability (product of q along
            its path) is below this; 0 expands every node the policy allows. Saves SSM forwards
            on branches the LLM is unlikely to accept. Deciding *whether to expand* from drafted
            values keeps stochastic verification exact (see verify_stochastic).
        draft_vocab: SSMs compute logits over the first K tokens of the draft ranking only
            (``draft_vocab.py``; K rows of the LM head instead of V); 0 keeps the whole vocabulary.
            Tokens outside it get q = 0, which verification handles exactly.
        ngram_depths: prompt lookup only (``lookup.py``): the chain length after a match of the newest
            n tokens, n = 1 .. len (longer matches use the last entry), each capped at the tree's
            depth; 0 drafts nothing after such a match; empty: always the tree's depth. Set per
            request by a learned scheduler (``scheduler/offline/stepwise.py``).
    """

    kind: str = "expansion"
    widths: tuple[int, ...] = field(default=(1, 1, 3, 1, 1, 1, 1, 1))
    topk: int = 4
    depth: int = 6
    budget: int = 32
    min_prob: float = 0.0
    draft_vocab: int = 0
    ngram_depths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in TREE_POLICIES:
            raise ValueError(f"tree.kind must be one of {sorted(TREE_POLICIES)}, got {self.kind!r}")
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        if self.kind == "expansion" and (not self.widths or min(self.widths) < 1):
            raise ValueError(f"tree.widths must be a non-empty list of positive ints, got {self.widths}")
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"tree.min_prob must be in [0, 1), got {self.min_prob}")
        if self.draft_vocab < 0:
            raise ValueError(f"tree.draft_vocab must be >= 0 (0 = the whole vocabulary), got {self.draft_vocab}")
        object.__setattr__(self, "ngram_depths", tuple(int(k) for k in self.ngram_depths))
        if any(k < 0 for k in self.ngram_depths):
            raise ValueError(f"tree.ngram_depths must be >= 0 (0: draft nothing), got {self.ngram_depths}")
        for name in ("topk", "depth", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"tree.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def policy(self) -> TreePolicy:
        """How this tree grows (``TREE_POLICIES[kind]``)."""
        return TREE_POLICIES[self.kind]

    @property
    def max_depth(self) -> int:
        return self.policy.depth(self)

    @property
    def label(self) -> str:
        """A short name for tables: the expansion widths ("3", "3,1"; a chain of n as "1x{n}", "+table"
        when ``ngram_depths`` sets its length per match), or "dyn:topk,depth,budget"."""
        if self.kind != "expansion":
            return f"dyn:{self.topk},{self.depth},{self.budget}"
        w = self.widths
        shape = f"1x{len(w)}" if len(w) > 1 and set(w) == {1} else ",".join(map(str, w))
        return shape + ("+table" if self.ngram_depths else "")


def choose_children(q: Tensor, width: int, greedy: bool, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """(F, V) q → (F, W) child tokens and (F, W) validity.

    Greedy: the W most likely tokens. Sampling: W sequential draws without replacement (the order
    of the Gumbel-top-k keys is the order of the draws); tokens with q = 0 are never drawn, so a
    row with fewer than W candidates yields invalid slots.
    """
    w = min(width, q.shape[-1])
    if greedy:
        tokens = torch.topk(q, w, dim=-1).indices  # (F, W)
        return tokens, torch.ones_like(tokens, dtype=torch.bool)
    # draw on the generator's device (the request's stream), then bring the noise to q
    dev = q.device if generator is None else generator.device
    u = torch.rand(q.shape, generator=generator, device=dev).to(q.device).clamp_(min=1e-20)
    keys = q.log() - (-u.log()).log()  # log q + Gumbel noise; -inf where q = 0
    top = torch.topk(keys, w, dim=-1)
    return top.indices, torch.isfinite(top.values)


def select_frontier(cum_logq: Tensor, topk: int) -> Tensor:
    """Indices (≤ topk,) of the frontier nodes with the largest cumulative log q."""
    k = min(topk, cum_logq.shape[0])
    return torch.topk(cum_logq, k).indices.sort().values


def rerank_keep(cum_logq: Tensor, depth: Tensor, budget: int) -> Tensor:
    """(N,) bool: the ``budget`` nodes with the largest cumulative log q.

    A node's cumulative probability never exceeds its parent's, and ties break towards the
    shallower node, so the kept set is closed under ancestors (always a valid tree).
    """
    n = cum_logq.shape[0]
    if n <= budget:
        return torch.ones(n, dtype=torch.bool, device=cum_logq.device)
    score = cum_logq.double() - 1e-9 * depth.double()
    keep = torch.zeros(n, dtype=torch.bool, device=cum_logq.device)
    keep[torch.topk(score, budget).indices] = True
    return keep


def subtree(tree: TokenTree, keep: Tensor) -> tuple[TokenTree, Tensor]:
    """Restrict a tree to an ancestor-closed node set; returns it and (N_kept,) old indices."""
    old = keep.nonzero().squeeze(-1)  # (K,) increasing, so still topological
    new_index = torch.full((tree.size,), -1, dtype=torch.long, device=keep.device)
    new_index[old] = torch.arange(old.shape[0], device=keep.device)
    par = tree.parents[old]
    new_par = torch.where(par >= 0, new_index[par.clamp(min=0)], par)
    assert bool((new_par[par >= 0] >= 0).all()), "kept node set must be closed under ancestors"
    t = TokenTree(
        tokens=tree.tokens[old], parents=new_par, depth=tree.depth[old], proposer=tree.proposer[old],
        q_prob=tree.q_prob[old], dist_row=tree.dist_row[old], q_dists=tree.q_dists,
    )
    return t, old


def merge_trees(trees: list[TokenTree], dedupe: bool) -> tuple[TokenTree, list[Tensor]]:
    """Merge several drafters' trees into one; returns it and, per input tree, (N_i,) merged indices.
    A node's proposer is the index of its tree in ``trees`` (for a shared node, the first).

    With ``dedupe`` (greedy decoding) nodes with the same token under the same merged parent are
    shared, so common prefixes are verified once. Without it (sampling) every draft node stays its
    own node: two SSMs drawing the same token are two independent samples, and the stochastic
    verifier needs each (see verify_stochastic). Draft distributions are concatenated.
    """
    if len(trees) == 1:
        return trees[0], [torch.arange(trees[0].size)]
    tokens, parents, depth, proposer, q_prob, dist_row = [], [], [], [], [], []
    dists, row_offset = [], 0
    children: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    maps = []
    for j, tree in enumerate(trees):
        tk, pa, dp = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()  # host sync, once
        qp, dr = tree.q_prob.tolist(), tree.dist_row.tolist()
        local = []
        for i in range(tree.size):
            mp = local[pa[i]] if pa[i] >= 0 else -1
            key = (mp, tk[i])
            if dedupe and key in children:
                local.append(children[key])
                continue
            children[key] = len(tokens)
            local.append(len(tokens))
            tokens.append(tk[i])
            parents.append(mp)
            depth.append(dp[i])
            proposer.append(j)
            q_prob.append(qp[i])
            dist_row.append(dr[i] + row_offset if dr[i] >= 0 else -1)
        if tree.q_dists is not None:
            dists.append(tree.q_dists)
            row_offset += tree.q_dists.shape[0]
        maps.append(torch.tensor(local, dtype=torch.long))
    # Nodes were appended tree by tree, so a node shared with an earlier tree always precedes
    # the new nodes below it: the merged order stays topological.
    long = dict(dtype=torch.long)
    merged = TokenTree(
        tokens=torch.tensor(tokens, **long), parents=torch.tensor(parents, **long),
        depth=torch.tensor(depth, **long), proposer=torch.tensor(proposer, **long),
        q_prob=torch.tensor(q_prob, dtype=torch.float32), dist_row=torch.tensor(dist_row, **long),
        # drafters may hold q on different devices (prompt lookup builds its own on the host)
        q_dists=torch.cat([d.to(dists[0].device) for d in dists]) if dists else None,
    )
    return merged, maps



class TreePolicy(Protocol):
    """How a drafter's tree grows, depth by depth: what differs between tree kinds, and nothing else."""

    def depth(self, cfg: TreeConfig) -> int:
        """Draft depths (forwards of a model drafter)."""
        ...

    def width(self, cfg: TreeConfig, d: int) -> int:
        """Children per expanded node at depth ``d`` (0-based)."""
        ...

    def frontier(self, cfg: TreeConfig, d: int, cum_logq: Tensor) -> Tensor | None:
        """Indices of the (F,) frontier nodes to expand at depth ``d``, given their cumulative log q;
        None: all of them."""
        ...

    def keep(self, cfg: TreeConfig, cum_logq: Tensor, depth: Tensor, greedy: bool) -> Tensor | None:
        """(N,) bool: the drafted nodes to keep, closed under ancestors; None: all of them."""
        ...

    def accepts(self, cfg: TreeConfig, ranks: np.ndarray) -> np.ndarray:
        """(O,) ranks of the true output tokens under a drafter (0: its argmax after the true prefix)
        → (O,) draft tokens this tree would have had accepted by a greedy step starting at each."""
        ...


class ExpansionTree:
    """SpecInfer's expansion tree: every node of depth d - 1 gets ``widths[d - 1]`` children."""

    def depth(self, cfg: TreeConfig) -> int:
        return len(cfg.widths)

    def width(self, cfg: TreeConfig, d: int) -> int:
        return cfg.widths[d]

    def frontier(self, cfg: TreeConfig, d: int, cum_logq: Tensor) -> Tensor | None:
        return None

    def keep(self, cfg: TreeConfig, cum_logq: Tensor, depth: Tensor, greedy: bool) -> Tensor | None:
        return None

    def accepts(self, cfg: TreeConfig, ranks: np.ndarray) -> np.ndarray:
        """``accepted[t]`` is the largest d <= len(widths) with ``ranks[t + l - 1] < widths[l - 1]`` for
        every l <= d (and t + d <= O: the output ends there): the tree's node on the true path at level
        l expands its ``widths[l - 1]`` likeliest tokens."""
        t_out = ranks.shape[0]
        out = np.zeros(t_out, dtype=np.int64)
        for t in range(t_out):
            d = 0
            while d < len(cfg.widths) and t + d < t_out and ranks[t + d] < cfg.widths[d]:
                d += 1
            out[t] = d
        return out


class DynamicTree:
    """EAGLE-2's tree: expand the ``topk`` likeliest frontier nodes per depth, then keep ``budget`` nodes."""

    def depth(self, cfg: TreeConfig) -> int:
        return cfg.depth

    def width(self, cfg: TreeConfig, d: int) -> int:
        return cfg.topk

    def frontier(self, cfg: TreeConfig, d: int, cum_logq: Tensor) -> Tensor | None:
        return select_frontier(cum_logq, cfg.topk) if d > 0 else None

    def keep(self, cfg: TreeConfig, cum_logq: Tensor, depth: Tensor, greedy: bool) -> Tensor | None:
        # pruning siblings by their sampled values would bias stochastic verification: greedy only
        return rerank_keep(cum_logq, depth, cfg.budget) if greedy else None

    def accepts(self, cfg: TreeConfig, ranks: np.ndarray) -> np.ndarray:
        raise ValueError("position labels need expansion trees: which nodes a dynamic tree keeps depends on "
                         "the draft probabilities along the way, not on the true tokens' ranks alone")


TREE_POLICIES: dict[str, TreePolicy] = {"expansion": ExpansionTree(), "dynamic": DynamicTree()}
"""The tree policies by ``TreeConfig.kind``."""
