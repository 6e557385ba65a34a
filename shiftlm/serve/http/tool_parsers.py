"""The `--tool-call-parser` parsers of tool_choice "auto", by vLLM's names (TOOL_CALL_PARSERS).

Content before a call streams as it comes, less a tail that may be the start of a call; a call is
sent whole (id, name, arguments) when its text closes. Text that is not a whole call stays content.
"""

from __future__ import annotations

import json

from shiftlm.serve.http.call_stream import CallStream, Deltas, json_or_none, parse_call, partial_suffix


class HermesCalls(CallStream):
    """`--tool-call-parser hermes` (Hermes 2 Pro/3, Qwen2.5, Qwen3): calls are
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after optional content.

    Content before the first `<tool_call>` streams as it comes (less a tail that may be the start of
    the tag); a call is sent when its `</tool_call>` arrives (or at the end, unclosed, if its JSON is
    whole). Text after the first call that is not a call (a block whose JSON does not parse, words
    between calls) is content, sent when the next tag or the end shows where it stops; whitespace
    between calls is dropped."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    tags_are_special = True  # as vLLM's hermes parser, which keeps special tokens for them

    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self.buffer = ""
        self.in_call = False
        self.seen_tag = False

    def feed(self, text: str) -> Deltas:
        self.buffer += text
        content, calls = [], []
        while True:
            tag = self.CLOSE if self.in_call else self.OPEN
            at = self.buffer.find(tag)
            if at < 0:
                break
            piece, self.buffer = self.buffer[:at], self.buffer[at + len(tag) :]
            if self.in_call:
                found = parse_call(json_or_none(piece))
                if found is None:
                    content.append(self.OPEN + piece + self.CLOSE)
                else:
                    calls += self._calls([found])
            else:
                content.append(self._between(piece))
                self.seen_tag = True
            self.in_call = not self.in_call
        if not self.in_call and not self.seen_tag:  # the first content streams, less a possible tag
            keep = partial_suffix(self.buffer, self.OPEN)
            content.append(self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
        return "".join(content), calls

    def finish(self) -> Deltas:
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return self._between(rest), []
        found = parse_call(json_or_none(rest))
        return ("", self._calls([found])) if found else (self.OPEN + rest, [])

    def _between(self, text: str) -> str:
        return text if not self.seen_tag or text.strip() else ""


class Llama3JsonCalls(CallStream):
    """`--tool-call-parser llama3_json` (Llama 3.1-3.3's JSON tool calling): a reply that starts with
    `{` (or `<|python_tag|>`) is one or more `{"name": ..., "parameters": {...}}` objects separated by
    `;`; any other reply is content. A call reply is held to its end and sent whole; one that does
    not parse as calls is content."""

    TAG = "<|python_tag|>"

    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self.buffer = ""
        self.mode: str | None = None  # None until the first characters decide: "content" or "calls"

    def feed(self, text: str) -> Deltas:
        if self.mode == "content":
            return text, []
        self.buffer += text
        head = self.buffer.lstrip()
        if not head or (self.TAG.startswith(head) and self.mode is None):
            return "", []  # undecided: whitespace, or the start of the tag
        if self.mode is None:
            self.mode = "calls" if head.startswith(("{", self.TAG)) else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", []

    def finish(self) -> Deltas:
        text, self.buffer = self.buffer, ""
        if self.mode == "content":
            return text, []
        found = _json_objects(text.strip().removeprefix(self.TAG))
        if not found or None in found:
            return text, []
        return "", self._calls(found)


def _json_objects(text: str) -> list[tuple[str, str] | None]:
    """The calls of `{...}; {...}`: one entry per object (None where one is not a call)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return [None]
        found.append(parse_call(value))
        rest = text[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return [None]
        at = len(text) - len(rest)
    return found


TOOL_CALL_PARSERS: dict[str, type[CallStream]] = {"hermes": HermesCalls, "llama3_json": Llama3JsonCalls}
