"""What every tool-call parser is (serve/http/tool_parsers.py has them, tools.py the tool_choice
streams): a `CallStream` per choice, fed the sample's text deltas, returns what may be sent so far,
content that can no longer be part of a call and calls whose text is complete, as
(content delta, `delta.tool_calls` items). The non-streaming reply is the same stream fed the whole
text, so both ways give one answer (tests/serve/test_tool_parsers.py checks it at every split).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule, with vLLM's dots

Deltas = tuple[str, list[dict[str, Any]]]  # (content, OpenAI `delta.tool_calls` items)


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_delta(index: int, name: str, arguments: str, tool_id: str | None = None) -> dict[str, Any]:
    """One whole call as a `tool_calls` item (a stream chunk's and, merged, the message's)."""
    return {
        "index": index,
        "id": tool_id or call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def arguments_json(value: Any) -> str | None:
    """A call's arguments as the JSON text OpenAI sends (an object), or None if they are not one."""
    if isinstance(value, str):  # some models write the arguments as a JSON string
        value = json_or_none(value)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def parse_call(value: Any) -> tuple[str, str] | None:
    """(name, arguments) of a parsed `{"name": ..., "arguments"|"parameters": {...}}`, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = arguments_json(value.get("arguments", value.get("parameters", {})))
    return None if arguments is None else (value["name"], arguments)


def json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class JsonEnd:
    """Where a JSON object or list closes, its text read as it grows (brackets in strings not
    counted): a call can be sent as soon as its JSON is whole, before the reply ends."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.read = 0, False, False, 0

    def find(self, text: str) -> int | None:
        """The end of the value that `text` (its text so far, from its first bracket) starts with."""
        for at in range(self.read, len(text)):
            char = text[at]
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped = char == "\\"
                self.in_string = char != '"'
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.read = at + 1
                    return at + 1
        self.read = len(text)
        return None


class CallStream:
    """Turns one sample's text into content and tool calls (the base: all text is content)."""

    tags_are_special = False  # its tags are special tokens in some vocabularies: decode those

    def __init__(self, parallel: bool = True):
        self.parallel = parallel  # False: only the first call is kept (`parallel_tool_calls: false`)
        self.count = 0  # calls sent so far

    def feed(self, text: str) -> Deltas:
        return text, []

    def finish(self) -> Deltas:
        return "", []

    def call_id(self) -> str:
        return call_id()

    def _calls(self, found: list[tuple[str, str]]) -> list[dict[str, Any]]:
        items = []
        for name, arguments in found:
            if self.count and not self.parallel:
                break
            items.append(call_delta(self.count, name, arguments, self.call_id()))
            self.count += 1
        return items


class SequenceCalls(CallStream):
    """A reply that is a sequence of calls, known by how it starts (llama3_json, pythonic): each call
    is sent as soon as its text closes. A reply that does not start as one is content, streamed; from
    the first piece that is neither a call nor a separator, the rest of the reply is content (all of it
    if no call came before). A subclass says how the sequence opens and ends, what separates calls,
    where a call's text ends and what call it is."""

    SEPARATOR = re.compile(r"\s*")  # what comes between two calls; its group 1: the separator proper
    SPACE = re.compile(r"\s*")  # before the first call and after the sequence's end: nothing else

    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self.buffer = ""  # text not sent yet, from the reply's start until a call is found
        self.mode: str | None = None  # None until the reply's start decides: "calls" or "content"
        self.at = 0  # where in `buffer` what follows the last call (or the opening) starts
        self.call: Any = None  # the scanner of the call being read, from `scanner()`
        self.start = 0  # where that call starts in `buffer`
        self.ended = False  # the sequence was closed (pythonic's `]`): only whitespace may follow

    def opens(self, head: str) -> int | None:
        """The length of the opening at the reply's start (`head`: less whitespace): -1 if the reply
        is not calls, None while it may still be."""
        raise NotImplementedError

    def begins(self, text: str) -> bool | None:
        """Whether `text` (after a gap) begins a call; None while it may still."""
        raise NotImplementedError

    def scanner(self) -> Any:
        """A new reader of one call's text: `.find(text)` is where the call ends, None until it does."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, str] | None:
        """(name, arguments) of one call's whole text, else None."""
        raise NotImplementedError

    def closing(self, text: str) -> int:
        """The length of what ends the sequence at the start of `text` (0: nothing does)."""
        return 0

    def feed(self, text: str) -> Deltas:
        if self.mode == "content":
            return text, []
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            opened = self.opens(head) if head else None
            if opened is None:
                return "", []
            if opened < 0:
                return self._content(0), []
            self.mode, self.at = "calls", len(self.buffer) - len(head) + opened
        return self._read(final=False)

    def finish(self) -> Deltas:
        if self.mode != "calls":
            return self._content(0), []
        content, calls = self._read(final=True)
        return content + (self._content(self.start) if self.call is not None else ""), calls

    def _read(self, final: bool) -> Deltas:
        calls: list[dict[str, Any]] = []
        while self.mode == "calls":
            if self.call is None:
                gap = (self.SEPARATOR if self.count and not self.ended else self.SPACE).match(
                    self.buffer, self.at
                )
                rest = self.buffer[gap.end() :]
                if not rest:
                    break
                closing = 0 if self.ended or not self.count else self.closing(rest)
                if closing:
                    self.at, self.ended = gap.end() + closing, True
                    continue
                separated = not self.count or bool(gap.groups() and gap.group(1))
                begins = self.begins(rest) if separated and not self.ended else False
                if begins is None and not final:
                    break
                if not begins:
                    return self._content(gap.end()), calls
                self.call, self.start = self.scanner(), gap.end()
            end = self.call.find(self.buffer[self.start :])
            if end is None:
                break
            found = self.parse(self.buffer[self.start : self.start + end])
            if found is None:
                return self._content(self.start), calls
            calls += self._calls([found])
            self.buffer, self.at, self.call = self.buffer[self.start + end :], 0, None
        return "", calls

    def _content(self, at: int) -> str:
        """From `at` on, the reply is content (from its start if no call came before)."""
        text, self.buffer, self.mode, self.call = self.buffer[at if self.count else 0 :], "", "content", None
        return text
