"""The `--tool-call-parser` parsers of tool_choice "auto", by vLLM's names (TOOL_CALL_PARSERS).

Content before a call streams as it comes, less a tail that may be the start of a call; a call is
sent whole (id, name, arguments) as soon as its text closes. Text that is not a whole call stays
content. In the formats that are a sequence of calls (llama3_json, pythonic) the calls that closed
stand, and from the first piece that is not a call the rest of the reply is content (all of it when
no call came before): a stream cannot take back a call it sent, and the whole reply must give what
the stream gave.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import warnings
from typing import Any

from shiftlm.serve.http.call_stream import (
    FUNCTION_NAME,
    CallStream,
    Deltas,
    JsonEnd,
    SequenceCalls,
    arguments_json,
    json_or_none,
    parse_call,
    partial_suffix,
)


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


class Llama3JsonCalls(SequenceCalls):
    """`--tool-call-parser llama3_json` (Llama 3.1-3.3's JSON tool calling): a reply that starts with
    `{` or `<|python_tag|>` is `{"name": ..., "parameters"|"arguments": {...}}` objects separated by
    `;`, each sent when its object closes; any other reply is content."""

    TAG = "<|python_tag|>"
    SEPARATOR = re.compile(r"\s*(;\s*)?")

    def opens(self, head: str) -> int | None:
        if head.startswith(self.TAG):
            return len(self.TAG)
        if self.TAG.startswith(head):
            return None
        return 0 if head.startswith("{") else -1

    def begins(self, text: str) -> bool:
        return text.startswith("{")

    def scanner(self) -> JsonEnd:
        return JsonEnd()

    def parse(self, text: str) -> tuple[str, str] | None:
        return parse_call(json_or_none(text))


class PythonicCalls(SequenceCalls):
    """`--tool-call-parser pythonic` (Llama 3.2, Llama 4): a reply that starts with `[` is a Python
    list of calls, `[get_weather(city='Paris', days=3), f()]`, each sent when its `)` closes. The
    calls are read with `ast`, never run: a call is a plain name with keyword arguments whose values
    are literals (strings, numbers, booleans, None, lists, dicts with string keys); anything else
    (positional arguments, names, expressions) is content, as is a reply that does not start with
    `[` or does not start with a call."""

    SEPARATOR = re.compile(r"\s*(,\s*)?")
    NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*")

    def opens(self, head: str) -> int:
        return 1 if head.startswith("[") else -1

    def closing(self, text: str) -> int:
        return 1 if text.startswith("]") else 0

    def begins(self, text: str) -> bool | None:
        name = self.NAME.match(text)
        if name is None or name.end() == len(text):
            return None if name else False
        return text[name.end()] == "("

    def scanner(self) -> CallEnd:
        return CallEnd()

    def parse(self, text: str) -> tuple[str, str] | None:
        call = _python(text)
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None
        if any(keyword.arg is None for keyword in call.keywords):  # **kwargs
            return None
        try:
            arguments = {keyword.arg: _literal(keyword.value) for keyword in call.keywords}
            return call.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, RecursionError):  # not a literal; 1e999 (inf), which JSON has not
            return None


class CallEnd:
    """Where a Python call `name(...)` closes: the first `)` up to which the text parses whole (a `)`
    inside a string leaves it unparsable), read as the text grows."""

    def __init__(self):
        self.read = 0

    def find(self, text: str) -> int | None:
        while (at := text.find(")", self.read)) >= 0:
            self.read = at + 1
            if _python(text[: at + 1]) is not None:
                return at + 1
        self.read = len(text)
        return None


def _python(text: str) -> ast.expr | None:
    """The expression `text` is (parsed, never run), else None."""
    try:
        with warnings.catch_warnings():  # a model's "\\d" in a string is not the server's to warn of
            warnings.simplefilter("ignore")
            return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # MemoryError: nesting too deep
        return None


def _literal(node: ast.expr) -> Any:
    """The value of a literal argument (as JSON has them), else ValueError."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, int, float, bool)):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(
        isinstance(key, ast.Constant) and isinstance(key.value, str) for key in node.keys
    ):
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


class MistralCalls(CallStream):
    """`--tool-call-parser mistral`: content, then `[TOOL_CALLS]` and either a JSON list of
    `{"name": ..., "arguments": {...}}` (tokenizers before v11) or `name[ARGS]{...}` (v11 and later),
    each marker opening one more call. A block is sent when its JSON closes; a block that is not calls
    stays content with its marker, and so does text after a call (whitespace dropped), sent when the
    next marker or the end shows where it stops. Call ids are 9 letters and digits, as Mistral's
    tokenizers require of the ids sent back to them (vLLM's mistral parser)."""

    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    tags_are_special = True  # special tokens in Mistral's vocabularies, which vLLM keeps for them
    HEAD = re.compile(r"\s*[A-Za-z0-9_.-]*\s*(\[ARGS\])?\s*")  # the name form, before its `{`
    ID_CHARS = string.ascii_letters + string.digits

    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self.buffer = ""  # text not sent yet, from the last marker (or the reply's start)
        self.state = "text"  # text (before any marker) -> head (after a marker) -> json -> after
        self.json = JsonEnd()
        self.start = 0  # where in `buffer` the block's JSON starts
        self.name: str | None = None  # the v11 form's name; None: the block is a list or an object
        self.failed = False  # the block since the last marker is not a call: content, marker and all

    def call_id(self) -> str:
        return "".join(random.choices(self.ID_CHARS, k=9))

    def feed(self, text: str) -> Deltas:
        self.buffer += text
        content, calls = [], []
        while True:
            marker = self.buffer.find(self.MARKER)
            if self.state == "head":
                if not self._head(marker):
                    break
            elif self.state == "json":
                end = self.json.find(self.buffer[self.start :])
                if end is None:
                    break
                found = self._parse(self.buffer[self.start : self.start + end])
                calls += self._calls(found or [])
                self.failed, self.state = found is None, "after"
                if found is not None:
                    self.buffer = self.buffer[self.start + end :]
            elif marker < 0:
                if self.state == "text":  # the first content streams, less a possible marker
                    keep = len(self.buffer) - partial_suffix(self.buffer, self.MARKER)
                    content.append(self.buffer[:keep])
                    self.buffer = self.buffer[keep:]
                break
            else:
                content.append(self._before(self.buffer[:marker]))
                self.buffer, self.state = self.buffer[marker + len(self.MARKER) :], "head"
        return "".join(content), calls

    def finish(self) -> Deltas:
        if self.state in ("head", "json"):  # a block its text never closed
            self.failed, self.state = True, "after"
        rest, self.buffer = self._before(self.buffer), ""
        return rest, []

    def _before(self, text: str) -> str:
        """The content of text that ends at a marker or the reply's end: all of it before the first
        marker and in a block that is not a call (with its marker); after a call, unless whitespace."""
        if self.state == "text":
            return text
        if self.failed:
            self.failed = False
            return self.MARKER + text
        return text if text.strip() else ""

    def _head(self, marker: int) -> bool:
        """After a marker: the block's JSON starts (state json), or the block is not a call (state
        after, failed); False: the text may still be the start of a name (wait for more)."""
        text = self.buffer if marker < 0 else self.buffer[:marker]
        stripped = text.lstrip()
        if stripped[:1] in ("[", "{"):  # a list of calls, or one
            self.start, self.name = len(text) - len(stripped), None
        elif "{" in text:
            self.start = text.index("{")
            self.name = text[: self.start].replace(self.ARGS, "").strip()
        else:
            name = self.HEAD.match(text)  # the name form, less a tail that may be `[ARGS]`'s start
            if marker < 0 and name.end() >= len(text) - partial_suffix(text, self.ARGS):
                return False
            self.name = ""
        if self.name is not None and not FUNCTION_NAME.fullmatch(self.name):
            self.failed, self.state = True, "after"
        else:
            self.json, self.state = JsonEnd(), "json"
        return True

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        value = json_or_none(text)
        if self.name is not None:
            arguments = arguments_json(value)
            return None if arguments is None else [(self.name, arguments)]
        found = [parse_call(item) for item in value] if isinstance(value, list) else [parse_call(value)]
        return None if not found or None in found else found


TOOL_CALL_PARSERS: dict[str, type[CallStream]] = {
    "hermes": HermesCalls,
    "llama3_json": Llama3JsonCalls,
    "mistral": MistralCalls,
    "pythonic": PythonicCalls,
}
