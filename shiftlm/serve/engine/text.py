"""Incremental detokenization with stop strings, for streaming: O(1) work per generated token.

A token's text can depend on its neighbours (SentencePiece drops the leading space of a text's first
piece; byte-level BPE splits one character over several tokens), so a token is never decoded alone.
As in vLLM's `detokenize_incrementally`, two offsets into the output ids bound a small window:
`decode(ids[prefix:])` minus `decode(ids[prefix:read])` is the text the tokens after `read` add.
While that text ends in U+FFFD (a multi-byte character the next token will finish) nothing is
emitted and the window grows until the character is complete. The window is a few tokens, so a
step costs the same at token 10 and at token 10,000 (re-decoding everything made it O(n) per token).

A delta never contains the start of a stop string that might still complete: the last
`len(longest stop) - 1` characters are held back until known, and stop strings are searched only in
the text that could contain a new match.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class StreamingText:
    """Turns the growing list of output tokens of one sample into text deltas."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        """`include_stop`: the text ends with the stop string that ended it (vLLM's
        `include_stop_str_in_output`), else just before it; `skip_special_tokens`: special tokens
        add no text (vLLM's default; tool-call tags are special tokens in some vocabularies)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._holdback = max(self._longest_stop - 1, 0)
        self.text = ""  # the text so far, cut at a stop string once one is seen
        self._sent = 0
        self._prefix = 0  # output ids [prefix, read) were decoded already: the context of the next ones
        self._read = 0
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text (vLLM's stop_reason)

    def update(self, output_ids: list[int]) -> str:
        """Decode the tokens added since the last call; return the new text that is safe to send.
        Sets `stopped` (and cuts `text`) when a stop string appears."""
        if self.stopped or len(output_ids) <= self._read:
            return ""
        decode = self.tokenizer.decode
        window = output_ids[self._prefix :]
        full = decode(window, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd"):
            return ""  # a character split over tokens: wait for the rest of it
        known = decode(output_ids[self._prefix : self._read], skip_special_tokens=self.skip_special_tokens)
        new = full[len(known) :]
        self._prefix, self._read = self._read, len(output_ids)
        before = len(self.text)
        self.text += new
        if self.stop and new:
            search_from = max(0, before - self._longest_stop + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                at, self.stop_string = min(hits)
                end = at + len(self.stop_string) if self.include_stop else at
                self.text, self.stopped = self.text[:end], True
                return self.flush()
        return self._advance(len(self.text) - self._holdback)

    def flush(self) -> str:
        """All text not sent yet (call when the sample finishes)."""
        return self._advance(len(self.text))

    def _advance(self, end: int) -> str:
        if end <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent : end], end
        return delta
