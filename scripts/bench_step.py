#!/usr/bin/env python3
"""Time one forward of the LLM as serving runs it: eager or compiled, unquantized or ``--quantize``d.

Loads the LLM (default: the embedded SmolLM2-135M) in ``--dtype``, makes the lean runner serving uses
(``serving/lean.py``), quantizes and compiles it as ``--quantize`` and ``--compile`` ask, prefills a
``--cache``-token prompt and times one forward of T new tokens (a chain, causal mask) for each T of
``--tokens``, cropping the cache back after each. Prints a markdown table of median ms per T.
Run it once per form, alone on the machine; to compare code versions, run each version's script in its
own clone one after the other.

Usage:
    python scripts/bench_step.py --compile                      # bf16, T = 1, 4, 8
    python scripts/bench_step.py --compile --quantize int4 --tokens 1,2,4,8,16
    python scripts/bench_step.py --batch 16 --tokens 1 --cache 150   # a batched server's plain step
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from boosttune.core.models import load_model, parse_dtype
from boosttune.serving.lean import LeanRunner, llm_runner
from boosttune.serving.quantize import SCHEMES


def step_times(runner: LeanRunner, cache: int, tokens: list[int], reps: int, batch: int = 1) -> dict[int, float]:
    """Median ms of one forward of T tokens after a ``cache``-token prefix, for each T; with ``batch`` > 1,
    of ``batch`` requests' forwards of T tokens each in one step (their caches in one pool, as a batched
    server's)."""
    gen = torch.Generator().manual_seed(0)
    if batch > 1:
        from boosttune.serving.lean import Feed, run_many

        pool = runner.new_pool(batch)
        runners = [runner.spawn(pool) for _ in range(batch)]
    else:
        runners = [runner]
    for r in runners:
        r.prefill(torch.randint(2, 1000, (cache,), generator=gen))
    out: dict[int, float] = {}
    for t in tokens:
        ids = torch.randint(2, 1000, (1, t), generator=gen)
        pos = torch.arange(cache, cache + t)[None]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        times = []
        for rep in range(reps + 5):  # five warm-up forwards
            for r in runners:
                r.crop(cache)
            start = time.perf_counter()
            if batch > 1:
                run_many([(r, Feed(ids, pos, cache, mask)) for r in runners])
            else:
                runner.forward(ids, pos, cache, mask)
            if rep >= 5:
                times.append((time.perf_counter() - start) * 1e3)
        out[t] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", default="default", help="the LLM (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="bf16", help="the LLM's dtype (default bf16)")
    ap.add_argument("--quantize", choices=SCHEMES, default=None, help="weight-only quantized products, as serve's")
    ap.add_argument("--compile", action="store_true", help="the compiled forward, as serve's --compile")
    ap.add_argument("--tokens", default="1,4,8", help="comma-separated T: tokens fed per forward (default 1,4,8)")
    ap.add_argument("--cache", type=int, default=60, help="tokens cached before each forward (default 60)")
    ap.add_argument("--reps", type=int, default=150, help="timed forwards per T; the median is shown (default 150)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--batch", type=int, default=1,
                    help="requests fed together in each forward, as a batched server's step (default 1)")
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise SystemExit(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
    if min(tokens) < 1 or args.cache < 1 or args.reps < 1 or args.threads < 1 or args.batch < 1:
        raise SystemExit("--tokens, --cache, --reps, --threads and --batch must be >= 1")
    torch.set_num_threads(args.threads)
    runner = llm_runner(load_model(args.llm, dtype=parse_dtype(args.dtype)).model)
    if not isinstance(runner, LeanRunner):
        raise SystemExit(f"{args.llm} does not run on the lean forward; nothing to time here")
    if args.quantize:
        runner.quantize(args.quantize)
    if args.compile:
        from boosttune.serving.compiled import compile_runner

        compile_s = compile_runner(runner, pooled=args.batch > 1)
        try:  # absent before the C++ op existed: the script also times older checkouts
            from boosttune.serving import native
            op = "yes" if native.available() else native.reason()
        except ImportError:
            op = "none in this version"
        print(f"# compiled in {compile_s:.1f} s; C++ op: {op}")
    times = step_times(runner, args.cache, tokens, args.reps, args.batch)
    form = f"{args.dtype}{' ' + args.quantize if args.quantize else ''}, {'compiled' if args.compile else 'eager'}"
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
          f"{form}; {args.batch} request(s) of a {args.cache}-token cache; median of {args.reps}")
    print("| tokens fed | ms |")
    print("|---|---|")
    for t, ms in times.items():
        print(f"| {t} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
