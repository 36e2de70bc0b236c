"""Stochastic (temperature > 0) verification of a token tree: multi-draft speculative sampling.

Shape legend: N tree nodes (the root is implicit), V vocabulary, M draft distributions.
p is the LLM (target) distribution and q an SSM (draft) distribution; both are the *processed*
distributions of ``serving.sampling.logits_to_probs``.

The procedure is SpecInfer's multi-step speculative sampling (arXiv 2305.09781, §4.2) with the
without-replacement correction of Sequoia (arXiv 2402.12374, §3.2): at a node, the children are
tried in index order; child x (proposer j) is accepted with probability min(1, p(x) / q_j(x)); on
rejection p ← norm(max(0, p − q_j)) and x is removed from q_j (q_j renormalised), because j's
next sibling was drawn from q_j without x. If every child is rejected, the bonus token is drawn
from the residual p. The code is ours; only the algorithm follows the papers.

Why the output is distributed exactly as p (the LLM sampling one token after another)
--------------------------------------------------------------------------------------
1. One-draft lemma. Let x ~ q, accept x with probability min(1, p(x)/q(x)), otherwise output
   y ~ r = norm(max(0, p − q)). Then P(out = y) = min(q(y), p(y)) + β·r(y) with rejection mass
   β = Σ_x max(0, q(x) − p(x)) = Σ_x max(0, p(x) − q(x)), so β·r(y) = max(0, p(y) − q(y)) and
   P(out = y) = min(q, p)(y) + max(0, p − q)(y) = p(y). The lemma needs only that, *given the
   rejection and the rejected x*, the fallback output is distributed as r: any procedure with
   that property may replace "draw from r".
2. Several siblings, by induction on the number k of children left. With k = 0 we draw from the
   current p: exact. With k ≥ 1, let x₁ be the next child and q₁ its distribution *conditioned on
   everything drawn before it* (for the first draw of a proposer its row; for a later draw of the
   same proposer the row with the earlier draws removed and renormalised — that is what sampling
   without replacement means). If x₁ is rejected, the remaining k − 1 children are, conditionally
   on the history including x₁, again draws with known conditional distributions (independent
   proposers are unaffected by x₁; proposer j's later draws follow q_j with x₁ removed), and p
   has become r = norm(max(0, p − q₁)), which does not depend on x₁. By induction the rest of
   the procedure outputs a token distributed as r given the history; the lemma then gives p.
3. Why without replacement needs the q update. Step 2 requires the ratio and the residual to use
   the draft's true conditional distribution. A second draw of proposer j given x₁ is drawn from
   q_j' = norm(q_j with x₁ zeroed), not q_j: using q_j underestimates q(x₂) by the factor
   1 − q_j(x₁), accepts x₂ too often and breaks the lemma (a negative control in the tests).
   (Sequoia's observation: a rejected x₁ has p(x₁) < q_j(x₁), so the residual puts no mass on x₁
   either and later draws of x₁ would be wasted: without replacement is also more efficient.)
4. Accepting a child = committing one token drawn from p; what happens below it is a fresh
   instance. The children of an accepted node x were drawn from the proposers' distributions at
   x, after x was fixed, independently of the acceptance coins; conditioned on the whole history
   they are draws with known distributions, so the same argument verifies the next token against
   p(· | prefix, x) (row x + 1 of ``p_probs``). Chaining over depths gives the joint
   distribution of the committed sequence, bonus token included.
5. Why deterministic top-k children break it. The lemma needs x to be *random* with law q. If x
   is the argmax of q, the output is x with probability min(1, p(x)/q(x)) ≠ p(x) in general
   (with p = q it is always x, but p(x) < 1). Greedy (top-k) children are only right for greedy
   decoding. The same goes for pruning siblings by their sampled values after drawing (EAGLE-2's
   final re-rank): a node's existence must not depend on its own token. How many children a
   node gets may depend on anything drawn before those children (ancestors, other branches).

Numerical edges (no NaN): if max(0, p − q_j) sums to less than ``_RESIDUAL_EPS`` the rejection
had at most that probability (β above) and p is kept unchanged, an error of at most β in total
variation. A child whose token has no mass left in its proposer's q (it could not have been
drawn, e.g. a later sibling of a proposer whose q is exhausted) is skipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from boosttune.serving.tree import TokenTree

_RESIDUAL_EPS = 1e-6  # a residual with less mass means rejection had probability < this


def stochastic_verify(
    tree: TokenTree, p_probs: Tensor, generator: torch.Generator, *, _update_q: bool = True
) -> tuple[list[int], int]:
    """Accept a path of the tree and draw the bonus token so the output is distributed exactly as p.

    Args:
        tree: the drafted tree; needs ``q_dists`` and ``dist_row >= 0`` for every node, siblings
            drawn by sampling (one proposer's siblings without replacement, in index order).
        p_probs: (N+1, V) the LLM's processed distributions: row 0 at the root, row i+1 at node i.
        generator: the request's random generator, on the device of ``p_probs``.
        _update_q: test hook only. False skips the without-replacement update of q (a wrong
            verifier, used as a negative control).

    Returns:
        (accepted node indices from the root down, bonus token id).
    """
    n = tree.size
    assert p_probs.dim() == 2 and p_probs.shape[0] == n + 1, f"p_probs must be (N+1, V) = ({n + 1}, V)"
    if n == 0:
        return [], int(torch.multinomial(p_probs[0].float(), 1, generator=generator).item())  # host sync
    q_dists = tree.q_dists  # (M, V)
    assert q_dists is not None, "stochastic verification needs the tree's q_dists"
    q_dists = q_dists.to(p_probs.device)  # a drafter may build its q on the host (prompt lookup)
    assert q_dists.shape[-1] == p_probs.shape[-1], "q_dists and p_probs disagree on V"
    # host sync: the topology and one uniform per node (each node is examined at most once)
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    proposer = tree.proposer.tolist()
    dist_row = tree.dist_row.tolist()
    uniforms = torch.rand(n, generator=generator, device=generator.device, dtype=torch.float64).tolist()
    children: list[list[int]] = [[] for _ in range(n + 1)]  # children[u + 1], index order
    for i, par in enumerate(parents):
        children[par + 1].append(i)

    accepted: list[int] = []
    node = -1
    while True:
        p_cur = p_probs[node + 1].float()  # (V,)
        q_cur: dict[tuple[int, int], Tensor] = {}  # (proposer, row) -> unnormalised q, drawn ones zeroed
        next_node = None
        for i in children[node + 1]:
            assert dist_row[i] >= 0, f"node {i} has no q row: stochastic verification needs one"
            key = (proposer[i], dist_row[i])
            q = q_cur.get(key)
            if q is None:
                q = q_dists[dist_row[i]].float()  # (V,)
            x = tokens[i]
            # host sync: one per tried child, sequential by nature
            px, qx, q_mass = torch.stack([p_cur[x], q[x], q.sum()]).tolist()
            if q_mass <= 0.0 or qx <= 0.0:
                continue  # x could not have been drawn from this q (exhausted proposer): skip it
            qx /= q_mass
            if uniforms[i] * qx < px:  # accept with probability min(1, p(x) / q(x))
                next_node = i
                break
            residual = (p_cur - q / q_mass).clamp_min(0.0)  # (V,)
            r_mass = residual.sum()
            # no host sync: keep p when the residual is (numerically) empty
            p_cur = torch.where(r_mass > _RESIDUAL_EPS, residual / r_mass.clamp_min(_RESIDUAL_EPS), p_cur)
            if _update_q:
                q = q.clone()
                q[x] = 0.0  # the next draw of this proposer excluded x (without replacement)
            q_cur[key] = q
        if next_node is None:
            # host sync: the bonus token
            bonus = int(torch.multinomial(p_cur, 1, generator=generator).item())
            return accepted, bonus
        accepted.append(next_node)
        node = next_node
