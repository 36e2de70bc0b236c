#!/usr/bin/env python3
"""How far a quantized LLM (``--quantize int8|int4|w8a8``) is from the LLM it was made from.

Speculative decoding with ``--quantize`` is lossless with respect to the quantized LLM; this script
states what the quantization itself changes, against the unquantized LLM in ``--dtype``:

- perplexity on the WikiText-2 test sample (``--wikitext``): the first ``--tokens`` tokens in windows
  of ``--window``, each window from an empty cache;
- teacher-forced agreement: over the unquantized LLM's own greedy answers to the first ``--questions``
  MT-bench questions (``--max-new-tokens`` each, chat template), the share of answer positions where
  the quantized LLM's top-1 token is the same;
- answers: how many of those greedy answers the quantized LLM reproduces token for token, and the
  mean length of the common prefix.

Every model runs through the lean CPU runner that serving uses (``LeanRunner``, quantized with
``LeanRunner.quantize``). Prints a markdown table, one row per form.

Usage:
    python scripts/quant_quality.py                       # bf16, int8 and int4, 20 questions
    python scripts/quant_quality.py --dtype fp32 --questions 80 --tokens 32768
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from boosttune.core.models import eos_token_ids, load_model, parse_dtype
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lean import LeanRunner
from boosttune.serving.stops import StopCriteria

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"


@torch.inference_mode()
def perplexity(runner: LeanRunner, ids: list[int], window: int) -> float:
    """exp(mean next-token NLL) over ``ids`` in windows of ``window`` tokens."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start : start + window + 1])
        if chunk.numel() < 2:
            break
        runner.reset()
        logits = runner.forward_chain(chunk[:-1])  # (T, V)
        total += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
        count += chunk.numel() - 1
    return math.exp(total / count)


def greedy(runner: LeanRunner, prompt: list[int], stop: StopCriteria) -> list[int]:
    """The greedy answer to ``prompt``: plain decoding through the engine, as bench's baseline decodes."""
    return SpeculativeEngine(runner, {}, Plan()).generate(prompt, stop).tokens


@torch.inference_mode()
def top1_agreement(runner: LeanRunner, prompt: list[int], answer: list[int]) -> tuple[int, int]:
    """(positions where ``runner``'s top-1 after prompt + answer[:j] is answer[j], positions)."""
    runner.reset()
    logits = runner.forward_chain(torch.tensor(prompt + answer[:-1]))[len(prompt) - 1 :]  # (len(answer), V)
    return int((logits.argmax(-1) == torch.tensor(answer)).sum()), len(answer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", default="default", help="the LLM (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="bf16", help="the unquantized LLM's dtype and the products' inputs: bf16 (default) or fp32")
    ap.add_argument("--schemes", default="int8,int4", help="comma-separated quantized forms to compare (default int8,int4)")
    ap.add_argument("--questions", type=int, default=20, help="MT-bench first turns for the greedy comparisons (default 20)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="length of each greedy answer (default 64)")
    ap.add_argument("--tokens", type=int, default=16384, help="WikiText-2 tokens for perplexity (default 16384)")
    ap.add_argument("--window", type=int, default=512, help="perplexity window (default 512)")
    ap.add_argument("--wikitext", default=str(DATA / "wikitext2_raw_test" / "wiki.test.raw"))
    ap.add_argument("--mt-bench", default=str(DATA / "mt_bench" / "question.jsonl"))
    args = ap.parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    if args.questions < 1 or args.max_new_tokens < 1 or args.tokens < 2 or args.window < 1:
        raise SystemExit("--questions, --max-new-tokens, --window must be >= 1 and --tokens >= 2")
    for path in (args.wikitext, args.mt_bench):
        if not Path(path).is_file():
            raise SystemExit(f"{path} not found: pass --wikitext / --mt-bench")

    loaded = load_model(args.llm, dtype=parse_dtype(args.dtype))
    tok = loaded.tokenizer
    stop = StopCriteria(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_token_ids(loaded))
    wiki = tok(Path(args.wikitext).read_text(encoding="utf-8"))["input_ids"][: args.tokens]
    questions = [json.loads(line)["turns"][0] for line in Path(args.mt_bench).read_text().splitlines() if line.strip()]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in questions[: args.questions]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]

    base = LeanRunner(loaded.model)
    answers = [greedy(base, p, stop) for p in prompts]
    rows = [(args.dtype, "-", perplexity(base, wiki, args.window), 1.0, len(answers), float(args.max_new_tokens))]
    for scheme in schemes:
        runner = LeanRunner(loaded.model)
        mb = runner.quantize(scheme) / 1e6
        agree = [top1_agreement(runner, p, a) for p, a in zip(prompts, answers, strict=True)]
        own = [greedy(runner, p, stop) for p in prompts]
        same = sum(o == a for o, a in zip(own, answers, strict=True))
        prefix = [next((j for j, (x, y) in enumerate(zip(o, a, strict=False)) if x != y), min(len(o), len(a)))
                  for o, a in zip(own, answers, strict=True)]
        rows.append((scheme, f"{mb:.0f}", perplexity(runner, wiki, args.window),
                     sum(a for a, _ in agree) / sum(n for _, n in agree), same, sum(prefix) / len(prefix)))
        print(f"{scheme} done", flush=True)
    print(f"\n# {args.llm} LLM, {args.dtype} inputs; WikiText-2 {len(wiki)} tokens in windows of {args.window}; "
          f"{len(prompts)} MT-bench questions, {args.max_new_tokens} greedy tokens")
    print(f"| weights | MB quantized | perplexity | top-1 agreement | answers identical (of {len(prompts)}) | mean common prefix |")
    print("|---|---|---|---|---|---|")
    for name, mb, ppl, agree_rate, same, prefix in rows:
        print(f"| {name} | {mb} | {ppl:.2f} | {agree_rate:.3f} | {same} | {prefix:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
