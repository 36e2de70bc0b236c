#!/usr/bin/env python3
"""What speculation could buy at scale: LLM step, tree verification and draft costs of random-weight
models of real shapes, and the speed-ups they predict at published acceptance rates.

Nothing is downloaded: every model is a ``LlamaForCausalLM`` built from a config with random weights
(costs depend on shapes, not values). Targets (``--shapes``), their dimensions from the models'
config.json files on the Hugging Face hub:

- ``1b``: Llama-3.2-1B (hidden 2048, 16 layers, 32 heads / 8 kv heads, intermediate 8192, vocabulary
  128,256, tied embeddings);
- ``8b``: Llama-3.1-8B (hidden 4096, 32 layers, 32 / 8 heads, intermediate 14,336, vocabulary 128,256);
- ``tiny``: a few-MB model (hidden 64, 2 layers) with drafters scaled down alike, so that a test runs
  the whole script on a CPU in seconds.

Drafters of each target, of the shapes boosttune trains, with the target's vocabulary:

- ``ssm-135m``: SmolLM2-135M's shape (hidden 576, 30 layers, 9 / 3 heads, intermediate 1536);
- ``ssm-4layer``: the same cut to 4 layers (the SSM shape of configs/);
- ``feature-head``: one decoder layer of the target's width with its pair projection
  (``core/feature_head.py``), fed (embedding, feature) pairs.

Measured on ``--device`` in ``--dtype``, each the median of ``--repeats`` timed calls after two
warm-ups (CUDA synchronised around each), at each committed prefix P of ``--prefixes``:

- ``plain_ms``: one plain decoding step, one token through the runner the LLM is served with
  (``serving/lean.py`` ``llm_runner``: ``ModelRunner`` on CUDA, ``LeanRunner`` on a CPU);
- ``verify_ms[T]``: one verification forward of T fed tokens (the root and T - 1 tree nodes, a binary
  tree, through ``serving/tree.py`` ``verification_inputs``) for T in ``--tree-tokens``;
  ``verify_ratio[T]`` = verify_ms[T] / plain_ms (T = 1 is the plain step again: about 1);
- ``draft_ms``: one draft forward of each drafter (one token, or one pair for the feature head,
  through ``drafter_runner``), and ``c`` = draft_ms / plain_ms;
- ``peak_memory_mib``: CUDA: the most memory torch allocated while the target and its drafters were
  built and measured; CPU: the process's peak resident set so far (it only grows).

Predicted speed-up over plain decoding, for a drafter of relative cost c drafting d = ``--depth``
forwards per step and a verification of T tokens accepting τ tokens per step (bonus included)::

    speed-up = τ / (c·d + verify_ratio[T])  =  τ / (1 + c·d + (verify_ratio[T] − 1))

the DESIGN.md cost model (``τ · t_LLM(1) / (d · t_SSM + t_LLM(T))``) with every time in plain steps. It
ignores the engine's own overhead (tree building, acceptance, cache compaction) and the prefill, so
it is an upper bound for a drafter that reaches τ. τ: Spec-Bench's leaderboard (github.com/hemingkx/
Spec-Bench, Leaderboard.md; Vicuna-7B-v1.3, greedy, fp16, one RTX 3090, mean accepted tokens per
step) gives SpS (a small draft model) 2.29 and EAGLE (a feature head with a tree) 3.57; ``--tau``
adds more. These are other models' acceptance rates: whether our drafters reach them on a Llama
target is not measured here.

Not measured (left for later): batched-teacher tokens/s and SSM training tokens/s.

Usage:
    python scripts/bench_scale.py --device cuda --out bench_scale.json      # 1b and 8b
    python scripts/bench_scale.py --shapes tiny --device cpu --repeats 3    # seconds, on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from boosttune.core.device import DEVICE_FORMS, device_arg, resolve_device
from boosttune.core.feature_head import FC_ATTR, new_fc, pair_inputs
from boosttune.core.models import dtype_name, parse_dtype
from boosttune.core.table import text_table
from boosttune.serving.lean import drafter_runner, llm_runner
from boosttune.serving.runner import ModelRunner
from boosttune.serving.tree import TokenTree, verification_inputs

FORMULA = "speed-up = tau / (c*d + verify_ratio[T]) = tau / (1 + c*d + (verify_ratio[T] - 1))"
TAUS = {"SpS tau 2.29": 2.29, "EAGLE tau 3.57": 3.57}
"""Mean accepted tokens per step on Spec-Bench's leaderboard (Vicuna-7B-v1.3, greedy, fp16, RTX 3090)."""


@dataclass(frozen=True)
class Shape:
    """The dimensions of a llama model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True

    def config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=8192,
                           tie_word_embeddings=self.tied, rope_theta=500000.0)


# config.json of meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B and HuggingFaceTB/SmolLM2-135M
TARGETS = {
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, tied=True),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, tied=False),
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512),
}
SMOLLM2_135M = Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
_TINY_SSM = Shape(hidden=32, layers=6, heads=2, kv_heads=1, intermediate=64, vocab=512)


def drafter_shapes(target: str) -> dict[str, Shape]:
    """The drafters measured for ``target``, by name, each with the target's vocabulary."""
    ssm = _TINY_SSM if target == "tiny" else SMOLLM2_135M
    t = TARGETS[target]
    return {
        "ssm-135m": replace(ssm, vocab=t.vocab),
        "ssm-4layer": replace(ssm, layers=4 if target != "tiny" else 2, vocab=t.vocab),
        "feature-head": replace(t, layers=1, tied=True),
    }


def build(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int, feature: bool = False) -> LlamaForCausalLM:
    """A random-weight model of ``shape``, built on ``device`` in ``dtype`` (no host copy); with
    ``feature``, given a feature head's pair projection."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(shape.config(), dtype=dtype)
    if feature:
        setattr(model, FC_ATTR, new_fc(shape.hidden).to(device=device, dtype=dtype))
    return model.eval().requires_grad_(False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(step: Callable[[], object], undo: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``step`` over ``repeats`` calls after two warm-ups; ``undo`` (untimed)
    restores the state after each call."""
    times = []
    for i in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
        undo()
    return statistics.median(times)


def tree_of(tokens: int, vocab: int, gen: torch.Generator) -> TokenTree:
    """A binary tree of ``tokens - 1`` nodes (node i's parent is (i - 1) // 2; -1: the root)."""
    n = tokens - 1
    parents = torch.tensor([(i - 1) // 2 for i in range(n)], dtype=torch.long)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(n):  # parents come first: one pass
        depth[i] = 1 + (depth[parents[i]] if parents[i] >= 0 else 0)
    return TokenTree(tokens=torch.randint(vocab, (n,), generator=gen), parents=parents, depth=depth,
                     proposer=torch.zeros(n, dtype=torch.long), q_prob=torch.ones(n),
                     dist_row=torch.full((n,), -1, dtype=torch.long))


def prefill(runner: ModelRunner, prefix: Tensor) -> None:
    runner.reset()
    runner.forward_chain(prefix)


def measure_llm(model: LlamaForCausalLM, prefixes: list[int], tree_tokens: list[int], repeats: int,
                gen: torch.Generator) -> dict:
    """plain_ms and verify_ms / verify_ratio per prefix (keys: str(P), then str(T))."""
    runner, device, vocab = llm_runner(model), model.device, model.config.vocab_size
    out: dict = {"runner": type(runner).__name__, "plain_ms": {}, "verify_ms": {}, "verify_ratio": {}}
    for p in prefixes:
        prefill(runner, torch.randint(vocab, (p,), generator=gen))
        tok = torch.randint(vocab, (1,), generator=gen)
        undo = partial(runner.crop, p)
        plain = median_ms(partial(runner.forward_chain, tok), undo, device, repeats)
        out["plain_ms"][str(p)] = plain
        out["verify_ms"][str(p)], out["verify_ratio"][str(p)] = {}, {}
        for t in tree_tokens:
            ids, pos, mask = verification_inputs(tree_of(t, vocab, gen), int(tok), p)
            ms = median_ms(partial(runner.forward, ids, pos, p, mask), undo, device, repeats)
            out["verify_ms"][str(p)][str(t)] = ms
            out["verify_ratio"][str(p)][str(t)] = ms / plain
    runner.reset()
    return out


def measure_drafter(model: LlamaForCausalLM, feature: bool, prefixes: list[int], repeats: int,
                    gen: torch.Generator) -> dict:
    """draft_ms per prefix: one token (an SSM) or one (embedding, feature) pair (a feature head)."""
    runner, device, vocab = drafter_runner(model), model.device, model.config.vocab_size
    out: dict = {"runner": type(runner).__name__, "draft_ms": {}}
    for p in prefixes:
        if feature:
            width = model.config.hidden_size
            features = torch.randn(p + 1, width, generator=gen)  # (P + 1, H) the LLM's features
            ids = torch.randint(vocab, (p + 1,), generator=gen)
            runner.reset()
            mask = torch.ones(p, p, dtype=torch.bool).tril()
            runner.forward_hidden(pair_inputs(model, features[:p], ids[:p]).unsqueeze(0), torch.arange(p)[None], 0, mask)
            one = pair_inputs(model, features[p:], ids[p:]).unsqueeze(0)  # (1, 1, H)
            step = partial(runner.forward_hidden, one, torch.tensor([[p]]), p, torch.ones(1, 1, dtype=torch.bool))
        else:
            prefill(runner, torch.randint(vocab, (p,), generator=gen))
            step = partial(runner.forward_chain, torch.randint(vocab, (1,), generator=gen))
        out["draft_ms"][str(p)] = median_ms(step, partial(runner.crop, p), device, repeats)
    runner.reset()
    return out


def _params(model: torch.nn.Module) -> int:
    return sum(t.numel() for t in model.parameters())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return models[0] if models else platform.processor() or platform.machine()


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def predict(llm: dict, drafters: dict[str, dict], taus: dict[str, float], depth: int) -> list[dict]:
    """The predicted speed-up (``FORMULA``) of each drafter, prefix and tree size T > 1, for each τ."""
    rows = []
    for name, d in drafters.items():
        for p, c in d["c"].items():
            for t, ratio in llm["verify_ratio"][p].items():
                if int(t) < 2:
                    continue
                rows.append({"drafter": name, "prefix": int(p), "tree_tokens": int(t), "depth": depth, "c": c,
                             "verify_ratio": ratio,
                             "speedup": {label: tau / (c * depth + ratio) for label, tau in taus.items()}})
    return rows


def run(shapes: list[str], device: torch.device, dtype: torch.dtype, prefixes: list[int], tree_tokens: list[int],
        repeats: int, depth: int, taus: dict[str, float]) -> dict:
    """Everything measured and predicted, as the JSON file holds it."""
    result: dict = {
        "device": str(device), "device_name": _device_name(device),
        "dtype": dtype_name(dtype), "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": repeats,
        "prefixes": prefixes, "tree_tokens": tree_tokens, "depth": depth, "taus": taus, "formula": FORMULA,
        "peak_memory": "CUDA: max allocated by torch" if device.type == "cuda" else "CPU: process peak RSS so far",
        "shapes": {},
    }
    for name in shapes:
        gen = torch.Generator().manual_seed(0)
        _peak_reset(device)
        llm = build(TARGETS[name], dtype, device, seed=0)
        entry: dict = {"config": asdict(TARGETS[name]), "params": _params(llm)}
        entry.update(measure_llm(llm, prefixes, tree_tokens, repeats, gen))
        entry["drafters"] = {}
        for k, (dname, shape) in enumerate(drafter_shapes(name).items(), start=1):
            feature = dname == "feature-head"
            model = build(shape, dtype, device, seed=k, feature=feature)
            d = {"config": asdict(shape), "params": _params(model)}
            d.update(measure_drafter(model, feature, prefixes, repeats, gen))
            d["c"] = {p: ms / entry["plain_ms"][p] for p, ms in d["draft_ms"].items()}
            entry["drafters"][dname] = d
            del model
        entry["peak_memory_mib"] = _peak_mb(device)
        entry["predicted"] = predict(entry, entry["drafters"], taus, depth)
        result["shapes"][name] = entry
        del llm
        gc.collect()
        _peak_reset(device)
    return result


def format_tables(result: dict) -> str:
    """The costs and the predicted speed-ups as text tables, one pair per target shape."""
    taus = result["taus"]
    out = [f"device {result['device']} ({result['device_name']}), {result['dtype']}, median of {result['repeats']}; "
           f"predicted {result['formula']}, d = {result['depth']}"]
    for name, e in result["shapes"].items():
        out.append(f"\n{name}: {e['params'] / 1e6:.1f}M parameters, {e['runner']}, peak memory {e['peak_memory_mib']:.0f} MiB")
        rows = [["prefix", "plain ms", *(f"T={t} ms (ratio)" for t in result["tree_tokens"]),
                 *(f"{d} ms (c)" for d in e["drafters"])]]
        for p in map(str, result["prefixes"]):
            rows.append([p, f"{e['plain_ms'][p]:.2f}",
                         *(f"{e['verify_ms'][p][str(t)]:.2f} ({e['verify_ratio'][p][str(t)]:.2f})" for t in result["tree_tokens"]),
                         *(f"{d['draft_ms'][p]:.2f} ({d['c'][p]:.3f})" for d in e["drafters"].values())])
        out += text_table(rows)
        rows = [["drafter", "prefix", "T", "c", "verify ratio", *taus]]
        for r in e["predicted"]:
            rows.append([r["drafter"], str(r["prefix"]), str(r["tree_tokens"]), f"{r['c']:.3f}", f"{r['verify_ratio']:.2f}",
                         *(f"{r['speedup'][k]:.2f}x" for k in taus)])
        out.append("")
        out += text_table(rows)
    return "\n".join(out)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _taus(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 1.5,2.5, got {text!r}") from None
    if not all(v >= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"tau counts the bonus token too, so each is >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,8b", help=f"comma-separated targets of {sorted(TARGETS)} (default 1b,8b)")
    ap.add_argument("--device", type=device_arg, default="auto", help=f"{DEVICE_FORMS} (default auto)")
    ap.add_argument("--dtype", default="auto", help="fp32, bf16, fp16 or auto (bf16 where the device has it natively)")
    ap.add_argument("--prefixes", type=_ints, default=[512, 2048], help="committed prefix lengths (default 512,2048)")
    ap.add_argument("--tree-tokens", type=_ints, default=[1, 4, 16, 64], help="tokens per verification (default 1,4,16,64)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per figure, after two warm-ups (default 20)")
    ap.add_argument("--depth", type=int, default=4, help="draft forwards per step, d in the formula (default 4)")
    ap.add_argument("--tau", type=_taus, default=[], help="more accepted tokens per step to predict for, e.g. 1.5,2")
    ap.add_argument("--out", default=None, help="also write everything as JSON here")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(shapes) - set(TARGETS))
    if unknown or not shapes:
        ap.error(f"--shapes: unknown {unknown}; choose from {sorted(TARGETS)}")
    if args.repeats < 1 or args.depth < 1:
        ap.error("--repeats and --depth must be >= 1")
    try:
        device = resolve_device(args.device)
        dtype = parse_dtype(args.dtype, device)
    except ValueError as e:
        ap.error(str(e))
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # random weights: subnormals slow CPU matmuls (cli/__init__.py)
    taus = {**TAUS, **{f"tau {t:g}": t for t in args.tau}}  # label -> tau
    result = run(shapes, device, dtype, args.prefixes, args.tree_tokens, args.repeats, args.depth, taus)
    print(format_tables(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
