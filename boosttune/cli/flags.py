"""Flags shared by the commands that decode: the models, their dtypes, the tree and the drafters."""

from __future__ import annotations

import argparse

from boosttune.serving.builders import TREE_POLICIES, TreeConfig


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: ``1,1,3,1`` → (1, 1, 3, 1)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,1,3,1, got {text!r}") from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--llm, --ssm, the dtypes, the tree flags, --draft-vocab/--draft-ranking and --prompt-lookup."""
    p.add_argument("--llm", default="default", help="LLM: 'default' (SmolLM2-135M-Instruct), a local path or a hub id")
    p.add_argument("--ssm", action="append", default=[], metavar="SSM",
                   help="an SSM (path or hub id); repeat for several; 'default' uses the LLM itself as SSM")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16 for the LLM, and the SSMs unless --ssm-dtype (default fp32)")
    p.add_argument("--ssm-dtype", default=None, help="dtype of the SSMs (default: --dtype); the output depends only on the LLM's")
    p.add_argument("--tree", default="expansion", choices=sorted(TREE_POLICIES), help="tree policy")
    p.add_argument("--widths", type=int_list, default=TreeConfig().widths,
                   help=f"expansion: children per node at each depth (default {','.join(map(str, TreeConfig().widths))}, "
                        "SpecInfer's)")
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


def tree_from_args(args: argparse.Namespace, base: TreeConfig | None = None) -> TreeConfig:
    """The tree the flags ask for; flags left unset (None) take ``base``'s value (a bundle's defaults)."""
    base = base or TreeConfig()

    def pick(flag: str, field: str):
        value = getattr(args, flag)
        return getattr(base, field) if value is None else value

    return TreeConfig(kind=pick("tree", "kind"), widths=pick("widths", "widths"), topk=pick("topk", "topk"),
                      depth=pick("depth", "depth"), budget=pick("budget", "budget"), min_prob=pick("min_prob", "min_prob"),
                      draft_vocab=pick("draft_vocab", "draft_vocab"))


def ssm_refs(args: argparse.Namespace) -> list[str]:
    """The --ssm references, 'default' meaning the LLM itself."""
    return [args.llm if s == "default" else s for s in args.ssm]
