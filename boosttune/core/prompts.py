"""Prompt files: MT-bench / ShareGPT style JSONL and plain text, and chat templating.

Accepted JSONL records (one per line): ``{"turns": [first, ...]}`` (MT-bench; the first turn is
used), ``{"prompt": ...}``, ``{"text": ...}``. Any other file is read as plain text, one prompt per
non-empty line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    """One request: its text, an id and a category when the source has them."""

    text: str
    id: str
    category: str = ""


def _from_record(rec: dict, line_no: int, path: str) -> Prompt:
    if isinstance(rec.get("turns"), list) and rec["turns"]:
        text = rec["turns"][0]
    elif isinstance(rec.get("prompt"), str):
        text = rec["prompt"]
    elif isinstance(rec.get("text"), str):
        text = rec["text"]
    else:
        raise ValueError(f"{path}:{line_no}: a JSONL record needs 'turns', 'prompt' or 'text' (got keys {sorted(rec)})")
    rid = rec.get("question_id", rec.get("id", line_no))
    return Prompt(text=str(text), id=str(rid), category=str(rec.get("category", "")))


def read_prompts(path: str | Path) -> list[Prompt]:
    """All prompts of a JSONL or text file, in file order."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file not found: {p}")
    # JSON Lines end at "\n" only; str.splitlines would also split inside strings that hold U+2028,
    # U+0085 and other Unicode line breaks (ShareGPT prompts do).
    lines = p.read_text(encoding="utf-8").split("\n")
    if p.suffix in (".jsonl", ".json"):
        out = []
        for i, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{i}: not valid JSON ({e.msg})") from None
                out.append(_from_record(rec, i, str(p)))
        return out
    return [Prompt(text=line.strip(), id=str(i)) for i, line in enumerate(lines, start=1) if line.strip()]


def encode_prompt(tokenizer, prompt: Prompt | str, chat: bool = True) -> list[int]:
    """Token ids of a prompt, through the chat template when asked and the tokenizer has one."""
    text = prompt.text if isinstance(prompt, Prompt) else prompt
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]
