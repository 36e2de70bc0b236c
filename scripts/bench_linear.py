#!/usr/bin/env python3
"""Benchmark one LLM verification forward with the CPU GEMM-layout choice off, on and forced.

Loads the default LLM (SmolLM2-135M, fp32) on the CPU, prefills a 200-token cache through
``ModelRunner`` and times one forward of T new tokens (a chain) for T in 1, 2, 4, 8, 16, cropping
the cache back to 200 after each. Three settings of the model's Linear layers, interleaved
rep by rep so that load from other jobs hits all of them alike:

- off: plain ``nn.Linear`` (``F.linear`` everywhere),
- on: ``serving.cpu_linear`` as ModelRunner installs it (the layout timed per shape at load),
- forced: the transposed layout for every 2..32-row input (``BOOSTTUNE_CPU_LINEAR=1``).

Prints the calibration's time and choices, then a markdown table of median ms per setting and
the cost of T tokens relative to T = 1. Nothing is hard-coded; on a shared machine the figures
are noisy, so compare ratios from one run.

Usage:
    python scripts/bench_linear.py                 # 2 threads, 11 reps
    python scripts/bench_linear.py --threads 1 --reps 21
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn

from boosttune.core.models import load_model
from boosttune.serving import cpu_linear
from boosttune.serving.runner import ModelRunner

PREFIX = 200
SIZES = (1, 2, 4, 8, 16)
SETTINGS = ("off", "on", "forced")


def apply(linears: list[cpu_linear.SkinnyLinear], setting: str) -> None:
    """Put every switched Linear in ``setting`` (see the module docstring)."""
    if setting == "forced":
        os.environ[cpu_linear.ENV_VAR] = "1"
    else:
        os.environ.pop(cpu_linear.ENV_VAR, None)
    for m in linears:
        m.__class__ = nn.Linear if setting == "off" else cpu_linear.SkinnyLinear
        if setting != "off":
            m.forget_layout()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--reps", type=int, default=11, help="timed forwards per T and setting; the median is shown")
    args = ap.parse_args()
    if args.threads < 1 or args.reps < 1:
        raise SystemExit("--threads and --reps must be >= 1")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the CLI does
    os.environ.pop(cpu_linear.ENV_VAR, None)

    model = load_model("default").model
    start = time.perf_counter()
    runner = ModelRunner(model)  # installs the layout choice (calibration included)
    print(f"# ModelRunner with calibration: {time.perf_counter() - start:.2f} s "
          f"({platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__})")
    linears = [m for m in model.modules() if isinstance(m, cpu_linear.SkinnyLinear)]
    shapes = {(m.out_features, m.in_features): m for m in linears}
    for (o, i), m in sorted(shapes.items()):
        print(f"#   {o} x {i}: transposed at rows {sorted(m.layout_rows())}")

    g = torch.Generator().manual_seed(0)
    runner.forward_chain(torch.randint(0, 40000, (PREFIX,), generator=g))
    ms: dict[tuple[int, str], list[float]] = {(t, s): [] for t in SIZES for s in SETTINGS}
    for t in SIZES:
        ids = torch.randint(0, 40000, (t,), generator=g)
        for _ in range(args.reps):
            for setting in SETTINGS:
                apply(linears, setting)
                t0 = time.perf_counter()
                runner.forward_chain(ids)
                ms[t, setting].append((time.perf_counter() - t0) * 1e3)
                runner.crop(PREFIX)
    apply(linears, "on")

    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"\nLLM forward, {PREFIX}-token cache, median of {args.reps} (ms; x = relative to T = 1 of the same setting)\n")
    print("| T | off | on (timed choice) | forced (all 2..32 rows) | on / off | forced / off |")
    print("|---|---|---|---|---|---|")
    for t in SIZES:
        cells = [f"{med[t, s]:.1f} ({med[t, s] / med[1, s]:.2f}x)" for s in SETTINGS]
        print(f"| {t} | {' | '.join(cells)} | {med[t, 'on'] / med[t, 'off']:.2f} | "
              f"{med[t, 'forced'] / med[t, 'off']:.2f} |")


if __name__ == "__main__":
    main()
