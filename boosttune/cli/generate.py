"""`boosttune generate [BUNDLE] PROMPT`: one prompt, streamed to the terminal, with statistics."""

from __future__ import annotations

import argparse
import sys

from boosttune.cli.flags import add_model_args, ssm_refs, tree_from_args


def add_commands(sub) -> dict:
    """Add the generate subcommand; returns its handler by name."""
    g = sub.add_parser("generate", help="one prompt, streamed to the terminal, with statistics",
                       usage="boosttune generate [BUNDLE] PROMPT [options]")
    add_model_args(g)
    # With a bundle, --llm overrides where its LLM is and unset tree flags take the bundle's defaults.
    g.set_defaults(llm=None, tree=None, widths=None, topk=None, depth=None, budget=None, min_prob=None, draft_vocab=None,
                   prompt_lookup=None)
    g.add_argument("bundle", nargs="?", default=None,
                   help="a bundle from `boosttune export` (its LLM, SSMs and tree); omit it to name --llm/--ssm")
    g.add_argument("prompt", help="the prompt (through the chat template unless --no-chat)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    return {"generate": cmd_generate}


def cmd_generate(args: argparse.Namespace) -> int:
    from boosttune.assemble import engine_from_models
    from boosttune.core.models import eos_token_ids, load_llm_and_ssms, parse_dtype
    from boosttune.core.prompts import encode_prompt
    from boosttune.serving.draft_vocab import ranking_for
    from boosttune.serving.sampling import SamplingParams
    from boosttune.serving.stops import StopCriteria

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.prompt_lookup is not None and args.prompt_lookup < 0:
        raise ValueError(f"--prompt-lookup must be >= 0 (0 = off), got {args.prompt_lookup}")
    dtype = parse_dtype(args.dtype)
    if args.bundle is not None:
        from boosttune.serving.bundle import load_bundle

        if args.ssm:
            raise ValueError("--ssm cannot be combined with a bundle: the bundle's SSMs are used")
        bundle = load_bundle(args.bundle, llm=args.llm, dtype=dtype, ssm_dtype=parse_dtype(args.ssm_dtype or args.dtype))
        llm, ssms, tree = bundle.llm, bundle.ssms, tree_from_args(args, bundle.tree)
        lookup = bundle.manifest.prompt_lookup if args.prompt_lookup is None else args.prompt_lookup
        ranking = bundle.ranking if args.draft_ranking is None else ranking_for(tree.draft_vocab, args.draft_ranking, [])
        if tree.draft_vocab and ranking is None:
            raise ValueError(f"--draft-vocab {tree.draft_vocab}: this bundle has no token ranking; pass --draft-ranking "
                             "RUN_DIR (its training run) or re-export it")
    else:
        args.llm = args.llm or "default"
        tree = tree_from_args(args)
        lookup = args.prompt_lookup or 0
        ranking = ranking_for(tree.draft_vocab, args.draft_ranking, ssm_refs(args))  # before any model loads
        llm, ssms = load_llm_and_ssms(args.llm, ssm_refs(args), dtype, parse_dtype(args.ssm_dtype or args.dtype))
    tok = llm.tokenizer
    ids = encode_prompt(tok, args.prompt, chat=not args.no_chat)
    eos = eos_token_ids(llm)
    engine = engine_from_models(
        llm.model, [s.model for s in ssms], tree, ranking=ranking, lookup=lookup
    )
    shown: list[int] = []
    printed = ""

    def stream(new: list[int]) -> None:
        nonlocal printed
        shown.extend(new)
        text = tok.decode(shown, skip_special_tokens=True)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text

    stop = StopCriteria(max_new_tokens=args.max_new_tokens, eos_token_ids=eos, stop_strings=tuple(args.stop), tokenizer=tok)
    res = engine.generate(ids, stop, sampling, stream)
    print()
    print(
        f"[{len(res.tokens)} tokens in {res.wall_time:.2f} s = {len(res.tokens) / res.wall_time:.1f} tok/s; "
        f"steps {res.steps}; tau {res.tau:.2f}; finish {res.finish_reason}; SSM hits {res.proposer_hits}]",
        file=sys.stderr,
    )
    return 0
