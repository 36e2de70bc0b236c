"""Prompt sources for the teacher: the embedded default, chat files, text corpora via `datasets`.

Every source yields :class:`TrainPrompt` records holding token ids, ready for the LLM:

- ``default``: the project's own seed requests (``data/prompts/seeds.jsonl``: writing, coding, math,
  QA, summarization, extraction, roleplay, translation), chat-templated.
- ``jsonl``: chat prompts (MT-bench ``turns``, ShareGPT ``prompt``, ``text``), chat-templated.
- ``text``: a plain-text file; one prompt per line, or (``chunk: true``) a corpus cut into chunks.
- ``openwebtext`` / ``dataset``: a `datasets` corpus (hub id streamed on a cluster, or a local
  ``save_to_disk`` folder, Arrow, Parquet, JSON or text file) cut into chunks of
  ``prompts.chunk_tokens`` tokens; the LLM continues each chunk as plain text.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from boosttune.config import PromptsConfig, SourceConfig
from boosttune.core.prompts import Prompt, encode_prompt, read_prompts

OPENWEBTEXT_HUB_ID = "Skylion007/openwebtext"  # the corpus SpecInfer boost-tunes on (arXiv 2305.09781, §6)


@dataclass
class TrainPrompt:
    """One teacher input: token ids plus where they came from."""

    id: str
    source: str
    category: str
    chat: bool
    input_ids: list[int]
    text: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @staticmethod
    def from_json(line: str) -> TrainPrompt:
        return TrainPrompt(**json.loads(line))


def default_seeds() -> list[Prompt]:
    """The embedded seed requests shipped with the package."""
    text = resources.files("boosttune.data").joinpath("prompts/seeds.jsonl").read_text(encoding="utf-8")
    out = []
    for i, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            rec = json.loads(line)
            out.append(Prompt(text=rec["prompt"], id=f"seed-{i}", category=rec["category"]))
    return out


def _chunks(ids: list[int], size: int) -> Iterator[list[int]]:
    """Consecutive chunks of ``size`` tokens (a last chunk under half the size is dropped)."""
    for start in range(0, len(ids), size):
        piece = ids[start : start + size]
        if len(piece) >= max(4, size // 2):
            yield piece


def _open_dataset(src: SourceConfig) -> Iterable[dict]:
    """Rows of a `datasets` corpus: local folder/file, or a hub id (streamed unless told not to)."""
    import datasets

    path = src.path or OPENWEBTEXT_HUB_ID
    p = Path(path).expanduser()
    if p.is_dir() and any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(str(p))
        return ds[src.split] if isinstance(ds, datasets.DatasetDict) else ds
    if p.is_file():
        builder = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}.get(p.suffix, "text")
        # Text corpora such as the OpenWebText sample separate documents by blank lines.
        kw = {"sample_by": "paragraph"} if builder == "text" else {}
        return datasets.load_dataset(builder, data_files=str(p), split="train", streaming=True, **kw)
    try:
        return datasets.load_dataset(path, split=src.split, streaming=src.streaming)
    except Exception as e:  # offline, unknown id, no access: say which source and what to do
        raise ValueError(
            f"prompts source {src.kind!r} path {path!r}: could not open the dataset ({type(e).__name__}: {e}); "
            "pass a local file or `save_to_disk` folder as path, or run where the hub is reachable"
        ) from e


def _corpus_prompts(src: SourceConfig, tok, cfg: PromptsConfig, rows: Iterable[dict]) -> Iterator[TrainPrompt]:
    for r, row in enumerate(rows):
        text = row.get(src.text_column)
        if not isinstance(text, str):
            raise ValueError(f"prompts source {src.kind!r}: rows have no text column {src.text_column!r} "
                             f"(columns: {sorted(row)}); set text_column")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for c, piece in enumerate(_chunks(ids, cfg.chunk_tokens)):
            yield TrainPrompt(id=f"{src.kind}-{r}-{c}", source=src.kind, category="corpus", chat=False, input_ids=piece)


def _chat_prompts(src: SourceConfig, prompts: list[Prompt], tok, chat: bool) -> Iterator[TrainPrompt]:
    for p in prompts:
        ids = encode_prompt(tok, p, chat=chat)
        yield TrainPrompt(id=f"{src.kind}-{p.id}", source=src.kind, category=p.category, chat=chat,
                          input_ids=ids, text=p.text)


def source_prompts(src: SourceConfig, tok, cfg: PromptsConfig) -> list[TrainPrompt]:
    """The prompts of one source (after ``limit`` and the prompt-length filter)."""
    if src.kind == "default":
        it = _chat_prompts(src, default_seeds(), tok, src.chat is not False)
    elif src.kind == "jsonl":
        it = _chat_prompts(src, read_prompts(src.path), tok, src.chat is not False)
    elif src.kind == "text" and not src.chunk:
        it = _chat_prompts(src, read_prompts(src.path), tok, bool(src.chat))
    elif src.kind == "text":
        it = _corpus_prompts(src, tok, cfg, _open_dataset(SourceConfig(**{**asdict(src), "kind": "text"})))
    else:  # openwebtext, dataset
        it = _corpus_prompts(src, tok, cfg, _open_dataset(src))
    it = (p for p in it if 0 < len(p.input_ids) <= cfg.max_prompt_tokens)
    return list(itertools.islice(it, src.limit or None))


def collect_prompts(cfg: PromptsConfig, tok) -> list[TrainPrompt]:
    """All sources' prompts, in config order, de-duplicated by token ids."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for src in cfg.sources:
        for p in source_prompts(src, tok, cfg):
            key = tuple(p.input_ids)
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out
