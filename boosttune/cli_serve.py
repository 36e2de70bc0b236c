"""`boosttune export` and `boosttune serve`: a run's bundle, and an OpenAI-compatible server over it.

``boosttune generate BUNDLE "prompt"`` (in cli.py) loads the same bundles through
:func:`boosttune.serving.bundle.load_bundle`.
"""

from __future__ import annotations

import argparse


def add_commands(sub) -> dict:
    """Add the export and serve subcommands; returns their handlers by name."""
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

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("bundle", metavar="BUNDLE", help="a bundle written by `boosttune export`")
    s.add_argument("--llm", default=None, metavar="PATH",
                   help="where the LLM is, overriding the bundle's reference (its hash is still checked)")
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--dtype", default="fp32", help="fp32 or bf16 for the LLM, and the SSMs unless --ssm-dtype")
    s.add_argument("--ssm-dtype", default=None, help="dtype of the SSMs (default: --dtype)")
    s.add_argument("--model-name", default=None, help="model id clients send (default: the bundle directory's name)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait for the engine (then 503)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--default-max-tokens", type=int, default=256, help="chat answer length when max_tokens is absent")
    s.add_argument("--threads", type=int, default=None,
                   help="torch threads of the engine (default: torch's; 1 is best on a CPU shared with other jobs)")
    s.add_argument("--no-scheduler", action="store_true",
                   help="ignore the bundle's learned scheduler: every request drafts with all SSMs "
                        "(and prompt lookup if the bundle was exported with --prompt-lookup)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return {"export": cmd_export, "serve": cmd_serve}


def cmd_export(args: argparse.Namespace) -> int:
    from boosttune.export import export_bundle

    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary), got {args.draft_vocab}")
    res = export_bundle(args.run_dir, args.out, force=args.force, draft_vocab=args.draft_vocab,
                        prompt_lookup=args.prompt_lookup)
    m = res.manifest
    sched = m["scheduler"]["dir"] if m["scheduler"] else "none"
    k = m["tree"].get("draft_vocab", 0)
    print(
        f"bundle {res.bundle}: LLM {m['llm']['ref']} (sha256 {m['llm']['sha256'][:12]}), "
        f"SSMs {', '.join(s['name'] for s in m['ssms'])}, scheduler {sched}, "
        f"draft vocabulary {k or 'whole'}, prompt lookup {m['prompt_lookup'] or 'off'}, {len(m['files'])} files, {res.total_bytes / 1e6:.1f} MB"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from boosttune.serving.bundle import load_bundle
    from boosttune.serving.server import ServerConfig, run_server

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    config = ServerConfig(model_name=args.model_name, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                          default_max_tokens=args.default_max_tokens, torch_threads=args.threads,
                          use_scheduler=not args.no_scheduler)
    bundle = load_bundle(args.bundle, llm=args.llm, dtype=args.dtype, ssm_dtype=args.ssm_dtype)
    run_server(bundle, config, host=args.host, port=args.port, log_level=args.log_level)
    return 0
