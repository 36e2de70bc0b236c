#!/usr/bin/env python3
"""Benchmark one LLM verification forward with each CPU Linear form: F.linear, packed, transposed.

Loads the default LLM (SmolLM2-135M) on the CPU in ``--dtype``, prefills a 200-token cache through
``ModelRunner`` and times one forward of T new tokens (a chain) for T in 1, 2, 4, 8, 16, 32,
cropping the cache back to 200 after each. The model's Linear layers take each form of
``serving.cpu_linear`` in turn, interleaved rep by rep so that load from other jobs hits all of
them alike:

- off: plain ``nn.Linear`` (``F.linear`` everywhere),
- packed: weights packed for oneDNN (the default where oneDNN can),
- transposed: ``(W @ x.T).T`` for 2..32 rows (fp32 only; the fallback).

Prints a markdown table of median ms per form, with the cost of T tokens relative to T = 1 of the
same form. Nothing is hard-coded; on a shared machine the figures are noisy, so compare ratios
from one run.

Usage:
    python scripts/bench_linear.py                 # fp32, 2 threads, 11 reps
    python scripts/bench_linear.py --dtype bf16 --threads 1 --reps 21
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from boosttune.core.models import load_model, parse_dtype
from boosttune.serving import cpu_linear
from boosttune.serving.runner import ModelRunner

PREFIX = 200
SIZES = (1, 2, 4, 8, 16, 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", help="the LLM's dtype: fp32 (default) or bf16")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--reps", type=int, default=11, help="timed forwards per T and form; the median is shown")
    args = ap.parse_args()
    if args.threads < 1 or args.reps < 1:
        raise SystemExit("--threads and --reps must be >= 1")
    dtype = parse_dtype(args.dtype)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the CLI does
    os.environ.pop(cpu_linear.ENV_VAR, None)

    model = load_model("default", dtype=dtype).model
    runner = ModelRunner(model)
    forms = ["off", "packed"] + (["transposed"] if dtype == torch.float32 else [])
    if not cpu_linear.can_pack(dtype):
        forms.remove("packed")
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"{args.dtype}; forms: {', '.join(forms)}")

    g = torch.Generator().manual_seed(0)
    runner.forward_chain(torch.randint(0, 40000, (PREFIX,), generator=g))
    ms: dict[tuple[int, str], list[float]] = {(t, f): [] for t in SIZES for f in forms}
    for t in SIZES:
        ids = torch.randint(0, 40000, (t,), generator=g)
        for _ in range(args.reps):
            for form in forms:
                cpu_linear.set_mode(model, form)
                runner.forward_chain(ids)  # packs the weights when the form needs them; not timed
                runner.crop(PREFIX)
                t0 = time.perf_counter()
                runner.forward_chain(ids)
                ms[t, form].append((time.perf_counter() - t0) * 1e3)
                runner.crop(PREFIX)
    cpu_linear.set_mode(model, cpu_linear.layout_mode())

    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"\nLLM forward, {PREFIX}-token cache, median of {args.reps} (ms; x = relative to T = 1 of the same form)\n")
    print("| T | " + " | ".join(forms) + " | " + " | ".join(f"{f} / off" for f in forms[1:]) + " |")
    print("|---" * (2 * len(forms)) + "|")
    for t in SIZES:
        cells = [f"{med[t, f]:.1f} ({med[t, f] / med[1, f]:.2f}x)" for f in forms]
        ratios = [f"{med[t, f] / med[t, 'off']:.2f}" for f in forms[1:]]
        print(f"| {t} | {' | '.join(cells + ratios)} |")


if __name__ == "__main__":
    main()
