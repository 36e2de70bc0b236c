"""RUN_DIR/draft_vocab.json: the draft vocabulary ranking of a training run (built once).

Counted over the LLM's continuations of the run's *training* prompts (the held-out ones stay
unseen); the file format and how SSMs use it are in ``serving/draft_vocab.py``. `boosttune train`
writes it after the teacher phase; `train-scheduler` and `export` build it for older runs that
lack it, from the same shards.
"""

from __future__ import annotations

import json
from pathlib import Path

from boosttune import rundir
from boosttune.serving.draft_vocab import FILE, rank_tokens, save_ranking


def ranking_path(run: str | Path) -> Path:
    return Path(run) / FILE


def ensure_draft_ranking(run: str | Path, vocab_size: int, ds=None) -> Path:
    """The run's ranking file, built from its teacher shards (``ds`` if already loaded) if missing."""
    run = Path(run)
    path = ranking_path(run)
    if path.is_file():
        return path
    marker = run / "prompts" / rundir.MARKER
    if not marker.is_file():
        raise ValueError(f"{run}: no {path.name} and no teacher outputs to rank tokens by; "
                         "use the whole vocabulary (draft vocabulary 0)")
    info = json.loads(marker.read_text())
    if ds is None:
        from boosttune.config import load_config
        from boosttune.teacher import load_teacher

        cfg = load_config(run / "config.yaml")
        ds = load_teacher(run / "teacher", info["count"], cfg.teacher.shard_size)
    ranking, counts = rank_tokens(ds.select(range(info["train"]))["output_ids"], vocab_size)
    save_ranking(path, ranking, counts)
    return path
