"""Building trees: choosing children, growing a drafter's tree depth by depth (``TreeGrowth``), cutting
a tree to a subset, and merging several drafters' trees. A tree's shape (``TreeConfig``) and the policies that grow it live
beside the trees themselves, in ``tree.py``.

Shape legend: F frontier nodes (nodes being expanded at one depth), W children per node,
V vocabulary, N tree nodes.

Children are the top-W tokens of q for greedy decoding, and W draws *without replacement* from q
(Gumbel-top-k) for sampling: deterministic top-k children would break exactness under sampling.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from boosttune.serving.tree import TokenTree, TreeConfig, ancestor_mask


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


class TreeGrowth:
    """One drafter's tree grown depth by depth, with the forwards left to the caller: ``expand``
    chooses a depth's children (``choose_children``, the tree policy's frontier and width) and names
    the nodes to feed, ``fed`` takes their q, ``finish`` applies the policy's cut and returns the tree.
    ``SSMDrafter`` feeds each depth's nodes to its own cache, ``StackedSSMs`` to every member's at once
    (padded slots), so both draft the same children, q, node order and cut.

    Greedy trees record no q rows (``dist_row`` -1); sampled trees keep each frontier's q for
    stochastic verification. Slots count the nodes fed after the committed tokens: node i's KV entry
    sits at slot ``fed`` + its position in the ``nodes`` handed to ``fed``.
    """

    def __init__(self, cfg: TreeConfig, greedy: bool, q_root: Tensor, vocab_ids: Tensor | None = None):
        """``q_root``: (1, V) q after the committed tokens, or (1, K) over the draft vocabulary
        ``vocab_ids`` (the token of each of its columns)."""
        self.cfg, self.policy, self.greedy = cfg, cfg.policy, greedy
        self.vocab_ids = vocab_ids
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.q_prob: list[float] = []
        self.dist_row: list[int] = []
        self.cum: list[float] = []
        self.depths: list[int] = []
        self.dists: list[Tensor] = []
        self.slot: dict[int, int] = {}  # node → its slot after the committed tokens
        self.frontier = torch.tensor([-1])  # node indices being expanded (-1 = root)
        self.q_frontier = q_root  # (F, V), or (F, K) over ``vocab_ids``
        self.cum_frontier = torch.zeros(1)
        self.done = False
        self._new_cum: Tensor | None = None

    def expand(self, d: int, generator: torch.Generator | None) -> Tensor | None:
        """Add depth ``d + 1``'s children; returns the (F',) new nodes to feed (None: the tree is done)."""
        if self.done:
            return None
        cfg, policy = self.cfg, self.policy
        sel = policy.frontier(cfg, d, self.cum_frontier)
        if sel is not None:
            self.frontier, self.cum_frontier = self.frontier[sel], self.cum_frontier[sel]
            self.q_frontier = self.q_frontier[sel.to(self.q_frontier.device)]
        q_frontier = self.q_frontier
        child_tok, valid = choose_children(q_frontier, policy.width(cfg, d), self.greedy, generator)  # (F, W)
        child_q = q_frontier.gather(1, child_tok)  # (F, W)
        if self.vocab_ids is not None:
            child_tok = self.vocab_ids[child_tok]  # draft vocabulary columns → token ids
        # the bookkeeping lives on the host (its lists sync anyway): the small (F, W) choices come
        # over once per depth; no copy when the drafter runs on the CPU
        child_tok, valid, child_q = child_tok.cpu(), valid.cpu(), child_q.cpu()
        if not self.greedy:
            rows = torch.arange(len(self.dists), len(self.dists) + q_frontier.shape[0])
            self.dists.append(q_frontier)
        else:
            rows = torch.full((q_frontier.shape[0],), -1)
        f, w = child_tok.shape
        par = self.frontier.unsqueeze(1).expand(f, w)
        count = int(valid.sum())  # host sync: once per depth
        new_idx = torch.arange(len(self.tokens), len(self.tokens) + count)
        self.tokens += child_tok[valid].tolist()
        self.parents += par[valid].tolist()
        self.q_prob += child_q[valid].tolist()
        self.dist_row += rows.unsqueeze(1).expand(f, w)[valid].tolist()
        new_cum = (self.cum_frontier.unsqueeze(1) + child_q.clamp(min=1e-30).log())[valid]
        self.cum += new_cum.tolist()
        self.depths += [d + 1] * count
        if cfg.min_prob > 0.0:  # expand only branches the drafter still believes in
            live = new_cum >= math.log(cfg.min_prob)
            new_idx, new_cum = new_idx[live], new_cum[live]
        if d + 1 == cfg.max_depth or new_idx.numel() == 0:
            self.done = True
            return None
        self._new_cum = new_cum
        return new_idx

    def tokens_of(self, nodes: Tensor) -> Tensor:
        return torch.tensor(self.tokens, dtype=torch.long)[nodes]

    def parents_of(self, nodes: Tensor) -> Tensor:
        return torch.tensor(self.parents, dtype=torch.long)[nodes]

    def feed_mask(self, nodes: Tensor, fed: int, width: int) -> Tensor:
        """(F', fed + width) bool: what the new ``nodes`` see of the slots after the committed tokens
        (their fed ancestors, and themselves at slots ``fed ...``; slots past them are padding)."""
        anc = ancestor_mask(torch.tensor(self.parents, dtype=torch.long))  # (N, N)
        mask = torch.zeros(nodes.numel(), fed + width, dtype=torch.bool)
        if self.slot:
            old = torch.tensor(list(self.slot), dtype=torch.long)
            cols = torch.tensor(list(self.slot.values()), dtype=torch.long)
            mask[:, cols] = anc[nodes][:, old]
        mask[:, fed : fed + nodes.numel()] = anc[nodes][:, nodes]
        return mask

    def fed(self, nodes: Tensor, fed: int, q: Tensor) -> None:
        """The new ``nodes`` were fed at slots ``fed ...``; ``q``: (F', V) their draft distributions."""
        for i, node in enumerate(nodes.tolist()):
            self.slot[node] = fed + i
        self.frontier, self.q_frontier = nodes, q
        assert self._new_cum is not None
        self.cum_frontier = self._new_cum

    def finish(self) -> tuple[TokenTree, Tensor]:
        """The tree (proposers 0) and (N,) each node's slot (-1: not fed), after the policy's cut."""
        long = dict(dtype=torch.long)
        n = len(self.tokens)
        drafted = TokenTree(
            tokens=torch.tensor(self.tokens, **long), parents=torch.tensor(self.parents, **long),
            depth=torch.tensor(self.depths, **long), proposer=torch.zeros(n, **long),
            q_prob=torch.tensor(self.q_prob, dtype=torch.float32), dist_row=torch.tensor(self.dist_row, **long),
            q_dists=torch.cat(self.dists) if self.dists else None,
        )
        slots = torch.full((n,), -1, **long)
        if self.slot:
            slots[torch.tensor(list(self.slot), **long)] = torch.tensor(list(self.slot.values()), **long)
        keep = self.policy.keep(self.cfg, torch.tensor(self.cum), drafted.depth, self.greedy)
        if keep is not None:
            drafted, old = subtree(drafted, keep)
            slots = slots[old]
        return drafted, slots


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
