"""The draft vocabulary: a ranking of the LLM's tokens by how often the LLM writes them.

SSMs may draft over the first K tokens of this ranking only (``TreeConfig.draft_vocab``), which
cuts their LM head, the largest matrix of a small SSM, to K rows (see ``runner.py``). The ranking
counts the tokens of the LLM's own continuations (the teacher outputs of `boosttune train`); tokens
it never wrote follow in id order, a fair prior for BPE vocabularies, whose early ids are the
frequent merges. Measured on the SmolLM2 long run's teacher outputs (62k tokens ranked, 16k held
out): the first 8,192 tokens cover 95.9 % of held-out continuation tokens, 16,384 cover 97.8 %.

File (``draft_vocab.json``)::

    {"format": "boosttune.draft_vocab", "version": 1, "vocab_size": V,
     "tokens_counted": int, "distinct": int, "ranking": [V distinct token ids]}
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from boosttune.core.rundir import DRAFT_VOCAB, RunDir

FORMAT = "boosttune.draft_vocab"
VERSION = 1


def rank_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> tuple[list[int], Counter]:
    """All ``vocab_size`` ids, most frequent in ``sequences`` first (ties and unseen ids by id)."""
    counts: Counter = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {sorted(bad)[:5]} are outside the vocabulary [0, {vocab_size})")
    seen = sorted(counts, key=lambda t: (-counts[t], t))
    seen_set = set(seen)
    return seen + [t for t in range(vocab_size) if t not in seen_set], counts


def save_ranking(path: str | Path, ranking: Sequence[int], counts: Counter) -> None:
    """Write the ranking file (temp file + rename: a reader never sees half of it)."""
    p = Path(path)
    body = {"format": FORMAT, "version": VERSION, "vocab_size": len(ranking),
            "tokens_counted": sum(counts.values()), "distinct": len(counts), "ranking": list(ranking)}
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(p)


def load_ranking(path: str | Path) -> Tensor:
    """(V,) token ids, most frequent first; refuses a file that is not a whole ranking."""
    p = Path(path)
    try:
        body = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: cannot read the draft vocabulary ranking: {e}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        raise ValueError(f"{p}: not a {FORMAT} version {VERSION} file; rebuild it with `boosttune train`")
    ranking = body.get("ranking")
    v = body.get("vocab_size")
    if not isinstance(ranking, list) or not all(isinstance(t, int) for t in ranking) or len(ranking) != v:
        raise ValueError(f"{p}: field 'ranking' must list vocab_size ({v}) token ids")
    ids = torch.tensor(ranking, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v or torch.unique(ids).numel() != v):
        raise ValueError(f"{p}: field 'ranking' must hold every id in [0, {v}) once")
    return ids


def head_ids(ranking: Tensor, k: int, rows: int) -> Tensor:
    """The first ``k`` ranked ids that a head of ``rows`` rows has (ids past it are skipped)."""
    if k < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {k}")
    return ranking[ranking < rows][:k]


def coverage(ranking: Tensor, k: int, sequences: Iterable[Sequence[int]]) -> float:
    """Share of the tokens of ``sequences`` among the first ``k`` ranked ids (nan if none)."""
    top = set(ranking[:k].tolist())
    total = hit = 0
    for seq in sequences:
        total += len(seq)
        hit += sum(int(t) in top for t in seq)
    return hit / total if total else float("nan")


def find_ranking(explicit: str | Path | None, ssm_dirs: Sequence[str | Path]) -> Path:
    """The ranking file: ``explicit`` (a file, or a directory holding one), else the first found in
    an SSM's directory or its training run (``RUN_DIR/ssms/ssm-K`` → ``RUN_DIR``)."""
    if explicit is not None:
        p = Path(explicit)
        p = p / DRAFT_VOCAB if p.is_dir() else p
        if not p.is_file():
            raise ValueError(f"--draft-ranking {explicit}: no {DRAFT_VOCAB} there")
        return p
    for ssm in ssm_dirs:
        for candidate in (Path(ssm) / DRAFT_VOCAB, RunDir.of_ssm(ssm).draft_vocab_path):
            if candidate.is_file():
                return candidate
    raise ValueError(f"--draft-vocab needs the token ranking ({DRAFT_VOCAB}, written by `boosttune train` in its run "
                     "directory); pass --draft-ranking RUN_DIR")


def ranking_for(draft_vocab: int, explicit: str | Path | None, ssm_dirs: Sequence[str | Path]) -> Tensor | None:
    """The ranking a tree with ``draft_vocab`` needs (see :func:`find_ranking`); None for 0."""
    return load_ranking(find_ranking(explicit, ssm_dirs)) if draft_vocab else None
