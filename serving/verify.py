"""Greedy tree verification: a short pure function.

Shape legend: N tree nodes, V vocabulary. Row 0 of the LLM's logits is the root (the pending
token), row i + 1 is node i.

A node is accepted iff its token equals the LLM's argmax after its parent and the same holds for
all its ancestors; the deepest accepted node ends the committed path, and the LLM's argmax after it
is the bonus token. Every committed token is therefore the argmax after the tokens before it,
which is exactly what incremental greedy decoding produces.
"""

from __future__ import annotations

import torch
from torch import Tensor

from boosttune.serving.sampling import greedy_tokens
from boosttune.serving.tree import TokenTree, path_to


def _targets(tree: TokenTree, p_logits: Tensor) -> Tensor:
    """(N + 1,) LLM argmax on the tree's device: the topology stays where the tree was built
    (the host), only N + 1 ids cross over (no copy when both are on the CPU)."""
    return greedy_tokens(p_logits).to(tree.tokens.device)


def greedy_verify(tree: TokenTree, p_logits: Tensor) -> tuple[list[int], int]:
    """(N + 1, V) LLM logits → (accepted node indices from the root down, bonus token)."""
    assert p_logits.shape[0] == tree.size + 1, "p_logits needs one row for the root and one per node"
    target = _targets(tree, p_logits)  # (N + 1,)
    if tree.size == 0:
        return [], int(target[0])
    correct = tree.tokens == target[tree.parents + 1]  # (N,)
    ok = ~(tree.ancestor_mask() & ~correct.unsqueeze(0)).any(dim=1)  # (N,) whole path correct
    score = torch.where(ok, tree.depth, torch.zeros_like(tree.depth))
    deepest = int(score.argmax())  # host sync: once per step
    if not bool(ok[deepest]):
        return [], int(target[0])
    return path_to(tree.parents, deepest), int(target[deepest + 1])


def greedy_branch_accepts(tree: TokenTree, p_logits: Tensor, maps: list[Tensor]) -> list[int]:
    """Per drafter, the draft tokens greedy verification would accept from its branch alone.

    ``maps[j]`` (N_j,) holds the merged index of each of drafter j's nodes (``merge_trees``). A
    merged node's verdict depends only on its path, so drafter j's branch alone accepts the deepest
    of its own nodes whose whole path is correct; the merged tree accepts the maximum over drafters
    (greedy trees share common prefixes, so the correct path is unique). Full-information labels
    for the scheduler: one verification scores every drafter's branch at once.
    """
    if tree.size == 0:
        return [0] * len(maps)
    target = _targets(tree, p_logits)  # (N + 1,)
    correct = tree.tokens == target[tree.parents + 1]  # (N,)
    ok = ~(tree.ancestor_mask() & ~correct.unsqueeze(0)).any(dim=1)  # (N,) whole path correct
    score = torch.where(ok, tree.depth, torch.zeros_like(tree.depth))  # (N,)
    return [int(score[m].max()) if m.numel() else 0 for m in maps]
