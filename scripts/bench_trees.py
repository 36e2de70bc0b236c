#!/usr/bin/env python3
"""Choose a tree shape by measurement: plain decoding and several tree shapes of the same drafters,
interleaved question by question in one process, so that load from other jobs hits all alike.

Each shape is ``NAME=WIDTHS`` or ``NAME=WIDTHS:LOOKUP`` (expansion widths; LOOKUP > 0 merges prompt
lookup with up to that many tokens; ``NAME=lookup:N`` is prompt lookup alone), or
``NAME=dyn:TOPK,DEPTH,BUDGET`` (EAGLE-2's dynamic tree, ``serving/tree.py``: the TOPK likeliest
nodes of each depth expanded by TOPK children, DEPTH levels, the BUDGET likeliest nodes kept). Every shape uses all
``--ssm`` drafters (SSMs or feature heads). Prints a markdown table: tokens/s, speed-up over plain
decoding, τ (tokens per LLM forward after the prefill, as `boosttune bench` counts it), how many answers equal plain decoding's
(greedy in fp32: all of them must), and per step the median tree size, drafting and verification milliseconds
(plain: milliseconds per token, prefill included).

Usage:
    python scripts/bench_trees.py --ssm runs/hour/ssms/feature --draft-vocab 8192 --draft-ranking runs/hour \\
        --questions ../shared/data/mt_bench/question.jsonl --limit 10 w1=1 w3=3 w21=2,1 w3L=3:8 L=lookup:8 \\
        d4=dyn:3,2,4
    python scripts/bench_trees.py --ssm runs/demo-bundle/ssms/feature --draft-vocab 8192 \
        --draft-ranking runs/demo-bundle/draft_vocab.json --dtype bf16 --quantize int8 --compile \
        --questions ../shared/data/mt_bench/question.jsonl --limit 20 L8=lookup:8 L4=lookup:4 w3=3 w3L4=3:4 w3L8=3:8
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from boosttune.assemble import Served, compile_served, engine_from_models, quantize_served
from boosttune.cli.flags import int_list
from boosttune.core.models import dtype_name, eos_token_ids, load_llm_and_ssms, parse_dtype
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.serving.draft_vocab import ranking_for
from boosttune.serving.quantize import SCHEMES
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig


def parse_shape(text: str) -> tuple[str, tuple[int, ...], int]:
    """``NAME=1,2`` / ``NAME=1,2:8`` / ``NAME=lookup:8`` → (name, widths (empty: no drafters), lookup);
    ``NAME=dyn:3,2,4`` → (name, ("dyn", topk, depth, budget), 0)."""
    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise ValueError(f"shape {text!r}: expected NAME=WIDTHS[:LOOKUP] or NAME=lookup:N, e.g. w3=3 or w3L=3:8")
    widths, _, lookup = spec.partition(":")
    if widths == "dyn":
        try:
            dyn = int_list(lookup)
        except (ValueError, argparse.ArgumentTypeError):
            dyn = ()
        if len(dyn) != 3 or min(dyn) < 1:
            raise ValueError(f"shape {text!r}: a dynamic tree is NAME=dyn:TOPK,DEPTH,BUDGET, e.g. d4=dyn:3,2,4")
        return name, ("dyn", *dyn), 0
    try:
        look = int(lookup) if lookup else 0
        shape = () if widths == "lookup" else int_list(widths)
    except (ValueError, argparse.ArgumentTypeError):
        raise ValueError(f"shape {text!r}: widths and lookup must be integers") from None
    if not shape and not look:
        raise ValueError(f"shape {text!r}: prompt lookup alone needs a length, e.g. {name}=lookup:8")
    return name, shape, look


def tree_of(shape: tuple, draft_vocab: int) -> TreeConfig:
    """The tree a parsed shape names (no widths: a placeholder for prompt lookup alone)."""
    if shape and shape[0] == "dyn":
        return TreeConfig(kind="dynamic", topk=shape[1], depth=shape[2], budget=shape[3], draft_vocab=draft_vocab)
    return TreeConfig(widths=shape or (1,), draft_vocab=draft_vocab)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shapes", nargs="+", help="NAME=WIDTHS[:LOOKUP] or NAME=lookup:N")
    p.add_argument("--llm", default="default")
    p.add_argument("--ssm", action="append", default=[], help="a drafter (SSM or feature head); repeat for several")
    p.add_argument("--draft-vocab", type=int, default=0)
    p.add_argument("--draft-ranking", default=None, help="draft_vocab.json or its run (default: next to the first --ssm)")
    p.add_argument("--questions", required=True)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or auto, for the LLM and (unless --ssm-dtype) the drafters")
    p.add_argument("--ssm-dtype", default=None, help="dtype of the drafters (default: --dtype)")
    p.add_argument("--quantize", choices=SCHEMES, default=None, help="the LLM's and drafters' products quantized, as "
                   "`boosttune bench --quantize` serves them (plain decoding too)")
    p.add_argument("--compile", action="store_true", help="every engine's forward compiled, as `bench --compile`")
    args = p.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes]
    except ValueError as e:
        p.error(str(e))
    if any(widths for _, widths, _ in shapes) and not args.ssm:
        p.error("shapes with widths need at least one --ssm")
    if args.threads:
        torch.set_num_threads(args.threads)
    ranking = ranking_for(args.draft_vocab, args.draft_ranking, args.ssm)
    try:
        dtype = parse_dtype(args.dtype)
        ssm_dtype = parse_dtype(args.ssm_dtype) if args.ssm_dtype else dtype
    except ValueError as e:
        p.error(str(e))
    llm, ssms = load_llm_and_ssms(args.llm, args.ssm, dtype, ssm_dtype)
    drafters = {f"ssm-{k}": s.model for k, s in enumerate(ssms, 1)}  # as runs and bundles name them
    kinds = {f"ssm-{k}": s.kind for k, s in enumerate(ssms, 1)}
    engines = {
        name: engine_from_models(llm.model, drafters if widths else {}, tree_of(widths, args.draft_vocab), ranking,
                                 look, kinds=kinds if widths else None)
        for name, widths, look in shapes
    }
    prompts = read_prompts(args.questions)[: args.limit or None]
    encoded = [encode_prompt(llm.tokenizer, q, chat=True) for q in prompts]
    eos = eos_token_ids(llm)
    stop = StopCriteria(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    warm = StopCriteria(max_new_tokens=8, eos_token_ids=eos)
    # plain decoding through the LLM runner the engines verify with (``bench``'s baseline)
    plain = engine_from_models(llm.model, [], tree_of((), args.draft_vocab), ranking)
    for engine in (plain, *engines.values()):  # each engine has runners of its own: each is quantized, compiled
        if args.quantize:
            quantize_served(engine, args.quantize)
        if args.compile:
            compile_served(Served(engine=engine, llm=llm, models={}))
    plain.generate(encoded[0], warm)  # first calls pay for lazy initialisation
    for engine in engines.values():
        engine.generate(encoded[0], warm)
    names = ["plain", *engines]
    seconds, tokens, steps, same = (dict.fromkeys(names, 0.0) for _ in range(4))
    draft_ms: dict[str, list[float]] = {name: [] for name in engines}  # per step after the first
    verify_ms: dict[str, list[float]] = {name: [] for name in engines}
    nodes: dict[str, list[int]] = {name: [] for name in engines}
    for i, ids in enumerate(encoded, 1):
        base = plain.generate(ids, stop)
        seconds["plain"] += base.wall_time
        tokens["plain"] += len(base.tokens)
        for name, engine in engines.items():
            res = engine.generate(ids, stop, record=True)
            draft_ms[name] += [1e3 * sum(r.draft_s) for r in res.records[1:]]  # step 1 catches up on the prompt
            verify_ms[name] += [1e3 * r.verify_s for r in res.records]
            nodes[name] += [r.nodes for r in res.records]
            seconds[name] += res.wall_time
            tokens[name] += len(res.tokens)
            steps[name] += len(res.accept_lengths)
            same[name] += res.tokens == base.tokens
        print(f"question {i}/{len(encoded)} done", file=sys.stderr, flush=True)
    plain_tps = tokens["plain"] / seconds["plain"]
    form = f"{' ' + args.quantize if args.quantize else ''}{', compiled' if args.compile else ''}"
    print(f"{len(encoded)} questions, {args.max_new_tokens} new tokens, LLM {dtype_name(dtype)}{form}, drafters "
          f"{dtype_name(ssm_dtype)}: {', '.join(args.ssm) or 'none'}")
    print("| shape | tok/s | speed-up | τ | = plain | nodes | draft ms | verify ms |\n|---|---|---|---|---|---|---|---|")
    print(f"| plain | {plain_tps:.2f} | 1.00× | 1.00 | | 0 | 0 | {1e3 / plain_tps:.1f} per token |")
    for name, widths, look in shapes:
        tps = tokens[name] / seconds[name]
        tau = tokens[name] / steps[name] if steps[name] else float("nan")  # as `boosttune bench` counts it
        label = f"{name} ({','.join(map(str, widths)) or '-'}{f' + lookup {look}' if look else ''})"
        if widths and widths[0] == "dyn":
            label = f"{name} (dynamic: top {widths[1]}, depth {widths[2]}, budget {widths[3]})"
        med = [statistics.median(x) if x else 0.0 for x in (nodes[name], draft_ms[name], verify_ms[name])]
        print(f"| {label} | {tps:.2f} | {tps / plain_tps:.2f}× | {tau:.2f} | {int(same[name])}/{len(encoded)} | "
              f"{med[0]:.0f} | {med[1]:.1f} | {med[2]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
