"""One HF causal LM plus its KV cache, fed through tree attention.

Shape legend: T tokens fed in one forward, S cached positions after the forward, P the prefix that
every fed token sees in full, V vocabulary.

Any transformers model whose attention layers call the registered attention interface (llama,
mistral, qwen2, ... in transformers 5.x) runs through ``boosttune.kernels.tree_attention``: we
register it under ``ATTN_NAME`` and switch the model to it only for our own forwards, so the same
model object still works with HF ``generate`` (the baseline and the assisted-generation peer).

A drafting SSM may compute its logits over a *draft vocabulary* only (``head_ids``, K of the V
tokens): the LM head is the largest matrix of a small SSM and reading it is most of a draft
forward's cost on CPU (measured here, SSM of 4 x 576 in bf16: 5.6 ms per token with the 49,152-row
head, 2.8 ms without it). The other tokens get logit -inf, so q = 0 there: the SSM cannot propose
them, and verification, which accepts any q, stays exact. FR-Spec (Zhao et al. 2025, arXiv
2502.14856) restricts the draft head to frequent tokens in the same way.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface, DynamicCache, PreTrainedModel

from boosttune.kernels.tree_attention import tree_attention
from boosttune.serving import cpu_linear
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


# Config fields by which some architectures rescale or cap logits after the LM head; a restricted
# head would skip that step, so such models keep their full head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def restricted_head_error(model: PreTrainedModel) -> str | None:
    """Why ``model``'s logits cannot be computed over a subset of the vocabulary, or None."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return f"{type(model).__name__}'s LM head is not a bias-free linear layer"
    for name in _LOGIT_TRANSFORMS:
        value = getattr(model.config, name, None)
        if value not in (None, 1, 1.0):
            return f"{type(model).__name__} transforms its logits ({name}={value})"
    if model.base_model is model:
        return f"{type(model).__name__} has no separate decoder body"
    return None


def cache_keyword(forward) -> str:
    """The cache argument's name of an HF ``forward``: transformers renamed past_key_values to cache
    during 5.x; accept either."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class ModelRunner:
    """An HF causal LM with its own ``DynamicCache``, fed with explicit positions and tree masks."""

    def __init__(self, model: PreTrainedModel, head_ids: Tensor | None = None):
        """``head_ids``: (K,) token ids to compute logits for (the others get -inf); None: all V."""
        self.model = model
        if self.device.type == "cpu":
            cpu_linear.install(model)  # oneDNN-packed weights for inference; idempotent
        self._cache_kw = cache_keyword(model.forward)
        self.cache = DynamicCache(config=model.config)
        self.head_ids: Tensor | None = None
        self._head: torch.nn.Linear | None = None  # (K, H) rows of the LM head, as a Linear of their own
        self.taps: tuple[int, ...] = ()
        """Decoder layers whose inputs the hidden-state path also returns (``set_taps``)."""
        if head_ids is not None:
            self.restrict_head(head_ids)

    def restrict_head(self, head_ids: Tensor | None) -> None:
        """Compute logits over ``head_ids`` only (None: the whole vocabulary again)."""
        if head_ids is None:
            self.head_ids = self._head = None
            return
        why = restricted_head_error(self.model)
        if why is not None:
            raise ValueError(f"cannot restrict the draft vocabulary: {why}; use the full vocabulary")
        weight = self.model.get_output_embeddings().weight
        ids = torch.as_tensor(head_ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]:
            raise ValueError(f"draft vocabulary ids must be non-empty and in [0, {weight.shape[0]})")
        self.head_ids = ids.to(weight.device)
        self._head = self._head_product(weight.detach()[self.head_ids].contiguous())
        self._vocab = weight.shape[0]
        self._body_cache_kw = cache_keyword(self.model.base_model.forward)

    def _head_product(self, rows: Tensor) -> torch.nn.Linear:
        """The product of the (K, H) ``rows`` of the LM head: a Linear of their own (oneDNN-packed on CPU)."""
        head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        head.weight = torch.nn.Parameter(rows, requires_grad=False)
        if self.device.type == "cpu":
            cpu_linear.install(head)
        return head

    def set_taps(self, layers: Sequence[int]) -> None:
        """Make every hidden-state result (``chain_hidden``, ``forward_hidden``) also carry the inputs
        of decoder ``layers`` (what an EAGLE-3 head reads): (T, (1 + len(layers)) H), the last-layer
        states first, then each tapped layer's input in the order given. Empty: (T, H) again."""
        layers = tuple(int(i) for i in layers)
        n = self.model.config.num_hidden_layers
        if any(not 0 <= i < n for i in layers):
            raise ValueError(f"taps must be decoder layers in 0..{n - 1}, got {list(layers)}")
        self.taps = layers

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def cached_len(self) -> int:
        return cache_length(self.cache)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    def spawn(self) -> ModelRunner:
        """A runner of the same model and LM head with an empty cache of its own: another request's."""
        other = copy.copy(self)
        other.reset()
        return other

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, position_ids: Tensor, prefix_len: int, tree_mask: Tensor) -> Tensor:
        """Feed (1, T) tokens at (1, T) positions; returns (T, V) fp32 logits.

        ``tree_mask`` is (T, S - prefix_len) with S = cached_len + T, the cache size after the feed.
        """
        return self._run(input_ids, position_ids, prefix_len, tree_mask, hidden=False)[0]

    def chain_hidden(self, tokens: Tensor) -> Tensor:
        """Like :meth:`forward_chain`, but returns the (T, H) fp32 last-layer hidden states (the
        input of the LM head) instead of the logits: request features at no extra forward
        (with ``taps``, the tapped layers' inputs after them)."""
        p = self.cached_len
        t = tokens.shape[0]
        pos = torch.arange(p, p + t).unsqueeze(0)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        hidden = self._run(tokens.unsqueeze(0), pos, p, mask, hidden=True)[1]
        assert hidden is not None
        return hidden

    def forward_hidden(
        self, inputs: Tensor, position_ids: Tensor, prefix_len: int, tree_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Like :meth:`forward`, but returns the (T, V) fp32 logits and the (T, H) fp32 last-layer
        hidden states (with ``taps``, the tapped layers' inputs after them); ``inputs`` are (1, T) token
        ids or (1, T, H) input embeddings (a feature drafter feeds embeddings it computed itself)."""
        logits, hidden = self._run(inputs, position_ids, prefix_len, tree_mask, hidden=True)
        assert hidden is not None
        return logits, hidden

    @torch.inference_mode()
    def _run(
        self, input_ids: Tensor, position_ids: Tensor, prefix_len: int, tree_mask: Tensor, hidden: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(T, V) fp32 logits and, with ``hidden``, (T, H) fp32 last-layer hidden states.
        ``input_ids``: (1, T) token ids, or (1, T, H) input embeddings."""
        t = input_ids.shape[1]
        s = self.cached_len + t
        assert position_ids.shape == input_ids.shape[:2], "position_ids must be (1, T)"
        assert tree_mask.shape == (t, s - prefix_len), f"tree_mask must be ({t}, {s - prefix_len})"
        spec = TreeAttentionSpec(prefix_len, tree_mask.to(self.device))
        key = "input_ids" if input_ids.dim() == 2 else "inputs_embeds"
        inputs = {key: input_ids.to(self.device), "position_ids": position_ids.to(self.device),
                  "use_cache": True, "tree_spec": spec}
        with _attention(self.model, ATTN_NAME):
            if self._head is not None:
                assert not self.taps, "a runner with a restricted head (a drafter's) has no taps"
                body = self.model.base_model(**inputs, **{self._body_cache_kw: self.cache})
                last = body.last_hidden_state[0]  # (T, H)
                return self._restricted_logits(last), (last.float() if hidden else None)
            out = self.model(**inputs, output_hidden_states=hidden, **{self._cache_kw: self.cache})
        states = None
        if hidden:  # hidden_states[i] is layer i's input, the last one the final norm's output
            states = torch.cat([out.hidden_states[-1][0], *(out.hidden_states[i][0] for i in self.taps)], -1).float()
        return out.logits[0].float(), states  # (T, V)

    def _restricted_logits(self, last: Tensor) -> Tensor:
        """(T, H) last hidden states → (T, V) fp32 logits, -inf outside the draft vocabulary."""
        assert self._head is not None and self.head_ids is not None
        small = self._head(last).float()  # (T, K), = last @ W.T
        full = small.new_full((last.shape[0], self._vocab), float("-inf"))
        full[:, self.head_ids] = small
        return full

    def forward_chain(self, tokens: Tensor) -> Tensor:
        """Feed (T,) tokens as a plain causal continuation of the cache; returns (T, V) logits."""
        p = self.cached_len
        t = tokens.shape[0]
        pos = torch.arange(p, p + t).unsqueeze(0)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        return self.forward(tokens.unsqueeze(0), pos, p, mask)

    def prefill(self, tokens: Tensor) -> None:
        """Feed (T,) tokens as a plain causal continuation of the cache, for the cache alone (a runner may
        skip what nobody reads: ``LeanRunner`` skips the LM head)."""
        self.forward_chain(tokens)

    def keep(self, start: int, offsets: Tensor) -> None:
        """Keep cache entries ``start + offsets`` (moved to ``start...``) and drop the rest."""
        compact_cache(self.cache, start, offsets)

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)
