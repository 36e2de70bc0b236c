"""`boosttune bench`: incremental decoding, HF's assisted generation and our engine side by side
(``--bundle``: exactly what `boosttune serve` serves for a bundle, beside plain decoding), and
llama.cpp's `llama-server` on the LLM's GGUF as the CPU peer (``boosttune/llama_cpp.py``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator

from boosttune.cli.flags import (
    add_bundle_args,
    add_model_args,
    ssm_refs,
    tree_override,
    wants_recost,
)


def add_commands(sub) -> dict:
    """Add the bench subcommand; returns its handler by name."""
    b = sub.add_parser("bench", help="incremental vs HF assisted vs token-tree speculative decoding")
    add_model_args(b)
    add_bundle_args(b, positional=False)
    b.add_argument("--questions", required=True, help="JSONL (MT-bench, {prompt}, {text}) or text file")
    b.add_argument("--limit", type=int, default=0, help="first N questions (0 = all)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--out", required=True, help="output directory (answers JSONL + summary.json)")
    b.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    b.add_argument("--methods", default=None,
                   help="comma-separated subset of baseline (plain decoding through our LLM runner), hf_plain (plain "
                        "decoding through transformers' forward), hf_assisted, hf_lookup (needs --prompt-lookup), ours, "
                        "and llama.cpp's llama (llama-server alone), llama_draft (with --draft-gguf), llama_eagle3 "
                        "(with --eagle3-gguf), llama_ngram (its n-gram self-speculation) (default baseline,hf_assisted,ours; with --bundle, baseline,ours)")
    g = b.add_argument_group("llama.cpp peer (methods llama, llama_draft, llama_eagle3, llama_ngram)")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary (default: $BOOSTTUNE_LLAMA_SERVER, else where "
                        "scripts/build_llama_server.sh builds it)")
    g.add_argument("--llm-gguf", default=None, metavar="PATH",
                   help="the LLM as GGUF for llama.cpp (default: the default LLM's own Q4_1 GGUF; required for other LLMs)")
    g.add_argument("--draft-gguf", default=None, metavar="PATH",
                   help="llama_draft's draft model, a GGUF (`boosttune export RUN --format gguf`)")
    g.add_argument("--eagle3-gguf", default=None, metavar="PATH",
                   help="llama_eagle3's EAGLE-3 head, a GGUF (`boosttune export RUN --format gguf` writes "
                        "eagle3.<type>.gguf for a run trained with eagle3.enabled)")
    g.add_argument("--llama-draft-max", type=int, default=None, metavar="N",
                   help="the most tokens llama.cpp drafts per step (default: llama.cpp's own for llama_draft; "
                        "--prompt-lookup N, else 8, for llama_ngram)")
    return {"bench": cmd_bench}


def cmd_bench(args: argparse.Namespace) -> int:
    from boosttune.bench import BenchConfig, format_category_table, format_table, run_bench
    from boosttune.llama_cpp import LlamaServerError

    methods = None if args.methods is None else tuple(m.strip() for m in args.methods.split(",") if m.strip())
    cfg = BenchConfig(
        questions=args.questions, out=args.out, llm=args.llm, ssms=ssm_refs(args), bundle=args.bundle,
        use_scheduler=not args.no_scheduler, phrases=not args.no_phrases, phrase_table=args.phrases, limit=args.limit, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
        ssm_dtype=args.ssm_dtype, tree=tree_override(args), chat=not args.no_chat, draft_ranking=args.draft_ranking,
        prompt_lookup=args.prompt_lookup, methods=methods, llama_server=args.llama_server, llm_gguf=args.llm_gguf,
        draft_gguf=args.draft_gguf, eagle3_gguf=args.eagle3_gguf, llama_draft_max=args.llama_draft_max, device=args.device,
        compile=args.compile, quantize=args.quantize, recost=wants_recost(args), stack_ssms=args.stack_ssms,
    )
    try:
        with sigterm_exits():
            summary = run_bench(cfg)
    except LlamaServerError as e:  # its log's tail says why (e.g. a draft GGUF with another vocabulary)
        print(f"boosttune bench: llama-server failed: {e}", file=sys.stderr)
        return 1
    print(format_table(summary))
    if per_category := format_category_table(summary):
        print(per_category)
    print(json.dumps(summary, indent=2))
    return 0


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Inside: SIGTERM ends the command as Ctrl-C does, by an exception in the main thread (SystemExit,
    status 128 + 15), so run_bench's ExitStack stops its llama-servers; the default action would end the
    process at once and leave them running."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def stop(signum: int, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
