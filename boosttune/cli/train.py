"""`boosttune train`: the boost-tuning pipeline from a YAML config (see boosttune.train.pipeline)."""

from __future__ import annotations

import argparse
import errno


def add_commands(sub) -> dict:
    t = sub.add_parser(
        "train", help="prompts -> LLM continuations -> N boost-tuned SSMs -> report (resumable)",
        description="Run or resume a training run. Every config field can be overridden as section.field=value "
                    "(YAML values), e.g. optim.max_steps=50 boost.num_ssms=5 prompts.sources='[{kind: default}]'.",
    )
    t.add_argument("--config", required=True, help="YAML config (configs/smollm2-demo.yaml, configs/tiny.yaml, ...)")
    t.add_argument("--run-dir", required=True, help="run directory: created, or resumed if it exists")
    t.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
    return {"train": cmd_train}


def cmd_train(args: argparse.Namespace) -> int:
    from boosttune.config import load_config
    from boosttune.train import dist
    from boosttune.train.pipeline import preflight, train

    cfg = load_config(args.config, args.overrides)
    preflight(cfg)
    if dist.needs_local_launch(cfg.optim.devices, cfg.optim.num_nodes):
        argv = ["train", "--config", args.config, "--run-dir", args.run_dir, *args.overrides]
        return dist.local_launch(cfg.optim.devices, argv)
    try:
        train(cfg, args.run_dir)
    except OSError as e:
        message = file_system_error(e, args.run_dir)
        if message is None:
            raise
        raise ValueError(message) from None  # printed as one line, exit 2 (boosttune.cli.main)
    if dist.is_main():  # what `boosttune report RUN` prints (report.json holds every figure)
        from boosttune.core.rundir import RunDir
        from boosttune.report import collect, summary_lines

        print("\n".join(summary_lines(collect(RunDir(args.run_dir)))), flush=True)
    return 0


# What to do when the run directory cannot be written: by errno.
_FIXES = {
    errno.EACCES: "make the run directory writable (chmod u+w) or pass a --run-dir you can write",
    errno.EPERM: "make the run directory writable (chmod u+w) or pass a --run-dir you can write",
    errno.EROFS: "pass a --run-dir on a writable file system",
    errno.ENOSPC: "free space there or pass a --run-dir on another disk; the same command then resumes the run",
    errno.EDQUOT: "free space there or pass a --run-dir on another disk; the same command then resumes the run",
}


def file_system_error(e: OSError, run_dir: str) -> str | None:
    """One line naming the path a write failed at and the fix; None when ``e`` is not such a failure."""
    fix = _FIXES.get(e.errno)
    if fix is None:
        return None
    return f"cannot write {e.filename or run_dir}: {e.strerror or e}; {fix}"
