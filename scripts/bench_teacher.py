"""Teacher generation speed: the HF ``generate`` backend vs boosttune's batched greedy decoder.

Both backends continue the same chat prompts in the same length-sorted batches, greedy, in one
process, one after the other per batch (so machine noise hits both alike). Prints tokens/s per
backend and how many continuations are token-identical to the HF backend's.

    .venv/bin/python scripts/bench_teacher.py --prompts ../shared/data/sharegpt_sample/sharegpt_v3_first_human_turns.jsonl \\
        --limit 128 --batch-size 32 --max-new-tokens 128 --dtype bf16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from boosttune.core.models import eos_token_ids, load_model
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.train.teacher import generate_batch

ROOT = Path(__file__).resolve().parents[1]
SHAREGPT = ROOT.parent / "shared" / "data" / "sharegpt_sample" / "sharegpt_v3_first_human_turns.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", default="default")
    ap.add_argument("--prompts", default=str(SHAREGPT))
    ap.add_argument("--limit", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--attn", default="eager", help="the HF backend's attention implementation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = load_model(args.llm, dtype=args.dtype)
    llm.model.config._attn_implementation = args.attn
    eos = eos_token_ids(llm)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else min(eos)
    ids = [encode_prompt(llm.tokenizer, p) for p in read_prompts(args.prompts)]
    ids = sorted([x for x in ids if len(x) <= args.max_prompt_tokens][: args.limit], key=len)
    totals = {b: {"tokens": 0, "seconds": 0.0} for b in ("hf", "batched")}
    same = 0
    for start in range(0, len(ids), args.batch_size):
        batch = ids[start:start + args.batch_size]
        outs = {}
        for backend in ("hf", "batched"):
            t0 = time.perf_counter()
            outs[backend] = generate_batch(llm.model, batch, args.max_new_tokens, 0.0, 1.0, pad, eos, backend=backend)
            totals[backend]["seconds"] += time.perf_counter() - t0
            totals[backend]["tokens"] += sum(len(c.output_ids) for c in outs[backend])
        same += sum(a.output_ids == b.output_ids for a, b in zip(outs["hf"], outs["batched"], strict=True))
        print(f"  batch {start // args.batch_size + 1}: prompts {len(batch[0])}-{len(batch[-1])} tokens, "
              + ", ".join(f"{b} {t['tokens'] / t['seconds']:.1f} tok/s" for b, t in totals.items()), flush=True)
    rows = {b: dict(t, tokens_per_s=t["tokens"] / t["seconds"]) for b, t in totals.items()}
    speedup = rows["batched"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    print(f"\n{len(ids)} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, {args.dtype}, "
          f"{args.threads} threads, HF attention {args.attn}")
    print("| backend | tokens | seconds | tokens/s | vs hf |")
    print("|---|---|---|---|---|")
    for b, r in rows.items():
        print(f"| {b} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / rows['hf']['tokens_per_s']:.2f}x |")
    print(f"continuations token-identical to hf: {same}/{len(ids)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "backends": rows, "speedup": speedup,
                                              "identical": same, "prompts": len(ids)}, indent=2))


if __name__ == "__main__":
    main()
