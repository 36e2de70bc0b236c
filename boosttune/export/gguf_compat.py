"""llama.cpp's rules for pairing a draft GGUF with a target GGUF, checked on the files' metadata.

``llama-server -m TARGET --model-draft DRAFT`` refuses a draft whose vocabulary is not compatible
with the target's (llama.cpp ``common/speculative.cpp``, ``common_speculative_are_compatible``):

1. the vocabulary types are equal (``tokenizer.ggml.model``: "gpt2" is BPE, "llama" SPM, ...);
2. the add-BOS flags are equal, and when BOS is added, the BOS ids are equal;
3. the same for EOS (add-EOS flag, then the EOS id);
4. the token counts differ by at most 128 (``SPEC_VOCAB_MAX_SIZE_DIFFERENCE``);
5. every token text from id 5 (``SPEC_VOCAB_CHECK_START_TOKEN_ID``) up to the smaller count is
   byte-for-byte equal.

llama.cpp applies these to the loaded vocabularies, where a missing ``add_bos_token`` /
``add_eos_token`` key takes a default that depends on the tokenizer model and pre-tokenizer
(src/llama-vocab.cpp). This checker reads the raw metadata, so it treats a missing flag as
"llama.cpp's default for this (model, pre)": both files must then miss it and agree on model and
pre, and the ids are compared (a flag that may be true is treated as true). That is at least as
strict as llama.cpp: a pair that passes here passes there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_VOCAB_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE in common/speculative.cpp
CHECK_START_TOKEN_ID = 5  # SPEC_VOCAB_CHECK_START_TOKEN_ID in common/speculative.cpp

# tokenizer.ggml.model -> llama.cpp's vocabulary type (src/llama-vocab.cpp, llama_vocab::impl::load)
_VOCAB_TYPES = {
    "no_vocab": "none", "none": "none", "llama": "spm", "bert": "wpm", "gpt2": "bpe", "hybriddna": "bpe",
    "whitespace": "bpe", "gemma4": "bpe", "t5": "ugm", "rwkv": "rwkv", "test": "test", "plamo2": "plamo2",
}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata llama.cpp's draft check depends on (None: key absent)."""

    model: str | None
    pre: str | None
    add_bos: bool | None
    add_eos: bool | None
    bos_id: int | None
    eos_id: int | None
    tokens: tuple[bytes, ...]

    @property
    def vocab_type(self) -> str:
        """llama.cpp's vocabulary type for ``model`` (an unknown model name stands for itself)."""
        return _VOCAB_TYPES.get(self.model or "", f"unknown:{self.model}")


def read_vocab(path: str | Path) -> GGUFVocab:
    """The draft-check metadata of a GGUF file."""
    import gguf

    fields = gguf.GGUFReader(path).fields

    def scalar(key: str):
        f = fields.get(key)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode("utf-8") if f.types[0] == gguf.GGUFValueType.STRING else value[0].item()

    tokens = fields.get("tokenizer.ggml.tokens")
    return GGUFVocab(
        model=scalar("tokenizer.ggml.model"), pre=scalar("tokenizer.ggml.pre"),
        add_bos=scalar("tokenizer.ggml.add_bos_token"), add_eos=scalar("tokenizer.ggml.add_eos_token"),
        bos_id=scalar("tokenizer.ggml.bos_token_id"), eos_id=scalar("tokenizer.ggml.eos_token_id"),
        tokens=tuple(bytes(tokens.parts[i]) for i in tokens.data) if tokens is not None else (),
    )


def _special(name: str, target: GGUFVocab, draft: GGUFVocab) -> list[str]:
    add_t, add_d = getattr(target, f"add_{name}"), getattr(draft, f"add_{name}")
    id_t, id_d = getattr(target, f"{name}_id"), getattr(draft, f"{name}_id")
    if add_t != add_d:
        return [f"add_{name}_token differs: target {add_t}, draft {add_d} (None: absent)"]
    if add_t is None and (target.model, target.pre) != (draft.model, draft.pre):
        return [f"add_{name}_token is absent in both, so llama.cpp's default applies, which depends on "
                f"tokenizer model and pre-tokenizer; they differ: {(target.model, target.pre)} vs {(draft.model, draft.pre)}"]
    if add_t is not False and id_t != id_d:
        return [f"{name.upper()} ids differ while {name.upper()} is added: target {id_t}, draft {id_d}"]
    return []


def draft_incompatibilities(target: GGUFVocab, draft: GGUFVocab) -> list[str]:
    """Why llama.cpp would refuse ``draft`` as a draft model for ``target`` (empty: it would not)."""
    problems = []
    if target.vocab_type != draft.vocab_type:
        problems.append(f"vocabulary types differ: target {target.model!r} ({target.vocab_type}), "
                        f"draft {draft.model!r} ({draft.vocab_type})")
    problems += _special("bos", target, draft)
    problems += _special("eos", target, draft)
    n_t, n_d = len(target.tokens), len(draft.tokens)
    if abs(n_t - n_d) > MAX_VOCAB_DIFFERENCE:
        problems.append(f"token counts differ by {abs(n_t - n_d)} (target {n_t}, draft {n_d}); "
                        f"llama.cpp allows {MAX_VOCAB_DIFFERENCE}")
    else:
        for i in range(CHECK_START_TOKEN_ID, min(n_t, n_d)):
            if target.tokens[i] != draft.tokens[i]:
                problems.append(f"token {i} differs: target {target.tokens[i]!r}, draft {draft.tokens[i]!r}")
                break
    return problems


def check_draft_gguf(target: str | Path, draft: str | Path) -> list[str]:
    """``draft_incompatibilities`` of two GGUF files."""
    return draft_incompatibilities(read_vocab(target), read_vocab(draft))
