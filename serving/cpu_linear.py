"""Pick, per Linear weight shape, the faster CPU GEMM layout for inputs of a few rows.

Shape legend: R rows fed at once (the product of an input's leading dimensions), I in_features,
O out_features.

Tree verification feeds the LLM R = 2..32 tokens in one forward. On the CPU this project was
measured on (AMD EPYC, AVX2 only, 2 threads, torch 2.13 with MKL, fp32), ``F.linear(x, W)``
(= x @ W.T) with so few rows is much slower than the equal ``(W @ x.T).T``: MKL's skinny-GEMM
path handles the first form badly on this CPU. Measured on this machine, SmolLM2-135M's LM head
(W 49152 x 576): R = 1 ~9-13 ms either way; R = 2..4 x @ W.T 22-26 ms, W @ x.T 7.4 ms; R = 8
29.6 vs 13.9 ms. Forcing the second form on every Linear of SmolLM2-135M for 2..32 rows took a
whole forward (200 cached tokens) from 125.8 to 98.0 ms at T = 2, 124.4 -> 106.9 at T = 4 and
159.6 -> 123.2 at T = 16, T = 1 unchanged (~74-88 ms; a busy machine, so the figures are noisy).

Which form wins on one weight in isolation depends on the shape and on R in no simple way (for the
576-wide body layers the transposed form wins at R <= 4 and at R = 16 and 32, and loses in
between); with ``auto`` :func:`install` times both at load time, per distinct (O, I, dtype, bias, threads), and swaps the model's
``nn.Linear`` modules for :class:`SkinnyLinear`, which uses the transposed form only for the row
counts where it was measurably faster. Everything else stays ``F.linear``: 1 row, more than
``MAX_ROWS`` rows, grad mode on (training and autograd see plain ``nn.Linear`` behaviour), inputs
off the CPU (a model moved to a GPU later) and dtype mismatches.

Calibration is bounded: each key gets about ``_BUDGET_S`` seconds; row counts are timed coarse to
fine (2, 4, 8, 16, 32, then 3, 6, 12, 24, then the rest) and an untimed count takes the choice of
the nearest timed one, so a cheap layer is timed at every count and the 49152-row head at a few.
Choices are cached per process, so models sharing shapes (an LLM and its SSMs) calibrate once, and
a later change of ``torch.get_num_threads()`` recalibrates lazily at the next few-row forward.
The timings use hot caches for the small layers, whereas a real forward streams their weights from
memory; the choice is a heuristic and never changes results beyond fp32 rounding.

The timed choice proved a poor predictor of whole forwards (helper's bench, quiet machine,
SmolLM2-135M fp32, 200 cached tokens; ms off / timed / transposed everywhere: T = 2 106.8 / 109.0 /
75.3, T = 4 121.5 / 81.5 / 80.9, T = 16 170.1 / 153.0 / 139.7), so the default takes the transposed
form for every fp32 weight at 2..MAX_ROWS rows without timing, and leaves other dtypes (bf16 on
AMX CPUs, not measured here) to ``F.linear``.

Environment ``BOOSTTUNE_CPU_LINEAR``: unset or ``fp32`` is the default above; ``0`` turns it off
(``install`` leaves the model alone); ``1`` uses the transposed form for every dtype; ``auto``
times both forms per shape at load.
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
"""Largest row count that may take the transposed form (a verification tree's size)."""

_BUDGET_S = 0.1  # calibration time per key, about; the last probe may overrun it
_MARGIN = 0.95  # the transposed form must be 5% faster: ties keep F.linear
_CHEAP_S = 2e-3  # a pair of calls cheaper than this is timed three times (noise), else once or twice
_AMBIGUOUS = (0.8, 1.25)  # a single timing whose ratio falls here is repeated
_PROBE_ORDER = (2, 4, 8, 16, 32, 3, 6, 12, 24) + tuple(
    r for r in range(5, MAX_ROWS + 1) if r not in (2, 4, 8, 16, 32, 3, 6, 12, 24)
)
_ALL_ROWS = frozenset(range(2, MAX_ROWS + 1))

_Key = tuple[int, int, torch.dtype, bool, int]
_CHOICES: dict[_Key, frozenset[int]] = {}  # process-wide: the CPU is too


def layout_mode() -> str:
    """``"off"``, ``"on"`` or ``"auto"`` from ``BOOSTTUNE_CPU_LINEAR``."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    modes = {"0": "off", "1": "on", "": "fp32", "fp32": "fp32", "auto": "auto"}
    if value not in modes:
        raise ValueError(f"{ENV_VAR}={value!r}: use 0 (off), 1 (always on), fp32 (the default: fp32 weights "
                         "only) or auto (timed at load)")
    return modes[value]


def transposed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` computed as (W @ x.T).T; returns a contiguous (..., O)."""
    flat = x.reshape(-1, x.shape[-1])  # (R, I)
    if bias is None:
        out = weight @ flat.T  # (O, R)
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, flat.T)  # (O, R)
    return out.T.contiguous().view(*x.shape[:-1], weight.shape[0])  # (..., O)


def _timed_pair(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[float, float]:
    """Seconds of one F.linear call and one transposed call, back to back."""
    t0 = time.perf_counter()
    F.linear(x, weight, bias)
    t1 = time.perf_counter()
    transposed_linear(x, weight, bias)
    return t1 - t0, time.perf_counter() - t1


def calibrate(weight: Tensor, bias: Tensor | None = None, budget_s: float = _BUDGET_S) -> frozenset[int]:
    """Row counts in 2..MAX_ROWS for which the transposed form beat F.linear on ``weight``.

    Times both forms on random inputs of ``weight``'s dtype, coarse to fine until ``budget_s`` is
    spent, and gives an untimed count the choice of the nearest timed one (the smaller on a tie).
    """
    out_f, in_f = weight.shape
    if out_f == 0 or in_f == 0:
        return frozenset()
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        xs = torch.randn(MAX_ROWS, in_f, generator=gen).to(weight.dtype)  # (MAX_ROWS, I)
        _timed_pair(xs[:2], weight, bias)  # first calls pay one-off set-up
        wins: dict[int, bool] = {}
        start = time.perf_counter()
        for r in _PROBE_ORDER:
            if wins and time.perf_counter() - start > budget_s:
                break
            plain, flipped = _timed_pair(xs[:r], weight, bias)
            extra = 2 if plain + flipped < _CHEAP_S else int(_AMBIGUOUS[0] < flipped / plain < _AMBIGUOUS[1])
            for _ in range(extra):
                p, f = _timed_pair(xs[:r], weight, bias)
                plain, flipped = min(plain, p), min(flipped, f)
            wins[r] = flipped < _MARGIN * plain
    timed = sorted(wins)
    return frozenset(r for r in _ALL_ROWS if wins[min(timed, key=lambda t: (abs(t - r), t))])


def transposed_rows(weight: Tensor, bias: Tensor | None = None) -> frozenset[int]:
    """Row counts for which :func:`linear` uses the transposed form on ``weight`` (CPU, no grad).

    Cached per (O, I, dtype, bias, threads); a miss calibrates on ``weight`` itself.
    """
    mode = layout_mode()
    if mode == "fp32":
        return _ALL_ROWS if weight.dtype == torch.float32 else frozenset()
    if mode != "auto":
        return _ALL_ROWS if mode == "on" else frozenset()
    key = (*weight.shape, weight.dtype, bias is not None, torch.get_num_threads())
    if key not in _CHOICES:
        _CHOICES[key] = calibrate(weight, bias)
    return _CHOICES[key]


def _candidate_rows(x: Tensor, weight: Tensor) -> int:
    """R when the transposed form may apply to ``x`` (no grad, CPU, 2 <= R <= MAX_ROWS, the weight's
    dtype and width), else 0. Checks the cheapest conditions first: every Linear call pays them."""
    if torch.is_grad_enabled() or x.dim() < 2:
        return 0
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if rows < 2 or rows > MAX_ROWS or not x.is_cpu or width != weight.shape[1] or x.dtype != weight.dtype:
        return 0
    return rows


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` in the faster layout for ``weight`` (the transposed one where calibrated)."""
    rows = _candidate_rows(x, weight)
    if rows and rows in transposed_rows(weight, bias):
        return transposed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class SkinnyLinear(nn.Linear):
    """An ``nn.Linear`` that feeds few-row inference inputs through the faster GEMM layout.

    Made only by :func:`install`, which swaps the class of existing modules (parameters, hooks and
    state-dict keys stay as they are). The chosen row counts are kept on the module and refreshed
    when the torch thread count changes.
    """

    _layout_threads: int
    _layout_rows: frozenset[int]

    def forward(self, input: Tensor) -> Tensor:
        rows = _candidate_rows(input, self.weight)
        if rows and rows in self.layout_rows():
            return transposed_linear(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)

    def layout_rows(self) -> frozenset[int]:
        """Row counts that take the transposed form at the current thread count."""
        threads = torch.get_num_threads()
        if threads != self._layout_threads:
            self._layout_rows = transposed_rows(self.weight, self.bias)
            self._layout_threads = threads
        return self._layout_rows

    def forget_layout(self) -> None:
        """Drop the kept choice; the next few-row forward looks it up again (after a change of
        ``BOOSTTUNE_CPU_LINEAR``, say)."""
        self._layout_threads = -1
        self._layout_rows = frozenset()


@dataclass(frozen=True)
class LayoutChoice:
    """What :func:`install` did.

    Attributes:
        modules: ``nn.Linear`` modules switched to :class:`SkinnyLinear` by this call.
        seconds: wall time of this call (calibration included).
        rows: ``"O x I dtype"`` -> the row counts taking the transposed form, for the switched shapes.
    """

    modules: int
    seconds: float
    rows: dict[str, tuple[int, ...]]


def install(model: nn.Module) -> LayoutChoice:
    """Switch ``model``'s CPU ``nn.Linear`` modules to :class:`SkinnyLinear`, calibrating new shapes.

    Idempotent: modules switched before are skipped. Only exact ``nn.Linear`` modules are touched
    (a subclass, e.g. a quantised or LoRA layer, has its own forward to keep). Does nothing when
    ``BOOSTTUNE_CPU_LINEAR=0``.
    """
    start = time.perf_counter()
    if layout_mode() == "off":
        return LayoutChoice(0, 0.0, {})
    switched: list[SkinnyLinear] = []
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            module.__class__ = SkinnyLinear
            assert isinstance(module, SkinnyLinear)
            module.forget_layout()
            switched.append(module)
    rows = {f"{m.out_features} x {m.in_features} {str(m.weight.dtype).removeprefix('torch.')}":
            tuple(sorted(m.layout_rows())) for m in switched}
    return LayoutChoice(len(switched), time.perf_counter() - start, rows)

