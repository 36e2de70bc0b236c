#!/usr/bin/env python3
"""Time the quantized products of two builds of ``serving/native_ops.cpp`` side by side, in one process.

A shared 2-core machine drifts by up to 1.5x within minutes, so two builds timed one after the other can
hide a 25 % difference or invent one. This script builds a git revision's ``native_ops.cpp`` beside the
working tree's (its ops renamed to ``boosttune_native_base``), feeds both the LLM's products as the lean
runner serves them (fused q/k/v and gate/up, the LM head) at each row count, alternating the builds rep by
rep, says whether they give the same outputs bit for bit, and prints a markdown table of median ms for all
the products once, with the ratio of the working tree's to the revision's.

Usage:
    python scripts/bench_native_builds.py --against HEAD~1                # w8a8, fp32 inputs
    python scripts/bench_native_builds.py --against abc1234 --scheme int8 --rows 1,8 --reps 31
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig

from boosttune.core.models import resolve_model_path
from boosttune.serving import native
from boosttune.serving.quantize import QuantLinear

BASE_OPS = "boosttune_native_base"


def product_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of every product of one step of a LLaMA-shaped LLM, fused as the lean runner fuses them."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    layer = [(config.num_attention_heads * head_dim + 2 * kv, h), (h, config.num_attention_heads * head_dim),
             (2 * inter, h), (h, inter)]
    return layer * config.num_hidden_layers + [(config.vocab_size, h)]


def build_revision(rev: str, repo: Path) -> None:
    """Build ``rev``'s native_ops.cpp as ``torch.ops.boosttune_native_base``."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:serving/native_ops.cpp"], cwd=repo, check=True,
                                capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--against {rev!r}: git cannot show serving/native_ops.cpp there ({e.stderr.strip()})") from None
    with tempfile.TemporaryDirectory(prefix="native_base_") as build:  # loaded, the library needs no file
        path = Path(build) / "native_ops_base.cpp"
        path.write_text(source.replace("boosttune_native", BASE_OPS))
        native.build(BASE_OPS, path, build)


def product_fn(ops: str, scheme: str):
    """f(x, QuantLinear) calling namespace ``ops``'s kernel for ``scheme``."""
    lib = getattr(torch.ops, ops)
    if scheme == "w8a8":
        return lambda x, q: lib.w8a8_mm(x, q.packed, q.scales, q.group)
    return lambda x, q: lib.int8_mm(x, q.packed, q.scales.to(x.dtype))


def time_all(f, inputs: dict[int, Tensor], products: list[QuantLinear]) -> float:
    start = time.perf_counter()
    for q in products:
        f(inputs[q.in_features], q)
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the git revision whose native_ops.cpp is the baseline")
    ap.add_argument("--llm", default="default", help="the LLM whose product shapes are timed (its config is enough; default: the embedded SmolLM2-135M)")
    ap.add_argument("--scheme", choices=("w8a8", "int8"), default="w8a8", help="which kernel (default w8a8)")
    ap.add_argument("--rows", default="1,2,4,8,12,16", help="comma-separated row counts (default 1,2,4,8,12,16)")
    ap.add_argument("--reps", type=int, default=21, help="reps per build and row count; the median is shown (default 21)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise SystemExit(f"--rows must be comma-separated integers, got {args.rows!r}") from None
    if min(rows) < 1 or args.reps < 1 or args.threads < 1:
        raise SystemExit("--rows, --reps and --threads must be >= 1")
    if not native.available():
        raise SystemExit(f"the working tree's native ops did not build here: {native.reason()}")
    torch.set_num_threads(args.threads)
    build_revision(args.against, Path(__file__).resolve().parents[1])
    config = AutoConfig.from_pretrained(resolve_model_path(args.llm))
    gen = torch.Generator().manual_seed(0)
    made = {s: QuantLinear.from_weight(torch.randn(*s, generator=gen) * 0.05, args.scheme)
            for s in set(product_shapes(config))}
    products = [made[s] for s in product_shapes(config)]
    builds = {"revision": product_fn(BASE_OPS, args.scheme), "working tree": product_fn("boosttune_native", args.scheme)}
    times: dict[tuple[str, int], list[float]] = {(b, r): [] for b in builds for r in rows}
    differ = 0.0  # a kernel that sums in another order may round otherwise: said, not refused
    for r in rows:
        inputs = {i: torch.randn(r, i, generator=gen) for i in {q.in_features for q in products}}
        for q in made.values():
            a, b = (f(inputs[q.in_features], q) for f in builds.values())
            differ = max(differ, float((a - b).abs().max()))
    for rep in range(args.reps):
        for r in rows:
            inputs = {i: torch.randn(r, i, generator=gen) for i in {q.in_features for q in products}}
            for name in (list(builds) if rep % 2 else list(builds)[::-1]):
                times[name, r].append(time_all(builds[name], inputs, products))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
          f"{args.scheme}, fp32 inputs; {len(products)} products; builds alternated, median of {args.reps}; "
          + ("outputs equal bit for bit" if differ == 0 else f"outputs differ by up to {differ:.3g}"))
    print("| rows | " + " | ".join(str(r) for r in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    print(f"| {args.against} (ms) | " + " | ".join(f"{med['revision', r]:.2f}" for r in rows) + " |")
    print("| working tree (ms) | " + " | ".join(f"{med['working tree', r]:.2f}" for r in rows) + " |")
    print("| ratio | " + " | ".join(f"{med['working tree', r] / med['revision', r]:.3f}" for r in rows) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
