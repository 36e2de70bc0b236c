"""A drafter that reads the LLM's features: a feature head (``boosttune/core/feature_head.py``).

Shape legend: T committed tokens, H the hidden width, N nodes, V vocabulary.

Its cache holds *pairs*: pair j = ``(F_j, token_{j+1})`` at position j, whose output is the head's
prediction of ``F_{j+1}`` and, through the LM head, of ``token_{j+2}``. The engine tells it the LLM's
features of every committed position but the pending one (the prefill's hidden states, then after
each verification those of the pending token and the accepted path: ``observe``), so before a draft
it knows ``F_0 .. F_{T-2}`` and feeds the pairs it lacks; the last pair's output drafts depth 1. A
node at depth d > 1 is fed as the pair (its parent's predicted feature, its token), with the tree
mask of the SSM drafter. Draft nodes never stay in its cache: after the verification their true
features are known, and the next draft feeds the accepted tokens again with those.

Verification is unchanged, so the output stays exactly the LLM's; the LLM's features come out of
the verification forward it runs anyway (its last hidden states), at no extra forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from boosttune.core.feature_head import is_feature_head, pair_inputs, teacher_forced_ranks
from boosttune.serving.drafter import Features, Replay, SSMDrafter
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.tree import TokenTree, TreeConfig


class FeatureDrafter(SSMDrafter):
    """Drafts a tree depth by depth from the LLM's features (one head forward per depth)."""

    def __init__(self, runner: ModelRunner, vocab_size: int | None = None, ranking: Tensor | None = None):
        self._check_model(runner.model)
        super().__init__(runner, vocab_size, ranking)
        width = runner.model.get_input_embeddings().weight.shape[1]
        # the LLM's features of the committed positions, (T - 1, H) in all: chunks as ``observe`` got them,
        # joined when a draft reads them (a batch that takes plain steps observes every step and drafts none)
        self._chunks: list[Tensor] = [torch.zeros(0, width)]
        self._node_hidden: dict[int, Tensor] = {}  # node index (-1: the root) → its predicted feature

    def _check_model(self, model) -> None:
        if not is_feature_head(model):
            raise ValueError("FeatureDrafter needs a feature head (a model loaded with its feature_fc)")

    def _pair(self, features: Tensor, tokens: Tensor) -> Tensor:
        """(n, H) features and the (n,) tokens after them → the (n, H) inputs of the head's pairs."""
        return pair_inputs(self.runner.model, features, tokens)

    def reset(self) -> None:
        super().reset()
        self._chunks = [self._chunks[0][:0]]
        self._node_hidden = {}

    def observes_features(self) -> bool:
        return True

    def observe(self, features: Tensor) -> None:
        """The LLM's (n, H) features of the next n committed positions."""
        self._chunks.append(features.detach().float().cpu())

    @property
    def _features(self) -> Tensor:
        """(T - 1, H) the LLM's features of the committed positions."""
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0]

    def _catch_up(self, committed: Tensor) -> Tensor:
        """Feed the pairs the cache lacks; returns the (V,) logits of the last one (depth 1)."""
        t = committed.shape[0]
        if self._features.shape[0] != t - 1:
            raise RuntimeError(f"feature drafter: the engine gave features of {self._features.shape[0]} positions, "
                               f"{t - 1} committed positions need them")
        start = self._synced
        self.runner.crop(start)
        inputs = self._pair(self._features[start:], committed[start + 1 :])  # (T-1-start, H)
        n = inputs.shape[0]
        assert n > 0, "every step commits a token, so a draft always has a new pair to feed"
        pos = torch.arange(start, start + n).unsqueeze(0)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        logits, hidden = self.runner.forward_hidden(inputs.unsqueeze(0), pos, start, mask)
        self._synced = t - 1
        self._node_hidden = {-1: hidden[-1]}
        return self._fit(logits[-1])

    def _feed_nodes(self, nodes: Tensor, tokens: Tensor, parents: Tensor, depth: int, t: int, mask: Tensor) -> Tensor:
        feats = torch.stack([self._node_hidden[p] for p in parents.tolist()])  # (F', H)
        inputs = self._pair(feats, tokens)
        pos = (t - 2 + depth) + torch.zeros(1, nodes.numel(), dtype=torch.long)
        logits, hidden = self.runner.forward_hidden(inputs.unsqueeze(0), pos, t - 1, mask)
        for i, node in enumerate(nodes.tolist()):
            self._node_hidden[node] = hidden[i]
        return logits

    @torch.inference_mode()
    def draft(
        self, committed: Tensor, tree: TreeConfig, sampling: SamplingParams, generator: torch.Generator | None
    ) -> TokenTree:
        if committed.shape[0] < 2:  # no pair yet: nothing to draft from
            self._slots = torch.zeros(0, dtype=torch.long)
            self._committed_len = committed.shape[0]
            return TokenTree.empty()
        return super().draft(committed, tree, sampling, generator)

    def accept(self, accepted: list[int]) -> None:
        """Drop every draft node: the accepted ones come back with the LLM's own features."""
        self.runner.crop(self._synced)

    def replay(self, prompt: Sequence[int], out: Sequence[int], tree: TreeConfig, features: Features | None = None) -> Replay:
        """What a tree of one or two levels would have had accepted at every output position, from one
        teacher-forced pass of the head over the LLM's ``features`` (its (len(prompt) + len(out) - 1, H)
        last hidden states over prompt and output, computed on demand; the scheduler's labels compute
        them with one LLM forward): depth 1 accepts when the output token ranks below ``widths[0]`` among the head's
        guesses after the true prefix, depth 2 when the next one also ranks below ``widths[1]`` among
        those of the node holding it (``teacher_forced_ranks``). This matches the engine up to rounding,
        as an SSM's replay does."""
        if features is None:
            raise ValueError("a feature head's replay needs the LLM's features over the request (the scheduler's "
                             "labels pass them)")
        if tree.kind != "expansion" or len(tree.widths) > 2:
            raise ValueError(f"a feature head's replay takes expansion trees of one or two levels, got {tree.kind} "
                             f"{list(tree.widths)}; label with scheduler.label_depth <= 2")
        second = len(tree.widths) == 2
        r1, r2 = teacher_forced_ranks(self.runner.model, features().to(self.runner.device, self.runner.model.dtype),
                                      [*prompt, *out], len(prompt), self._head(tree.draft_vocab), second)
        accepted = (r1 < tree.widths[0]).long()
        if r2 is not None:
            accepted += (accepted.bool() & (r2 < tree.widths[1])).long()
        return Replay(accepted.numpy())
