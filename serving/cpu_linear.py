"""Faster CPU matrix products for inference: ``nn.Linear`` layers with weights pre-packed for oneDNN.

Shape legend: R rows fed at once (the product of an input's leading dimensions), I in_features,
O out_features.

Speculative decoding is bounded by how the LLM's forward cost grows with the tokens it verifies at
once (R = 1 for a plain step, 2..32 for a tree), and by what a one-token step costs at all.
torch's ``F.linear`` hands fp32 products to MKL, which on the CPUs of this project handles few rows
badly; bf16 products go to oneDNN unpacked, re-laying the weight out every call. Measured on one
machine (AMD EPYC with AVX512-BF16, 2 threads, torch 2.13), all of SmolLM2-135M's Linear weights
(30 layers and the 49,152-row head) once, median ms:

| rows R | 1 | 2 | 4 | 8 | 16 | 32 |
|---|---|---|---|---|---|---|
| fp32 ``F.linear`` | 37.3 | 57.8 | 52.6 | 48.8 | 62.3 | 85.0 |
| fp32 packed | 16.0 | 17.1 | 15.9 | 19.2 | 24.8 | 36.0 |
| bf16 ``F.linear`` | 13.4 | 14.0 | 15.3 | 14.9 | 18.0 | 23.9 |
| bf16 packed | 9.9 | 9.8 | 9.4 | 11.2 | 12.7 | 18.7 |

So :class:`CpuLinear` (what :func:`install` turns a model's ``nn.Linear`` layers into) packs its
weight once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the op
torch's own inductor uses when it freezes CPU models) and multiplies with
``torch.ops.mkldnn._linear_pointwise``. The packed copy is made at the first inference call and
again whenever the weight changes (its version counter), so a model trained between evaluations
packs its new weights. Grad mode (training, autograd), inputs off the CPU, dtype mismatches and
dtypes other than fp32 and bf16 keep ``F.linear``. The packed weight is a second copy of the
weight (SmolLM2-135M fp32: +540 MB).

Where oneDNN cannot (a torch built without it, bf16 on a CPU without native bf16), fp32 layers fall
back to the *transposed* form: ``(W @ x.T).T`` for 2..32 rows, which MKL computes much faster than
``x @ W.T`` on the AVX2-only EPYC this project was measured on earlier (SmolLM2's LM head at 2..4
rows: 7.4 ms against 22-26 ms). Results differ from ``F.linear`` only by fp32 (bf16) rounding.

Environment ``BOOSTTUNE_CPU_LINEAR``: unset is ``packed`` where oneDNN can, else ``transposed``;
``packed`` or ``transposed`` asks for one (``packed`` falls back like the default); ``0`` or ``off``
leaves models alone. Read when :func:`install` runs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ENV_VAR = "BOOSTTUNE_CPU_LINEAR"
MAX_ROWS = 32
"""Largest row count that takes the transposed form (a verification tree's size)."""
PACK_HINT = 8
"""The row count oneDNN's packed layout is chosen for (verification trees feed 2..32 rows; a
layout chosen for 8 was as fast at 1 and at 192 rows as one chosen for those, and a layout chosen
for 192 rows was 100x slower at one row in fp32)."""

MODES = ("packed", "transposed", "off")


def layout_mode() -> str:
    """``"packed"``, ``"transposed"`` or ``"off"`` from ``BOOSTTUNE_CPU_LINEAR`` (unset: ``packed``)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    modes = {"": "packed", "packed": "packed", "transposed": "transposed", "0": "off", "off": "off"}
    if value not in modes:
        raise ValueError(f"{ENV_VAR}={value!r}: use packed (the default: oneDNN-packed weights), transposed "
                         "(fp32 few-row inputs as (W @ x.T).T) or 0 (off)")
    return modes[value]


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies CPU ``dtype`` weights packed here (fp32 always where torch has
    oneDNN; bf16 where the CPU has native bf16)."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: Tensor) -> Tensor:
    """``weight`` (O, I) in oneDNN's blocked layout, for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack(weight)``; returns a contiguous (..., O)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def transposed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` computed as (W @ x.T).T; returns a contiguous (..., O)."""
    flat = x.reshape(-1, x.shape[-1])  # (R, I)
    if bias is None:
        out = weight @ flat.T  # (O, R)
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, flat.T)  # (O, R)
    return out.T.contiguous().view(*x.shape[:-1], weight.shape[0])  # (..., O)


def _fast_path(x: Tensor, weight: Tensor) -> bool:
    """Whether ``x`` may take a fast form: no grad, on the CPU, the weight's dtype and width.
    Checks the cheapest conditions first: every Linear call pays them."""
    return (not torch.is_grad_enabled() and x.dim() >= 1 and x.is_cpu and x.dtype == weight.dtype
            and x.shape[-1] == weight.shape[1] and x.numel() > 0)


class CpuLinear(nn.Linear):
    """An ``nn.Linear`` whose CPU inference calls take the faster form of its mode.

    Made only by :func:`install`, which swaps the class of existing modules (parameters, hooks and
    state-dict keys stay as they are).
    """

    _mode: str  # "packed", "transposed" or "off": what this layer does with a fast-path input
    _packed: Tensor | None
    _packed_key: tuple[int, int, torch.dtype] | None

    def forward(self, input: Tensor) -> Tensor:
        if self._mode != "off" and _fast_path(input, self.weight):
            if self._mode == "packed":
                return packed_linear(input, self.packed_weight(), self.bias)
            rows = input.numel() // input.shape[-1]
            if 2 <= rows <= MAX_ROWS:
                return transposed_linear(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)

    def packed_weight(self) -> Tensor:
        """The weight packed for oneDNN, packed again after any change of the weight (an inference
        tensor, made under ``torch.inference_mode``, has no version counter: a new tensor only)."""
        w = self.weight
        key = (w.data_ptr(), -1 if w.is_inference() else w._version, w.dtype)
        if key != self._packed_key:
            self._packed = pack(w)
            self._packed_key = key
        assert self._packed is not None
        return self._packed

    def set_mode(self, mode: str) -> None:
        """Use ``mode`` (one of ``MODES``; ``packed`` falls back to ``transposed`` for fp32 weights
        oneDNN cannot pack, and to ``off`` for other dtypes). A packed copy made before is kept."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        dtype = self.weight.dtype
        if mode == "packed" and not can_pack(dtype):
            mode = "transposed"
        if mode == "transposed" and dtype != torch.float32:
            mode = "off"
        self._mode = mode
        if not hasattr(self, "_packed_key"):
            self._packed = self._packed_key = None

    @property
    def mode(self) -> str:
        return self._mode

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight behind (oneDNN's opaque tensors cannot be
        copied); it is packed again at the copy's first inference call."""
        state = self.__dict__.copy()
        state["_packed"] = state["_packed_key"] = None
        return state


@dataclass(frozen=True)
class LayoutChoice:
    """What :func:`install` did.

    Attributes:
        modules: ``nn.Linear`` modules switched to :class:`CpuLinear` by this call.
        seconds: wall time of this call.
        modes: ``"O x I dtype"`` -> the mode its layers took, for the switched shapes.
    """

    modules: int
    seconds: float
    modes: dict[str, str]


def install(model: nn.Module) -> LayoutChoice:
    """Switch ``model``'s CPU ``nn.Linear`` modules to :class:`CpuLinear` in the environment's mode.

    Idempotent: modules switched before are skipped. Only exact ``nn.Linear`` modules are touched
    (a subclass, e.g. a quantised or LoRA layer, has its own forward to keep). Does nothing when
    ``BOOSTTUNE_CPU_LINEAR=0``. Weights are packed lazily, at a layer's first inference call.
    """
    start = time.perf_counter()
    mode = layout_mode()
    if mode == "off":
        return LayoutChoice(0, 0.0, {})
    switched: list[CpuLinear] = []
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            module.__class__ = CpuLinear
            assert isinstance(module, CpuLinear)
            module.set_mode(mode)
            switched.append(module)
    modes = {f"{m.out_features} x {m.in_features} {str(m.weight.dtype).removeprefix('torch.')}": m.mode
             for m in switched}
    return LayoutChoice(len(switched), time.perf_counter() - start, modes)


def set_mode(model: nn.Module, mode: str) -> None:
    """Put every :class:`CpuLinear` of ``model`` in ``mode`` (benchmarks and tests compare modes)."""
    for module in model.modules():
        if isinstance(module, CpuLinear):
            module.set_mode(mode)
