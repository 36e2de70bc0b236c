#!/usr/bin/env python3
"""Benchmark the default LLM's matrix products in quantized forms against oneDNN's packed bf16.

Does a weight-only int8 or int4 LLM pay on this CPU? A plain decoding step reads every weight
once, so halving the bytes read should speed it up; a verification forward feeds 2..32 rows, where
a product's cost depends on how the kernel handles several rows. This script answers it for the
kernels torch ships, before any serving code is written around them.

Loads the default LLM (SmolLM2-135M) in bf16 and takes its Linear weights (every layer's q, k, v, o,
gate, up and down projections and the tied LM head) in these forms:

- bf16 packed: oneDNN's packed product (``serving.cpu_linear``), what serving uses today;
- int8 weight-only: ``serving.quantize.QuantLinear`` (per-output-channel scales), what ``--quantize
  int8`` serves: our kernel ``boosttune_native::int8_mm`` where it is built (``serving/native_ops.cpp``),
  else torch's ``aten._weight_int8pack_mm``;
- int8 weight-only through torch's kernel, ``aten._weight_int8pack_mm``, on the same codes;
- int4 weight-only: ``QuantLinear`` with groups of ``--group`` inputs (``--quantize int4`` uses 32),
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``;
- int8 weights and int8 inputs: each input row quantized on the fly with its own scale (so rows
  stay independent of one another), ``torch._int_mm``, rescaled to bf16;
- w8a8: ``QuantLinear`` with int8 weights and int8 inputs per block of up to 256 (``--quantize w8a8``),
  ``boosttune_native::w8a8_mm`` (AMX tiles, else VNNI) where it is built.

For each row count R in 1, 2, 4, 8, 16, 32 it times all the products once (random bf16 inputs of R
rows), forms interleaved rep by rep so that load from other jobs hits them alike, and prints a
markdown table of median ms, then each quantized form's relative error against bf16 on the same
inputs (||y_q - y|| / ||y||, over all products at R = 8).

Usage:
    python scripts/bench_quant_linear.py                  # 2 threads, 11 reps
    python scripts/bench_quant_linear.py --threads 1 --reps 21 --group 64
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from boosttune.core.models import load_model
from boosttune.serving import cpu_linear
from boosttune.serving.quantize import QuantLinear, int8_codes, shape_reason

SIZES = (1, 2, 4, 8, 16, 32)


def int8_rows(x: Tensor, q_t: Tensor, scale: Tensor) -> Tensor:
    """``x`` (R, I) bf16 times the int8 weight ``q_t`` (I, O) with per-row int8 inputs, to bf16."""
    xf = x.float()
    sx = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127  # (R, 1)
    xq = torch.round(xf / sx).to(torch.int8)
    return (torch._int_mm(xq, q_t).float() * sx * scale.float()).to(torch.bfloat16)


def forms(weights: list[Tensor], group: int) -> dict[str, list[Callable[[Tensor], Tensor]]]:
    """Per form, one product per weight taking an (R, I) bf16 input."""
    packed = [cpu_linear.pack(w) for w in weights]
    q8 = [QuantLinear.from_weight(w, "int8") for w in weights]
    q4 = [QuantLinear.from_weight(w, "int4", group) for w in weights]
    # w8a8 where every product takes it (in_features a multiple of 64)
    w8a8 = [QuantLinear.from_weight(w, "w8a8") for w in weights] if not any(
        shape_reason(*w.shape, "w8a8") for w in weights) else []
    rows8 = [(codes.t().contiguous().t(), scale) for codes, scale in map(int8_codes, weights)]  # (I, O) column-major views
    return {
        "bf16 packed": [lambda x, p=p: cpu_linear.packed_linear(x, p) for p in packed],
        "int8 weights": list(q8),
        "int8 weights, torch's kernel": [lambda x, q=q: torch.ops.aten._weight_int8pack_mm(x, q.packed, q.scales)
                                         for q in q8],
        f"int4 weights (group {group})": list(q4),
        "int8 weights and rows": [lambda x, q=q, s=s: int8_rows(x, q.t(), s) for q, s in rows8],
        **({"w8a8": list(w8a8)} if w8a8 else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", default="default", help="the LLM whose products are timed (default: the embedded SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--reps", type=int, default=11, help="timed passes per R and form; the median is shown")
    ap.add_argument("--group", type=int, default=32, help="int4 group size (32, 64 or 128; default 32, as --quantize int4)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.reps < 1 or args.group not in (32, 64, 128):
        raise SystemExit("--threads and --reps must be >= 1, --group one of 32, 64, 128")
    if not cpu_linear.can_pack(torch.bfloat16):
        raise SystemExit("this CPU has no native bf16 for oneDNN: the comparison would be against F.linear")
    torch.set_num_threads(args.threads)
    model = load_model(args.llm, dtype=torch.bfloat16).model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [m.weight.detach() for m in linears]  # includes the LM head (tied to the embeddings)
    mb = sum(w.numel() for w in weights) * 2 / 1e6
    products = forms(weights, args.group)
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
          f"{len(weights)} products, {mb:.0f} MB of bf16 weights; median ms for all products once")
    gen = torch.Generator().manual_seed(0)
    rows: dict[int, dict[str, float]] = {}
    errors: dict[str, float] = {}
    with torch.inference_mode():
        for r in SIZES:
            inputs = [torch.randn(r, w.shape[1], generator=gen).to(torch.bfloat16) for w in weights]
            times: dict[str, list[float]] = {name: [] for name in products}
            for rep in range(args.reps + 2):
                for name, fns in products.items():
                    start = time.perf_counter()
                    for fn, x in zip(fns, inputs, strict=True):
                        fn(x)
                    if rep >= 2:  # two warm-up passes
                        times[name].append((time.perf_counter() - start) * 1e3)
            rows[r] = {name: statistics.median(t) for name, t in times.items()}
            if r == 8:
                ref = [f(x).float() for f, x in zip(products["bf16 packed"], inputs, strict=True)]
                for name, fns in products.items():
                    num = sum(float((f(x).float() - y).norm() ** 2) for f, x, y in zip(fns, inputs, ref, strict=True))
                    errors[name] = (num / sum(float(y.norm() ** 2) for y in ref)) ** 0.5
    names = list(products)
    print("| rows R | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for r, t in rows.items():
        print(f"| {r} | " + " | ".join(f"{t[n]:.1f}" for n in names) + " |")
    print("\nrelative error against bf16 packed at R = 8: "
          + ", ".join(f"{n} {errors[n]:.4f}" for n in names if n != "bf16 packed"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
