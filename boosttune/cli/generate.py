"""`boosttune generate [BUNDLE] PROMPT`: one prompt, streamed to the terminal, with statistics."""

from __future__ import annotations

import argparse
import sys

from boosttune.cli.flags import add_bundle_args, add_model_args, add_seed_arg, assemble_from_args


def add_commands(sub) -> dict:
    """Add the generate subcommand; returns its handler by name."""
    g = sub.add_parser("generate", help="one prompt, streamed to the terminal, with statistics",
                       usage="boosttune generate [BUNDLE] PROMPT [options]")
    add_model_args(g)
    add_bundle_args(g, positional=True)
    g.add_argument("prompt", help="the prompt (through the chat template unless --no-chat)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    add_seed_arg(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    return {"generate": cmd_generate}


def cmd_generate(args: argparse.Namespace) -> int:
    from boosttune.core.models import eos_token_ids
    from boosttune.core.prompts import encode_prompt
    from boosttune.serving.sampling import SamplingParams
    from boosttune.serving.stops import StopCriteria

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    served = assemble_from_args(args)
    tok = served.llm.tokenizer
    ids = encode_prompt(tok, args.prompt, chat=not args.no_chat)
    shown: list[int] = []
    printed = ""

    def stream(new: list[int]) -> None:
        nonlocal printed
        shown.extend(new)
        text = tok.decode(shown, skip_special_tokens=True)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text

    stop = StopCriteria(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_token_ids(served.llm),
                        stop_strings=tuple(args.stop), tokenizer=tok)
    res = served.generate(ids, stop, sampling, stream, chat=not args.no_chat)
    print()
    print(
        f"[{len(res.tokens)} tokens in {res.wall_time:.2f} s = {len(res.tokens) / res.wall_time:.1f} tok/s; "
        f"steps {res.steps}; tau {res.tau:.2f}; finish {res.finish_reason}; drafters {res.active}; "
        f"hits {res.proposer_hits}]",
        file=sys.stderr,
    )
    return 0
