"""Stochastic tree verification leaves the LLM's distribution unchanged (with negative controls).

The distribution test drafts a small two-level tree afresh in every trial (two proposers at the
root, one of them drawing two children without replacement; all trials' drafts are drawn at once),
verifies each against a fixed target p over 2-token sequences, completes the output to exactly two
tokens and compares the empirical distribution with p(x1) p(x2 | x1) by a chi-square goodness-of-fit
test. Three wrong procedures must fail the same test.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare
from torch import Tensor

from boosttune.serving.tree import TokenTree
from boosttune.serving.verify_stochastic import stochastic_verify

V = 6
TRIALS = 20_000
# The negative controls' trials: a chi-square test's power against a fixed wrong distribution only grows
# with the sample size, so a control that fails at 5,000 (p < 1e-40 for the closest, no_q_update, over
# seeds 7-9) would fail the 20,000-trial test too.
NEGATIVE_TRIALS = 5_000

# The tree drafted in every trial: (parent, proposer, slot). Nodes with the same parent and the same
# slot share one q row and are sequential draws without replacement, in index order. Slots: "root0",
# "root1" are proposer 0/1 at the root; "cond0"/"cond1" are proposer 0/1's conditional q given the
# parent's token. Node 1 (proposer 1) sits between proposer 0's two root draws on purpose.
LAYOUT: list[tuple[int, int, str]] = [
    (-1, 0, "root0"),  # node 0
    (-1, 1, "root1"),  # node 1 (leaf)
    (-1, 0, "root0"),  # node 2: proposer 0's second draw, without replacement
    (0, 0, "cond0"),  # node 3
    (0, 0, "cond0"),  # node 4: without replacement after node 3
    (0, 1, "cond1"),  # node 5: independent of nodes 3 and 4
    (2, 1, "cond1"),  # node 6
]


def _norm(t: Tensor) -> Tensor:
    return t / t.sum(-1, keepdim=True)


def _tables(concentrated: bool) -> dict[str, Tensor]:
    """Target p (root row, conditional rows) and the proposers' q tables, all float32.

    Zeros on purpose: p_root(5) = 0 and p(4 | x1) = 0 for x1 in {0, 2, 4} while the q's put mass
    there; proposer 0's q is 0 where p > 0 (token 0 at the root, token 2 below). ``concentrated`` makes proposer 0 put 0.9 on one token so that forgetting the
    without-replacement update changes the result a lot.
    """
    g = torch.Generator().manual_seed(1234)
    p_root = torch.rand(V, generator=g) + 0.2
    p_root[5] = 0.0
    p_root = _norm(p_root)
    p_cond = _norm(torch.rand(V, V, generator=g) ** 2 + 0.05)  # (V, V): p(x2 | x1)
    p_cond[:, 4] *= torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # p = 0 where q > 0, for some x1
    p_cond = _norm(p_cond)
    if concentrated:
        q0_root = _norm(torch.tensor([0.0, 0.9, 0.04, 0.03, 0.02, 0.01]))
    else:
        q0_root = _norm(torch.tensor([0.0, 0.3, 0.1, 0.2, 0.15, 0.25]))  # q = 0 at token 0, p > 0
    q1_root = _norm(torch.tensor([0.4, 0.05, 0.25, 0.1, 0.1, 0.1]))
    q0_cond = _norm(torch.rand(V, V, generator=g) + 0.1)
    q0_cond[:, 2] = 0.0  # q = 0 where p > 0
    q0_cond = _norm(q0_cond)
    q1_cond = _norm(torch.rand(V, V, generator=g) ** 3 + 0.02)
    return {
        "p_root": p_root, "p_cond": p_cond, "root0": q0_root, "root1": q1_root,
        "cond0": q0_cond, "cond1": q1_cond,
    }


def _draw_all(tables: dict[str, Tensor], n: int, generator: torch.Generator, top_k: bool) -> tuple[Tensor, Tensor]:
    """The LAYOUT tree's tokens for ``n`` trials at once: (n, N) tokens and (n, M, V) q rows.

    A row's later draws exclude its earlier ones. Sampled: the Gumbel-top-k trick (the tokens of
    log q + Gumbel noise in descending order are sequential draws from q without replacement;
    Vieira 2014, Kool et al. 2019, arXiv 1903.06059), so every trial's row is perturbed once and each
    draw takes the largest key left. Top-k: the keys are q itself (the next-best token).
    """
    keys: dict[tuple[int, str], Tensor] = {}  # (parent node, slot) -> (n, V) keys of tokens not drawn yet
    rows: list[Tensor] = []  # (n, V) q per row, in order of first use
    tokens: list[Tensor] = []  # (n,) per node
    every = torch.arange(n)
    for parent, _, slot in LAYOUT:
        if (parent, slot) not in keys:
            q = tables[slot].expand(n, V) if parent < 0 else tables[slot][tokens[parent]]
            rows.append(q)
            if top_k:
                keys[(parent, slot)] = q.clone()
            else:
                gumbel = -torch.log(-torch.log(torch.rand(n, V, generator=generator).clamp_min(1e-12)))
                keys[(parent, slot)] = q.log() + gumbel
        k = keys[(parent, slot)]
        tok = k.argmax(-1)  # (n,)
        k[every, tok] = float("-inf")
        tokens.append(tok)
    return torch.stack(tokens, 1), torch.stack(rows, 1)


_PARENTS = torch.tensor([par for par, _, _ in LAYOUT])
_PROPOSER = torch.tensor([prop for _, prop, _ in LAYOUT])


def _dist_rows() -> Tensor:
    """(N,) the q row of each LAYOUT node (rows numbered in order of first use, as ``_draw_all``'s)."""
    first: dict[tuple[int, str], int] = {}
    return torch.tensor([first.setdefault((par, slot), len(first)) for par, _, slot in LAYOUT])


_DIST_ROW = _dist_rows()


def _tree(tokens: Tensor, q_dists: Tensor) -> TokenTree:
    """One trial's LAYOUT tree from its (N,) tokens and (M, V) q rows."""
    dist_row = _DIST_ROW
    return TokenTree(
        tokens=tokens, parents=_PARENTS, depth=torch.where(_PARENTS < 0, 1, 2), proposer=_PROPOSER,
        q_prob=q_dists[dist_row, tokens], dist_row=dist_row, q_dists=q_dists,
    )


def _p_probs(tables: dict[str, Tensor], tokens: Tensor) -> Tensor:
    """(n, N + 1, V): p at the root, p(. | x1) at depth-1 nodes; rows at depth 2 only feed a 3rd
    token (ignored)."""
    n = tokens.shape[0]
    deep = torch.full((V,), 1.0 / V)
    p_nodes = torch.where((_PARENTS < 0)[None, :, None], tables["p_cond"][tokens], deep)  # (n, N, V)
    return torch.cat([tables["p_root"].expand(n, 1, V), p_nodes], 1)


Verifier = Callable[[TokenTree, Tensor, torch.Generator], tuple[list[int], int]]


def _accept_always(tree: TokenTree, p_probs: Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """Wrong: follow the first child at every level, bonus from p at the leaf."""
    path, node = [], -1
    parents = tree.parents.tolist()
    while True:
        kids = [i for i, par in enumerate(parents) if par == node]
        if not kids:
            break
        node = kids[0]
        path.append(node)
    return path, int(torch.multinomial(p_probs[node + 1], 1, generator=generator))


def _no_q_update(tree: TokenTree, p_probs: Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """Wrong: treats proposer 0's siblings as if drawn with replacement."""
    return stochastic_verify(tree, p_probs, generator, _update_q=False)


def _two_token_counts(concentrated: bool, verifier: Verifier, top_k: bool, seed: int, trials: int = TRIALS) -> Tensor:
    """(V, V) counts of the first two output tokens over ``trials`` fresh drafts."""
    tables = _tables(concentrated)
    g = torch.Generator().manual_seed(seed)
    tokens, q_rows = _draw_all(tables, trials, g, top_k)  # drafting, batched; verification one tree at a time
    p_probs = _p_probs(tables, tokens)
    first, second = torch.zeros(trials, dtype=torch.long), torch.full((trials,), -1)
    for i in range(trials):
        path, bonus = verifier(_tree(tokens[i], q_rows[i]), p_probs[i], g)
        out = [int(tokens[i, j]) for j in path] + [bonus]
        first[i] = out[0]
        if len(out) > 1:
            second[i] = out[1]
    rejected = second < 0  # rejected at the root: the 2nd token comes straight from p(. | x1)
    if bool(rejected.any()):
        second[rejected] = torch.multinomial(tables["p_cond"][first[rejected]], 1, generator=g).squeeze(-1)
    return torch.bincount(first * V + second, minlength=V * V).reshape(V, V)


def _gof_pvalue(counts: Tensor, probs: Tensor) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are merged. 0 on impossible outcomes."""
    obs, prob = counts.flatten().double(), probs.flatten().double()
    if bool((obs[prob == 0] > 0).any()):
        return 0.0
    keep = prob > 0
    obs, exp = obs[keep], prob[keep] / prob[keep].sum() * obs.sum()
    order = exp.argsort()  # ascending: merge the small cells (and more if needed) into one
    obs, exp = obs[order], exp[order]
    k = int((exp < 5).sum())
    while 0 < k < len(exp) and exp[:k].sum() < 5:
        k += 1
    if k > 1:
        obs = torch.cat([obs[:k].sum(0, keepdim=True), obs[k:]])
        exp = torch.cat([exp[:k].sum(0, keepdim=True), exp[k:]])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def _target(concentrated: bool) -> Tensor:
    t = _tables(concentrated)
    return t["p_root"].unsqueeze(-1) * t["p_cond"]  # (V, V): p(x1) p(x2 | x1)


@pytest.mark.parametrize("concentrated", [False, True])
def test_stochastic_verify_is_exact(concentrated: bool) -> None:
    counts = _two_token_counts(concentrated, stochastic_verify, top_k=False, seed=7)
    assert _gof_pvalue(counts, _target(concentrated)) > 1e-3


@pytest.mark.parametrize(
    ("name", "verifier", "top_k", "concentrated"),
    [
        ("accept_always", _accept_always, False, False),
        ("no_q_update", _no_q_update, False, True),
        ("top_k_children", stochastic_verify, True, False),
    ],
)
def test_negative_controls_fail(name: str, verifier: Verifier, top_k: bool, concentrated: bool) -> None:
    counts = _two_token_counts(concentrated, verifier, top_k=top_k, seed=7, trials=NEGATIVE_TRIALS)
    assert _gof_pvalue(counts, _target(concentrated)) < 1e-6, name


# ---- deterministic unit cases ------------------------------------------------------------------------


def _one_level(tokens: list[int], proposer: list[int], dist_row: list[int], q_dists: Tensor) -> TokenTree:
    """A tree whose nodes are all children of the root."""
    t = torch.tensor(tokens)
    dr = torch.tensor(dist_row)
    return TokenTree(
        tokens=t, parents=torch.full_like(t, -1), depth=torch.ones_like(t), proposer=torch.tensor(proposer),
        q_prob=q_dists[dr, t], dist_row=dr, q_dists=q_dists,
    )


def test_p_equal_q_is_always_accepted() -> None:
    p = _norm(torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0]))
    p_probs = torch.stack([p, p])
    g = torch.Generator().manual_seed(0)
    for tok in (0, 1, 2, 3):
        tree = _one_level([tok], [0], [0], p.unsqueeze(0))
        for _ in range(50):
            path, bonus = stochastic_verify(tree, p_probs, g)
            assert path == [0] and p[bonus] > 0


def test_token_with_zero_p_is_never_accepted() -> None:
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([[0.1, 0.1, 0.8, 0.0], [0.0, 0.0, 0.5, 0.5]])
    tree = _one_level([2, 3, 2], [0, 1, 0], [0, 1, 0], q)  # node 2 repeats token 2: impossible draw, skipped
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        path, bonus = stochastic_verify(tree, torch.stack([p, p, p, p]), g)
        assert path == [] and bonus in (0, 1)


def test_bonus_avoids_rejected_tokens() -> None:
    # q = one-hot on 0: accept w.p. 1/2; the residual max(0, p - q) is all on token 1
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]])
    tree = _one_level([0], [0], [0], q)
    g = torch.Generator().manual_seed(2)
    outcomes = set()
    for _ in range(200):
        path, bonus = stochastic_verify(tree, torch.stack([p, p]), g)
        outcomes.add((tuple(path), bonus if not path else None))
        if not path:
            assert bonus == 1
    assert outcomes == {((0,), None), ((), 1)}  # both branches were exercised


def test_exhausted_proposer_and_residuals_stay_finite() -> None:
    # proposer 0's q is one-hot: its second sibling cannot exist and is skipped; proposer 1 then
    # sees the residual p; after rejecting 0 and 1 (both possible) only token 2 is left
    p = torch.tensor([0.4, 0.3, 0.3, 0.0])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    tree = _one_level([0, 3, 1], [0, 0, 1], [0, 0, 1], q)
    g = torch.Generator().manual_seed(3)
    seen = set()
    for _ in range(300):
        path, bonus = stochastic_verify(tree, torch.stack([p] * 4), g)
        assert path in ([], [0], [2])
        if not path:
            assert bonus == 2
        seen.add(tuple(path))
    assert seen == {(), (0,), (2,)}


def test_full_path_accepted_when_drafts_match_a_one_hot_p() -> None:
    # a chain 3 -> 1 -> 4 and a distractor sibling; p is one-hot along the chain, then on 0
    eye = torch.eye(V)
    q_dists = torch.stack([_norm(torch.ones(V))] * 3)
    tree = TokenTree(
        tokens=torch.tensor([2, 3, 1, 4]), parents=torch.tensor([-1, -1, 1, 2]), depth=torch.tensor([1, 1, 2, 3]),
        proposer=torch.zeros(4, dtype=torch.long), q_prob=torch.full((4,), 1.0 / V),
        dist_row=torch.tensor([0, 0, 1, 2]), q_dists=q_dists,
    )
    p_probs = torch.stack([eye[3], eye[0], eye[1], eye[4], eye[0]])  # (N+1, V)
    path, bonus = stochastic_verify(tree, p_probs, torch.Generator().manual_seed(4))
    assert path == [1, 2, 3] and bonus == 0


def test_empty_tree_samples_the_root_distribution() -> None:
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert stochastic_verify(TokenTree.empty(), p, torch.Generator().manual_seed(5)) == ([], 2)


@pytest.mark.parametrize("top_p", [1e-154, 1e-50, 1e-9])
def test_a_vanishing_top_p_keeps_the_likeliest_token(top_p):
    """top_p below fp32's range once dropped every token (NaN probabilities, a 500 in the server)."""
    from boosttune.serving.sampling import SamplingParams, logits_to_probs

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7, top_p=top_p))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
