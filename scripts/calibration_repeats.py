#!/usr/bin/env python3
"""Does a bundle's fixed choice of drafters survive another calibration? And is the choice really faster?

A bundle serves every request with its scheduler's fixed choice (the per-request one where
cross-validation adopted it). That choice is the fastest per token by the cost model, which a calibration
times on a few prompts (``scheduler/calibrate.py``), and timings on a shared CPU move a few per cent
between calibrations. Where two choices come close, which one a run ships depends on its calibration.

This repeats ``--recost``'s calibration ``--repeats`` times on the bundle's forward (``--dtype``,
``--quantize``, ``--compile`` as in ``bench``) and prints, per repeat, the fixed choice it takes
(``Scheduler.recosted``) with the two next-fastest and their predicted tokens/s. Then, with
``--questions``, it times plain decoding and every choice that came first or second in any repeat, for
real, interleaved per question, and prints their tokens/s. Measured: docs/measurements.md,
"Calibration that repeats".

Usage:
    python scripts/calibration_repeats.py runs/demo-bundle [--repeats 4] [--dtype fp32] \\
        [--quantize w8a8 --compile] [--questions ../shared/data/mt_bench/question.jsonl --limit 30]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from boosttune import assemble
from boosttune.core.models import eos_token_ids
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.core.table import text_table
from boosttune.scheduler.policy import Candidate, Scheduler
from boosttune.serving.engine import Plan
from boosttune.serving.stops import StopCriteria


def ranked(sched: Scheduler, prompt_tokens: int, top: int = 3) -> list[tuple[Candidate, float, float, float]]:
    """The ``top`` fastest fixed choices by ``sched``'s costs for the mean training request (as
    ``Scheduler.recosted`` ranks them before its margin), each with its predicted tokens/s, τ and
    milliseconds per step."""
    tau, sec = sched.mean_request_costs(prompt_tokens)
    return [(sched.candidates[int(i)], float(1.0 / sec[i]), float(tau[i]), float(sec[i] * tau[i] * 1e3))
            for i in np.argsort(sec)[:top]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24, help="tokens per calibration run (training's calib_tokens)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--quantize", choices=("int8", "int4", "w8a8"))
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--questions", help="time the choices for real on these prompts (JSONL or text)")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    for flag, value in (("--repeats", args.repeats), ("--tokens", args.tokens), ("--limit", args.limit),
                        ("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    prompts = read_prompts(args.questions)[: args.limit] if args.questions else []
    torch.set_num_threads(args.threads)
    served = assemble.load(bundle=args.bundle, dtype=args.dtype)
    sched = served.scheduler
    if sched is None:
        ap.error(f"{args.bundle}: the bundle has no learned scheduler; there is no fixed choice to check")
    if args.quantize:
        assemble.quantize_served(served.engine, args.quantize)
    if args.compile:
        assemble.compile_served(served)
    tok = served.llm.tokenizer
    calib = [encode_prompt(tok, text) for text in assemble.CALIBRATION_PROMPTS[:2]]
    mean_prompt = round(sum(map(len, calib)) / len(calib))
    print(f"{args.bundle}: shipped fixed choice {sched.plan(sched.with_table(sched.fallback)).label} (margin {sched.margin:g})")

    rows, seen = [], {}
    for r in range(args.repeats):
        served.scheduler = sched  # each repeat recosts the bundle's scheduler afresh
        seconds = assemble.recost_served(served, calib, args.tokens)
        again = served.scheduler
        top = ranked(again, mean_prompt)
        for cand, *_ in top[:2]:
            seen.setdefault(again.with_table(cand), None)
        seen.setdefault(again.with_table(again.fallback), None)
        rows.append([r + 1, f"{seconds:.0f}", f"{again.costs.verify_s[0] * 1e3:.1f}",
                     again.plan(again.fallback).label,
                     *(f"{again.plan(c).label} {v:.2f} (τ {t:.2f}, {ms:.1f} ms)" for c, v, t, ms in top)])
        print(f"repeat {r + 1} done", file=sys.stderr, flush=True)
    print("\n".join(text_table([["repeat", "s", "plain step ms", "fixed choice", "fastest (tok/s)", "second",
                                  "third"], *[[str(c) for c in row] for row in rows]])))
    if not prompts:
        return 0

    plans = {"plain decoding": Plan(), **{sched.plan(c).label: sched.plan(c) for c in seen}}
    stop = StopCriteria(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_token_ids(served.llm))
    encoded = [encode_prompt(tok, p) for p in prompts]
    for plan in plans.values():  # lazy initialisation out of the timings
        served.engine.generate(encoded[0], StopCriteria(max_new_tokens=4), plan=plan)
    tokens, seconds = dict.fromkeys(plans, 0), dict.fromkeys(plans, 0.0)
    # after the prefill, as the costs predict them: tokens committed per step, and seconds per step (the
    # first step, which catches the drafters up on the prompt, left out)
    committed, steps = dict.fromkeys(plans, 0), dict.fromkeys(plans, 0)
    later_s, later = dict.fromkeys(plans, 0.0), dict.fromkeys(plans, 0)
    for ids in encoded:
        for name, plan in plans.items():
            start = time.perf_counter()
            res = served.engine.generate(ids, stop, plan=plan, record=True)
            seconds[name] += time.perf_counter() - start
            tokens[name] += len(res.tokens)
            committed[name] += sum(res.accept_lengths)
            steps[name] += len(res.accept_lengths)
            later_s[name] += sum(r.step_s for r in res.records[1:])
            later[name] += max(len(res.records) - 1, 0)
    plain = tokens["plain decoding"] / seconds["plain decoding"]
    rows = [[name, f"{tokens[name] / seconds[name]:.2f}", f"{tokens[name] / seconds[name] / plain:.3f}",
             f"{committed[name] / max(steps[name], 1):.2f}", f"{later_s[name] / max(later[name], 1) * 1e3:.1f}"]
            for name in plans]
    print("\n".join(text_table([["choice", "tok/s", "× plain", "τ", "ms per step"], *rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
