"""`boosttune export RUN_DIR --out OUT [--format bundle|hf|gguf]`: a training run's SSMs for serving.

``bundle`` (default) is boosttune's own servable bundle (``boosttune/export/bundle.py``); ``hf`` writes each
SSM as a Hugging Face model folder for vLLM, SGLang and transformers assisted generation
(``boosttune/export/hf.py``); ``gguf`` writes each SSM as a llama.cpp draft model
(``boosttune/export/gguf.py``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from boosttune.cli.flags import add_draft_vocab_arg, add_prompt_lookup_arg

if TYPE_CHECKING:
    from boosttune.export.bundle import Choice

FORMATS = ("bundle", "hf", "gguf")


def add_commands(sub) -> dict:
    """Add the export subcommand; returns its handler by name."""
    from boosttune.export.gguf import GGUF_TYPES

    e = sub.add_parser("export", help="write a run's SSMs for serving: a boosttune bundle (manifest, tokenizer, SSMs, "
                                      "scheduler), Hugging Face model folders, or llama.cpp GGUF draft models")
    e.add_argument("run_dir", metavar="RUN_DIR", help="a `boosttune train` run directory")
    e.add_argument("--out", required=True, metavar="OUT", help="the directory to create")
    e.add_argument("--format", choices=FORMATS, default="bundle",
                   help="bundle: for boosttune serve/generate/bench (default); hf: one Hugging Face model folder "
                        "per SSM (OUT/ssm-K/, for vLLM, SGLang, transformers assisted generation); gguf: one "
                        "llama.cpp draft model per SSM (OUT/ssm-K.TYPE.gguf, for llama-server --model-draft)")
    e.add_argument("--force", action="store_true", help="replace --out if it exists")
    e.add_argument("--drafters", default=None, metavar="NAMES",
                   help="bundle: the run's drafters to ship, comma-separated (ssm-1, ..., feature for the run's "
                        "feature head, eagle3 for its EAGLE-3 head); without a learned scheduler every request "
                        "drafts with all of them (a scheduler trained for other drafters is left out). "
                        "Default: with a scheduler, the drafters it chooses among; without one, what the run's "
                        "evaluation measured fastest (one SSM, the feature head, or all SSMs merged)")
    add_draft_vocab_arg(e, default="the run's tree's", scope="bundle")
    add_prompt_lookup_arg(e, default="as the run's evaluation measured fastest with the drafters export chose, "
                                     "else off", scope="bundle")
    e.add_argument("--gguf-type", choices=GGUF_TYPES, default=None,
                   help=f"gguf: weight type of the files (default {GGUF_TYPES[0]}; norms stay f32)")
    e.add_argument("--llm-gguf", default=None, metavar="PATH",
                   help="gguf: the LLM's own GGUF, whose tokenizer the draft files copy (llama.cpp pairs a draft "
                        "only with a target of the same vocabulary); default: the embedded SmolLM2's")
    return {"export": cmd_export}


def _check_flags(args: argparse.Namespace) -> None:
    """Flags of one format given with another: an error naming the flag, before any work."""
    only = {"--draft-vocab": ("bundle", args.draft_vocab), "--prompt-lookup": ("bundle", args.prompt_lookup),
            "--drafters": ("bundle", args.drafters),
            "--gguf-type": ("gguf", args.gguf_type), "--llm-gguf": ("gguf", args.llm_gguf)}
    for flag, (fmt, value) in only.items():
        if value is not None and args.format != fmt:
            raise ValueError(f"{flag} applies to --format {fmt} only (this export is --format {args.format})")


def cmd_export(args: argparse.Namespace) -> int:
    _check_flags(args)
    if args.format == "hf":
        return _export_hf(args)
    if args.format == "gguf":
        return _export_gguf(args)
    return _export_bundle(args)


def _export_bundle(args: argparse.Namespace) -> int:
    from boosttune.core.rundir import RunDir
    from boosttune.export.bundle import export_bundle
    from boosttune.serving import kinds
    from boosttune.train.draft_ranking import ensure_counted

    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary), got {args.draft_vocab}")
    run = RunDir(args.run_dir)
    ensure_counted(run)  # runs from before the ranking or the phrase table existed: count them from their teacher outputs
    drafters = [n.strip() for n in args.drafters.split(",") if n.strip()] if args.drafters else None
    res = export_bundle(run, args.out, force=args.force, draft_vocab=args.draft_vocab, drafters=drafters,
                        prompt_lookup=args.prompt_lookup)
    m = res.manifest
    def vocab(d) -> str | int:
        return "its own" if kinds.kind(d.kind).own_vocabulary else d.tree.draft_vocab or "whole"

    drafters = ", ".join(f"{d.name} ({d.kind}, draft vocabulary {vocab(d)})" for d in m.models)
    lookup = m.prompt_lookup or ("where the scheduler plans it" if res.scheduler_lookup else "off")
    print(
        f"bundle {res.bundle}: LLM {m.llm.ref} (sha256 {m.llm.sha256[:12]}), drafters {drafters}, "
        f"scheduler {m.scheduler_dir or 'none'}, prompt lookup {lookup}"
        f"{', the phrase table' if m.phrases else ''}, "
        f"{len(m.files)} files, {res.total_bytes / 1e6:.1f} MB"
    )
    if res.choice is not None:
        print(_choice_line(res.choice))
    return 0


def _choice_line(choice: Choice) -> str:
    """Why export shipped the drafters it chose, with what it left out."""
    others = ", ".join(f"{label} {s:.2f}x" for label, s in sorted(choice.others.items(), key=lambda kv: -kv[1]))
    with_lookup = f" + prompt lookup {choice.prompt_lookup}" if choice.prompt_lookup else ""
    line = (f"drafters {', '.join(choice.drafters)}{with_lookup}: fastest in the run's evaluation, "
            f"{choice.speedup:.2f}x plain decoding on its held-out requests")
    line += f" (others: {others})" if others else ""
    if choice.speedup < 1.0:
        line += ("; slower than plain decoding there: train longer or with more data "
                 "(docs/measurements.md, 'Drafter recipes')")
    return line + "; --drafters NAMES ships others"


def _export_hf(args: argparse.Namespace) -> int:
    from boosttune.export.hf import export_hf

    res = export_hf(args.run_dir, args.out, force=args.force)
    names = ", ".join(p.name for p in res.models)
    print(f"hf {res.out}: {len(res.models)} model folders ({names}), {res.total_bytes / 1e6:.1f} MB; "
          f"each loads with AutoModelForCausalLM.from_pretrained and its README.md shows vLLM, SGLang and "
          f"transformers draft use")
    if res.eagle3 is not None:
        print(f"  EAGLE-3 head: {res.eagle3} (the Hugging Face EAGLE-3 layout that vLLM and SGLang load)")
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    from boosttune.export.gguf import GGUF_TYPES, export_gguf

    res = export_gguf(args.run_dir, args.out, gguf_type=args.gguf_type or GGUF_TYPES[0], llm_gguf=args.llm_gguf,
                      force=args.force)
    names = ", ".join(p.name for p in [*res.files, *([res.eagle3] if res.eagle3 else [])])
    print(f"gguf {res.out}: {names} ({res.total_bytes / 1e6:.1f} MB), tokenizer from {res.llm_gguf}; "
          f"use: llama-server -m LLM.gguf --model-draft {res.files[0]} --spec-type draft-simple")
    if res.eagle3 is not None:
        print(f"  EAGLE-3 head: llama-server -m LLM.gguf --model-draft {res.eagle3} --spec-type draft-eagle3")
    return 0
