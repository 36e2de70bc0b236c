"""RUN_DIR/draft_vocab.json and RUN_DIR/phrases.safetensors: the draft vocabulary ranking and the LLM's
phrase table of a training run (each built once).

Both are counted over the LLM's continuations of the run's *training* prompts (the held-out ones stay
unseen); the file formats and how drafters use them are in ``serving/draft_vocab.py`` and
``serving/phrases.py``. `boosttune train` writes them after the teacher phase; the `train-scheduler`
and `export` commands build them for older runs that lack them, from the same shards.
"""

from __future__ import annotations

import json
from pathlib import Path

from boosttune.core.rundir import RunDir
from boosttune.serving.draft_vocab import rank_tokens, save_ranking
from boosttune.serving.phrases import build_phrases, save_phrases


def ensure_draft_ranking(run: RunDir, vocab_size: int | None = None, ds=None) -> Path:
    """The run's ranking file, built from its teacher shards (``ds`` if already loaded) if missing, with
    the phrase table (:func:`ensure_counted`); ``vocab_size``: the LLM's (None: from the config of the LLM
    the run's report names)."""
    path = run.draft_vocab_path
    if not path.is_file() and run.prompts_info() is None:
        raise ValueError(f"{run}: no {path.name} and no teacher outputs to rank tokens by; "
                         "use the whole vocabulary (draft vocabulary 0)")
    ensure_counted(run, vocab_size, ds)
    return path


def ensure_counted(run: RunDir, vocab_size: int | None = None, ds=None) -> None:
    """The run's draft vocabulary ranking and phrase table, each built if missing, from one read of its
    teacher outputs (nothing for a run without them); arguments as :func:`ensure_draft_ranking`'s."""
    missing = [p for p in (run.draft_vocab_path, run.phrases_path) if not p.is_file()]
    if not missing or run.prompts_info() is None:
        return
    outputs, vocab_size = _training_outputs(run, vocab_size, ds)
    if run.draft_vocab_path in missing:
        save_ranking(run.draft_vocab_path, *rank_tokens(outputs, vocab_size))
    if run.phrases_path in missing:
        save_phrases(run.phrases_path, build_phrases(outputs, vocab_size))


def _training_outputs(run: RunDir, vocab_size: int | None, ds) -> tuple[list[list[int]], int]:
    """The LLM's continuations of the run's training prompts (from ``ds``, else its shards) and the
    LLM's vocabulary size (``vocab_size``, else its config's)."""
    info = run.prompts_info()
    if ds is None:
        from boosttune.config import load_config
        from boosttune.train.teacher.shards import load_teacher

        cfg = load_config(run.config_path)
        ds = load_teacher(run, info["count"], cfg.teacher.shard_size)
    if vocab_size is None:
        vocab_size = int(json.loads((run.llm_dir() / "config.json").read_text())["vocab_size"])
    return ds.select(range(info["train"]))["output_ids"], vocab_size
