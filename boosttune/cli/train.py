"""`boosttune train`: the boost-tuning pipeline from a YAML config (see boosttune.train.pipeline)."""

from __future__ import annotations

import argparse
import json
import sys


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
    report = train(cfg, args.run_dir)
    if dist.is_main():
        print(json.dumps({"stages": report["stages"], "evaluation": report["evaluation"]}, indent=2), file=sys.stdout)
    return 0
