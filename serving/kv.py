"""KV-cache bookkeeping after a verification step: keep only the accepted path, in place.

Shape legend: B batch, Hkv kv heads, S cached positions, C head dim, K kept entries.

Works on transformers' ``DynamicCache`` (5.x), whose layers hold ``keys``/``values`` of shape
(B, Hkv, S, C). The prefix before ``start`` is never touched, so nothing is ever re-run.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def compact_cache(cache: DynamicCache, start: int, keep: Tensor) -> None:
    """Move entries ``start + keep[i]`` to ``start + i`` and drop everything after ``start + K``.

    ``keep`` (K,) long holds offsets relative to ``start``, increasing (a root-to-leaf path is). The
    gather reads before it writes, so overlapping source and destination are safe.
    """
    assert keep.dim() == 1, "keep must be a 1-D tensor of offsets"
    k = keep.shape[0]
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        idx = (keep + start).to(layer.keys.device)
        if k:
            layer.keys[:, :, start : start + k] = layer.keys.index_select(2, idx)  # (B, Hkv, K, C)
            layer.values[:, :, start : start + k] = layer.values.index_select(2, idx)
        layer.keys = layer.keys[:, :, : start + k]
        layer.values = layer.values[:, :, : start + k]


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer."""
    compact_cache(cache, length, torch.zeros(0, dtype=torch.long))
