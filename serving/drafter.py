"""Drafters: anything that proposes a token tree for the committed text, through one interface.

Shape legend: T committed tokens (P of them the prompt's, O generated), F frontier nodes, W children
per node, V vocabulary, K draft vocabulary, N nodes.

A drafter is told its tree with every ``draft`` call (``TreeConfig``: the engine's plan decides it
per request) and keeps no configuration of its own. ``replay`` answers, for a finished greedy
request, what its tree would have had accepted by a step starting at every output position: the
full-information labels the learned scheduler is trained on (``scheduler/offline/labels.py``).
Whether a drafter reads the LLM's features is part of the interface (``observes_features``), so the
engine and the labels never ask what kind of drafter they hold; kinds themselves are named and built in
one registry (``serving/kinds.py``).

An SSM drafter keeps its own KV cache. Its cache layout during a step is
``[committed tokens (T)] [draft nodes it fed, in feed order]``; every node of one depth is fed in
one forward with a tree mask (the same tree attention as the LLM's verification). After the
verification, ``accept`` keeps the accepted nodes it had fed (gathered into place after the
committed tokens) and drops the rest; what it lacks (nodes other SSMs proposed, the bonus token)
is fed at the start of the next ``draft``. The committed prefix is never re-run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from boosttune.core.ranks import token_ranks
from boosttune.serving.builders import TreeGrowth
from boosttune.serving.draft_vocab import head_ids
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams, logits_to_probs
from boosttune.serving.tree import TokenTree, TreeConfig


@dataclass(frozen=True)
class Replay:
    """What a drafter alone would have had accepted on a finished greedy request of O output tokens.

    Attributes:
        accepted: (O,) draft tokens a step starting at output position t would have had accepted
            from this drafter's tree (the bonus token not counted).
        ngram: (O,) prompt lookup's matched n-gram length at t (0: no match); None for drafters
            whose draft does not depend on a match.
        chain: (O,) tokens prompt lookup's chain holds at t; None likewise.
        branch: (O, 3) prompt lookup's phrase-table branch at t (``lookup.lookup_positions``): its
            tokens the LLM would have accepted, its length, and the prefix it shares with the chain
            of ``chain[t]`` tokens; None without a table.
    """

    accepted: np.ndarray
    ngram: np.ndarray | None = None
    chain: np.ndarray | None = None
    branch: np.ndarray | None = None


Features = Callable[[], Tensor]
"""On demand, the LLM's (T - 1, H) last hidden states over a finished request's prompt and output
(every position but the last): what a replay of a drafter that observes features reads. The labels
compute them with one LLM forward, and only when a drafter calls for them."""


class Drafter(Protocol):
    """Proposes a tree rooted at the last committed token, then learns which path was accepted."""

    def reset(self) -> None:
        """Forget the previous request (caches)."""
        ...

    def spawn(self, memo: dict[int, object]) -> Drafter:
        """A drafter of the same weights with state of its own, for another request decoded at the
        same time (``serving/batch.py``); drafters that share state (a stacked group) share one
        copy of it through ``memo``, which one set of spawns passes to every drafter."""
        ...

    def observes_features(self) -> bool:
        """Whether this drafter reads the LLM's last hidden states: the engine then runs the prefill
        through the hidden-state path and hands it every committed position's features (``observe``)."""
        ...

    def observe(self, features: Tensor) -> None:
        """The LLM's (n, H) features of the next n committed positions (only called on drafters whose
        ``observes_features`` is True); (n, 3 H) layer inputs for a drafter whose ``feature_layers``
        names three layers."""
        ...

    def feature_layers(self) -> tuple[int, ...]:
        """The LLM layers whose inputs this drafter reads instead of the last hidden states (an EAGLE-3
        head's three); () for the last hidden states (or none, without ``observes_features``)."""
        ...

    def draft(
        self, committed: Tensor, tree: TreeConfig, sampling: SamplingParams, generator: torch.Generator | None
    ) -> TokenTree:
        """Tree of shape ``tree`` for the (T,) committed tokens; its root is ``committed[-1]``.
        Node proposers are 0 (``merge_trees`` numbers the drafters of a step)."""
        ...

    def accept(self, accepted: list[int]) -> None:
        """``accepted``: this drafter's node indices on the accepted path, from the root down,
        stopping where the accepted path leaves this drafter's tree."""
        ...

    def replay(self, prompt: Sequence[int], out: Sequence[int], tree: TreeConfig, features: Features) -> Replay:
        """Per output position of a finished greedy request (``prompt`` then ``out``), what a step
        starting there would have had accepted from a tree of shape ``tree``; ``features`` gives the
        LLM's features over the request, for drafters that read them."""
        ...


def draft_probs(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """(R, V) SSM logits → the (R, V) distribution a tree is drafted from.

    Sampling: the processed distribution the children are drawn from (stochastic verification needs
    exactly that q). Greedy: the SSM's plain softmax. Greedy verification reads no q, and the
    processed greedy distribution is one-hot, whose top-w for w > 1 would be the argmax plus w - 1
    arbitrary zero-probability tokens and whose cumulative probabilities (``min_prob``, the dynamic
    tree's ranking) would be all 0 or 1; the softmax ranks the SSM's real next-best guesses.
    """
    if sampling.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return logits_to_probs(logits, sampling)


def greedy_vocab(head_ids: Tensor | None, vocab_size: int | None) -> Tensor | None:
    """The (K,) draft vocabulary whose logits alone a greedy tree ranks, or None (rank all V): a cut head's
    ids where they are all tokens of the LLM's ``vocab_size``. The other V - K logits are -inf (q = 0), so the
    children and their q are the same; ranking 8,192 instead of 49,152 took a head's softmax and top-k from
    0.25 to 0.10 ms a step (AMX Xeon, bf16). Sampling keeps all V: stochastic verification reads q there."""
    if head_ids is None or (vocab_size is not None and int(head_ids.max()) >= vocab_size):
        return None
    return head_ids


class SSMDrafter:
    """A small causal LM that drafts a tree depth by depth (one forward per depth)."""

    def __init__(self, runner: ModelRunner, vocab_size: int | None = None, ranking: Tensor | None = None):
        """``vocab_size``: the LLM's logit width V; an SSM with embedding rows padded differently
        has its logits cut or padded (with -inf, q = 0) to V so p and q share one support.
        ``ranking``: the draft vocabulary ranking, used by trees with ``draft_vocab`` > 0."""
        self.runner = runner
        self.ranking = ranking
        self._head_k = 0  # draft vocabulary size the runner's head is cut to (0: whole); a cache
        self._greedy_ids: Tensor | None = None  # ``greedy_vocab`` of the runner's cut head
        self.vocab_size = vocab_size
        self._synced = 0  # committed tokens whose KV entries sit at the start of the cache
        self._committed_len = 0  # committed length at the last draft
        self._slots: Tensor = torch.zeros(0, dtype=torch.long)  # (N,) cache offset of each node, -1 unfed

    def reset(self) -> None:
        self.runner.reset()
        self._synced = 0

    def spawn(self, memo: dict[int, object]) -> SSMDrafter:
        other = copy.copy(self)
        other.runner = self.runner.spawn()
        other.reset()
        return other

    def observes_features(self) -> bool:
        return False

    def observe(self, features: Tensor) -> None:
        raise TypeError(f"{type(self).__name__} does not read the LLM's features")

    def feature_layers(self) -> tuple[int, ...]:
        return ()

    def _head(self, k: int) -> Tensor | None:
        """(K,) token ids of a draft vocabulary of ``k`` tokens (None for 0: the whole vocabulary)."""
        if not k:
            return None
        if self.ranking is None:
            raise ValueError(f"tree draft_vocab={k} needs the draft vocabulary ranking (draft_vocab.json); "
                             "none was given to this SSM drafter")
        return head_ids(self.ranking, k, self.runner.model.get_output_embeddings().weight.shape[0])

    def _sync_head(self, k: int) -> None:
        """Cut the runner's LM head to a draft vocabulary of ``k`` tokens (on a change only)."""
        if k != self._head_k:
            self.runner.restrict_head(self._head(k))
            self._head_k = k
            self._greedy_ids = greedy_vocab(self.runner.head_ids, self.vocab_size)

    def prepare(self, tree: TreeConfig) -> None:
        """Make ready to draft ``tree``s: the LM head cut to its draft vocabulary now, not at the first
        draft, so that a forward compiled after this one is built for that head."""
        self._sync_head(tree.draft_vocab)

    def _catch_up(self, committed: Tensor) -> Tensor:
        """Feed the committed tokens the cache lacks; returns (V,) logits after the last one."""
        self.runner.crop(self._synced)
        logits = self.runner.forward_chain(committed[self._synced :].to(self.runner.device))
        self._synced = committed.shape[0]
        return self._fit(logits[-1])

    def _fit(self, logits: Tensor) -> Tensor:
        """(..., V_ssm) logits → (..., V) in the LLM's vocabulary width."""
        v = self.vocab_size
        if v is None or logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:
            return logits[..., :v]
        pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    @torch.inference_mode()
    def draft(
        self, committed: Tensor, tree: TreeConfig, sampling: SamplingParams, generator: torch.Generator | None
    ) -> TokenTree:
        cfg = tree  # the tree's shape
        greedy = sampling.greedy
        t = committed.shape[0]
        self._committed_len = t
        self._sync_head(cfg.draft_vocab)
        ids = self._greedy_ids if greedy else None

        def probs(logits: Tensor) -> Tensor:
            """(F, V_ssm) logits → (F, V) q, or (F, K) over the draft vocabulary ``ids`` (greedy)."""
            return draft_probs(self._fit(logits) if ids is None else logits.index_select(-1, ids), sampling)

        growth = TreeGrowth(cfg, greedy, probs(self._catch_up(committed).unsqueeze(0)), ids)  # q: (1, V) or (1, K)
        fed = 0  # nodes fed after the committed tokens, in cache order
        for d in range(cfg.max_depth):
            nodes = growth.expand(d, generator)  # (F',) to feed, or None: the tree is done
            if nodes is None:
                break
            # they see the committed prefix, their fed ancestors and themselves
            mask = growth.feed_mask(nodes, fed, nodes.numel())  # (F', fed + F')
            logits = self._feed_nodes(nodes, growth.tokens_of(nodes), growth.parents_of(nodes), d + 1, t, mask)
            growth.fed(nodes, fed, probs(logits))  # (F', V) or (F', K)
            fed += nodes.numel()
        drafted, self._slots = growth.finish()
        return drafted

    def _feed_nodes(self, nodes: Tensor, tokens: Tensor, parents: Tensor, depth: int, t: int, mask: Tensor) -> Tensor:
        """Feed the (F',) new ``nodes`` (all at ``depth``; their ``tokens`` and ``parents``, each (F',))
        after the ``t`` committed tokens and the nodes fed before them, with ``mask`` (F', fed + F');
        returns their (F', V_ssm) logits."""
        pos = (t - 1 + depth) + torch.zeros(1, tokens.numel(), dtype=torch.long)
        return self.runner.forward(tokens.unsqueeze(0), pos, t, mask)

    def accept(self, accepted: list[int]) -> None:
        keep = []
        for node in accepted:
            slot = int(self._slots[node])
            if slot < 0:
                break
            keep.append(slot)
        self.runner.keep(self._committed_len, torch.tensor(keep, dtype=torch.long))
        self._synced = self._committed_len + len(keep)

    def replay(self, prompt: Sequence[int], out: Sequence[int], tree: TreeConfig, features: Features | None = None) -> Replay:
        """The tree's node on the true path at level l expands the SSM's top ``w_l`` tokens after the
        true prefix, so the tree holds the true continuation to depth d iff each of its first d tokens
        ranks high enough (``TreePolicy.accepts``); one teacher-forced forward over ``prompt + out``
        gives every rank at once. This matches the engine up to rounding: the engine drafts with a KV
        cache in the SSM's dtype, which can order near-tied logits differently."""
        ranks = draft_ranks(self.runner.model, prompt, out, self._head(tree.draft_vocab))
        return Replay(tree.policy.accepts(tree, ranks))


@torch.inference_mode()
def draft_ranks(model, prompt: Sequence[int], out: Sequence[int], head: Tensor | None = None) -> np.ndarray:
    """(O,) rank of each output token among the SSM's logits after the true prefix (0: its argmax).

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
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, p - 1 :]  # (O, H)
    return token_ranks(hidden, weight, head, torch.tensor(out, dtype=torch.long)).numpy()
