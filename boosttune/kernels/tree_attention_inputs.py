"""The input contract of tree attention, checked the same way by both implementations.

It lives apart from both so that the dispatcher (``tree_attention``) can import the Triton kernel
(``tree_attention_triton``) while the kernel checks its inputs without importing the dispatcher:
no import cycle between the two. Shapes as in ``tree_attention``'s legend: q (B, H, T, C),
k and v (B, Hkv, S, C), tree_mask (T, S - P).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["check_inputs"]


def check_inputs(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, tree_mask: Tensor) -> None:
    """Shape, dtype and device checks for the public entry points (ValueError with the shapes)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"tree_attention: q, k, v must be 4-D (B, H, T, C) / (B, Hkv, S, C); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H, T, C = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"tree_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape"
        )
    Bk, Hkv, S, Ck = k.shape
    if Bk != B or Ck != C:
        raise ValueError(
            f"tree_attention: batch and head dim of k {tuple(k.shape)} must match q {tuple(q.shape)}"
        )
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"tree_attention: query heads H={H} must be a multiple of kv heads Hkv={Hkv}")
    if not 0 <= prefix_len <= S:
        raise ValueError(f"tree_attention: prefix_len={prefix_len} must lie in [0, S={S}]")
    if tuple(tree_mask.shape) != (T, S - prefix_len):
        raise ValueError(
            f"tree_attention: tree_mask must be (T, S - prefix_len) = ({T}, {S - prefix_len}); "
            f"got {tuple(tree_mask.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"tree_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == tree_mask.device):
        raise ValueError(
            f"tree_attention: q, k, v, tree_mask must share a device; got "
            f"{q.device}, {k.device}, {v.device}, {tree_mask.device}"
        )
