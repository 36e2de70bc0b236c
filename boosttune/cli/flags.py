"""Flags shared by the commands that decode (generate, bench): a bundle or models, dtypes, the tree, the drafters.

Tree and prompt-lookup flags default to None: unset, they take a bundle's defaults (or the tree
config's ``TreeConfig()`` without a bundle), so the same bundle decodes with the same drafters in
`generate`, `bench` and `serve` (``boosttune/assemble.py``). ``--draft-vocab`` and ``--prompt-lookup``
are also what `export` writes into a bundle as its defaults, so each is declared once here
(``add_draft_vocab_arg``, ``add_prompt_lookup_arg``) and says the same thing in every command.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from boosttune.core.device import DEVICE_FORMS, device_arg
from boosttune.serving.quantize import SCHEMES
from boosttune.serving.tree import (
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    TREE_POLICIES,
    TreeConfig,
    check_tree_limits,
)

if TYPE_CHECKING:  # the assembly loads transformers: only when a command runs
    from boosttune.assemble import Served

_TREE_FLAGS = {"tree": "kind", "widths": "widths", "topk": "topk", "depth": "depth", "budget": "budget",
               "min_prob": "min_prob", "draft_vocab": "draft_vocab"}  # flag -> TreeConfig field


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: ``1,1,3,1`` → (1, 1, 3, 1)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,1,3,1, got {text!r}") from None


SEED_MAX = 2**64 - 1
"""The largest seed a torch generator takes (``Generator.manual_seed``); larger ones overflowed in torch."""
INT_MAX = 2**31 - 1
"""An upper bound for counts that have no tighter one (e.g. --draft-vocab, before the vocabulary is known)."""


def bounded_int(lo: int, hi: int):
    """An argparse type: an integer in ``lo .. hi``. The limits are the ones the bundle and scheduler
    loaders apply (``serving/tree.py``), so a flag cannot ask for what a bundle may not; argparse names
    the flag in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo} .. {hi}, got {text if len(text) <= 30 else text[:30] + '...'}")
        return value

    parse.__name__ = f"integer in {lo} .. {hi}"
    return parse


def tree_widths(text: str) -> tuple[int, ...]:
    """An argparse type: expansion widths (``int_list``), each >= 1, within the tree limits."""
    widths = int_list(text)
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,1,3,1, got {text!r}")
    try:
        check_tree_limits("expansion", widths, 1, 1, 1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("tree.widths", "widths", 1)) from None
    return widths


def add_seed_arg(p: argparse.ArgumentParser) -> None:
    """--seed S: the request's random generator's seed (``SamplingParams.seed``)."""
    p.add_argument("--seed", type=bounded_int(0, SEED_MAX), default=None,
                   help="seed of the sampling generator, 0 .. 2**64 - 1 (default: nondeterministic)")


def _scoped(scope: str, text: str) -> str:
    return f"{scope}: {text}" if scope else text


def add_draft_vocab_arg(p: argparse.ArgumentParser, default: str, scope: str = "") -> None:
    """--draft-vocab K, with one help text wherever it is offered.

    Args:
        p: the command's parser.
        default: what the flag means when unset, in this command.
        scope: the ``--format`` it applies to, shown first in the help (empty: the command has no formats).
    """
    p.add_argument("--draft-vocab", type=bounded_int(0, INT_MAX), default=None, metavar="K",
                   help=_scoped(scope, "SSMs draft over the K tokens the LLM writes most: K rows of their LM head "
                                       f"instead of all (cheaper drafts, still lossless); 0 = the whole vocabulary; "
                                       f"default: {default}"))


def add_prompt_lookup_arg(p: argparse.ArgumentParser, default: str, scope: str = "") -> None:
    """--prompt-lookup N, with one help text wherever it is offered.

    Args:
        p: the command's parser.
        default: what the flag means when unset, in this command.
        scope: the ``--format`` it applies to, shown first in the help (empty: the command has no formats).
    """
    p.add_argument("--prompt-lookup", type=bounded_int(0, MAX_TREE_DEPTH), default=None, metavar="N",
                   help=_scoped(scope, "also draft up to N tokens copied from where the newest 1-3 tokens occurred "
                                       "before in the prompt or the answer (prompt lookup; free to draft), where no "
                                       "learned scheduler decides (a bundle without one, or --no-scheduler); "
                                       f"0 = off, at most {MAX_TREE_DEPTH}; default: {default}"))


DTYPE_HELP = ("fp32, bf16 or auto (bf16 where --device multiplies bf16 natively: a CUDA GPU with bf16, or a CPU "
              "with AMX or AVX512-BF16; else fp32)")
"""What ``--dtype`` takes, in every command that loads models."""


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """--device: where the LLM and every drafter run (``core/device.py``); its form is checked here, the
    machine's devices when the command runs, before any model loads."""
    p.add_argument("--device", type=device_arg, default="auto", metavar="DEVICE",
                   help=f"{DEVICE_FORMS}: where the LLM and the drafters run (default auto: CUDA when torch "
                        "sees a CUDA device, else the CPU)")


COMPILE_HELP = ("compile the CPU forward of the LLM and the drafters with torch.compile (serving/compiled.py): plain steps and trees "
                "run ~1.3x faster on a CPU; costs ~15-60 s at start (inductor's cache on disk makes later starts "
                "the faster end) and needs a C++ compiler")
"""What ``--compile`` says, in every command that decodes."""

QUANTIZE_HELP = ("serve the LLM and the drafters with quantized weights (serving/quantize.py; CPU, fp32 or bf16): int8 "
                 "or int4 (groups of 32) weights alone, or w8a8: int8 weights and inputs (a scale per block of up to 256 "
                 "inputs; integer products on AMX or VNNI, so a tree costs little more than one token). A step reads "
                 "fewer bytes. Lossless with respect to the quantized LLM; its output differs from the unquantized "
                 "LLM's as a quantized model's does (default off)")
"""What ``--quantize`` says, in every command that decodes."""
RECOST_HELP = ("time the bundle scheduler's costs again on the forward being served and take its fixed choice again "
               "(15-40 s at the first start on a forward and machine; later starts read the costs kept in "
               "<cache>/recost; its acceptance model stays the one learned on the training prompts). Default: on with "
               "--quantize, whose products make trees dearer against a plain step than the eager forward the training "
               "run timed, off otherwise; --recost also elsewhere (--compile, another machine than training's), "
               "--no-recost never")
"""What ``--recost`` says, in every command that decodes."""


def add_recost_arg(p: argparse.ArgumentParser) -> None:
    """--recost / --no-recost; unset: ``wants_recost`` decides from --quantize and --compile."""
    p.add_argument("--recost", action=argparse.BooleanOptionalAction, default=None, help=RECOST_HELP)


def wants_recost(args: argparse.Namespace) -> bool:
    """Whether to time the scheduler's costs again on the served forward: as asked, else with --quantize.
    The run's costs rank the fixed choices for the eager forward they were timed on; over int8 and w8a8
    products a tree costs more against a plain step, and there the trained choice ran at 0.81x-0.93x plain
    decoding and the recosted one at 0.97x-1.12x (int8 on an AMX Xeon and an AVX2 EPYC, w8a8 on the EPYC;
    w8a8 on AMX, where trees stay cheap, not measured). With --compile alone it stays off: on the AMX Xeon
    in bf16 the recosted choice (prompt lookup alone) ran at 1.26x against the trained one's 1.39x, the
    training prompts' acceptance overrating lookup on MT-bench (docs/measurements.md)."""
    if args.recost is not None:
        return bool(args.recost)
    return bool(args.quantize)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--llm, --ssm, the dtypes, --device, the tree flags, --draft-vocab/--draft-ranking and --prompt-lookup."""
    default = TreeConfig()
    p.add_argument("--llm", default=None,
                   help="LLM: 'default' (SmolLM2-135M-Instruct, the default), a local path or a hub id; with a "
                        "bundle, where its LLM is (its hash is still checked)")
    p.add_argument("--ssm", action="append", default=[], metavar="SSM",
                   help="an SSM (path or hub id); repeat for several; 'default' uses the LLM itself as SSM")
    p.add_argument("--dtype", default="fp32", help=f"{DTYPE_HELP}, for the LLM, and the SSMs unless --ssm-dtype (default fp32)")
    add_device_arg(p)
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    p.add_argument("--quantize", choices=SCHEMES, default=None, help=QUANTIZE_HELP)
    add_recost_arg(p)
    p.add_argument("--ssm-dtype", default=None, help="dtype of the SSMs (default: --dtype); the output depends only on the LLM's")
    p.add_argument("--tree", default=None, choices=sorted(TREE_POLICIES), help=f"tree policy (default {default.kind})")
    p.add_argument("--widths", type=tree_widths, default=None,
                   help=f"expansion: children per node at each depth (default {','.join(map(str, default.widths))}, "
                        f"SpecInfer's); at most {MAX_TREE_DEPTH} depths and {MAX_TREE_NODES} nodes")
    p.add_argument("--topk", type=bounded_int(1, MAX_TREE_NODES), default=None,
                   help=f"dynamic: frontier and children per depth (default {default.topk})")
    p.add_argument("--depth", type=bounded_int(1, MAX_TREE_DEPTH), default=None,
                   help=f"dynamic: draft depth (default {default.depth})")
    p.add_argument("--budget", type=bounded_int(1, MAX_TREE_NODES), default=None,
                   help=f"dynamic: nodes kept, greedy (default {default.budget})")
    p.add_argument("--min-prob", type=float, default=None,
                   help="stop expanding branches whose cumulative draft probability is below this (default 0 = never)")
    add_draft_vocab_arg(p, default="the bundle's tree's, else the whole vocabulary")
    p.add_argument("--draft-ranking", default=None, metavar="PATH",
                   help="the token ranking for --draft-vocab (draft_vocab.json or its run directory; default: "
                        "the bundle's, or found next to the first --ssm or in its run directory)")
    add_prompt_lookup_arg(p, default="the bundle's, else off")
    p.add_argument("--phrases", default=None, metavar="PATH",
                   help="with --llm/--ssm and --prompt-lookup: prompt lookup drafts with this phrase table too (a "
                        "run's phrases.safetensors or its run directory; the LLM's most frequent next token after "
                        "two, a second branch of greedy trees: serving/phrases.py); a bundle brings its own")
    add_stack_ssms_arg(p)


def add_stack_ssms_arg(p: argparse.ArgumentParser) -> None:
    """--stack-ssms, in every command that decodes."""
    p.add_argument("--stack-ssms", choices=("auto", "on", "off"), default="auto",
                   help="draft the SSMs of one shape in one batched forward per depth: auto (default) where they "
                        "carry low-rank factors over SSM 1 (boost.delta_rank: SSM 1's weights read once for all), "
                        "on, or off (each drafts separately); the output is the same either way")


def add_bundle_args(p: argparse.ArgumentParser, positional: bool) -> None:
    """The bundle to decode with (as `boosttune serve` would serve it), --no-scheduler and --no-phrases."""
    text = "a bundle from `boosttune export`, assembled as `boosttune serve` serves it; omit it to name --llm/--ssm"
    if positional:
        p.add_argument("bundle", nargs="?", default=None, help=text)
    else:
        p.add_argument("--bundle", default=None, metavar="BUNDLE", help=text)
    p.add_argument("--no-scheduler", action="store_true",
                   help="ignore the bundle's learned scheduler: every request drafts with all its SSMs (and prompt "
                        "lookup if it was exported with --prompt-lookup); needed to set tree or lookup flags")
    p.add_argument("--no-phrases", action="store_true",
                   help="prompt lookup drafts without the bundle's phrase table (the LLM's most frequent next token "
                        "after two, a second branch of greedy trees: serving/phrases.py)")


def ssm_refs(args: argparse.Namespace) -> list[str]:
    """The --ssm references, 'default' meaning the LLM itself."""
    return [(args.llm or "default") if s == "default" else s for s in args.ssm]


def tree_override(args: argparse.Namespace) -> TreeConfig | None:
    """The tree the tree flags ask for, unset fields kept from the tree of the bundle's first drafter
    (else ``TreeConfig()``); None when no tree flag is set."""
    changes = {field: getattr(args, flag) for flag, field in _TREE_FLAGS.items() if getattr(args, flag) is not None}
    if not changes:
        return None
    base = TreeConfig()
    if args.bundle is not None:
        from boosttune.serving.manifest import read_manifest

        base = read_manifest(args.bundle).models[0].tree
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as e:  # a combination no single flag's limit catches (e.g. --topk with --depth)
        flags = ", ".join(f"--{flag.replace('_', '-')}" for flag in _TREE_FLAGS if getattr(args, flag) is not None)
        raise ValueError(f"{flags}: {e}") from None


def assemble_from_args(args: argparse.Namespace) -> Served:
    """The engine the flags ask for (``assemble.load``): a bundle's or the named models'."""
    from boosttune import assemble

    served = assemble.load(
        bundle=args.bundle, llm=args.llm, ssms=ssm_refs(args), dtype=args.dtype, ssm_dtype=args.ssm_dtype,
        tree=tree_override(args), draft_ranking=args.draft_ranking, lookup=args.prompt_lookup,
        use_scheduler=not args.no_scheduler, device=args.device, stack_ssms=args.stack_ssms,
        phrases=not args.no_phrases, phrase_table=args.phrases,
    )
    if args.quantize:
        assemble.quantize_served(served.engine, args.quantize)
    if args.compile:
        assemble.compile_served(served)
    if wants_recost(args):
        assemble.recost_served(served, keep=True)
    return served
