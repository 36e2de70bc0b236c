#!/usr/bin/env python3
"""c(N): what drafting with N same-shape SSMs costs, separately and stacked (``serving/stacked.py``).

For N = 1 .. --n-max random-weight SSMs of the shape boosttune trains (SmolLM2-135M cut to 4 layers:
hidden 576, 9 heads, 3 kv heads, intermediate 1536, vocabulary 49,152, tied embeddings), each
drafting a chain of --depth tokens after a --prefix token prompt, one new committed token per step
(as a step that accepted nothing commits the bonus token): the draft time per depth (a step's draft
seconds / depth, median over --steps steps) of

- ``separate``: N ``SSMDrafter`` s, each through its own ``LeanRunner`` (what the engine runs today);
- ``stacked``: one ``StackedSSMs`` group, products "packed" (M oneDNN-packed products per layer) and
  "bmm" (one ``torch.bmm`` per layer),

in fp32, and in bf16 where the CPU multiplies bf16 natively (``native_bf16``), with the full
49,152-row head and with an 8,192-row draft vocabulary head. Ratios are to one separate SSM drafter of
the same dtype and head (c(N) in the issue's sense: N drafters' draft cost over one's). The variants
are timed step by step in turn, so load from other jobs hits all alike; medians, since the machine
is shared. ``--clock cpu`` (the default with one thread) times this thread's CPU seconds
(``time.thread_time``): on a machine shared with other jobs, wall time mostly measures waiting for a
core, CPU time what a draft itself costs (memory stalls included); with more threads it would miss the
helper threads' work, so ``wall`` is the default there.

Usage:
    python scripts/bench_stacked.py                 # the table (about two minutes on 2 cores)
    python scripts/bench_stacked.py --steps 8 --n-max 2
    python scripts/bench_stacked.py --shared-head --dtype bf16   # adds SSMs sharing one LM head

``--shared-head`` adds a column: the stacked group (packed) of SSMs that share one LM head (and, tied,
their embedding), whose head product ``StackedSSMs`` computes once over all members' rows: what
drafters trained with a frozen shared head would cost.

``--delta-rank R`` adds another: SSMs 2.. as SSM 1 plus rank-R deltas in every layer matrix
(``core/low_rank.py``, what ``boost.delta_rank`` trains), sharing its frozen head: one product with
SSM 1's weights over all members' rows plus the members' small products.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from boosttune.core.low_rank import cut_to_rank
from boosttune.core.models import native_bf16
from boosttune.serving.drafter import SSMDrafter
from boosttune.serving.lean import drafter_runner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stacked import stacked_drafters
from boosttune.serving.tree import TreeConfig

VOCAB = 49152


def ssm(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).eval()


def time_steps(
    variants: dict[str, list], tree: TreeConfig, prefix: int, steps: int, clock=time.perf_counter,
) -> dict[str, float]:
    """Median draft seconds per depth of each variant (a list of drafters), timed step by step in turn."""
    gen = torch.Generator().manual_seed(0)
    committed = torch.randint(2, VOCAB, (prefix,), generator=gen)
    sampling = SamplingParams()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for drafters in variants.values():
        for d in drafters:
            d.reset()
    for step in range(steps + 2):  # two warm-up steps: the prompt's catch-up, packing
        committed = torch.cat([committed, torch.randint(2, VOCAB, (1,), generator=gen)])
        for name, drafters in variants.items():
            t0 = clock()
            for d in drafters:
                d.draft(committed, tree, sampling, None)
            dt = clock() - t0
            for d in drafters:
                d.accept([])
            if step >= 2:
                times[name].append(dt / tree.max_depth)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-max", type=int, default=4, help="largest N")
    ap.add_argument("--depth", type=int, default=4, help="chain depth drafted per step")
    ap.add_argument("--prefix", type=int, default=200, help="prompt tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per configuration")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="one dtype only (default: both)")
    ap.add_argument("--shared-head", action="store_true", help="add SSMs sharing one LM head, stacked")
    ap.add_argument("--delta-rank", type=int, default=0, help="add SSMs 2.. as SSM 1 plus rank-R deltas, stacked")
    ap.add_argument("--clock", choices=("cpu", "wall"), default=None,
                    help="cpu: this thread's CPU time; wall: wall time (default: cpu with one thread, else wall)")
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    clock_name = args.clock or ("cpu" if torch.get_num_threads() == 1 else "wall")
    clock = time.thread_time if clock_name == "cpu" else time.perf_counter
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16() else [])
    if args.dtype:
        dtypes = [d for d in dtypes if d == {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]]
    print(f"threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
          f"native bf16: {native_bf16()}, chain depth {args.depth}, prefix {args.prefix}, "
          f"{args.steps} timed steps, {clock_name} clock; ms per draft depth (median); ratio: to one separate "
          "SSM drafter of the same dtype and head\n")
    extra = (" shared-head packed ms | shared ratio |" if args.shared_head else "") + \
        (f" rank-{args.delta_rank} ms | rank-{args.delta_rank} ratio |" if args.delta_rank else "")
    print("| dtype | head | N | separate ms | sep. ratio | stacked packed ms | packed ratio "
          f"| stacked bmm ms | bmm ratio |{extra}")
    print("|---|---|---|---|---|---|---|---|---|" + "---|---|" * (bool(args.shared_head) + bool(args.delta_rank)))
    base = ssm(0)
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    tree_of = {"49152": TreeConfig(widths=(1,) * args.depth), "8192": TreeConfig(widths=(1,) * args.depth,
                                                                                 draft_vocab=8192)}
    for dtype in dtypes:
        models = [copy.deepcopy(base).to(dtype) for _ in range(args.n_max)]
        with torch.no_grad():  # distinct weights, the same shape
            for j, m in enumerate(models[1:], start=1):
                g = torch.Generator().manual_seed(j)
                for p in m.parameters():
                    p.add_((torch.randn(p.shape, generator=g) * 0.01).to(dtype))
        shared = []
        for m in models:  # the same bodies, one LM head (tied: one embedding too)
            c, body = copy.copy(m), copy.copy(m.model)  # shallow: own module tables, the same weights
            c._modules, body._modules = dict(m._modules), dict(m.model._modules)
            c.model, c.lm_head = body, models[0].lm_head
            body.embed_tokens = models[0].model.embed_tokens
            shared.append(c)
        low = models[:1]
        for m in models[1:] if args.delta_rank else ():  # SSM 1 plus rank-R deltas, its head and embedding
            c = copy.deepcopy(m)
            c.lm_head, c.model.embed_tokens = models[0].lm_head, models[0].model.embed_tokens
            c.low_rank_delta, _ = cut_to_rank(models[0], c, args.delta_rank)
            low.append(c)
        for head, tree in tree_of.items():
            one = None
            for n in range(1, args.n_max + 1):
                names = [f"ssm-{j + 1}" for j in range(n)]
                variants = {
                    "separate": [SSMDrafter(drafter_runner(m), VOCAB, ranking) for m in models[:n]],
                    "packed": list(stacked_drafters(models[:n], names, VOCAB, ranking, "packed").values()),
                    "bmm": list(stacked_drafters(models[:n], names, VOCAB, ranking, "bmm").values()),
                }
                if args.shared_head:
                    variants["shared"] = list(stacked_drafters(shared[:n], names, VOCAB, ranking, "packed").values())
                if args.delta_rank:
                    variants["low"] = list(stacked_drafters(low[:n], names, VOCAB, ranking, "packed").values())
                # a group drafts all its members at a member's first call: time the group through one
                for k in [k for k in variants if k != "separate"]:
                    variants[k] = variants[k][:1]
                ms = {k: 1e3 * v for k, v in time_steps(variants, tree, args.prefix, args.steps, clock).items()}
                one = one or ms["separate"]
                name = str(dtype).removeprefix("torch.")
                print(f"| {name} | {head} | {n} | {ms['separate']:.2f} | {ms['separate'] / one:.2f} "
                      f"| {ms['packed']:.2f} | {ms['packed'] / one:.2f} | {ms['bmm']:.2f} | {ms['bmm'] / one:.2f} |"
                      + (f" {ms['shared']:.2f} | {ms['shared'] / one:.2f} |" if args.shared_head else "")
                      + (f" {ms['low']:.2f} | {ms['low'] / one:.2f} |" if args.delta_rank else ""), flush=True)
                del variants
                gc.collect()
        del models, shared, low
        gc.collect()


if __name__ == "__main__":
    main()
