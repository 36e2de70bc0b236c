"""The `boosttune` command line.

bench and generate live here; other commands live in their own modules (``COMMAND_MODULES``), each
exposing ``add_commands(subparsers) -> dict[str, handler]`` where a handler takes the parsed
``argparse.Namespace`` and returns an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

# Flush subnormal floats to zero, before anything starts torch's worker threads (each thread keeps
# its own setting): random or badly scaled models (e.g. tiny-random, whose attention softmax
# underflows) ran 60x slower on this CPU with subnormals (254 ms vs 4 ms per forward); real
# checkpoints were unaffected. Values below ~1e-38 do not change any argmax.
torch.set_flush_denormal(True)

from boosttune.serving.builders import TreeConfig  # noqa: E402

# Modules that add subcommands (see the module docstring).
COMMAND_MODULES: tuple[str, ...] = ("boosttune.cli_train", "boosttune.cli_scheduler", "boosttune.cli_serve")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,1,3,1, got {text!r}") from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default="default", help="LLM: 'default' (SmolLM2-135M-Instruct), a local path or a hub id")
    p.add_argument("--ssm", action="append", default=[], metavar="SSM",
                   help="an SSM (path or hub id); repeat for several; 'default' uses the LLM itself as SSM")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16 for the LLM, and the SSMs unless --ssm-dtype (default fp32)")
    p.add_argument("--ssm-dtype", default=None, help="dtype of the SSMs (default: --dtype); the output depends only on the LLM's")
    p.add_argument("--tree", default="expansion", choices=["expansion", "dynamic"], help="tree policy")
    p.add_argument("--widths", type=_int_list, default=TreeConfig().widths,
                   help="expansion: children per node at each depth (default 1,1,3,1,1,1,1,1, SpecInfer's)")
    p.add_argument("--topk", type=int, default=TreeConfig().topk, help="dynamic: frontier and children per depth")
    p.add_argument("--depth", type=int, default=TreeConfig().depth, help="dynamic: draft depth")
    p.add_argument("--budget", type=int, default=TreeConfig().budget, help="dynamic: nodes kept (greedy)")
    p.add_argument("--min-prob", type=float, default=TreeConfig().min_prob,
                   help="stop expanding branches whose cumulative draft probability is below this (0 = never)")
    p.add_argument("--draft-vocab", type=int, default=TreeConfig().draft_vocab, metavar="K",
                   help="SSMs draft over the K tokens the LLM writes most: K rows of their LM head instead of "
                        "all (cheaper drafts, still lossless); 0 = the whole vocabulary")
    p.add_argument("--draft-ranking", default=None, metavar="PATH",
                   help="the token ranking for --draft-vocab (draft_vocab.json or its run directory; default: "
                        "found next to the first --ssm or in its run directory)")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="also draft up to N tokens copied from where the newest 1-3 tokens occurred before in "
                        "the prompt or the answer (prompt lookup; free to draft); 0 = off")


def _tree(args: argparse.Namespace, base: TreeConfig | None = None) -> TreeConfig:
    """The tree the flags ask for; flags left unset (None) take ``base``'s value (a bundle's defaults)."""
    base = base or TreeConfig()

    def pick(flag: str, field: str):
        value = getattr(args, flag)
        return getattr(base, field) if value is None else value

    return TreeConfig(kind=pick("tree", "kind"), widths=pick("widths", "widths"), topk=pick("topk", "topk"),
                      depth=pick("depth", "depth"), budget=pick("budget", "budget"), min_prob=pick("min_prob", "min_prob"),
                      draft_vocab=pick("draft_vocab", "draft_vocab"))


def _build() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="boosttune", description="Boost-tuned SSMs and lossless token-tree speculative inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="incremental vs HF assisted vs token-tree speculative decoding")
    _add_model_args(b)
    b.add_argument("--questions", required=True, help="JSONL (MT-bench, {prompt}, {text}) or text file")
    b.add_argument("--limit", type=int, default=0, help="first N questions (0 = all)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--out", required=True, help="output directory (answers JSONL + summary.json)")
    b.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    b.add_argument("--methods", default="baseline,hf_assisted,ours",
                   help="comma-separated subset of baseline, hf_assisted, hf_lookup (needs --prompt-lookup), ours")

    g = sub.add_parser("generate", help="one prompt, streamed to the terminal, with statistics",
                       usage="boosttune generate [BUNDLE] PROMPT [options]")
    _add_model_args(g)
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
    return parser, _handlers(sub)


def _handlers(sub) -> dict:
    import importlib

    handlers = {"bench": cmd_bench, "generate": cmd_generate}
    for name in COMMAND_MODULES:
        handlers.update(importlib.import_module(name).add_commands(sub))
    return handlers


def _ssm_refs(args: argparse.Namespace) -> list[str]:
    return [args.llm if s == "default" else s for s in args.ssm]


def cmd_bench(args: argparse.Namespace) -> int:
    from boosttune.bench import BenchConfig, format_table, run_bench

    cfg = BenchConfig(
        llm=args.llm, ssms=_ssm_refs(args), questions=args.questions, out=args.out, limit=args.limit,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, ssm_dtype=args.ssm_dtype, tree=_tree(args), chat=not args.no_chat,
        draft_ranking=args.draft_ranking, prompt_lookup=args.prompt_lookup,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
    )
    summary = run_bench(cfg)
    print(format_table(summary))
    print(json.dumps(summary, indent=2))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from boosttune.core.models import eos_token_ids, load_llm_and_ssms, parse_dtype
    from boosttune.core.prompts import encode_prompt
    from boosttune.serving.draft_vocab import ranking_for
    from boosttune.serving.engine import SpeculativeEngine
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
        llm, ssms, tree = bundle.llm, bundle.ssms, _tree(args, bundle.tree)
        lookup = bundle.manifest.prompt_lookup if args.prompt_lookup is None else args.prompt_lookup
        ranking = bundle.ranking if args.draft_ranking is None else ranking_for(tree.draft_vocab, args.draft_ranking, [])
        if tree.draft_vocab and ranking is None:
            raise ValueError(f"--draft-vocab {tree.draft_vocab}: this bundle has no token ranking; pass --draft-ranking "
                             "RUN_DIR (its training run) or re-export it")
    else:
        args.llm = args.llm or "default"
        tree = _tree(args)
        lookup = args.prompt_lookup or 0
        ranking = ranking_for(tree.draft_vocab, args.draft_ranking, _ssm_refs(args))  # before any model loads
        llm, ssms = load_llm_and_ssms(args.llm, _ssm_refs(args), dtype, parse_dtype(args.ssm_dtype or args.dtype))
    tok = llm.tokenizer
    ids = encode_prompt(tok, args.prompt, chat=not args.no_chat)
    eos = eos_token_ids(llm)
    engine = SpeculativeEngine.from_models(
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


def main(argv: Sequence[str] | None = None) -> int:
    parser, handlers = _build()
    args = parser.parse_args(argv)

    try:
        return handlers[args.command](args)
    except ValueError as e:  # configuration errors: one clear line, no traceback
        print(f"boosttune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
