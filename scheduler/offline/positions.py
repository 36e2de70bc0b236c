"""Position-level labels: what each drafter would have had accepted had a step started at each token.

Shape legend: P prompt tokens, T generated tokens, V vocabulary, K draft vocabulary, W tree depth.

Greedy decoding is lossless, so every policy writes the same T tokens; what differs is where its
steps start. A label per position (not per step of one run) therefore lets ``walk.py`` replay any
policy step by step, including one that changes the tree between steps:

- prompt lookup at position t drafts ``find_match(prompt + out[:t])``; its accepted length is how
  many leading chain tokens equal ``out[t:]`` (exact: the drafter sees exactly that context);
- an SSM's expansion tree (widths w_1..w_W, ``builders.py``) contains the true continuation to
  depth d iff, for every level l <= d, ``out[t + l - 1]`` is among the SSM's top ``w_l`` tokens
  after ``prompt + out[:t + l - 1]`` (the tree's node on the true path expands its top ``w_l``).
  One teacher-forced forward of the SSM over ``prompt + out`` gives every such rank at once. This
  matches the engine up to rounding: the engine drafts with a KV cache in the SSM's dtype, which
  can order near-tied logits differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from boosttune.serving.lookup import find_match

NOT_DRAFTABLE = np.iinfo(np.int64).max
"""The rank of a token outside the draft vocabulary: no tree width reaches it."""


def lookup_positions(
    prompt: Sequence[int], out: Sequence[int], depth: int, max_ngram: int = 3, min_ngram: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt lookup at every output position, chains of up to ``depth`` tokens.

    Returns:
        accepted: (T,) leading chain tokens equal to the output from t on.
        ngram: (T,) length of the matched n-gram (0: no match, no draft).
        chain: (T,) tokens the chain holds (0 when no match).
    """
    ctx = np.asarray([*prompt, *out], dtype=np.int64)
    p, t_out = len(prompt), len(out)
    accepted, ngram, chain = (np.zeros(t_out, dtype=np.int64) for _ in range(3))
    for t in range(t_out):
        n, draft = find_match(ctx[: p + t], depth, max_ngram, min_ngram)
        truth = ctx[p + t : p + t + draft.shape[0]]
        same = draft[: truth.shape[0]] == truth
        ngram[t], chain[t] = n, draft.shape[0]
        accepted[t] = same.shape[0] if same.all() else int(np.argmin(same))
    return accepted, ngram, chain


def expansion_accepts(ranks: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """(T,) ranks of the true tokens under an SSM → (T,) levels its expansion tree would accept.

    ``accepted[t]`` is the largest d <= len(widths) with ``ranks[t + l - 1] < widths[l - 1]`` for
    every l <= d (and t + d <= T: the output ends there).
    """
    t_out = ranks.shape[0]
    out = np.zeros(t_out, dtype=np.int64)
    for t in range(t_out):
        d = 0
        while d < len(widths) and t + d < t_out and ranks[t + d] < widths[d]:
            d += 1
        out[t] = d
    return out


@torch.inference_mode()
def draft_ranks(model, prompt: Sequence[int], out: Sequence[int], head: Tensor | None = None) -> np.ndarray:
    """(T,) rank of each output token among the SSM's logits after the true prefix (0: its argmax).

    Args:
        model: the SSM (a causal LM with ``base_model`` and output embeddings).
        prompt: the prompt's token ids (at least one).
        out: the generated token ids.
        head: (K,) the draft vocabulary's token ids (None: the whole vocabulary); tokens outside it
            get ``NOT_DRAFTABLE``.
    """
    p, t_out = len(prompt), len(out)
    if t_out == 0:
        return np.zeros(0, dtype=np.int64)
    weight = model.get_output_embeddings().weight
    ids = torch.tensor([[*prompt, *out[:-1]]], dtype=torch.long, device=weight.device)
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, p - 1 :]  # (T, H)
    rows = weight if head is None else weight[head.to(weight.device)]
    logits = (hidden @ rows.T).float()  # (T, K)
    truth = torch.tensor(out, dtype=torch.long, device=weight.device)
    if head is None:  # an LLM token past the SSM's vocabulary cannot be drafted
        inside = truth < weight.shape[0]
        col = truth.clamp(max=weight.shape[0] - 1)
    else:
        where = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)
        where[head.to(weight.device)] = torch.arange(head.numel(), device=weight.device)
        col = where[truth]
        inside = col >= 0
        col = col.clamp(min=0)
    true_logit = logits.gather(1, col[:, None])  # (T, 1)
    ranks = (logits > true_logit).sum(dim=1).cpu().numpy().astype(np.int64)
    ranks[~inside.cpu().numpy()] = NOT_DRAFTABLE
    return ranks
