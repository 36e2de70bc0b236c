"""Token trees as flat tensors, and the one function that derives their topology.

Shape legend: N tree nodes (the root is implicit), V vocabulary, M draft distributions, T tokens fed
to a model in one forward.

The root of every tree is the last committed token (the "pending" token: committed but not yet in
the LLM's KV cache). Nodes are stored in topological order (``parents[i] < i``); ``parents[i] == -1``
means node i is a child of the root. Depth counts from the root: children of the root have depth 1,
so a node's position id is ``prefix_len + depth`` where ``prefix_len`` is the cached length before
the root (the root itself sits at ``prefix_len``).

p is the LLM (target) distribution and q an SSM (draft) distribution everywhere in this package.
"""

from __future__ import annotations

from dataclasses import dataclass

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

