"""Tree attention: every new token sees the whole committed prefix plus its own branch of the tree.

Shape legend:
    B    batch
    H    query heads
    Hkv  key/value heads (H is a multiple of Hkv; query head h reads kv head h // (H // Hkv))
    G    H // Hkv, query heads per kv head (grouped-query attention)
    T    new tokens (queries) in this forward
    S    cached positions (keys/values), including the T new tokens, which sit at the end
    P    prefix_len: the first P cached positions, visible to every query
    C    head dim

Key ``j < P`` is visible to every query; key ``P + m`` is visible to query ``t`` iff
``tree_mask[t, m]``. The output is ``softmax(scale * q k^T, masked) v`` with fp32 accumulation,
returned in q's dtype. A query row that sees no key at all (possible only when P == 0) gets zeros.

``tree_attention`` dispatches: CUDA tensors with triton importable go to the Triton kernel in
``tree_attention_triton``; everything else (the CPU production path) goes to
``tree_attention_reference``, which is plain PyTorch ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from boosttune.kernels.tree_attention_inputs import check_inputs

__all__ = ["full_mask", "tree_attention", "tree_attention_reference"]


def full_mask(prefix_len: int, tree_mask: Tensor, S: int) -> Tensor:
    """The (T, S) bool visibility mask: all prefix columns True, then ``tree_mask``.

    Args:
        prefix_len: P, number of leading cached positions every query sees.
        tree_mask: (T, S - P) bool (any dtype is read as ``!= 0``).
        S: total cached positions.

    Returns:
        (T, S) bool tensor on ``tree_mask``'s device.
    """
    if tree_mask.dtype != torch.bool:
        tree_mask = tree_mask != 0
    T = tree_mask.shape[0]
    prefix = torch.ones(T, prefix_len, dtype=torch.bool, device=tree_mask.device)
    mask = torch.cat([prefix, tree_mask], dim=1)
    if mask.shape[1] != S:
        raise ValueError(
            f"full_mask: prefix_len ({prefix_len}) + tree_mask width ({tree_mask.shape[1]}) != S ({S})"
        )
    return mask


def tree_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, prefix_len: int, tree_mask: Tensor, scale: float
) -> Tensor:
    """Tree attention in plain PyTorch (``scaled_dot_product_attention`` with a bool mask).

    Grouped-query attention is handled without copying k/v: the G query heads that share a kv
    head are folded into the query-row axis, (B, H, T, C) -> (B, Hkv, G*T, C), and the (T, S)
    mask is tiled G times along rows.

    Args:
        q: (B, H, T, C) queries.
        k: (B, Hkv, S, C) keys for all cached positions.
        v: (B, Hkv, S, C) values.
        prefix_len: P, leading positions visible to every query.
        tree_mask: (T, S - P) bool, visibility of the tree positions.
        scale: multiplier applied to q k^T before the softmax.

    Returns:
        (B, H, T, C) in q's dtype; rows that see no key are zeros.
    """
    B, H, T, C = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    if T == 0 or S == 0 or B * H == 0:
        return q.new_zeros(B, H, T, v.shape[-1])
    mask = full_mask(prefix_len, tree_mask, S)  # (T, S)
    empty_rows = None
    if prefix_len == 0:
        # A row with no visible key would softmax to NaN: let it see everything, zero it afterwards
        # (no host sync, so this is free on GPU too).
        empty_rows = ~mask.any(dim=1)  # (T,)
        mask = mask | empty_rows[:, None]
    qg = q.reshape(B, Hkv, G * T, C)  # row g*T + t is query head kvh*G + g, token t
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(G, 1), scale=scale)
    out = out.reshape(B, H, T, C)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows[:, None], 0.0)
    return out


def tree_attention(
    q: Tensor, k: Tensor, v: Tensor, prefix_len: int, tree_mask: Tensor, scale: float
) -> Tensor:
    """Tree attention, dispatched to the Triton kernel on CUDA (when triton imports) or PyTorch.

    Args:
        q: (B, H, T, C) queries.
        k: (B, Hkv, S, C) keys for all cached positions; H must be a multiple of Hkv.
        v: (B, Hkv, S, C) values.
        prefix_len: P, leading cached positions visible to every query.
        tree_mask: (T, S - P) bool; query t sees key P + m iff tree_mask[t, m].
        scale: multiplier applied to q k^T before the softmax.

    Returns:
        (B, H, T, C) attention output in q's dtype.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices.
    """
    prefix_len = int(prefix_len)
    check_inputs(q, k, v, prefix_len, tree_mask)
    if q.is_cuda:
        # Imported on the first CUDA call: CPU runs never pay for importing triton.
        from boosttune.kernels import tree_attention_triton as tat

        if tat.HAS_TRITON:
            return tat.tree_attention_triton(q, k, v, prefix_len, tree_mask, scale)
    return tree_attention_reference(q, k, v, prefix_len, tree_mask, scale)
