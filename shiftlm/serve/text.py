"""Incremental detokenization with stop strings, for streaming.

Text is re-decoded from all output tokens (a token's text can depend on its neighbours) and sent in
deltas. A delta never contains the start of a stop string that might still complete, nor a trailing
U+FFFD from a multi-byte character that the next token will finish; both are held back until known.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class StreamingText:
    """Turns the growing list of output tokens of one sample into text deltas."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the text so far, cut at a stop string once one is seen
        self._sent = 0
        self.stopped = False

    def update(self, output_ids: list[int]) -> str:
        """Re-decode; return the new text that is safe to send. Sets `stopped` on a stop string."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        hits = [index for index in (text.find(s) for s in self.stop) if index >= 0]
        if hits:
            self.text, self.stopped = text[: min(hits)], True
            return self.flush()
        self.text = text
        safe = len(text) - self._holdback
        while safe > self._sent and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._advance(safe)

    def flush(self) -> str:
        """All text not sent yet (call when the sample finishes)."""
        return self._advance(len(self.text))

    def _advance(self, end: int) -> str:
        if end <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent : end], end
        return delta
