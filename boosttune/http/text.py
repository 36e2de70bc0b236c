"""Streaming detokenization: token ids in, text deltas out, never showing what a stop string will cut.

OpenAI semantics: the returned text ends before the first stop string, and streamed deltas add up to
exactly that text. So a delta holds back (a) a trailing U+FFFD (half of a multi-byte character
whose other bytes are in the next token) and (b) any tail that could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Accumulates generated tokens and yields the text that is safe to show so far."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.tokens: list[int] = []
        self.sent = ""

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _trim(self, text: str) -> str:
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def push(self, tokens: Sequence[int]) -> str:
        """Add ``tokens``; the new text that may be shown now ("" if nothing yet)."""
        self.tokens.extend(tokens)
        text = self._decoded()
        safe = self._trim(text)
        if safe == text:  # no stop string yet: hold back what could become one
            safe = text[: len(text) - _stop_prefix_len(text, self.stop)]
        safe = safe.rstrip(_INCOMPLETE)
        if not safe.startswith(self.sent):  # decoding revised earlier text: wait for the end
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self) -> str:
        """The rest of the final text (call once, after the last tokens)."""
        final = self.text
        delta = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent = final if final.startswith(self.sent) else self.sent
        return delta

    @property
    def text(self) -> str:
        """The whole answer: decoded, cut before the first stop string."""
        return self._trim(self._decoded())
