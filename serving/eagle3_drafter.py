"""A drafter that reads three of the LLM's layer inputs: an EAGLE-3 head (``core/eagle3_head.py``).

Shape legend: T committed tokens, H the hidden width, K the head's draft vocabulary, V the LLM's,
N nodes, S cached positions.

It drafts as the feature head does (``feature_drafter.py``), pair by pair: pair j = ``(g_j,
token_{j+1})`` at position j, where ``g_j = fc(aux_j)`` fuses the LLM's three layer inputs at j
(the engine taps them from the verification forward it runs anyway: ``ModelRunner.set_taps``). A
pair's output is the head's *pre-norm state*; its logits guess ``token_{j+2}``, and a node at depth
d > 1 is fed as the pair (its parent's pre-norm state, its token), which is how the head was trained
("training-time test", ``Eagle3Head.unroll``). Its cache holds the committed pairs; draft nodes are
dropped after the verification, and the next draft feeds the accepted tokens again with the LLM's
own states.

The head's logits cover its K draft tokens; they are scattered into the LLM's V (-inf, q = 0,
elsewhere), so greedy and stochastic verification read one support, unchanged: the output stays
exactly the LLM's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from boosttune.core.eagle3_head import Eagle3Head
from boosttune.kernels.tree_attention import full_mask
from boosttune.serving.drafter import Features, Replay
from boosttune.serving.feature_drafter import FeatureDrafter
from boosttune.serving.tree import TreeConfig


class Eagle3Runner:
    """An :class:`Eagle3Head` with a KV cache of its one layer, fed with explicit positions and tree
    masks (the parts of ``ModelRunner`` a feature drafter calls)."""

    def __init__(self, head: Eagle3Head):
        self.model = head
        s = head.spec
        self._g, self._rep, self._c = s.kv_heads, s.heads // s.kv_heads, s.head_dim
        self._keys = self._values = torch.zeros(0)  # (G, capacity, C)
        self._len = 0

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    @property
    def cached_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0

    def crop(self, length: int) -> None:
        self._len = min(self._len, length)

    def spawn(self) -> Eagle3Runner:
        other = copy.copy(self)
        other._keys = other._values = torch.zeros(0)
        other._len = 0
        return other

    def _reserve(self, n: int, like: Tensor) -> None:
        cap = self._keys.shape[1] if self._keys.dim() == 3 else 0
        if n <= cap and self._keys.dtype == like.dtype:
            return
        shape = (self._g, max(n, 2 * cap, 256), self._c)
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if cap:
            keys[:, : self._len], values[:, : self._len] = self._keys[:, : self._len], self._values[:, : self._len]
        self._keys, self._values = keys, values

    @torch.inference_mode()
    def forward_hidden(self, inputs: Tensor, position_ids: Tensor, prefix_len: int, tree_mask: Tensor
                       ) -> tuple[Tensor, Tensor]:
        """Feed (1, n, 2H) pair inputs ``[embed(token), g]`` at (1, n) positions after the cache;
        ``tree_mask`` (n, S - prefix_len) as ``ModelRunner.forward``'s. Returns the (n, V) fp32 logits
        (-inf outside the draft vocabulary) and the (n, H) fp32 pre-norm states."""
        head = self.model
        dtype = head.fc.weight.dtype
        h = head.spec.hidden
        e, g = inputs.to(self.device, dtype).split(h, dim=-1)  # (1, n, H) each
        n, s0 = inputs.shape[1], self._len
        q, k, v = head.qkv_embedded(e, g, position_ids.to(self.device))  # (1, heads, n, C), (1, G, n, C)
        self._reserve(s0 + n, k)
        self._keys[:, s0 : s0 + n], self._values[:, s0 : s0 + n] = k[0], v[0]
        self._len = s = s0 + n
        mask = full_mask(prefix_len, tree_mask.to(self.device), s)  # (n, S)
        keys = self._keys[:, :s].repeat_interleave(self._rep, 0)[None]  # (1, heads, S, C)
        values = self._values[:, :s].repeat_interleave(self._rep, 0)[None]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        prenorm = head.finish(attn, g)[0]  # (n, H)
        small = head.logits(prenorm).float()  # (n, K)
        logits = small.new_full((n, head.spec.vocab), float("-inf"))
        logits[:, head.d2t] = small
        return logits, prenorm.float()


class Eagle3Drafter(FeatureDrafter):
    """Drafts a tree depth by depth from the LLM's three layer inputs (one head forward per depth)."""

    def __init__(self, head: Eagle3Head, vocab_size: int | None = None):
        if vocab_size is not None and vocab_size != head.spec.vocab:
            raise ValueError(f"this EAGLE-3 head drafts for an LLM of {head.spec.vocab} tokens, the LLM has {vocab_size}")
        super().__init__(Eagle3Runner(head), vocab_size)

    def _check_model(self, model) -> None:
        if not isinstance(model, Eagle3Head):
            raise ValueError(f"Eagle3Drafter needs an Eagle3Head, got {type(model).__name__}")

    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.runner.model.spec.layers)

    def observe(self, features: Tensor) -> None:
        """The LLM's (n, 3 H_t) inputs of the head's three layers at the next n committed positions,
        fused once here (``fc``) into the (n, H) states the pairs read."""
        head = self.runner.model
        with torch.inference_mode():
            g = head.fc(features.to(self.runner.device, head.fc.weight.dtype)).float().cpu()
        super().observe(g)

    def _pair(self, states: Tensor, tokens: Tensor) -> Tensor:
        """(n, H) states and (n,) tokens → (n, 2H) inputs ``[embed(token), state]`` of the runner."""
        e = self.runner.model.embed(tokens.to(self.runner.device)).float().cpu()
        return torch.cat([e, states], -1)

    def _sync_head(self, k: int) -> None:
        if k:
            raise ValueError(f"an EAGLE-3 head drafts over its own vocabulary of {self.runner.model.spec.draft_vocab} "
                             f"tokens; its tree needs draft_vocab 0, got {k}")

    def replay(self, prompt: Sequence[int], out: Sequence[int], tree: TreeConfig, features: Features | None = None) -> Replay:
        raise ValueError("an EAGLE-3 head has no replay for the learned scheduler's labels yet; serve it without "
                         "a scheduler (the bundle's drafters, or --no-scheduler)")
