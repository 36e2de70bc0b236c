"""Write a mixed request workload (ShareGPT prompts by kind, plus document continuation) as
OUT/train.jsonl and OUT/heldout.jsonl in MT-bench's question format (``boosttune/workload.py``).

    .venv/bin/python scripts/mixed_workload.py --out /tmp/mixed
    boosttune train-scheduler RUN --prompts /tmp/mixed/train.jsonl --limit 0
    boosttune bench --bundle BUNDLE --questions /tmp/mixed/heldout.jsonl --out /tmp/mixed-bench
"""

from __future__ import annotations

import argparse
from pathlib import Path

from boosttune.workload import WorkloadConfig, build, category_table, write_questions

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULTS = WorkloadConfig(
    sharegpt=DATA / "sharegpt_sample" / "sharegpt_v3_first_human_turns.jsonl",
    openwebtext=DATA / "openwebtext_sample" / "openwebtext_sample.txt",
    c4=DATA / "c4_realnewslike_sample" / "c4_ref.json",
)


def parse_config(argv: list[str] | None) -> tuple[WorkloadConfig, Path]:
    """The workload config and the output directory from the command line (not yet validated)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (train.jsonl, heldout.jsonl)")
    p.add_argument("--sharegpt", type=Path, default=DEFAULTS.sharegpt, help="ShareGPT first human turns, JSONL {id, prompt}")
    p.add_argument("--sharegpt-skip", type=int, default=DEFAULTS.sharegpt_skip, metavar="N",
                   help="leave out the first N ShareGPT records (those the shipped configs train drafters on)")
    p.add_argument("--openwebtext", type=Path, default=DEFAULTS.openwebtext, help="OpenWebText sample (plain text)")
    p.add_argument("--c4", type=Path, default=DEFAULTS.c4, help="C4 realnewslike sample, JSON array of {input, output}")
    p.add_argument("--per-category-train", type=int, default=DEFAULTS.per_train, metavar="N")
    p.add_argument("--per-category-heldout", type=int, default=DEFAULTS.per_heldout, metavar="N")
    p.add_argument("--min-chars", type=int, default=DEFAULTS.min_chars, help="shortest ShareGPT prompt kept")
    p.add_argument("--max-chars", type=int, default=DEFAULTS.max_chars, help="longest ShareGPT prompt kept")
    p.add_argument("--continuation-words", type=int, default=DEFAULTS.continuation_words, metavar="N",
                   help="words of a document shown by a continuation request")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of the stratified split")
    args = p.parse_args(argv)
    cfg = WorkloadConfig(
        sharegpt=args.sharegpt, sharegpt_skip=args.sharegpt_skip, openwebtext=args.openwebtext, c4=args.c4, per_train=args.per_category_train,
        per_heldout=args.per_category_heldout, min_chars=args.min_chars, max_chars=args.max_chars,
        continuation_words=args.continuation_words, seed=args.seed,
    )
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return cfg, args.out


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_config(argv)
    split = build(cfg)
    out.mkdir(parents=True, exist_ok=True)
    write_questions(out / "train.jsonl", split.train)
    write_questions(out / "heldout.jsonl", split.heldout)
    for cat, (have, asked) in split.short.items():
        print(f"{cat}: only {have} prompts for the {asked} asked; all of them are used")
    print(category_table(split))
    print(f"wrote {out / 'train.jsonl'} ({len(split.train)}) and {out / 'heldout.jsonl'} ({len(split.heldout)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
