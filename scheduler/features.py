"""Request features known before decoding starts: the prompt, and the LLM's prefill (free).

Shape legend: T prompt tokens, H the LLM's hidden size, B hash buckets, F = 2 + L + H + B features
(L = 1 when the spec has the prompt-lookup feature, else 0).

The feature vector, in order (``RequestFeatures.vector``):

======================  =====  ==================================================================
block                   size   unit
======================  =====  ==================================================================
log_prompt_tokens       1      ln(1 + prompt length in tokens, chat template included)
chat                    1      1.0 when the chat template was applied, else 0.0
lookup_hit_rate         L      share of the prompt's tokens (after the first) that prompt lookup
                               (``serving/lookup.py``) would have guessed from the text before
                               them: how much the prompt repeats itself, a proxy for copying
hidden_mean             H      LLM last-layer hidden state (input of the LM head), averaged over
                               the prefilled prompt positions; activation units, fp32
ngrams                  B      hashed token-id unigrams and bigrams of the prompt, counts scaled
                               to unit L2 norm (bag of n-grams; a stable hash, not Python's)
======================  =====  ==================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_MIX_A = 2654435761  # Knuth's multiplicative hash constant (2**32 / golden ratio)
_MIX_B = 40503
_MOD = 1 << 32


@dataclass(frozen=True)
class FeatureSpec:
    """The feature layout a scheduler was trained with (checked at serve time).

    Attributes:
        hidden_size: H, the LLM's hidden size.
        ngram_buckets: B, the hashed n-gram block size.
    """

    hidden_size: int
    ngram_buckets: int
    lookup: bool = True

    @property
    def head(self) -> int:
        """Scalar features at the front of the vector (the model passes them by its PCA)."""
        return 2 + int(self.lookup)

    @property
    def dim(self) -> int:
        """F, length of the feature vector."""
        return self.head + self.hidden_size + self.ngram_buckets

    def to_json(self) -> dict:
        return {"type": "feature_spec", "hidden_size": self.hidden_size, "ngram_buckets": self.ngram_buckets,
                "lookup": self.lookup}

    @classmethod
    def from_json(cls, obj: dict) -> FeatureSpec:
        # files written before the lookup feature existed have no "lookup" key and no such feature
        return cls(hidden_size=int(obj["hidden_size"]), ngram_buckets=int(obj["ngram_buckets"]),
                   lookup=bool(obj.get("lookup", False)))


@dataclass(frozen=True)
class RequestFeatures:
    """One request's features (see the module docstring for units).

    Attributes:
        prompt_tokens: prompt length in tokens (chat template included).
        chat: whether the chat template was applied.
        hidden_mean: (H,) float32, mean prefill last-layer hidden state.
        ngrams: (B,) float32, unit-norm hashed n-gram counts.
        lookup_hit_rate: ``lookup_hit_rate`` of the prompt, or None when the spec has no such feature.
    """

    prompt_tokens: int
    chat: bool
    hidden_mean: np.ndarray
    ngrams: np.ndarray
    lookup_hit_rate: float | None = None

    def vector(self) -> np.ndarray:
        """(F,) float64 feature vector."""
        lookup = [] if self.lookup_hit_rate is None else [self.lookup_hit_rate]
        head = np.array([np.log1p(self.prompt_tokens), float(self.chat), *lookup])
        return np.concatenate([head, self.hidden_mean.astype(np.float64), self.ngrams.astype(np.float64)])

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "chat": self.chat,
            "hidden_mean": self.hidden_mean.tolist(),
            "ngrams": self.ngrams.tolist(),
            "lookup_hit_rate": self.lookup_hit_rate,
        }

    @classmethod
    def from_json(cls, obj: dict) -> RequestFeatures:
        return cls(
            prompt_tokens=int(obj["prompt_tokens"]),
            chat=bool(obj["chat"]),
            hidden_mean=np.asarray(obj["hidden_mean"], dtype=np.float32),
            ngrams=np.asarray(obj["ngrams"], dtype=np.float32),
            lookup_hit_rate=None if obj.get("lookup_hit_rate") is None else float(obj["lookup_hit_rate"]),
        )


def hashed_ngrams(ids: Sequence[int], buckets: int) -> np.ndarray:
    """(B,) float32: token-id unigram and bigram counts hashed into ``buckets``, unit L2 norm."""
    a = np.asarray(list(ids), dtype=np.int64)
    uni = (a * _MIX_A) % _MOD
    bi = ((a[:-1] * _MIX_A) ^ (a[1:] * _MIX_B + 0x5BD1E995)) % _MOD
    counts = np.bincount(np.concatenate([uni, bi]) % buckets, minlength=buckets).astype(np.float32)
    norm = float(np.linalg.norm(counts))
    return counts / norm if norm > 0 else counts


def lookup_hit_rate(ids: Sequence[int], max_ngram: int = 3) -> float:
    """Share of tokens ``ids[1:]`` that prompt lookup would have predicted from the tokens before them.

    The prediction for ``ids[t]`` is the token that followed the latest earlier occurrence of the
    longest of the last ``max_ngram`` .. 1 tokens before t (``serving.lookup.find_match``
    with length 1), found in O(T) with one dictionary per n-gram length.
    """
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        return 0.0
    follows: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
    hits = 0
    for t in range(1, len(ids)):
        guess = None
        for n in range(min(max_ngram, t), 0, -1):
            guess = follows[n].get(tuple(ids[t - n : t]))
            if guess is not None:
                break
        hits += guess == ids[t]
        for n in range(1, min(max_ngram, t) + 1):  # n-grams ending at t - 1, followed by ids[t]
            follows[n][tuple(ids[t - n : t])] = ids[t]
    return hits / (len(ids) - 1)


def pool_hidden(hidden: torch.Tensor, hidden_size: int) -> np.ndarray:
    """(T, H) prefill hidden states → (H,) float32 mean (zeros when nothing was prefilled)."""
    if hidden.numel() == 0:
        return np.zeros(hidden_size, dtype=np.float32)
    if hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden states have width {hidden.shape[-1]}, the scheduler expects {hidden_size}: "
            "it was trained for another LLM; retrain it with `boosttune train-scheduler RUN_DIR`"
        )
    return hidden.float().mean(dim=0).cpu().numpy()


def request_features(
    prompt_ids: Sequence[int], hidden: torch.Tensor, chat: bool, spec: FeatureSpec
) -> RequestFeatures:
    """Features of one request from its token ids and the LLM's (T, H) prefill hidden states."""
    return RequestFeatures(
        prompt_tokens=len(prompt_ids),
        chat=bool(chat),
        hidden_mean=pool_hidden(hidden, spec.hidden_size),
        ngrams=hashed_ngrams(prompt_ids, spec.ngram_buckets),
        lookup_hit_rate=lookup_hit_rate(prompt_ids) if spec.lookup else None,
    )
