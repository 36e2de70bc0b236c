"""Teacher generation speed: HF ``generate``, boosttune's batched greedy decoder, and an OpenAI-compatible server.

Every backend continues the same chat prompts in the same length-sorted batches, greedy, one after the
other per batch (so machine noise hits them alike). The local backends run in this process; the
``openai`` backend sends each batch's prompts to ``--endpoint`` as token-id completions requests,
``--concurrency`` in flight (what ``teacher.backend: openai`` does in `boosttune train`), after the same
preflight (model, tokenizer probes). Prints tokens/s per backend and how many continuations are
token-identical to the first backend's.

    .venv/bin/python scripts/bench_teacher.py --prompts ../shared/data/sharegpt_sample/sharegpt_v3_first_human_turns.jsonl \\
        --limit 128 --batch-size 32 --max-new-tokens 128 --dtype bf16 --threads 2

    # HF vs a server (llama-server, vLLM, boosttune serve) on the same prompts:
    .venv/bin/python scripts/bench_teacher.py --backends hf,openai --endpoint http://127.0.0.1:8080/v1 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from boosttune.config import TeacherConfig
from boosttune.core.models import eos_token_ids, load_model
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.train.teacher.local import generate_batch
from boosttune.train.teacher.openai_server import IdStats, OpenAITeacher

ROOT = Path(__file__).resolve().parents[1]
SHAREGPT = ROOT.parent / "shared" / "data" / "sharegpt_sample" / "sharegpt_v3_first_human_turns.jsonl"
BACKENDS = ("hf", "batched", "openai")


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
    ap.add_argument("--backends", default="",
                    help=f"comma-separated, from {','.join(BACKENDS)} (default: hf,batched; hf,openai with --endpoint)")
    ap.add_argument("--endpoint", default="", help="openai backend: the server's base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="", help="openai backend: the model name (default: the server's first)")
    ap.add_argument("--concurrency", type=int, default=8, help="openai backend: requests in flight")
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args()
    backends = [b for b in (args.backends or ("hf,openai" if args.endpoint else "hf,batched")).split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        ap.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    if "openai" in backends and not args.endpoint:
        ap.error("--backends openai needs --endpoint URL (e.g. http://127.0.0.1:8000/v1)")
    torch.set_num_threads(args.threads)
    llm = load_model(args.llm, dtype=args.dtype)
    llm.model.config._attn_implementation = args.attn
    eos = eos_token_ids(llm)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else min(eos)
    ids = [encode_prompt(llm.tokenizer, p) for p in read_prompts(args.prompts)]
    ids = sorted([x for x in ids if len(x) <= args.max_prompt_tokens][: args.limit], key=len)

    server, pool, id_stats, server_info = None, None, IdStats(), None
    if "openai" in backends:
        cfg = TeacherConfig(max_new_tokens=args.max_new_tokens, backend="openai", endpoint=args.endpoint,
                            model=args.model, concurrency=args.concurrency)
        server = OpenAITeacher(cfg, llm.tokenizer, eos)
        info = server.preflight(ids[0])
        server_info = {"url": info.url, "model": info.model, "owned_by": info.owned_by,
                       "tokenizer_check": info.tokenizer_check}
        print(f"server: {info.name}; tokenizer check {info.tokenizer_check}", flush=True)
        pool = ThreadPoolExecutor(args.concurrency)

    totals = {b: {"tokens": 0, "seconds": 0.0} for b in backends}
    same = {b: 0 for b in backends[1:]}
    for start in range(0, len(ids), args.batch_size):
        batch = ids[start:start + args.batch_size]
        outs = {}
        for backend in backends:
            t0 = time.perf_counter()
            if backend == "openai":
                outs[backend], s = server.generate(batch, [0] * len(batch), pool)
                id_stats.add(s)
            else:
                outs[backend] = generate_batch(llm.model, batch, args.max_new_tokens, 0.0, 1.0, pad, eos, backend=backend)
            totals[backend]["seconds"] += time.perf_counter() - t0
            totals[backend]["tokens"] += sum(len(c.output_ids) for c in outs[backend])
        for b in backends[1:]:
            same[b] += sum(x.output_ids == y.output_ids for x, y in zip(outs[backends[0]], outs[b], strict=True))
        print(f"  batch {start // args.batch_size + 1}: prompts {len(batch[0])}-{len(batch[-1])} tokens, "
              + ", ".join(f"{b} {t['tokens'] / t['seconds']:.1f} tok/s" for b, t in totals.items()), flush=True)
    if pool is not None:
        pool.shutdown()
        server.close()
    rows = {b: dict(t, tokens_per_s=t["tokens"] / t["seconds"]) for b, t in totals.items()}
    ref = backends[0]
    print(f"\n{len(ids)} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, {args.dtype}, "
          f"{args.threads} threads, HF attention {args.attn}"
          + (f", openai: {args.endpoint} x{args.concurrency}" if server else ""))
    print(f"| backend | tokens | seconds | tokens/s | vs {ref} |")
    print("|---|---|---|---|---|")
    for b, r in rows.items():
        print(f"| {b} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / rows[ref]['tokens_per_s']:.2f}x |")
    for b, n in same.items():
        print(f"{b}: continuations token-identical to {ref}: {n}/{len(ids)}")
    if server is not None:
        print(f"openai token ids: {id_stats.as_dict()}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "args": vars(args), "backends": rows, "identical_to": ref, "identical": same, "prompts": len(ids),
            "speedup": {b: r["tokens_per_s"] / rows[ref]["tokens_per_s"] for b, r in rows.items()},
            "server": server_info, "token_ids": id_stats.as_dict() if server else None}, indent=2))


if __name__ == "__main__":
    main()
