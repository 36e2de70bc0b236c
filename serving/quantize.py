"""Weight-only quantized matrix products for serving the LLM on a CPU (``--quantize int8|int4``).

Shape legend: R rows fed at once, I in_features, O out_features, N groups per row (I / group).

A plain decoding step reads every weight of the LLM once, so its matrix products are bounded by the
bytes they read; quantized weights read fewer. torch ships CPU kernels that multiply bf16 or fp32
inputs by quantized weights directly: ``aten._weight_int8pack_mm`` (int8, one scale per output
channel) and ``aten._weight_int4pack_mm_for_cpu`` (int4 in groups of inputs, a scale and an offset per
group). Measured with ``scripts/bench_quant_linear.py`` (AMD EPYC with AVX512-BF16, 2 threads, torch
2.13, all 211 products of SmolLM2-135M once; median ms):

| rows R | 1 | 2 | 4 | 8 | 16 | 32 |
|---|---|---|---|---|---|---|
| bf16, oneDNN packed (today's default) | 17.2 | 18.1 | 15.0 | 17.4 | 20.9 | 35.1 |
| int8 weights, torch's kernel | 10.3 | 12.5 | 14.7 | 26.9 | 43.5 | 77.8 |
| int4 weights, groups of 32 | 5.2 | 6.2 | 8.3 | 14.6 | 27.6 | 56.6 |

Both kernels walk the weights again for every few rows, so their cost grows with the rows a
verification feeds, where oneDNN's bf16 product barely grows: int4 pays up to about 8 rows, int8
only at one or two. Each output row is computed from its input row alone (checked bit for bit
here), so a tree's row rounds exactly as a plain step's would.

int8 products therefore run on our own kernel where it is built (``int8_mm``: ``boosttune_native::int8_mm``
in ``serving/native_ops.cpp``, AVX512 or AVX2 with FMA): it converts each weight once per eight rows (six
with AVX2's 16 registers), keeps a block of two outputs' weights in L1 for the next rows, and prefetches
the weights eight outputs ahead, since a row of 576 or 1536 bytes is too short for the hardware
prefetcher. The same script on an Intel Xeon with AMX (2 threads, torch 2.13; bf16 packed for comparison;
this machine's figures drift by ~10 % from run to run):

| rows R | 1 | 2 | 4 | 8 | 16 | 32 |
|---|---|---|---|---|---|---|
| bf16, oneDNN packed | 19.2 | 19.5 | 20.1 | 18.9 | 20.2 | 22.7 |
| int8 weights, torch's kernel | 13.2 | 14.8 | 17.6 | 30.9 | 46.1 | 75.1 |
| int8 weights, ``int8_mm`` | **10.0** | 11.3 | 13.2 | **14.5** | 26.2 | 53.2 |

Without the prefetch one row ran at torch's speed (13.1 ms). Blocks of four outputs and four rows gave
17.0 ms at eight rows. Taking the bf16 inputs two at a time with AVX512-BF16's dot product
(``vdpbf16ps``) was slower here (24.5 ms at eight rows): converting the weights to bf16 costs more than
the products it saves. On an AVX2-only EPYC (fp32 inputs, 2 threads) blocks of six rows instead of two
took the 121 products from 31.6 to 24.4 ms at eight rows and from 67.5 to 51.2 at sixteen (10.0 ms at one
row either way); blocks of four outputs, or weights converted to an fp32 buffer once per block of outputs,
were slower.

Both weight-only kernels compute with fp32 FMAs, so on a CPU with one 512-bit FMA port their cost still
grows with the rows. ``w8a8`` quantizes each product's inputs too, per row and block (``w8a8_block``), so
that the products are integer ones (``boosttune_native::w8a8_mm``): AMX tiles where the CPU has them (16
outputs by 64 inputs by 16 rows an instruction), else AVX512-VNNI's ``vpdpbusd`` (64 multiply-adds an
instruction), else int16 products (AVX512 without VNNI) or ``vpmaddubsw`` byte products (AVX2). Same script
and machine (AMX), all 211 products, median ms:

| rows R | 1 | 4 | 8 | 16 | 32 |
|---|---|---|---|---|---|
| int8 weights, ``int8_mm`` | 8.2 | 10.8 | 13.8 | 24.7 | 51.2 |
| w8a8, VNNI (``BOOSTTUNE_AMX=0``) | 6.6 | 7.9 | 9.7 | 15.9 | 28.7 |
| w8a8, AMX | 5.9 | 5.8 | 6.7 | 7.8 | 13.8 |

Integer sums are exact and each row's inputs are quantized alone, so a row's output does not depend on
the other rows; but the input quantizer turns a last-bit difference of an input into other codes, so a
w8a8 runner in fp32 also computes attention row by row (``pooled.sdpa``'s ``exact``). On an AVX2-only EPYC
(fp32 inputs) the 121 products took 6.3 / 18.7 / 37.5 ms at 1 / 8 / 16 rows against ``int8_mm``'s 9.1 /
23.1 / 42.8, and once that row-by-row attention ran in vectors there too, a compiled w8a8 step of 1 / 8
tokens took 8.4 / 21.0 ms against int8's 10.5 / 24.3 (docs/measurements.md). The AVX2 form of
``w8a8_block`` since then takes 0.95-0.97x those products' time at 1 row and 0.74-0.80x at 4 to 16.

The quantization: per output channel, round to nearest (int8: symmetric, scale = max |w| / 127; int4:
each group of ``group`` inputs mapped onto 16 levels between its min and max). A fused product
(q/k/v, gate/up) is quantized from the concatenated weight; since every row quantizes on its own,
that equals quantizing the parts.

Lossless serving holds with respect to the *quantized* LLM: plain decoding and verification run the
same quantized products (``LeanRunner.quantize``), so greedy output is token-identical to the quantized
LLM's own plain decoding and sampling follows its distribution. Against the bf16 LLM the output
differs as any quantized model's does (``scripts/quant_quality.py`` measures how much).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from boosttune.serving import native

SCHEMES = ("int8", "int4", "w8a8")
W8A8_BLOCKS = 64
"""w8a8 input blocks are multiples of this (the native kernel's step: one AVX512 vector of bytes, two AVX2 ones)."""
W8A8_MAX_BLOCK = 256
"""The largest w8a8 input block (``w8a8_block``)."""
NATIVE_LANES = 16
"""in_features the native int8 kernel takes must be a multiple of this (its widest vector's lanes)."""
INT4_GROUPS = (32, 64, 128, 256)
"""Group sizes ``_weight_int4pack_mm_for_cpu`` accepts."""
DEFAULT_GROUP = 32
"""int4 group size: groups of 64 gave 2.8x the relative output error of groups of 32 on SmolLM2-135M's
products (0.085 against 0.031, ``scripts/bench_quant_linear.py``) at the same speed."""


def check_scheme(scheme: str, group: int = DEFAULT_GROUP) -> None:
    """Raise ValueError naming ``--quantize`` for an unknown scheme or int4 group size."""
    if scheme not in SCHEMES:
        raise ValueError(f"--quantize {scheme!r}: use one of {', '.join(SCHEMES)} (or leave it off for the "
                         "LLM's own dtype)")
    if scheme == "int4" and group not in INT4_GROUPS:
        raise ValueError(f"--quantize int4: group size {group} is not one of {INT4_GROUPS}")


def shape_reason(out_features: int, in_features: int, scheme: str, group: int = DEFAULT_GROUP) -> str | None:
    """Why an (O, I) weight cannot take ``scheme`` (None: it can)."""
    if scheme == "int4" and (in_features % group or out_features % 16):
        return f"int4 needs in_features divisible by the group ({group}) and out_features by 16, got ({out_features}, {in_features})"
    if scheme == "w8a8" and in_features % W8A8_BLOCKS:
        return f"w8a8 needs in_features divisible by {W8A8_BLOCKS}, got ({out_features}, {in_features})"
    return None


def w8a8_block(in_features: int) -> int:
    """The inputs per w8a8 scale for products of ``in_features`` inputs: the largest multiple of 64 up to
    256 that divides it (192 for SmolLM2-135M's 576, 256 for 1536 or 4096); 0 where none does.

    Each block of a row gets its own scale, so one outlier coarsens only its block's codes. Simulated on
    SmolLM2-135M (WikiText-2, 4,096 tokens; weights int8 per channel, inputs int8): perplexity 30.13 with
    bf16 inputs, 30.25 with a scale per 64 inputs, 30.43 per 96, 30.61 per 192, 31.22 per row. Timed with
    ``scripts/bench_quant_linear.py`` (Intel Xeon with AMX, 2 threads), blocks of 64 cost 12.2 ms for all
    products at 8 rows against 9.7 per 192 and 9.2 per row: each block's integer sums are converted and
    scaled, which a block of one chunk pays for every 64 multiply-adds."""
    for block in range(W8A8_MAX_BLOCK, 0, -W8A8_BLOCKS):
        if in_features % block == 0:
            return block
    return 0


def int8_codes(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(O, I) int8 codes and (O,) fp32 scales of ``weight`` (O, I): symmetric, per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (O,)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int4_codes(weight: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """(O, I) int32 codes in 0..15, (O, N) fp32 scales and (O, N) fp32 minima of ``weight`` (O, I):
    value = code * scale + minimum, per group of ``group`` inputs of a row."""
    o, i = weight.shape
    g = weight.detach().float().view(o, i // group, group)  # (O, N, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # (O, N)
    scale = (hi - lo).clamp(min=1e-12) / 15
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return codes.view(o, i), scale, lo


@dataclass(eq=False)
class QuantLinear:
    """A bias-free Linear whose weight is held quantized; called like ``nn.Linear`` on (..., I) inputs of
    ``dtype`` (the weight's original dtype: bf16 or fp32), returning (..., O) in that dtype.

    Attributes:
        scheme: "int8" or "int4".
        out_features, in_features: O and I.
        dtype: the inputs' and outputs' dtype.
        group: int4's group size (0 for int8).
        packed: the kernel's weight: (O, I) int8 codes, or int4 codes in the kernel's packed layout.
        scales: int8: (O,) scales; int4: (N, O, 2) scales and offsets, as the kernel wants them.
        reference: the (O, I) dequantized weight in fp32, kept only when asked (tests).
    """

    scheme: str
    out_features: int
    in_features: int
    dtype: torch.dtype
    group: int
    packed: Tensor
    scales: Tensor
    reference: Tensor | None = None

    @classmethod
    def from_weight(cls, weight: Tensor, scheme: str, group: int = DEFAULT_GROUP, keep_reference: bool = False) -> QuantLinear:
        """Quantize ``weight`` (O, I) (a CPU bf16 or fp32 tensor)."""
        check_scheme(scheme, group)
        o, i = weight.shape
        why = shape_reason(o, i, scheme, group)
        if why is not None:
            raise ValueError(f"--quantize {scheme}: {why}")
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--quantize {scheme}: the weights must be fp32 or bf16 on the CPU, got "
                             f"{weight.dtype} on {weight.device}")
        dtype = weight.dtype
        if scheme != "int4":
            codes, scale = int8_codes(weight)
            ref = codes.float() * scale[:, None] if keep_reference else None
            if scheme == "int8":
                return cls("int8", o, i, dtype, 0, codes, scale.to(dtype), ref)
            # w8a8: the native kernel multiplies unsigned by signed bytes, so the weights are held as code + 128
            return cls("w8a8", o, i, dtype, w8a8_block(i), (codes.to(torch.int16) + 128).to(torch.uint8), scale, ref)
        codes4, scale4, lo = int4_codes(weight, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes4, 2)
        # the kernel computes (code - 8) * scale + offset: offset = minimum + 8 scale
        scales = torch.stack([scale4, lo + 8 * scale4], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (N, O, 2)
        ref = None
        if keep_reference:
            s, off = scales.float().transpose(0, 1).unbind(-1)  # (O, N) each, as the kernel reads them
            ref = ((codes4.view(o, i // group, group).float() - 8) * s[..., None] + off[..., None]).view(o, i)
        return cls("int4", o, i, dtype, group, packed, scales, ref)

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype != self.dtype:
            raise ValueError(f"a {self.scheme} product of {self.dtype} weights was fed {x.dtype} inputs")
        flat = x.reshape(-1, self.in_features)  # (R, I)
        if self.scheme == "int8":
            out = int8_mm(flat, self.packed, self.scales)
        elif self.scheme == "w8a8":
            out = w8a8_mm(flat, self.packed, self.scales, block=self.group)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales)
        return out.view(*x.shape[:-1], self.out_features)  # (..., O)

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight and its scales."""
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()


@functools.cache
def native_int8() -> bool:
    """Whether int8 products run on ``boosttune_native::int8_mm`` (``serving/native_ops.cpp``): where the
    native ops are built and their int8 loops are vectorised (AVX512 or AVX2 with FMA), else on torch's
    ``_weight_int8pack_mm``. One answer per process, so plain steps and verifications compute alike."""
    return native.available() and bool(torch.ops.boosttune_native.int8_vectorised())


def int8_mm(x: Tensor, packed: Tensor, scales: Tensor, native_ok: bool | None = None) -> Tensor:
    """(R, I) ``x`` times the (O, I) int8 codes ``packed`` scaled per output by ``scales`` (O,): (R, O) in
    ``x``'s dtype. Our kernel reads each weight once per call whatever R is; torch's reads them again every
    few rows (the table above). ``native_ok``: ``native_int8()``'s answer, passed where it must not be
    asked (a compiled graph); None asks it."""
    if native_ok is None:
        native_ok = native_int8()
    if native_ok and x.shape[1] % NATIVE_LANES == 0:
        return torch.ops.boosttune_native.int8_mm(x, packed, scales)
    return torch.ops.aten._weight_int8pack_mm(x, packed, scales)


@functools.cache
def native_w8a8() -> bool:
    """Whether w8a8 products run on ``boosttune_native::w8a8_mm`` (AVX512 or AVX2), else on
    ``w8a8_reference``; one answer per process, as ``native_int8``."""
    return native.available() and bool(torch.ops.boosttune_native.w8a8_vectorised())


def w8a8_codes(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """(R, I) ``x``'s int8 codes (as fp32) and (R, I / block) fp32 scales: each block of ``block`` inputs of
    a row scaled by its absolute maximum / 127 and rounded half to even, as the native kernel does."""
    r, i = x.shape
    xb = x.float().view(r, i // block, block)
    amax = xb.abs().amax(dim=-1)  # (R, N)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return codes.view(r, i), amax / 127


def w8a8_reference(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    """``w8a8_mm`` in torch (where the native kernel is not built): the same codes, the same integer block
    sums (exact in fp32: at most 127 * 127 * 256 < 2^24), summed over blocks in another order."""
    r, i = x.shape
    block = w8a8_block(i)
    codes, xs = w8a8_codes(x, block)  # (R, I), (R, N)
    w = packed.to(torch.int16).sub(128).float().view(-1, i // block, block)  # (O, N, block)
    sums = torch.einsum("rnb,onb->rno", codes.view(r, i // block, block), w)  # (R, N, O), exact integers
    return ((sums * xs[..., None]).sum(dim=1) * scales.float()).to(x.dtype)


def w8a8_mm(x: Tensor, packed: Tensor, scales: Tensor, native_ok: bool | None = None, block: int = 0) -> Tensor:
    """(R, I) ``x`` quantized to int8 per block of ``w8a8_block(I)`` inputs (``block`` where the caller knows
    it), times the (O, I) weight codes ``packed`` (uint8, code + 128) scaled per output by ``scales`` (O,)
    fp32: (R, O) in ``x``'s dtype. Each row's output depends on that row alone. ``native_ok``: as
    ``int8_mm``'s."""
    if native_ok is None:
        native_ok = native_w8a8()
    if native_ok:
        return torch.ops.boosttune_native.w8a8_mm(x, packed, scales, block or w8a8_block(x.shape[1]))
    return w8a8_reference(x, packed, scales)


def stack(products: list[QuantLinear]) -> tuple[Tensor, Tensor]:
    """Stack like ``products``' (one per layer) weights and scales along a new dim 0 and point each product
    at its slice, so that the weights are held once; returns (packed, scales). A compiled forward takes
    one input per stack instead of one per product (``serving/compiled.py``)."""
    packed, scales = torch.stack([p.packed for p in products]), torch.stack([p.scales for p in products])
    for i, p in enumerate(products):
        p.packed, p.scales = packed[i], scales[i]
    return packed, scales
