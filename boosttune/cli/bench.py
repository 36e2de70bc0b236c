"""`boosttune bench`: incremental decoding, HF's assisted generation and our engine side by side
(``--bundle``: exactly what `boosttune serve` serves for a bundle, beside plain decoding)."""

from __future__ import annotations

import argparse
import json

from boosttune.cli.flags import add_bundle_args, add_model_args, ssm_refs, tree_override


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
                   help="comma-separated subset of baseline, hf_assisted, hf_lookup (needs --prompt-lookup), ours "
                        "(default baseline,hf_assisted,ours; with --bundle, baseline,ours)")
    return {"bench": cmd_bench}


def cmd_bench(args: argparse.Namespace) -> int:
    from boosttune.bench import BenchConfig, format_table, run_bench

    methods = None if args.methods is None else tuple(m.strip() for m in args.methods.split(",") if m.strip())
    cfg = BenchConfig(
        questions=args.questions, out=args.out, llm=args.llm, ssms=ssm_refs(args), bundle=args.bundle,
        use_scheduler=not args.no_scheduler, limit=args.limit, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
        ssm_dtype=args.ssm_dtype, tree=tree_override(args), chat=not args.no_chat, draft_ranking=args.draft_ranking,
        prompt_lookup=args.prompt_lookup, methods=methods,
    )
    summary = run_bench(cfg)
    print(format_table(summary))
    print(json.dumps(summary, indent=2))
    return 0
