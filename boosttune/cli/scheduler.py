"""`boosttune train-scheduler RUN_DIR`: (re)train the learned SSM scheduler of a training run.

The base config is the ``scheduler:`` section of ``--config`` (default: RUN_DIR/config.yaml when
it exists), else ``SchedulerConfig`` defaults; flags override single fields.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from boosttune.cli.flags import add_device_arg


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,2,4, got {text!r}"
        ) from None


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_commands(subparsers) -> dict:
    """Add `train-scheduler` to the `boosttune` parser; returns its handler."""
    p = subparsers.add_parser("train-scheduler", help="train the learned SSM scheduler of a run directory")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `boosttune train` run directory")
    p.add_argument(
        "--config",
        default=None,
        help="YAML whose scheduler: section is the base (default RUN_DIR/config.yaml)",
    )
    p.add_argument("--prompts", default=None, help="prompts held out from SSM training (JSONL/text)")
    p.add_argument(
        "--eval-prompts", default=None, help="separate evaluation prompts (default: split --prompts)"
    )
    p.add_argument("--limit", type=int, default=None, help="first N prompts (0 = all)")
    p.add_argument("--eval-limit", type=int, default=None, help="first N evaluation prompts (0 = all)")
    p.add_argument("--skip", type=int, default=None, help="leave out the first N of --prompts (those the run trained on)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="leave out longer requests (0: none)")
    p.add_argument("--train-fraction", type=float, default=None, help="share of --prompts used to fit")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument(
        "--no-chat",
        action="store_const",
        const=False,
        dest="chat",
        default=None,
        help="do not apply the chat template",
    )
    p.add_argument(
        "--depths", type=_ints, default=None, help="tree depths the policy chooses from, e.g. 1,2,4"
    )
    p.add_argument(
        "--widths", type=_ints, default=None, help="expansion widths per depth (default: the run's tree)"
    )
    p.add_argument("--dtype", default=None, help="LLM dtype (default: the run's)")
    p.add_argument("--ssm-dtype", default=None, help="SSM dtype (default: --dtype)")
    add_device_arg(p)  # the costs are timed there: fit the scheduler on the device that will serve
    p.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                   help="SSMs draft over the run's K most frequent tokens (cheaper drafts; 0 = whole vocabulary)")
    p.add_argument("--no-prompt-lookup", action="store_const", const=False, dest="prompt_lookup", default=None,
                   help="choose among the SSMs only (default: prompt lookup is one more drafter to choose)")
    p.add_argument("--no-stepwise-lookup", action="store_const", const=False, dest="stepwise_lookup", default=None,
                   help="draft prompt lookup to the chosen depth at every step (default: a learned length per "
                        "matched n-gram length)")
    p.add_argument("--no-feature-head", action="store_const", const=False, dest="feature_head", default=None,
                   help="leave the run's feature head out of the choice (default: one more drafter to choose)")
    p.add_argument("--cv-folds", type=int, default=None, metavar="K",
                   help="serve the per-request choice and the per-match lookup lengths only where K-fold "
                        "cross-validation on the training requests shows them faster (default 10; 0 = unchecked)")
    p.add_argument("--calib-prompts", type=int, default=None, help="prompts used to time the SSMs")
    p.add_argument("--calib-tokens", type=int, default=None, help="tokens per timing run")
    p.add_argument(
        "--real-policies",
        type=_words,
        default=None,
        help="policies run for real on the eval prompts (learned,all,best_fixed,none)",
    )
    return {"train-scheduler": cmd_train_scheduler}


def base_config(run_dir: str, config: str | None):
    """The scheduler: section of ``config`` (or RUN_DIR/config.yaml) as a SchedulerConfig."""
    import yaml

    from boosttune.config import (
        SchedulerConfig,
        from_dict,  # typed conversion with errors that name the field
    )
    from boosttune.core.rundir import RunDir

    path = Path(config) if config else RunDir(run_dir).config_path
    if config and not path.is_file():
        raise ValueError(f"--config: no such file: {path}")
    if not path.is_file():
        return SchedulerConfig()
    data = yaml.safe_load(path.read_text()) or {}
    section = data.get("scheduler") if isinstance(data, dict) else None
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"{path}: the scheduler: section must be a mapping")
    return from_dict(SchedulerConfig, section or {}, "scheduler")


def cmd_train_scheduler(args: argparse.Namespace) -> int:
    from boosttune.core.device import resolve_device
    from boosttune.core.rundir import RunDir
    from boosttune.scheduler.offline.train import RunModels, train_scheduler
    from boosttune.train.draft_ranking import ensure_draft_ranking

    device = resolve_device(args.device)  # before anything is read or loaded

    cfg = base_config(args.run_dir, args.config).replace(
        prompts=args.prompts,
        eval_prompts=args.eval_prompts,
        limit=args.limit,
        skip=args.skip,
        max_prompt_tokens=args.max_prompt_tokens,
        eval_limit=args.eval_limit,
        train_fraction=args.train_fraction,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        depths=args.depths,
        widths=args.widths,
        dtype=args.dtype,
        ssm_dtype=args.ssm_dtype,
        draft_vocab=args.draft_vocab,
        prompt_lookup=args.prompt_lookup,
        stepwise_lookup=args.stepwise_lookup,
        calib_prompts=args.calib_prompts,
        calib_tokens=args.calib_tokens,
        real_policies=args.real_policies,
        feature_head=args.feature_head,
        cv_folds=args.cv_folds,
    )
    if cfg.draft_vocab:  # runs from before the ranking existed: count it from their teacher outputs
        ensure_draft_ranking(RunDir(args.run_dir))
    train_scheduler(args.run_dir, cfg, models=RunModels.of_run(RunDir(args.run_dir), device=str(device)))
    return 0
