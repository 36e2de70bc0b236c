#!/usr/bin/env python3
"""Benchmark tree attention and the cost of one tree-verification forward; prints markdown tables.

Part 1, kernel: the Triton tree-attention kernel (``tree_attention_triton``) against the PyTorch
reference (``tree_attention_reference``: SDPA with a bool mask), B = 1, for attention shapes of
LLaMA-2-7B and SmolLM2-135M, committed prefix P in (512, 2048, 8192) and T in (1, 8, 32, 64) new
tree tokens under a random tree mask. The kernel is timed twice: forced single pass
(``num_splits=1``) and with its automatic split-K choice (the default; the "auto splits" column
says how many key splits it launched, 1 = the single pass again; always 1 off CUDA). Reports
microseconds, the speed ratios and the max abs error of each against an fp32 reference computed
from the same (rounded) inputs.

Part 2, verification cost: a randomly initialised LlamaForCausalLM with LLaMA-2-7B dimensions,
prefilled with P = 512 tokens through ``ModelRunner``, then one verification forward of T tokens
(T in 1..64, a chain tree) timed with our tree attention (the runner's registered attention) and
with HF's own sdpa attention given an equivalent 4-D bool mask; ms and the ratio to T = 1.

Every figure is measured on the run; nothing is hard-coded. On CUDA, timings use
``triton.testing.do_bench`` (median; falls back to CUDA events without triton); on the CPU, a
plain timer loop (median). On the CPU the Triton kernel runs only under TRITON_INTERPRET=1 (very
slow: use with --small); otherwise its columns say why they are empty.

Usage:
    python scripts/bench_kernels.py                       # cuda if available, full sizes
    python scripts/bench_kernels.py --device cpu --small  # tiny sizes, runs on a CPU in < 1 min
    python scripts/bench_kernels.py --out bench.json      # also write the tables as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Run from a checkout without installing: pyproject.toml maps the repo's top-level folders serving/,
# scheduler/, data/ onto boosttune.<name> ([tool.setuptools.package-dir]). Without an
# install, the same mapping is had by adding the repo root to boosttune's package __path__.
_REPO = Path(__file__).resolve().parents[1]


def _ensure_boosttune_importable() -> None:
    try:
        import boosttune.kernels  # noqa: F401
        import boosttune.serving  # noqa: F401
    except ModuleNotFoundError:
        if str(_REPO) not in sys.path:
            sys.path.insert(0, str(_REPO))
        import boosttune

        if str(_REPO) not in boosttune.__path__:
            boosttune.__path__.append(str(_REPO))


_ensure_boosttune_importable()

from boosttune.kernels import tree_attention_triton as tat  # noqa: E402
from boosttune.kernels.tree_attention import full_mask, tree_attention_reference  # noqa: E402
from boosttune.serving.runner import cache_keyword  # noqa: E402
from boosttune.serving.tree import ancestor_mask  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Shapes (borrowed numbers, with their sources)
# ------------------------------------------------------------------------------------------------

# LLaMA-2-7B: 32 layers, hidden 4096, 32 attention heads (no GQA at 7B), so head dim 128; context
# 4096. Touvron et al. 2023, "Llama 2", arXiv 2307.09288 (the architecture of LLaMA 1, Touvron et
# al. 2023, arXiv 2302.13971, Table 2). Intermediate size 11008 and vocabulary 32000 are from the
# released config.json of meta-llama/Llama-2-7b-hf.
LLAMA2_7B = dict(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000, context=4096)
# SmolLM2-135M: hidden 576, 9 query heads, 3 kv heads, head dim 64 (HuggingFaceTB/SmolLM2-135M
# config.json; Allal et al. 2025, arXiv 2502.02737). The same numbers are in the config this
# project converts from the default LLM's GGUF (boosttune.core.models).
SMOLLM2_135M = dict(heads=9, kv_heads=3, head_dim=64)

KERNEL_SHAPES = {  # name -> (H, Hkv, C)
    "llama2-7b": (LLAMA2_7B["heads"], LLAMA2_7B["kv_heads"], LLAMA2_7B["hidden"] // LLAMA2_7B["heads"]),
    "smollm2-135m": (SMOLLM2_135M["heads"], SMOLLM2_135M["kv_heads"], SMOLLM2_135M["head_dim"]),
}
KERNEL_PREFIXES = (512, 2048, 8192)
KERNEL_TOKENS = (1, 8, 32, 64)
VERIFY_PREFIX = 512
VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64)

# --small: tiny stand-ins with the same structure (MHA and GQA), for testing the script on a CPU.
SMALL_KERNEL_SHAPES = {"tiny-mha": (4, 4, 32), "tiny-gqa": (3, 1, 16)}
SMALL_KERNEL_PREFIXES = (32, 128)
SMALL_KERNEL_TOKENS = (1, 8)
SMALL_MODEL = dict(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=256, context=512)
SMALL_VERIFY_PREFIX = 64

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 3,
    reps: int = 20,
    budget_ms: float = 100.0,
) -> float:
    """Median milliseconds of one ``fn()`` call, after warm-up, with the device synchronised."""
    _sync(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            ms = do_bench(fn, warmup=25, rep=max(25, int(budget_ms)), return_mode="median")
            _sync(device)
            return float(ms)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    deadline = time.perf_counter() + budget_ms / 1000.0
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
        if i >= 2 and time.perf_counter() > deadline:
            break
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------
# Part 1: the kernel
# ------------------------------------------------------------------------------------------------


def random_tree_mask(t: int, g: torch.Generator) -> torch.Tensor:
    """(T, T) bool ancestor mask of a random tree of T nodes in topological order (self included)."""
    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(t)]
    return ancestor_mask(torch.tensor(parents, dtype=torch.long))


def triton_status(device: torch.device) -> str | None:
    """None if the Triton kernel can run here, else why not."""
    if not tat.HAS_TRITON:
        return "triton not installed"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    return "Triton needs CUDA (or TRITON_INTERPRET=1)"


def bench_kernel(
    device: torch.device, dtype: torch.dtype, small: bool, seed: int = 0
) -> tuple[list[dict], str | None]:
    shapes = SMALL_KERNEL_SHAPES if small else KERNEL_SHAPES
    prefixes = SMALL_KERNEL_PREFIXES if small else KERNEL_PREFIXES
    tokens = SMALL_KERNEL_TOKENS if small else KERNEL_TOKENS
    why_not = triton_status(device)
    interp = device.type != "cuda" and why_not is None
    rows = []
    g = torch.Generator().manual_seed(seed)
    for name, (h, hkv, c) in shapes.items():
        for p in prefixes:
            for t in tokens:
                s = p + t
                q = torch.randn(1, h, t, c, generator=g).to(device=device, dtype=dtype)
                k = torch.randn(1, hkv, s, c, generator=g).to(device=device, dtype=dtype)
                v = torch.randn(1, hkv, s, c, generator=g).to(device=device, dtype=dtype)
                mask = random_tree_mask(t, g).to(device)
                scale = c**-0.5
                exact = tree_attention_reference(q.float(), k.float(), v.float(), p, mask, scale)
                ref_out = tree_attention_reference(q, k, v, p, mask, scale)
                ref_ms = time_ms(
                    lambda q=q, k=k, v=v, p=p, m=mask, sc=scale: tree_attention_reference(q, k, v, p, m, sc),
                    device,
                )
                row = dict(
                    shape=name,
                    H=h,
                    Hkv=hkv,
                    C=c,
                    P=p,
                    T=t,
                    ref_us=ref_ms * 1000.0,
                    ref_err=float((ref_out.float() - exact).abs().max()),
                    triton_us=None,  # single pass (num_splits=1)
                    triton_err=None,
                    speedup=None,  # ref / single pass
                    splits=None,  # key splits the automatic choice launches (1 = single pass)
                    triton_auto_us=None,
                    triton_auto_err=None,
                    speedup_auto=None,  # ref / automatic
                )
                if why_not is None:
                    row["splits"] = tat.choose_num_splits(q, k)
                    for key, ns in (("triton", 1), ("triton_auto", None)):
                        tri_out = tat.tree_attention_triton(q, k, v, p, mask, scale, num_splits=ns)
                        _sync(device)
                        row[f"{key}_err"] = float((tri_out.float() - exact).abs().max())
                        tri_ms = time_ms(
                            lambda q=q, k=k, v=v, p=p, m=mask, sc=scale, ns=ns: tat.tree_attention_triton(
                                q, k, v, p, m, sc, num_splits=ns
                            ),
                            device,
                            warmup=1 if interp else 3,
                            reps=3 if interp else 20,
                        )
                        row[f"{key}_us"] = tri_ms * 1000.0
                        row["speedup" if ns == 1 else "speedup_auto"] = ref_ms / tri_ms
                rows.append(row)
                print(f"  kernel {name} P={p} T={t} done", file=sys.stderr, flush=True)
    note = why_not
    if interp:
        note = "Triton ran under TRITON_INTERPRET (CPU interpreter): its times mean nothing"
    return rows, note


# ------------------------------------------------------------------------------------------------
# Part 2: verification forward of a LLaMA-2-7B-sized model
# ------------------------------------------------------------------------------------------------


def build_model(device: torch.device, dtype: torch.dtype, small: bool):
    """A randomly initialised LlamaForCausalLM, allocated directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = SMALL_MODEL if small else LLAMA2_7B
    cfg = LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=dims["context"],
        tie_word_embeddings=False,
    )
    old = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to(device=device, dtype=dtype).eval()
    model.config._attn_implementation = "sdpa"  # HF's own attention outside ModelRunner's forwards
    return model, dims


class _CallCounter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def bench_verify(
    device: torch.device, dtype: torch.dtype, small: bool, hf_sdpa: bool = True
) -> tuple[list[dict], dict]:
    from boosttune.serving.runner import ModelRunner

    t0 = time.perf_counter()
    model, dims = build_model(device, dtype, small)
    _sync(device)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    prefix = SMALL_VERIFY_PREFIX if small else VERIFY_PREFIX
    g = torch.Generator().manual_seed(1)
    runner = ModelRunner(model)
    cache_kw = cache_keyword(model.forward)

    t0 = time.perf_counter()
    runner.forward_chain(torch.randint(0, dims["vocab"], (prefix,), generator=g))
    _sync(device)
    prefill_s = time.perf_counter() - t0
    assert runner.cached_len == prefix

    rows = []
    for t in VERIFY_TOKENS:
        ids = torch.randint(0, dims["vocab"], (1, t), generator=g).to(device)
        pos = torch.arange(prefix, prefix + t, device=device).unsqueeze(0)
        chain = torch.ones(t, t, dtype=torch.bool, device=device).tril()  # a chain is the simplest tree

        def ours(ids=ids, pos=pos, chain=chain):
            runner.forward(ids, pos, prefix, chain)
            runner.crop(prefix)

        # one untimed forward through a counter: does the runner's attention reach the Triton kernel?
        counter = _CallCounter(tat.tree_attention_triton)
        tat.tree_attention_triton = counter
        try:
            ours()
        finally:
            tat.tree_attention_triton = counter.fn
        row = dict(
            T=t,
            ours_ms=time_ms(ours, device, budget_ms=200.0),
            triton_calls_per_forward=counter.calls,
            hf_sdpa_ms=None,
        )
        if hf_sdpa:
            mask4d = full_mask(prefix, chain, prefix + t)[None, None]  # (1, 1, T, P + T) bool, True = visible

            @torch.inference_mode()
            def hf(ids=ids, pos=pos, mask4d=mask4d):
                model(
                    input_ids=ids,
                    position_ids=pos,
                    attention_mask=mask4d,
                    use_cache=True,
                    **{cache_kw: runner.cache},
                )
                runner.crop(prefix)

            hf()
            assert runner.cached_len == prefix
            row["hf_sdpa_ms"] = time_ms(hf, device, budget_ms=200.0)
        assert runner.cached_len == prefix
        rows.append(row)
        print(f"  verify T={t} done", file=sys.stderr, flush=True)
    base = rows[0]
    for r in rows:
        r["ours_vs_T1"] = r["ours_ms"] / base["ours_ms"]
        if r["hf_sdpa_ms"] is not None:
            r["hf_sdpa_vs_T1"] = r["hf_sdpa_ms"] / base["hf_sdpa_ms"]
            r["ours_vs_hf"] = r["ours_ms"] / r["hf_sdpa_ms"]
    meta = dict(model_dims=dims, params=n_params, prefix=prefix, build_s=build_s, prefill_s=prefill_s)
    return rows, meta


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def _fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)


def _md_table(head: str, body) -> str:
    """A Markdown table: the header row ``head``, its ``|---|`` separator, then the rows in ``body``."""
    return "\n".join([head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|", *body])


def kernel_table(rows: list[dict]) -> str:
    head = (
        "| shape | H | Hkv | C | P | T | SDPA ref (µs) | Triton 1-pass (µs) | Triton auto (µs) | "
        "auto splits | ref/1-pass | ref/auto | max err 1-pass | max err auto | max err SDPA |"
    )
    return _md_table(
        head,
        (
            f"| {r['shape']} | {r['H']} | {r['Hkv']} | {r['C']} | {r['P']} | {r['T']} | "
            f"{_fmt(r['ref_us'], '.1f')} | {_fmt(r['triton_us'], '.1f')} | "
            f"{_fmt(r['triton_auto_us'], '.1f')} | {_fmt(r['splits'], 'd')} | "
            f"{_fmt(r['speedup'], '.2f')} | {_fmt(r['speedup_auto'], '.2f')} | "
            f"{_fmt(r['triton_err'], '.2e')} | {_fmt(r['triton_auto_err'], '.2e')} | "
            f"{_fmt(r['ref_err'], '.2e')} |"
            for r in rows
        ),
    )


def verify_table(rows: list[dict]) -> str:
    head = (
        "| T | ours (ms) | ours / T=1 | HF sdpa (ms) | HF sdpa / T=1 | ours / HF | Triton calls per forward |"
    )
    return _md_table(
        head,
        (
            f"| {r['T']} | {_fmt(r['ours_ms'], '.2f')} | {_fmt(r['ours_vs_T1'], '.2f')} | "
            f"{_fmt(r['hf_sdpa_ms'], '.2f')} | {_fmt(r.get('hf_sdpa_vs_T1'), '.2f')} | "
            f"{_fmt(r.get('ours_vs_hf'), '.2f')} | {r['triton_calls_per_forward']} |"
            for r in rows
        ),
    )


def environment(device: torch.device) -> dict:
    import transformers

    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        triton=None,
        device=str(device),
        device_name=platform.processor() or platform.machine(),
        triton_interpret=os.environ.get("TRITON_INTERPRET"),
    )
    if tat.HAS_TRITON:
        import triton

        env["triton"] = triton.__version__
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny sizes (a CPU finishes in under a minute)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--out", type=Path, help="also write the tables as JSON here")
    ap.add_argument("--skip-kernel", action="store_true", help="skip part 1 (kernel)")
    ap.add_argument("--skip-verify", action="store_true", help="skip part 2 (verification forward)")
    ap.add_argument("--no-hf-sdpa", action="store_true", help="part 2 without the HF sdpa comparison")
    ap.add_argument(
        "--threads", type=int, help="torch CPU threads (default: 1 on --device cpu, steadier on a shared CPU)"
    )
    args = ap.parse_args(argv)
    if args.threads or torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads or 1)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    dtype = DTYPES[args.dtype]
    torch.set_grad_enabled(False)
    torch.set_float32_matmul_precision("highest")  # the fp32 reference must not use TF32
    result: dict = dict(
        env=environment(device), dtype=args.dtype, small=args.small, cpu_threads=torch.get_num_threads()
    )
    print(
        f"# bench_kernels: {result['env']}, dtype {args.dtype}, {torch.get_num_threads()} CPU threads"
        f"{', small' if args.small else ''}\n"
    )

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    failed = False
    if not args.skip_kernel:
        try:
            t0 = time.perf_counter()
            rows, note = bench_kernel(device, dtype, args.small)
            result["kernel"] = dict(rows=rows, note=note, seconds=time.perf_counter() - t0)
            print(f"## Tree attention kernel, B=1, {args.dtype}, random tree mask over the T new tokens")
            if note:
                print(f"\nNote: {note}")
            print("\nErrors: max |out - fp32 reference| on the same rounded inputs.\n")
            print(kernel_table(rows) + "\n", flush=True)
        except Exception as e:  # keep going: part 2 is independent
            failed = True
            result["kernel_error"] = f"{type(e).__name__}: {e}"
            print(f"## Kernel benchmark FAILED: {type(e).__name__}: {e}\n", flush=True)
            import traceback

            traceback.print_exc()
        save()
    if not args.skip_verify:
        try:
            rows, meta = bench_verify(device, dtype, args.small, hf_sdpa=not args.no_hf_sdpa)
            result["verify"] = dict(rows=rows, **meta)
            name = "tiny LLaMA" if args.small else "LLaMA-2-7B dimensions"
            print(
                f"## Verification forward, random-init {name} ({meta['params'] / 1e9:.2f} B params, "
                f"{args.dtype}), prefix P={meta['prefix']}, chain of T tokens"
            )
            print(
                f"\nModel built in {meta['build_s']:.1f} s, prefill {meta['prefill_s'] * 1000:.1f} ms "
                "(includes first-call compilation).\n"
            )
            print(verify_table(rows) + "\n", flush=True)
        except Exception as e:
            failed = True
            result["verify_error"] = f"{type(e).__name__}: {e}"
            print(f"## Verification benchmark FAILED: {type(e).__name__}: {e}\n", flush=True)
            import traceback

            traceback.print_exc()
        save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
