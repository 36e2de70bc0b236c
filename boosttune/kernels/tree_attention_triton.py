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
#     SpecInfer's tree attention, Miao et al. 2023, arXiv 2305.09781;
#   - splitting the key axis across programs and merging the per-split softmax partials afterwards:
#     Flash-Decoding, T. Dao, D. Haziza, F. Massa, G. Sizov, "Flash-Decoding for long-context
#     inference", PyTorch blog / Stanford CRFM, October 2023.
#
# Layout of the work: one program per (batch, kv head, block of BLOCK_R query rows). The G query
# heads that share a kv head are folded into the row axis (row r = g * T + t), so each k/v block is
# loaded once for the whole group, and T=1 decoding with G > 1 still fills a 16-row tl.dot tile.
# Keys are walked in two loops: the prefix [0, P) with only a bounds mask, then the tree part
# [P, S) with the tree mask loaded per block. Both kernels below share this code: _load_q_rows
# (program ids -> rows, q tile) and _attend_keys (the two loops over a key range [lo, hi); the
# single pass gives it [0, S)).
#
# Split-K (Flash-Decoding) path: with one program per (batch, kv head, row block), small B * Hkv * T
# leaves most SMs idle (LLaMA-2-7B at T=1: 32 programs on an H200's 132 SMs, each walking every key
# serially), so at long prefixes the single pass loses to SDPA. The launcher then adds a third grid
# axis over NUM_SPLITS contiguous key ranges of KEYS_PER_SPLIT keys (a multiple of BLOCK_S; the
# last range is shorter). Each program walks the prefix and tree parts of its own range with the
# same visibility rule and writes its un-normalised partials (running max m, sum l, acc; base-2,
# fp32) to a scratch buffer; a second small kernel (_combine_splits, one program per query row)
# merges them: m* = max_s m_s, out = sum_s acc_s 2^(m_s - m*) / sum_s l_s 2^(m_s - m*), and a row
# with l = 0 in every split (it sees no key) gets zeros, never NaN. The number of splits is chosen
# from occupancy (_plan_splits): about 2 programs per SM, at least min_keys_per_split (256) keys per
# split; one split means the single-pass kernel above, unchanged. On CPU (the interpreter) the SM
# count is unknown and the single pass is used unless num_splits is forced.
#
# Numerics: tiles are upcast to fp32 after loading and all tl.dot calls take fp32 operands with an
# fp32 accumulator. For fp32 inputs the dots use input_precision="ieee" (full fp32). For fp16 and
# bf16 inputs they use "tf32", which is exact for the q k^T operands (tf32 holds every fp16/bf16
# value) and rounds only the softmax weights p to a 10-bit mantissa before p v (a native-dtype
# kernel would round p to fp16/bf16, which is coarser). A row that sees no key returns zeros.
#
# Where it was tested: both paths pass tests/test_kernels.py::test_triton_matches_reference_gpu on an
# NVIDIA H200 (torch 2.11+cu130, triton 3.6.0; 4 shapes x 3 dtypes x automatic / 4 splits, against
# the fp32 reference and against each other) and the CPU cases under TRITON_INTERPRET=1 (triton 3.9,
# torch 2.13 CPU); the engine's gpu tests (tests/test_gpu.py) run every tree forward through it.
#
# Known limits:
#   - C (head dim) up to 256; it is padded to BLOCK_C = max(16, next power of two) with masked loads.
#   - block sizes, num_warps, num_stages and the split heuristic (2 programs per SM, >= 256 keys
#     per split) are untuned defaults; BLOCK_R and BLOCK_S must be powers of two >= 16 (tl.dot's
#     minimum tile). Shared memory for C = 256 in fp32 with large blocks is the first thing that
#     may not fit: lower block_s / num_stages if a launch fails with "out of resources".
#   - forward only (no autograd); no dropout, no ALiBi/soft-capping, no paged KV cache.
#   - the split path costs a second launch and (NUM_SPLITS x B x H x T x (C + 2)) fp32 of scratch;
#     with at most 256 keys, or >= 2 programs per SM already, the heuristic keeps one split
#     (whether splitting pays at P ~ 512 is for the GPU benchmark to say). Its summation order
#     depends on the split count, so results are deterministic for a given shape and device, not
#     bitwise equal across split counts.
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

import functools
import os

import torch
from torch import Tensor

from boosttune.kernels.tree_attention_inputs import check_inputs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the kernel is optional: CPU installs run tree_attention_reference
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "choose_num_splits", "tree_attention_triton"]

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
    def _load_q_rows(
        Q, Hkv, T, C,
        stride_qb, stride_qh, stride_qt, stride_qc,
        GROUP: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """This program's (batch b, kv head kvh, row block) from program ids 0 and 1, and its queries.

        Returns (b, kvh, q, t, h, row_ok, offs_c, c_ok): q is (BLOCK_R, BLOCK_C) in fp32. The GROUP
        query heads sharing kv head kvh are folded into the row axis: row r = g * T + t is query t
        of head h = kvh * GROUP + g.
        """
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

        q_ptrs = (
            Q + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + offs_c[None, :] * stride_qc
        )
        q = tl.load(q_ptrs, mask=row_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        return b, kvh, q, t, h, row_ok, offs_c, c_ok

    @triton.jit
    def _attend_keys(
        q, k_base, v_base, M,
        t, row_ok, offs_c, c_ok,
        lo, hi, P,
        stride_ks, stride_kc, stride_vs, stride_vc, stride_mt, stride_mm,
        qk_scale,
        BLOCK_R: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Online-softmax state (m_i, l_i, acc) of the rows in q over keys [lo, hi), from empty.

        Two loops: the prefix keys [lo, min(hi, P)) with only a bounds mask, then the tree keys
        [max(lo, P), hi) with the tree mask loaded per block. k_base / v_base point at this (batch,
        kv head)'s keys and values; q is (BLOCK_R, BLOCK_C) fp32 with rows of query position t.
        A row that sees no key in the range keeps m_i = -inf, l_i = 0, acc = 0.
        """
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        offs_s = tl.arange(0, BLOCK_S)

        # Prefix keys [lo, min(hi, P)): visible to every row; only the bounds (cols < p_hi) mask.
        p_hi = tl.minimum(hi, P)
        for start in range(lo, p_hi, BLOCK_S):
            cols = start + offs_s
            col_ok = cols < p_hi
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

        # Tree keys [max(lo, P), hi): key P + m visible to row (g, t) iff tree_mask[t, m].
        for start in range(tl.maximum(lo, P), hi, BLOCK_S):
            cols = start + offs_s
            col_ok = cols < hi
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
        return m_i, l_i, acc

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
        """Single pass: every key [0, S) of one (batch, kv head, row block), normalised into Out."""
        b, kvh, q, t, h, row_ok, offs_c, c_ok = _load_q_rows(
            Q, Hkv, T, C, stride_qb, stride_qh, stride_qt, stride_qc, GROUP, BLOCK_R, BLOCK_C
        )
        # All keys [0, S): the prefix [0, P), then the tree part [P, S).
        m_i, l_i, acc = _attend_keys(
            q, K + b * stride_kb + kvh * stride_kh, V + b * stride_vb + kvh * stride_vh, M,
            t, row_ok, offs_c, c_ok, 0, S, P,
            stride_ks, stride_kc, stride_vs, stride_vc, stride_mt, stride_mm, qk_scale,
            BLOCK_R, BLOCK_S, BLOCK_C, DOT_PRECISION,
        )  # fmt: skip

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

    @triton.jit
    def _tree_attn_fwd_split(
        Q, K, V, M, Part,
        stride_qb, stride_qh, stride_qt, stride_qc,
        stride_kb, stride_kh, stride_ks, stride_kc,
        stride_vb, stride_vh, stride_vs, stride_vc,
        stride_mt, stride_mm,
        H, Hkv, T, S, P, C,
        NS, KEYS_PER_SPLIT, N_PART,
        qk_scale,
        GROUP: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Online-softmax partials of keys [lo, hi) = split pid_s, written to the fp32 scratch Part.

        Part is one contiguous fp32 buffer of N_PART * (C + 2): m at [0, N), l at [N, 2N), acc (N, C)
        from 2N, with N = N_PART = B * H * T * NS; entry (row, split) sits at row * NS + split, where
        row = (b * H + h) * T + t.
        """
        b, kvh, q, t, h, row_ok, offs_c, c_ok = _load_q_rows(
            Q, Hkv, T, C, stride_qb, stride_qh, stride_qt, stride_qc, GROUP, BLOCK_R, BLOCK_C
        )
        # This split's keys [lo, hi): its share of the prefix, then its share of the tree part.
        pid_s = tl.program_id(2)
        lo = pid_s * KEYS_PER_SPLIT
        hi = tl.minimum(lo + KEYS_PER_SPLIT, S)
        m_i, l_i, acc = _attend_keys(
            q, K + b * stride_kb + kvh * stride_kh, V + b * stride_vb + kvh * stride_vh, M,
            t, row_ok, offs_c, c_ok, lo, hi, P,
            stride_ks, stride_kc, stride_vs, stride_vc, stride_mt, stride_mm, qk_scale,
            BLOCK_R, BLOCK_S, BLOCK_C, DOT_PRECISION,
        )  # fmt: skip

        # Un-normalised partials; a row that saw no key here keeps m = -inf, l = 0, acc = 0.
        idx = ((b * H + h) * T + t) * NS + pid_s  # (BLOCK_R,) entry (row, split)
        tl.store(Part + idx, m_i, mask=row_ok)
        tl.store(Part + N_PART + idx, l_i, mask=row_ok)
        tl.store(
            Part + 2 * N_PART + idx[:, None] * C + offs_c[None, :],
            acc,
            mask=row_ok[:, None] & c_ok[None, :],
        )

    @triton.jit
    def _combine_splits(
        Part, Out,
        stride_ob, stride_oh, stride_ot, stride_oc,
        H, T, C, NS, N_PART,
        BLOCK_NS: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """Merge the NS partials of one query row (program id = (b * H + h) * T + t) into Out.

        Walks the splits BLOCK_NS at a time (any NS, bounded registers): one pass for the max m*,
        one for sum_s l_s 2^(m_s - m*) and sum_s acc_s 2^(m_s - m*).
        """
        row = tl.program_id(0).to(tl.int64)
        b = row // (H * T)
        h = (row // T) % H
        t = row % T
        offs_n = tl.arange(0, BLOCK_NS)
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        base = row * NS

        m_max = tl.full([BLOCK_NS], float("-inf"), tl.float32)
        for n0 in range(0, NS, BLOCK_NS):
            n_ok = n0 + offs_n < NS
            m = tl.load(Part + base + n0 + offs_n, mask=n_ok, other=float("-inf"))
            m_max = tl.maximum(m_max, m)
        m_star = tl.max(m_max, 0)
        # Every split -inf (the row sees no key): subtract 0 so exp2 gives 0 weights, not NaN.
        m_safe = tl.where(m_star == float("-inf"), 0.0, m_star)

        l_sum = tl.zeros([BLOCK_NS], tl.float32)
        o = tl.zeros([BLOCK_C], tl.float32)
        for n0 in range(0, NS, BLOCK_NS):
            n_ok = n0 + offs_n < NS
            idx = base + n0 + offs_n
            m = tl.load(Part + idx, mask=n_ok, other=float("-inf"))
            w = tl.exp2(m - m_safe)  # a split that saw no key for this row: m = -inf, weight 0
            l_sum += tl.load(Part + N_PART + idx, mask=n_ok, other=0.0) * w
            acc = tl.load(
                Part + 2 * N_PART + idx[:, None] * C + offs_c[None, :],
                mask=n_ok[:, None] & c_ok[None, :],
                other=0.0,
            )  # (BLOCK_NS, BLOCK_C)
            o += tl.sum(acc * w[:, None], 0)
        l_tot = tl.sum(l_sum, 0)
        l_safe = tl.where(l_tot == 0.0, 1.0, l_tot)  # rows that saw no key: o is 0, output 0
        o = o / l_safe
        o_ptrs = Out + b * stride_ob + h * stride_oh + t * stride_ot + offs_c * stride_oc
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=c_ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_MIN_KEYS_PER_SPLIT = 256
# Automatic splitting starts at this many keys. Measured on an H200 (bf16, B=1, LLaMA-2-7B and SmolLM2
# head shapes, T = 1..64): at P = 512 the single pass won 7 of 8 shapes (the split path's second
# launch and scratch buffer cost more than the parallelism gains); at P = 8192 the split path won
# 7 of 8, by up to 7x; at P = 2048 they split evenly (docs/measurements.md, "GPU").
_MIN_KEYS_TO_SPLIT = 1024
_PROGRAMS_PER_SM = 2
_COMBINE_BLOCK_NS = 16  # splits merged per step of _combine_splits (fixed: one compile for any count)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _num_sms(device: torch.device) -> int | None:
    """Streaming multiprocessors on a CUDA device; None elsewhere (the interpreter, CPU)."""
    if device.type != "cuda":
        return None
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _plan_splits(
    S: int,
    programs: int,
    block_s: int,
    *,
    num_sms: int | None,
    num_splits: int | None = None,
    min_keys_per_split: int = _MIN_KEYS_PER_SPLIT,
) -> tuple[int, int]:
    """(splits, keys_per_split) for S keys and ``programs`` = B * Hkv * row blocks per split.

    Automatic (num_splits None): enough splits for about _PROGRAMS_PER_SM programs per SM, capped
    so each split has at least min_keys_per_split keys; 1 when num_sms is None (not on CUDA) or
    S < _MIN_KEYS_TO_SPLIT.
    A forced num_splits is an upper bound. Either way the key ranges are whole BLOCK_S blocks, so
    the count is then reduced to the ranges that hold a key (ceil(S / keys_per_split)); 1 split
    means the single-pass kernel.
    """
    if num_splits is None:
        if num_sms is None or S < _MIN_KEYS_TO_SPLIT or programs == 0:
            return 1, S
        want = _cdiv(_PROGRAMS_PER_SM * num_sms, programs)
        num_splits = max(1, min(want, _cdiv(S, max(1, min_keys_per_split))))
    if num_splits <= 1 or S == 0:
        return 1, S
    keys_per_split = _cdiv(_cdiv(S, num_splits), block_s) * block_s
    num_splits = _cdiv(S, keys_per_split)
    return (num_splits, keys_per_split) if num_splits > 1 else (1, S)


def _block_sizes(G: int, T: int, C: int, block_r: int | None, block_s: int | None) -> tuple[int, int, int]:
    """(block_r, block_s, block_c) with the defaults filled in, validated."""
    block_r = block_r or min(64, max(16, _next_pow2(G * T)))
    block_c = max(16, _next_pow2(C))
    block_s = block_s or (64 if block_c <= 64 else 32)  # keeps staged k/v tiles in shared memory
    for name, val in (("block_r", block_r), ("block_s", block_s)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"tree_attention_triton: {name}={val} must be a power of two >= 16")
    return block_r, block_s, block_c


def choose_num_splits(
    q: Tensor,
    k: Tensor,
    *,
    block_r: int | None = None,
    block_s: int | None = None,
    num_splits: int | None = None,
    min_keys_per_split: int = _MIN_KEYS_PER_SPLIT,
) -> int:
    """The number of key splits ``tree_attention_triton`` uses for these q, k and options.

    1 means the single-pass kernel. Arguments as for ``tree_attention_triton``.
    """
    B, H, T, C = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    block_r, block_s, _ = _block_sizes(G, T, C, block_r, block_s)
    programs = B * Hkv * _cdiv(G * T, block_r)
    splits, _ = _plan_splits(
        S,
        programs,
        block_s,
        num_sms=_num_sms(q.device),
        num_splits=num_splits,
        min_keys_per_split=min_keys_per_split,
    )
    return splits


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
    num_splits: int | None = None,
    min_keys_per_split: int = _MIN_KEYS_PER_SPLIT,
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
        num_splits: split the keys into at most this many ranges (split-K, see the header comment);
            1 forces the single-pass kernel. Default None chooses from the device's SM count (on
            CUDA; 1 elsewhere).
        min_keys_per_split: the automatic choice keeps at least this many keys per split.

    Returns:
        (B, H, T, C) in q's dtype.

    Raises:
        ImportError: when the package ``triton`` is not installed.
        ValueError: on inconsistent shapes, an unsupported dtype/head dim, num_splits < 1, or CPU
            tensors outside the Triton interpreter.
    """
    if not HAS_TRITON:
        raise ImportError(
            "tree_attention_triton needs the package `triton` (pip install 'boosttune[triton]'); "
            "use boosttune.kernels.tree_attention.tree_attention, which falls back to PyTorch"
        )
    prefix_len = int(prefix_len)
    check_inputs(q, k, v, prefix_len, tree_mask)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"tree_attention_triton: dtype {q.dtype} not supported (fp32, fp16, bf16)")
    if num_splits is not None and int(num_splits) < 1:
        raise ValueError(f"tree_attention_triton: num_splits={num_splits} must be >= 1 (or None)")
    if not q.is_cuda and not _interpreting():
        raise ValueError("tree_attention_triton: tensors must be on CUDA (or set TRITON_INTERPRET=1 for CPU)")
    B, H, T, C = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if C > _MAX_HEAD_DIM:
        raise ValueError(f"tree_attention_triton: head dim C={C} > {_MAX_HEAD_DIM} is not supported")
    G = H // Hkv
    block_r, block_s, block_c = _block_sizes(G, T, C, block_r, block_s)

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

    row_blocks = triton.cdiv(G * T, block_r)
    splits, keys_per_split = _plan_splits(
        S,
        B * Hkv * row_blocks,
        block_s,
        num_sms=_num_sms(q.device),
        num_splits=None if num_splits is None else int(num_splits),
        min_keys_per_split=min_keys_per_split,
    )
    # Compile-time parameters and launch options, the same for both key-walking kernels.
    meta = dict(
        GROUP=G,
        BLOCK_R=block_r,
        BLOCK_S=block_s,
        BLOCK_C=block_c,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits == 1:
        grid = (B * Hkv, row_blocks)
        _tree_attn_fwd[grid](
            q, k, v, mask_u8, out,
            *q.stride(), *k.stride(), *v.stride(), *mask_u8.stride(), *out.stride(),
            Hkv, T, S, prefix_len, C,
            float(scale) * _LOG2E,
            **meta,
        )  # fmt: skip
        return out

    # Split-K: partials (m, l, acc) per (query row, split) in one fp32 scratch buffer, then merged.
    n_part = B * H * T * splits
    part = torch.empty(n_part * (C + 2), dtype=torch.float32, device=q.device)
    _tree_attn_fwd_split[(B * Hkv, row_blocks, splits)](
        q, k, v, mask_u8, part,
        *q.stride(), *k.stride(), *v.stride(), *mask_u8.stride(),
        H, Hkv, T, S, prefix_len, C,
        splits, keys_per_split, n_part,
        float(scale) * _LOG2E,
        **meta,
    )  # fmt: skip
    _combine_splits[(B * H * T,)](
        part, out,
        *out.stride(),
        H, T, C, splits, n_part,
        BLOCK_NS=_COMBINE_BLOCK_NS,
        BLOCK_C=block_c,
        num_warps=4,
    )  # fmt: skip
    return out
