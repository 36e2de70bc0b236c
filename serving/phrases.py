"""The LLM's phrase table: which token it most often writes after a pair of tokens, counted over its
own continuations (the teacher outputs of `boosttune train`).

Prompt lookup (``lookup.py``) copies from the request's own text. Where the request has nothing to
copy, the LLM still writes its habitual phrases ("I'm sorry, but", "Here is a", markdown list
markers...). This table drafts them: a chain that starts at the newest two committed tokens and
follows the most frequent next token (the pair's, else the last token's alone), as a second branch
of the prompt-lookup drafter's tree. It is a retrieval drafter like REST (He et al., "REST:
Retrieval-Based Speculative Decoding", arXiv 2311.08252), over a datastore of the LLM's own outputs
and cut to its most frequent continuation, so that it costs a dictionary lookup per token.

Measured (docs/measurements.md, "The LLM's phrase table"): a table of the demo run's 51.6k teacher
tokens beside the demo bundle's head [3] and prompt lookup raised τ on MT-bench 1-24 from 1.839 to
1.923 (fp32, both token-identical to plain decoding) for 1.2 more verified nodes a step, about 1.7 %
of a bf16 step.

File (``phrases.safetensors``, ``core/rundir.PHRASES``): tensors ``pairs`` (P, 2) int64 sorted, ``pair_next`` (P,) int64 and
``last_next`` (V,) int64 (-1: the token was never followed), metadata ``format`` and ``version``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT = "boosttune.phrases"
VERSION = "1"
CHAIN = 2
"""Tokens the table drafts a step. Teacher-forced on MT-bench (module docstring): chains of 1 / 2 / 3 /
4 gave τ 2.079 / 2.142 / 2.158 / 2.164 for up to 0.64 / 1.44 / 2.23 / 3.01 more nodes a step; at
~0.22 ms a node against a 24 ms step (bf16, AMX Xeon), 2 is where the extra tokens stop paying."""


def _most_frequent(counts: Counter) -> int:
    """The most frequent token, ties to the smaller id (deterministic whatever the counting order)."""
    return min(counts, key=lambda t: (-counts[t], t))


@dataclass(frozen=True)
class PhraseTable:
    """Most frequent next token after a pair of tokens and after one token.

    Attributes:
        pair_next: (a, b) -> the token most often written after a then b.
        last_next: (V,) the token most often written after each token (-1: never followed).
    """

    pair_next: dict[tuple[int, int], int]
    last_next: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.last_next.shape[0])

    def next_token(self, a: int, b: int) -> int:
        """The table's guess after ``a`` then ``b`` (-1: none)."""
        nxt = self.pair_next.get((a, b))
        if nxt is not None:
            return nxt
        return int(self.last_next[b]) if 0 <= b < self.last_next.shape[0] else -1

    def chain(self, context: np.ndarray, length: int) -> np.ndarray:
        """Up to ``length`` tokens following the (T,) ``context``'s last two (stops where the table has
        no guess; empty for a context of fewer than two tokens)."""
        out: list[int] = []
        if context.shape[0] < 2:
            return np.zeros(0, dtype=np.int64)
        a, b = int(context[-2]), int(context[-1])
        for _ in range(length):
            c = self.next_token(a, b)
            if c < 0:
                break
            out.append(c)
            a, b = b, c
        return np.asarray(out, dtype=np.int64)


def build_phrases(sequences: Iterable[Sequence[int]], vocab_size: int) -> PhraseTable:
    """The table of ``sequences`` (token ids in [0, ``vocab_size``)), counted within each sequence."""
    pairs: defaultdict[tuple[int, int], Counter] = defaultdict(Counter)
    lasts: defaultdict[int, Counter] = defaultdict(Counter)
    for seq in sequences:
        ids = [int(t) for t in seq]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {sorted(set(bad))[:5]} are outside the vocabulary [0, {vocab_size})")
        for a, b, c in zip(ids, ids[1:], ids[2:], strict=False):  # shorter by design
            pairs[(a, b)][c] += 1
        for b, c in zip(ids, ids[1:], strict=False):
            lasts[b][c] += 1
    last_next = np.full(vocab_size, -1, dtype=np.int64)
    for b, counts in lasts.items():
        last_next[b] = _most_frequent(counts)
    return PhraseTable({k: _most_frequent(v) for k, v in pairs.items()}, last_next)


def save_phrases(path: Path, table: PhraseTable) -> None:
    """Write ``table`` as one safetensors file (atomically: a partial file is never left behind)."""
    from safetensors.torch import save_file

    keys = sorted(table.pair_next)
    pairs = torch.tensor(keys, dtype=torch.int64).reshape(len(keys), 2)
    nxt = torch.tensor([table.pair_next[k] for k in keys], dtype=torch.int64)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"pairs": pairs, "pair_next": nxt, "last_next": torch.from_numpy(table.last_next.copy())},
              str(tmp), metadata={"format": FORMAT, "version": VERSION})
    tmp.replace(path)


def load_phrases(path: Path, vocab_size: int | None = None) -> PhraseTable:
    """Read a phrase table; a ``ValueError`` names what is wrong (format, tensors, ids outside the
    LLM's ``vocab_size`` when given)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise ValueError(f"{path}: not a {FORMAT} v{VERSION} file (metadata {meta})")
            if names != {"pairs", "pair_next", "last_next"}:
                raise ValueError(f"{path}: must hold pairs, pair_next and last_next, holds {sorted(names)}")
            pairs, nxt, last = (f.get_tensor(n) for n in ("pairs", "pair_next", "last_next"))
    except SafetensorError as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    if (pairs.dim() != 2 or pairs.shape[1] != 2 or nxt.shape != (pairs.shape[0],) or last.dim() != 1
            or any(t.dtype != torch.int64 for t in (pairs, nxt, last))):
        raise ValueError(f"{path}: pairs must be (P, 2), pair_next (P,) and last_next (V,), all int64")
    v = int(last.shape[0])
    if vocab_size is not None and v != vocab_size:
        raise ValueError(f"{path}: last_next covers {v} tokens, the LLM has {vocab_size}; the table was built "
                         "for another vocabulary")
    if pairs.numel() and (int(pairs.min()) < 0 or int(pairs.max()) >= v or int(nxt.min()) < 0 or int(nxt.max()) >= v):
        raise ValueError(f"{path}: token ids outside [0, {v})")
    if v and (int(last.min()) < -1 or int(last.max()) >= v):
        raise ValueError(f"{path}: last_next holds ids outside [-1, {v})")
    table = dict(zip(map(tuple, pairs.tolist()), nxt.tolist(), strict=True))
    return PhraseTable(table, last.numpy())
