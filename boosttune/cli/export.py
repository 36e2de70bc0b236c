"""`boosttune export RUN_DIR --out BUNDLE`: a training run's servable parts as one bundle."""

from __future__ import annotations

import argparse


def add_commands(sub) -> dict:
    """Add the export subcommand; returns its handler by name."""
    e = sub.add_parser("export", help="write a servable bundle (manifest, tokenizer, SSMs, scheduler) from a run")
    e.add_argument("run_dir", metavar="RUN_DIR", help="a `boosttune train` run directory")
    e.add_argument("--out", required=True, metavar="BUNDLE", help="the bundle directory to create")
    e.add_argument("--force", action="store_true", help="replace --out if it exists")
    e.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                   help="SSMs draft over the K tokens the LLM writes most (cheaper drafts; 0: whole vocabulary; "
                        "default: the run's tree)")
    e.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="serve with a prompt-lookup drafter proposing up to N tokens when no learned scheduler "
                        "decides (no scheduler in the bundle, or serve --no-scheduler); 0 = off")
    return {"export": cmd_export}


def cmd_export(args: argparse.Namespace) -> int:
    from boosttune.core.rundir import RunDir
    from boosttune.export import export_bundle
    from boosttune.train.draft_ranking import ensure_draft_ranking

    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary), got {args.draft_vocab}")
    run = RunDir(args.run_dir)
    if run.prompts_info() is not None:  # runs from before the ranking existed: count it from their teacher outputs
        ensure_draft_ranking(run)
    res = export_bundle(run, args.out, force=args.force, draft_vocab=args.draft_vocab, prompt_lookup=args.prompt_lookup)
    m = res.manifest
    print(
        f"bundle {res.bundle}: LLM {m.llm.ref} (sha256 {m.llm.sha256[:12]}), "
        f"SSMs {', '.join(s.name for s in m.ssms)}, scheduler {m.scheduler_dir or 'none'}, "
        f"draft vocabulary {m.tree.draft_vocab or 'whole'}, prompt lookup {m.prompt_lookup or 'off'}, "
        f"{len(m.files)} files, {res.total_bytes / 1e6:.1f} MB"
    )
    return 0
