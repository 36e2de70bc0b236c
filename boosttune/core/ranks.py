"""Where a true token ranks among a drafter's guesses: the quantity every replay and label is built on."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

NOT_DRAFTABLE = int(np.iinfo(np.int64).max)
"""The rank of a token no tree width reaches (outside the draft vocabulary, or nothing to draft from)."""


def token_ranks(hidden: Tensor, weight: Tensor, rows: Tensor | None, truth: Tensor) -> Tensor:
    """(n,) rank of each ``truth`` token (0: the argmax) among the logits ``hidden @ weight[rows].T``,
    on the CPU; ``NOT_DRAFTABLE`` where it is not among ``rows`` (None: every row of ``weight``) or
    past ``weight``'s rows.

    Args:
        hidden: (n, H) last hidden states.
        weight: (V, H) the LM head.
        rows: (K,) token ids the logits cover (a draft vocabulary), or None.
        truth: (n,) the tokens to rank.
    """
    dev = weight.device
    w = weight if rows is None else weight[rows.to(dev)]
    logits = hidden.float() @ w.float().T  # (n, K)
    truth = truth.to(dev)
    if rows is None:
        inside = truth < weight.shape[0]
        col = truth.clamp(max=weight.shape[0] - 1)
    else:
        where = torch.full((weight.shape[0],), -1, dtype=torch.long, device=dev)
        where[rows.to(dev)] = torch.arange(rows.numel(), device=dev)
        col = where[truth.clamp(max=weight.shape[0] - 1)]
        inside = (col >= 0) & (truth < weight.shape[0])
        col = col.clamp(min=0)
    ranks = (logits > logits.gather(1, col[:, None])).sum(dim=1)
    return torch.where(inside, ranks, torch.full_like(ranks, NOT_DRAFTABLE)).cpu()
