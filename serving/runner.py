"""One HF causal LM plus its KV cache, fed through tree attention.

Shape legend: T tokens fed in one forward, S cached positions after the forward, P the prefix that
every fed token sees in full, V vocabulary.

Any transformers model whose attention layers call the registered attention interface (llama,
mistral, qwen2, ... in transformers 5.x) runs through ``boosttune.kernels.tree_attention``: we
register it under ``ATTN_NAME`` and switch the model to it only for our own forwards, so the same
model object still works with HF ``generate`` (the baseline and the assisted-generation peer).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface, DynamicCache, PreTrainedModel

from boosttune.kernels.tree_attention import tree_attention
from boosttune.serving.kv import cache_length, compact_cache, crop_cache

ATTN_NAME = "boosttune_tree"


@dataclass(frozen=True)
class TreeAttentionSpec:
    """What the fed tokens may see: all of ``[0, prefix_len)`` and, beyond it, ``tree_mask``.

    Attributes:
        prefix_len: P, cached positions visible to every fed token.
        tree_mask: (T, S - P) bool over the positions after the prefix (earlier draft nodes and
            the T fed tokens themselves, which sit at the end of the cache).
    """

    prefix_len: int
    tree_mask: Tensor


def _tree_attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface adapter: (B, H, T, C) in, (B, T, H, C) out."""
    spec: TreeAttentionSpec | None = kwargs.get("tree_spec")
    if spec is None:
        raise RuntimeError(f"the '{ATTN_NAME}' attention needs a tree_spec; call through ModelRunner")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = tree_attention(query, key, value, spec.prefix_len, spec.tree_mask, scale)  # (B, H, T, C)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, _tree_attention_interface)


@contextlib.contextmanager
def _attention(model: PreTrainedModel, name: str) -> Iterator[None]:
    old = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = old


class ModelRunner:
    """An HF causal LM with its own ``DynamicCache``, fed with explicit positions and tree masks."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        # transformers renamed past_key_values to cache during 5.x; accept either.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = DynamicCache(config=model.config)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def cached_len(self) -> int:
        return cache_length(self.cache)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, position_ids: Tensor, prefix_len: int, tree_mask: Tensor) -> Tensor:
        """Feed (1, T) tokens at (1, T) positions; returns (T, V) fp32 logits.

        ``tree_mask`` is (T, S - prefix_len) with S = cached_len + T, the cache size after the feed.
        """
        return self._run(input_ids, position_ids, prefix_len, tree_mask, hidden=False)[0]

    def chain_hidden(self, tokens: Tensor) -> Tensor:
        """Like :meth:`forward_chain`, but returns the (T, H) fp32 last-layer hidden states (the
        input of the LM head) instead of the logits: request features at no extra forward."""
        p = self.cached_len
        t = tokens.shape[0]
        pos = torch.arange(p, p + t).unsqueeze(0)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        hidden = self._run(tokens.unsqueeze(0), pos, p, mask, hidden=True)[1]
        assert hidden is not None
        return hidden

    @torch.inference_mode()
    def _run(
        self, input_ids: Tensor, position_ids: Tensor, prefix_len: int, tree_mask: Tensor, hidden: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(T, V) fp32 logits and, with ``hidden``, (T, H) fp32 last-layer hidden states."""
        t = input_ids.shape[1]
        s = self.cached_len + t
        assert position_ids.shape == input_ids.shape, "position_ids must match input_ids"
        assert tree_mask.shape == (t, s - prefix_len), f"tree_mask must be ({t}, {s - prefix_len})"
        spec = TreeAttentionSpec(prefix_len, tree_mask.to(self.device))
        kwargs = {self._cache_kw: self.cache}
        with _attention(self.model, ATTN_NAME):
            out = self.model(
                input_ids=input_ids.to(self.device),
                position_ids=position_ids.to(self.device),
                use_cache=True,
                tree_spec=spec,
                output_hidden_states=hidden,
                **kwargs,
            )
        states = out.hidden_states[-1][0].float() if hidden else None  # (T, H)
        return out.logits[0].float(), states  # (T, V)

    def forward_chain(self, tokens: Tensor) -> Tensor:
        """Feed (T,) tokens as a plain causal continuation of the cache; returns (T, V) logits."""
        p = self.cached_len
        t = tokens.shape[0]
        pos = torch.arange(p, p + t).unsqueeze(0)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        return self.forward(tokens.unsqueeze(0), pos, p, mask)

    def keep(self, start: int, offsets: Tensor) -> None:
        """Keep cache entries ``start + offsets`` (moved to ``start...``) and drop the rest."""
        compact_cache(self.cache, start, offsets)

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)
