"""When generation stops: max_new_tokens, EOS ids, stop strings.

A verification step may commit several tokens at once; ``StopCriteria.cut`` trims them exactly
where token-by-token decoding would have stopped, so speculative and plain decoding agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StopCriteria:
    """Attributes:
    max_new_tokens: hard cap on generated tokens (>= 1).
    eos_token_ids: generation ends after emitting any of these (the EOS token is kept).
    stop_strings: generation ends once the decoded text contains one of these.
    tokenizer: needed only for stop_strings (decodes the generated tokens).
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode the generated text")

    def cut(self, generated: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """Tokens of ``new`` to commit after ``generated``, and the finish reason if it stops."""
        room = self.max_new_tokens - len(generated)
        for i, tok in enumerate(new):
            if tok in self.eos_token_ids:
                return new[: i + 1], "stop"
            if self.stop_strings and self._hits_stop(generated + new[: i + 1]):
                return new[: i + 1], "stop"
            if i + 1 >= room:
                return new[: i + 1], "length"
        return new, None

    def _hits_stop(self, tokens: list[int]) -> bool:
        # Decode a short tail only: a stop string spans at most a few dozen tokens.
        tail = self.tokenizer.decode(tokens[-32:], skip_special_tokens=False)
        return any(s in tail for s in self.stop_strings)
