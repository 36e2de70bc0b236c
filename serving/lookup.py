"""Prompt lookup: a drafter without a model that copies what followed the last n-gram's earlier use.

Shape legend: T committed tokens, N drafted nodes (a chain), V vocabulary.

When the text being written repeats text already in the context (a passage quoted from the prompt,
a code block being edited, a name or phrase the model has used before), the tokens that followed
the previous occurrence of the newest n tokens are a good guess for what comes next. This was
proposed as "prompt lookup decoding" (A. Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding;
also in HF transformers' assisted generation as ``prompt_lookup_num_tokens``) and earlier as LLMA
(Yang et al., "Inference with Reference", arXiv 2304.04487). It costs microseconds per step, so it
pays whenever the LLM verifies a few extra tokens for about the price of one (bf16 on this CPU:
shared/DESIGN.md), and a scheduler can tell from the prompt when to expect copying.

The draft is a chain (one node per depth) of up to ``max_depth`` tokens of the tree it is given
(``TreeConfig.max_depth``: an expansion tree's widths only set the length here), and in greedy trees
the phrase table's branch beside it (below). Its draft
distribution is one-hot at the proposed token, which the stochastic verifier handles exactly like
any q: a node is accepted with probability p(x), and on rejection the residual is p without x.

Its full-information labels (``replay``, ``lookup_positions``) are exact: at every output position
the drafter would see exactly the prompt and the output before it.

Given the LLM's phrase table (``phrases.py``), greedy trees hold a second branch: up to
``phrases.CHAIN`` tokens the LLM most often writes after the newest two, sharing whatever prefix
they have with the copied chain. Sampling drafts the copied chain alone (its q is one-hot, and a
second deterministic sibling would need the verifier's residual over the first). The replay labels
the branch too (``lookup_positions``), so the scheduler's walk counts what it accepts and the nodes it
adds, for every chain length it tries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from boosttune.serving.drafter import Features, Replay
from boosttune.serving.phrases import CHAIN, PhraseTable
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.tree import TokenTree, TreeConfig

LOOKUP_NAME = "prompt-lookup"
"""How reports, bundles and schedulers name the prompt-lookup drafter."""


def lookup_tree(length: int, ngram_depths: tuple[int, ...] = ()) -> TreeConfig:
    """The tree of a prompt-lookup drafter of chain length ``length`` (per match: ``chain_length``)."""
    if length < 1:
        raise ValueError(f"prompt lookup length must be >= 1, got {length}")
    return TreeConfig(widths=(1,) * length, ngram_depths=ngram_depths)


def find_match(
    context: np.ndarray, length: int, max_ngram: int = 3, min_ngram: int = 1
) -> tuple[int, np.ndarray]:
    """``(n, chain)``: up to ``length`` tokens that followed the latest earlier occurrence of the
    context's last n-gram, and that n (0 and an empty chain when nothing matches).

    Tries n = ``max_ngram`` down to ``min_ngram`` and returns at the first n with a match; among
    matches it takes the latest one that is followed by at least one token.

    Args:
        context: (T,) int token ids, the committed text (its last token is the newest).
        length: most tokens to return.
        max_ngram: longest n-gram of the newest tokens to look for.
        min_ngram: shortest n-gram tried before giving up.
    """
    t = context.shape[0]
    if length <= 0:
        return 0, context[:0]
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        starts = t - n  # candidate starts s in [0, t - n): the n-gram at s is followed by context[s + n]
        hit = np.ones(starts, dtype=bool)
        for i in range(n):  # hit[s] &= context[s + i] == context[t - n + i]
            hit &= context[i : i + starts] == context[t - n + i]
        where = np.flatnonzero(hit)
        if where.size:
            s = int(where[-1])
            return n, context[s + n : s + n + length]
    return 0, context[:0]


def chain_length(ngram: int, depth: int, ngram_depths: tuple[int, ...] = ()) -> int:
    """Tokens to draft after a match of ``ngram`` tokens: ``ngram_depths[ngram - 1]`` (longer
    matches: the last entry) capped at ``depth`` when per-match lengths are set, else ``depth``."""
    if ngram < 1:
        return 0
    if ngram_depths:
        return min(ngram_depths[min(ngram, len(ngram_depths)) - 1], depth)
    return depth


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens the two arrays have in common."""
    n = min(a.shape[0], b.shape[0])
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))


def with_branch(chain: np.ndarray, branch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tree of ``chain`` (a path from the root) plus ``branch``, another path from the root, sharing
    their common prefix: ``(tokens, parents, depth)``, the chain's nodes first, in topological order."""
    n = chain.shape[0]
    same = shared_prefix(chain, branch)
    extra = branch[same:].astype(np.int64)
    k = extra.shape[0]
    parents = np.concatenate([np.arange(-1, n - 1), np.arange(n - 1, n + k - 1)]).astype(np.int64)
    if k:
        parents[n] = same - 1  # the branch leaves after the shared prefix (-1: at the root)
    depth = np.concatenate([np.arange(1, n + 1), np.arange(same + 1, same + k + 1)]).astype(np.int64)
    return np.concatenate([chain.astype(np.int64), extra]), parents, depth


def lookup_positions(
    prompt: Sequence[int], out: Sequence[int], depth: int, max_ngram: int = 3, min_ngram: int = 1,
    phrases: PhraseTable | None = None, phrase_length: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Prompt lookup at every output position, chains of up to ``depth`` tokens, and with ``phrases``
    the table's branch of up to ``phrase_length`` tokens beside each chain (one search per position).

    Returns:
        accepted: (T,) leading chain tokens equal to the output from t on.
        ngram: (T,) length of the matched n-gram (0: no match, no draft).
        chain: (T,) tokens the chain holds (0 when no match).
        branch: (T, 3) per position the branch's leading tokens equal to the output from t on, its
            length, and the prefix it shares with the chain; None without ``phrases``. A chain cut to k
            tokens shares ``min(shared, k)`` of them, so the branch adds ``length - min(shared, k)``
            nodes to a tree of that chain (``with_branch``).
    """
    ctx = np.asarray([*prompt, *out], dtype=np.int64)
    p, t_out = len(prompt), len(out)
    accepted, ngram, chain = (np.zeros(t_out, dtype=np.int64) for _ in range(3))
    branch = np.zeros((t_out, 3), dtype=np.int64) if phrases is not None and phrase_length else None
    for t in range(t_out):
        n, draft = find_match(ctx[: p + t], depth, max_ngram, min_ngram)
        ngram[t], chain[t], accepted[t] = n, draft.shape[0], shared_prefix(draft, ctx[p + t :])
        if branch is not None:
            guess = phrases.chain(ctx[: p + t], phrase_length)  # type: ignore[union-attr]
            branch[t] = shared_prefix(guess, ctx[p + t :]), guess.shape[0], shared_prefix(guess, draft)
    return accepted, ngram, chain, branch


class PromptLookupDrafter:
    """Drafts a chain copied from the committed text (``find_match``), and in greedy trees the phrase
    table's branch beside it (``with_branch``); keeps no state. The chain is
    as long as the tree's depth, or as ``TreeConfig.ngram_depths`` sets for the match's n-gram length
    (a learned scheduler drafts long chains after long matches, short ones after a single token)."""

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, phrases: PhraseTable | None = None,
                 phrase_length: int = CHAIN):
        """``vocab_size``: the LLM's logit width V (the one-hot draft distributions' width);
        ``phrases``: the LLM's phrase table, drafting a second branch of ``phrase_length`` tokens in
        greedy trees (None: the copied chain alone)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if phrases is not None and phrases.vocab_size != vocab_size:
            raise ValueError(f"the phrase table covers {phrases.vocab_size} tokens, the LLM {vocab_size}")
        if phrase_length < 0:
            raise ValueError(f"phrase_length must be >= 0, got {phrase_length}")
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.phrases = phrases
        self.phrase_length = phrase_length

    def reset(self) -> None:
        pass

    def spawn(self, memo: dict[int, object]) -> PromptLookupDrafter:
        return self  # it keeps no state

    def observes_features(self) -> bool:
        return False

    def observe(self, features: Tensor) -> None:
        raise TypeError("prompt lookup does not read the LLM's features")

    def feature_layers(self) -> tuple[int, ...]:
        return ()

    def draft(
        self, committed: Tensor, tree: TreeConfig, sampling: SamplingParams, generator: torch.Generator | None
    ) -> TokenTree:
        ctx = committed.detach().cpu().numpy()
        ngram, chain = find_match(ctx, tree.max_depth, self.max_ngram, self.min_ngram)
        chain = chain[: chain_length(ngram, tree.max_depth, tree.ngram_depths)]
        branch = ctx[:0]
        if sampling.greedy and self.phrases is not None and self.phrase_length:
            branch = self.phrases.chain(ctx, self.phrase_length)
        chain, parents, depth = with_branch(chain, branch)
        n = int(chain.shape[0])
        long = dict(dtype=torch.long)
        q_dists, dist_row = None, torch.full((n,), -1, **long)  # greedy verification reads no q
        if not sampling.greedy:  # one-hot rows, one per node
            q_dists = torch.zeros(n, self.vocab_size, dtype=torch.float32)
            q_dists[torch.arange(n), torch.from_numpy(chain).long()] = 1.0
            dist_row = torch.arange(n, **long)
        return TokenTree(
            tokens=torch.from_numpy(chain),
            parents=torch.from_numpy(parents),
            depth=torch.from_numpy(depth),
            proposer=torch.zeros(n, **long),
            q_prob=torch.ones(n, dtype=torch.float32),
            dist_row=dist_row,
            q_dists=q_dists,
        )

    def accept(self, accepted: list[int]) -> None:
        pass

    def replay(self, prompt: Sequence[int], out: Sequence[int], tree: TreeConfig, features: Features | None = None) -> Replay:
        """Chains of up to the tree's depth at every output position (``lookup_positions``), and the
        phrase table's branch beside them when the drafter has a table; the
        per-match lengths (``ngram_depths``) are left to the replay, which knows each match's length."""
        accepted, ngram, chain, branch = lookup_positions(  # the labels are greedy: the branch is drafted
            prompt, out, tree.max_depth, self.max_ngram, self.min_ngram, self.phrases, self.phrase_length)
        return Replay(accepted, ngram, chain, branch)
