"""Token trees as flat tensors, and the one function that derives their topology.

Shape legend: N tree nodes (the root is implicit), V vocabulary, M draft distributions, T tokens fed
to a model in one forward.

The root of every tree is the last committed token (the "pending" token: committed but not yet in
the LLM's KV cache). Nodes are stored in topological order (``parents[i] < i``); ``parents[i] == -1``
means node i is a child of the root. Depth counts from the root: children of the root have depth 1,
so a node's position id is ``prefix_len + depth`` where ``prefix_len`` is the cached length before
the root (the root itself sits at ``prefix_len``).

A tree's shape is a ``TreeConfig``, grown by its policy (``TREE_POLICIES``, a registry keyed by
``TreeConfig.kind``; a drafter asks its tree's policy how wide each depth is, which frontier nodes to
expand and what to keep at the end):
- ``expansion``: SpecInfer's expansion-based tree, a width per depth (the paper's ⟨1,1,3,1,1,1,1,1⟩,
  arXiv 2305.09781 §3): every node of depth d-1 gets ``widths[d-1]`` children.
- ``dynamic``: EAGLE-2's context-aware tree (arXiv 2406.16858): at each depth expand only the
  ``topk`` frontier nodes with the largest cumulative draft probability, each with ``topk``
  children; at the end re-rank all nodes by cumulative probability and keep ``budget`` of them.
  The re-rank prunes siblings by their sampled values, which would bias stochastic verification,
  so it runs for greedy decoding only (the expansion step itself is safe, see verify_stochastic).

p is the LLM (target) distribution and q an SSM (draft) distribution everywhere in this package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenTree:
    """Candidate continuations of the committed text, rooted at the pending token.

    Attributes:
        tokens: (N,) long, the candidate token of each node.
        parents: (N,) long, index of the parent node, -1 for children of the root; ``parents[i] < i``.
        depth: (N,) long, 1 for children of the root.
        proposer: (N,) long, which of the drafters merged into this tree proposed the node (``merge_trees``).
        q_prob: (N,) float, q(token) under the proposer's (processed) distribution at the parent.
        dist_row: (N,) long, row of ``q_dists`` that the node was drawn from (-1 when not kept).
        q_dists: (M, V) float or None: the proposers' processed distributions at expanded nodes,
            kept only for stochastic verification (siblings from one proposer share a row).
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    proposer: Tensor
    q_prob: Tensor
    dist_row: Tensor
    q_dists: Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("parents", "depth", "proposer", "q_prob", "dist_row"):
            assert getattr(self, name).shape == (n,), f"TokenTree.{name} must have shape ({n},)"
        if n:
            idx = torch.arange(n, device=self.parents.device)
            assert bool((self.parents < idx).all()), "TokenTree nodes must be in topological order"

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> TokenTree:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return TokenTree(z, z.clone(), z.clone(), z.clone(), torch.zeros(0, device=device), z.clone())

    def ancestor_mask(self) -> Tensor:
        """(N, N) bool: ``[i, j]`` is True iff j is i or an ancestor of i (computed once per tree:
        the verification inputs and the greedy verifier both need it)."""
        cached = self.__dict__.get("_ancestor_mask")
        if cached is None:
            cached = ancestor_mask(self.parents)
            object.__setattr__(self, "_ancestor_mask", cached)  # frozen dataclass: cache only
        return cached


def ancestor_mask(parents: Tensor) -> Tensor:
    """(N, N) bool, ``[i, j]`` True iff node j is node i or one of its ancestors (root excluded).

    Pointer chasing, vectorised over nodes: one pass per tree level.
    """
    n = parents.shape[0]
    rows = torch.arange(n, device=parents.device)
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    cur = parents.clone()
    while True:
        live = cur >= 0
        if not bool(live.any()):  # host sync: once per level, trees are shallow
            return mask
        mask[rows[live], cur[live]] = True
        cur = torch.where(live, parents[cur.clamp(min=0)], cur)


def verification_inputs(tree: TokenTree, root_token: int, prefix_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs of the one LLM forward that verifies a whole tree.

    The forward feeds ``[root] + nodes`` (T = N + 1 tokens) over a cache of ``prefix_len`` tokens.

    Returns:
        input_ids (1, T), position_ids (1, T), tree_mask (T, T) bool where ``[a, b]`` says token a
        may attend to token b among the T fed tokens (the cached prefix is visible to all).
    """
    n = tree.size
    dev = tree.tokens.device
    input_ids = torch.cat([torch.tensor([root_token], device=dev), tree.tokens]).unsqueeze(0)  # (1, T)
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), tree.depth])
    position_ids = (prefix_len + depth).unsqueeze(0)  # (1, T)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=dev)
    mask[:, 0] = True  # everyone sees the root
    mask[1:, 1:] = tree.ancestor_mask()
    return input_ids, position_ids, mask


def path_to(parents: Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for the root, node == -1)."""
    path = []
    plist = parents.tolist()  # host sync: once per step
    while node >= 0:
        path.append(node)
        node = plist[node]
    return path[::-1]


MAX_TREE_NODES = 1024
"""The most nodes one drafter's tree may draft in a step (expansion: every level's product of widths;
dynamic: ``topk`` children of ``topk`` frontier nodes per depth, and ``budget``). SpecInfer's tree has
20, EAGLE-2's 60; a bound keeps a bundle, a scheduler file or a flag from asking for an allocation of
billions of nodes. The one tree-size limit: the manifest parser, the scheduler loader and the CLI all
check through :class:`TreeConfig` or :func:`check_tree_limits`."""
MAX_TREE_DEPTH = 64
"""The most draft depths of one tree, prompt lookup's chain length included (SpecInfer drafts 8)."""


def expansion_nodes(widths: tuple[int, ...]) -> int:
    """Nodes an expansion tree of ``widths`` drafts: sum over depths of the product of widths so far
    (stops counting once past ``MAX_TREE_NODES``: no huge integers from hostile widths)."""
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
        if total > MAX_TREE_NODES:
            break
    return total


def check_tree_limits(kind: str, widths: tuple[int, ...], topk: int, depth: int, budget: int,
                      ngram_depths: tuple[int, ...] = ()) -> None:
    """Refuse a tree beyond ``MAX_TREE_DEPTH`` / ``MAX_TREE_NODES`` (a ``ValueError`` naming the field)."""
    if kind == "expansion":
        if len(widths) > MAX_TREE_DEPTH:
            raise ValueError(f"tree.widths has {len(widths)} depths, more than the {MAX_TREE_DEPTH} a tree may have")
        nodes = expansion_nodes(widths)
        if nodes > MAX_TREE_NODES:
            raise ValueError(f"tree.widths {list(widths)[:8]}{'...' if len(widths) > 8 else ''} drafts more than "
                             f"{MAX_TREE_NODES} nodes per step (the limit); use narrower widths")
    else:
        if depth > MAX_TREE_DEPTH:
            raise ValueError(f"tree.depth must be <= {MAX_TREE_DEPTH}, got {depth}")
        if topk > MAX_TREE_NODES or topk + (depth - 1) * topk * topk > MAX_TREE_NODES or budget > MAX_TREE_NODES:
            raise ValueError(f"tree.topk {topk}, depth {depth}, budget {budget} draft or keep more than "
                             f"{MAX_TREE_NODES} nodes per step (the limit); use a smaller topk, depth or budget")
    if len(ngram_depths) > MAX_TREE_DEPTH:
        raise ValueError(f"tree.ngram_depths has {len(ngram_depths)} entries, more than {MAX_TREE_DEPTH}")


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
        check_tree_limits(self.kind, self.widths, self.topk, self.depth, self.budget, self.ngram_depths)

    @property
    def policy(self) -> TreePolicy:
        """How this tree grows (``TREE_POLICIES[kind]``)."""
        return TREE_POLICIES[self.kind]

    @property
    def max_depth(self) -> int:
        return self.policy.depth(self)

    @property
    def label(self) -> str:
        """A short name for tables: the expansion widths ("3", "3,1"; a chain of n as "1x{n}", "+lengths"
        when ``ngram_depths`` sets its length per match, not to be read as the phrase table), or "dyn:topk,depth,budget"."""
        if self.kind != "expansion":
            return f"dyn:{self.topk},{self.depth},{self.budget}"
        w = self.widths
        shape = f"1x{len(w)}" if len(w) > 1 and set(w) == {1} else ",".join(map(str, w))
        return shape + ("+lengths" if self.ngram_depths else "")


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
