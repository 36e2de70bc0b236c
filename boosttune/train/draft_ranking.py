"""RUN_DIR/draft_vocab.json: the draft vocabulary ranking of a training run (built once).

Counted over the LLM's continuations of the run's *training* prompts (the held-out ones stay
unseen); the file format and how SSMs use it are in ``serving/draft_vocab.py``. `boosttune train`
writes it after the teacher phase; the `train-scheduler` and `export` commands build it for older
runs that lack it, from the same shards.
"""

from __future__ import annotations

import json
from pathlib import Path

from boosttune.core.rundir import RunDir
from boosttune.serving.draft_vocab import rank_tokens, save_ranking


def ensure_draft_ranking(run: RunDir, vocab_size: int | None = None, ds=None) -> Path:
    """The run's ranking file, built from its teacher shards (``ds`` if already loaded) if missing;
    ``vocab_size``: the LLM's (None: from the config of the LLM the run's report names)."""
    path = run.draft_vocab_path
    if path.is_file():
        return path
    info = run.prompts_info()
    if info is None:
        raise ValueError(f"{run}: no {path.name} and no teacher outputs to rank tokens by; "
                         "use the whole vocabulary (draft vocabulary 0)")
    if ds is None:
        from boosttune.config import load_config
        from boosttune.train.teacher.shards import load_teacher

        cfg = load_config(run.config_path)
        ds = load_teacher(run, info["count"], cfg.teacher.shard_size)
    if vocab_size is None:
        vocab_size = int(json.loads((run.llm_dir() / "config.json").read_text())["vocab_size"])
    ranking, counts = rank_tokens(ds.select(range(info["train"]))["output_ids"], vocab_size)
    save_ranking(path, ranking, counts)
    return path
