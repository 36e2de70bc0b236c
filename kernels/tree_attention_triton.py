# Tree attention as a Triton kernel.
#
# What it computes: out = softmax(scale * q k^T, masked) v, where key j < P (the committed prefix)
# is visible to every query and key P + m (a tree/draft position) is visible to query t iff
# tree_mask[t, m]. Same contract as boosttune.kernels.tree_attention.tree_attention_reference.
#
# Shapes: q (B, H, T, C); k, v (B, Hkv, S, C); tree_mask (T, S - P) bool; out (B, H, T, C) in q's
# dtype. H is a multiple of Hkv (grouped-query attention, G = H // Hkv query heads per kv head).
# Any strides are accepted for q, k, v and tree_mask; nothing is copied except the output.
#
# Mask memory format: the caller's (T, S - P) torch.bool tensor itself, reinterpreted (zero-copy,
# Tensor.view(torch.uint8)) as one byte per entry, 0 = hidden, nonzero = visible, read with its own
# two strides. No bit packing: the mask is T x (S - P) bytes, tiny next to k and v.
#
# Where the ideas come from (cited, not copied; this code was written from the papers):
#   - the online softmax with running max m_i, running sum l_i and rescaled accumulator acc, one
#     pass over key blocks: FlashAttention, Dao et al. 2022, arXiv 2205.14135;
#   - attending a whole token tree in one pass with a topology mask over the speculated tokens:
#     SpecInfer's tree attention, Miao et al. 2023, arXiv 2305.09781.
#
# Layout of the work: one program per (batch, kv head, block of BLOCK_R query rows). The G query
# heads that share a kv head are folded into the row axis (row r = g * T + t), so each k/v block is
# loaded once for the whole group, and T=1 decoding with G > 1 still fills a 16-row tl.dot tile.
# Keys are walked in two loops: the prefix [0, P) with only a bounds mask, then the tree part
# [P, S) with the tree mask loaded per block.
#
# Numerics: tiles are upcast to fp32 after loading and all tl.dot calls take fp32 operands with an
# fp32 accumulator. For fp32 inputs the dots use input_precision="ieee" (full fp32). For fp16 and
# bf16 inputs they use "tf32", which is exact for the q k^T operands (tf32 holds every fp16/bf16
# value) and rounds only the softmax weights p to a 10-bit mantissa before p v (a native-dtype
# kernel would round p to fp16/bf16, which is coarser). A row that sees no key returns zeros.
#
# Where it was tested: CPU only, under TRITON_INTERPRET=1 with triton 3.9 (torch 2.13 CPU), against
# the PyTorch reference; not yet run on a GPU. tests/test_kernels.py::test_triton_matches_reference_gpu
# is the GPU check (skipped without CUDA).
#
# Known limits:
#   - C (head dim) up to 256; it is padded to BLOCK_C = max(16, next power of two) with masked loads.
#   - block sizes, num_warps and num_stages are untuned defaults (no GPU was available when this
#     was written); BLOCK_R and BLOCK_S must be powers of two >= 16 (tl.dot's minimum tile). Shared
#     memory for C = 256 in fp32 with large blocks is the first thing that may not fit: lower
#     block_s / num_stages if a launch fails with "out of resources".
#   - forward only (no autograd); no dropout, no ALiBi/soft-capping, no paged KV cache.
#   - tf32 tensor-core dots for fp16/bf16 run at half the fp16/bf16 tensor-core rate; fine for the
#     memory-bound small-T decode case this serves, worth revisiting for long prefills.
#   - under the Triton interpreter, bf16 arithmetic on un-converted values is wrong (bf16 is held as
#     uint16 there), which is one more reason every tile is converted to fp32 right after tl.load;
#     keep it that way or the interpreter tests stop meaning anything.
#
# Before touching block sizes or the loop structure, run:
#   HF_HUB_OFFLINE=1 python -m pytest tests/test_kernels.py -q
# (the interpreter cases run on CPU; on a GPU machine the gpu-marked test runs as well).

"""Triton tree-attention kernel and its launcher (see the header comment for the details)."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from boosttune.kernels.tree_attention import _check_inputs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the kernel is optional: CPU installs run tree_attention_reference
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tree_attention_triton"]

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256


def _interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if HAS_TRITON:

    @triton.jit
    def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
        """Fold one block of base-2 logits s (BLOCK_R, BLOCK_S) and values v into (m_i, l_i, acc)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with every key so far hidden keep m = -inf; subtracting 0 instead keeps exp2 finite
        # (exp2(-inf) = 0), so such rows keep l_i = 0 and acc = 0 rather than turning NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _tree_attn_fwd(
        Q, K, V, M, Out,
        stride_qb, stride_qh, stride_qt, stride_qc,
        stride_kb, stride_kh, stride_ks, stride_kc,
        stride_vb, stride_vh, stride_vs, stride_vc,
        stride_mt, stride_mm,
        stride_ob, stride_oh, stride_ot, stride_oc,
        Hkv, T, S, P, C,
        qk_scale,
        GROUP: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_bk = tl.program_id(0).to(tl.int64)  # b * Hkv + kv head; int64 so offsets cannot wrap
        pid_r = tl.program_id(1)
        b = pid_bk // Hkv
        kvh = pid_bk % Hkv

        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # r = g * T + t
        row_ok = rows < GROUP * T
        t = rows % T
        h = kvh * GROUP + rows // T
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        offs_s = tl.arange(0, BLOCK_S)

        q_ptrs = (
            Q + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + offs_c[None, :] * stride_qc
        )
        q = tl.load(q_ptrs, mask=row_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)

        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh

        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)

        # Prefix [0, P): visible to every row; only the bounds (cols < P) mask.
        for start in range(0, P, BLOCK_S):
            cols = start + offs_s
            col_ok = cols < P
            kt = tl.load(
                k_base + cols[None, :] * stride_ks + offs_c[:, None] * stride_kc,
                mask=c_ok[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)  # (BLOCK_C, BLOCK_S)
            v = tl.load(
                v_base + cols[:, None] * stride_vs + offs_c[None, :] * stride_vc,
                mask=col_ok[:, None] & c_ok[None, :],
                other=0.0,
            ).to(tl.float32)  # (BLOCK_S, BLOCK_C)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(col_ok[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

        # Tree part [P, S): key P + m visible to row (g, t) iff tree_mask[t, m].
        for start in range(P, S, BLOCK_S):
            cols = start + offs_s
            col_ok = cols < S
            kt = tl.load(
                k_base + cols[None, :] * stride_ks + offs_c[:, None] * stride_kc,
                mask=c_ok[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            v = tl.load(
                v_base + cols[:, None] * stride_vs + offs_c[None, :] * stride_vc,
                mask=col_ok[:, None] & c_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            tm = tl.load(
                M + t[:, None] * stride_mt + (cols - P)[None, :] * stride_mm,
                mask=row_ok[:, None] & col_ok[None, :],
                other=0,
            )
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(tm != 0, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key: acc is 0, output 0
        o = acc / l_safe[:, None]
        o_ptrs = (
            Out
            + b * stride_ob
            + h[:, None] * stride_oh
            + t[:, None] * stride_ot
            + offs_c[None, :] * stride_oc
        )
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tree_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    prefix_len: int,
    tree_mask: Tensor,
    scale: float,
    *,
    block_r: int | None = None,
    block_s: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """Tree attention with the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    Args:
        q: (B, H, T, C) queries, fp32/fp16/bf16.
        k: (B, Hkv, S, C) keys for all cached positions; H must be a multiple of Hkv.
        v: (B, Hkv, S, C) values.
        prefix_len: P, leading cached positions visible to every query.
        tree_mask: (T, S - P) bool; query t sees key P + m iff tree_mask[t, m].
        scale: multiplier applied to q k^T before the softmax.
        block_r: query rows per program (power of two >= 16); default picks 16..64 from G*T.
        block_s: keys per inner-loop block (power of two >= 16); default 64, 32 for C > 64.
        num_warps: warps per program on the GPU.
        num_stages: software-pipelining depth of the key loop on the GPU.

    Returns:
        (B, H, T, C) in q's dtype.

    Raises:
        ImportError: when the package ``triton`` is not installed.
        ValueError: on inconsistent shapes, an unsupported dtype/head dim, or CPU tensors outside
            the Triton interpreter.
    """
    if not HAS_TRITON:
        raise ImportError(
            "tree_attention_triton needs the package `triton` (pip install 'boosttune[triton]'); "
            "use boosttune.kernels.tree_attention.tree_attention, which falls back to PyTorch"
        )
    prefix_len = int(prefix_len)
    _check_inputs(q, k, v, prefix_len, tree_mask)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"tree_attention_triton: dtype {q.dtype} not supported (fp32, fp16, bf16)")
    if not q.is_cuda and not _interpreting():
        raise ValueError("tree_attention_triton: tensors must be on CUDA (or set TRITON_INTERPRET=1 for CPU)")
    B, H, T, C = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if C > _MAX_HEAD_DIM:
        raise ValueError(f"tree_attention_triton: head dim C={C} > {_MAX_HEAD_DIM} is not supported")
    G = H // Hkv
    block_r = block_r or min(64, max(16, _next_pow2(G * T)))
    block_c = max(16, _next_pow2(C))
    block_s = block_s or (64 if block_c <= 64 else 32)  # keeps staged k/v tiles in shared memory
    for name, val in (("block_r", block_r), ("block_s", block_s)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"tree_attention_triton: {name}={val} must be a power of two >= 16")

    out = torch.empty(B, H, T, C, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if S == 0:
        return out.zero_()

    if tree_mask.dtype != torch.bool:
        tree_mask = tree_mask != 0
    if tree_mask.numel() == 0:  # S == P: no tree columns; pass a valid 1-byte buffer, never read
        mask_u8 = torch.zeros(1, 1, dtype=torch.uint8, device=q.device)
    else:
        mask_u8 = tree_mask.view(torch.uint8)  # zero-copy: torch.bool is one byte, 0 or 1

    grid = (B * Hkv, triton.cdiv(G * T, block_r))
    _tree_attn_fwd[grid](
        q, k, v, mask_u8, out,
        *q.stride(), *k.stride(), *v.stride(), *mask_u8.stride(), *out.stride(),
        Hkv, T, S, prefix_len, C,
        float(scale) * _LOG2E,
        GROUP=G,
        BLOCK_R=block_r,
        BLOCK_S=block_s,
        BLOCK_C=block_c,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
