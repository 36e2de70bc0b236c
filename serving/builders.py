"""Building trees: choosing children, cutting a tree to a subset, and merging several drafters'
trees; short pure functions. A tree's shape (``TreeConfig``) and the policies that grow it live
beside the trees themselves, in ``tree.py``.

Shape legend: F frontier nodes (nodes being expanded at one depth), W children per node,
V vocabulary, N tree nodes.

Children are the top-W tokens of q for greedy decoding, and W draws *without replacement* from q
(Gumbel-top-k) for sampling: deterministic top-k children would break exactness under sampling.
"""

from __future__ import annotations

import torch
from torch import Tensor

from boosttune.serving.tree import TokenTree


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
