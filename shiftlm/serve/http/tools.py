"""Tool calling on /v1/chat/completions, as OpenAI and vLLM serve it.

    tools = ToolChoice.of(tools, tool_choice, "hermes", parallel)   # None: no tools
    tools.structured()      # the grammar of a named or `required` choice (a JSON schema), else None
    calls = tools.stream()  # one per choice: text deltas in, (content delta, tool-call deltas) out

`tool_choice` says what the model may do with the request's `tools`:
- a named function: the reply is that function's arguments, held to its `parameters` schema by the
  structured-output grammar (serve/engine/structured.py); finish_reason stays the sample's ("stop").
- `required`: a JSON list of one or more `{"name", "parameters"}` calls, held to a schema that allows
  exactly the request's functions (vLLM's, and no other keys); finish_reason "tool_calls".
- `auto` (the default when tools are sent): the model answers freely and a tool-call parser
  (`--enable-auto-tool-choice --tool-call-parser NAME`) finds the calls in its text; finish_reason
  "tool_calls" when it found one.
- `none`: the tools reach the chat template and nothing is parsed.

A stream is fed the sample's text deltas and returns what may be sent so far: content that can no
longer be part of a call, and calls whose text is complete. The non-streaming reply is the same
stream fed the whole text, so both ways give one answer (tests/serve/test_tool_parsers.py checks it at
every split of the text).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.structured import StructuredOutputsParams

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule, with vLLM's dots

Deltas = tuple[str, list[dict[str, Any]]]  # (content, OpenAI `delta.tool_calls` items)


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    """One whole call as a `tool_calls` item (a stream chunk's and, merged, the message's)."""
    return {
        "index": index,
        "id": call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def merge_calls(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A choice's `delta.tool_calls` items as its message's `tool_calls` (arguments joined per call)."""
    calls: dict[int, dict[str, Any]] = {}
    for item in items:
        call = calls.setdefault(
            item["index"],
            {
                "id": item.get("id"),
                "type": "function",
                "function": {"name": item["function"].get("name"), "arguments": ""},
            },
        )
        call["function"]["arguments"] += item["function"].get("arguments", "")
    return list(calls.values())


def _arguments(value: Any) -> str | None:
    """A call's arguments as the JSON text OpenAI sends (an object), or None if they are not one."""
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(value: Any) -> tuple[str, str] | None:
    """(name, arguments) of a parsed `{"name": ..., "arguments"|"parameters": {...}}`, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = _arguments(value.get("arguments", value.get("parameters", {})))
    return None if arguments is None else (value["name"], arguments)


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

    def _calls(self, found: list[tuple[str, str]]) -> list[dict[str, Any]]:
        items = []
        for name, arguments in found:
            if self.count and not self.parallel:
                break
            items.append(call_delta(self.count, name, arguments))
            self.count += 1
        return items


class NamedCall(CallStream):
    """tool_choice names a function: the whole text is its arguments, streamed as they come."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Deltas:
        if self.count == 0:
            self.count = 1
            return "", [call_delta(0, self.name, text)]
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []


class RequiredCalls(CallStream):
    """tool_choice `required`: the text is a JSON list of calls, sent once it is complete. A text
    the grammar could not finish (max_tokens) is returned as content."""

    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self.text = ""

    def feed(self, text: str) -> Deltas:
        self.text += text
        return "", []

    def finish(self) -> Deltas:
        try:
            value = json.loads(self.text)
        except ValueError:
            value = None
        found = [_call(item) for item in value] if isinstance(value, list) else [None]
        if not found or None in found:
            return self.text, []
        return "", self._calls(found)


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
                found = self._parse(piece)
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
        found = self._parse(rest)
        return ("", self._calls([found])) if found else (self.OPEN + rest, [])

    def _between(self, text: str) -> str:
        return text if not self.seen_tag or text.strip() else ""

    @staticmethod
    def _parse(body: str) -> tuple[str, str] | None:
        try:
            return _call(json.loads(body))
        except ValueError:
            return None


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
        found.append(_call(value))
        rest = text[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return [None]
        at = len(text) - len(rest)
    return found


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


TOOL_CALL_PARSERS: dict[str, type[CallStream]] = {"hermes": HermesCalls, "llama3_json": Llama3JsonCalls}


class ToolChoice:
    """A request's tools and tool_choice, checked: what constrains and what parses its replies."""

    def __init__(self, tools: list[dict], choice: str | dict, parser: str | None, parallel: bool):
        self.tools, self.choice, self.parser, self.parallel = tools, choice, parser, parallel

    @classmethod
    def of(
        cls, tools: list[dict] | None, choice: Any, parser: str | None, parallel: bool
    ) -> ToolChoice | None:
        """The request's tool use (None: no tools, or tool_choice "none" with none to render), or an
        InvalidRequest naming the field and the fix."""
        if tools is not None and not tools:
            raise InvalidRequest(
                "tools must not be empty: send at least one tool or leave the field out", "tools"
            )
        if choice is None:
            choice = "auto" if tools else "none"
        if not tools:
            if choice != "none":
                raise InvalidRequest("tool_choice needs tools: send the functions it may call", "tool_choice")
            return None
        names = [tool["function"]["name"] for tool in tools]
        for name in names:
            if not _FUNCTION_NAME.fullmatch(name):
                raise InvalidRequest(
                    f"tool name {name[:80]!r} must be 1-64 letters, digits, '_', '-' or '.'", "tools"
                )
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise InvalidRequest(
                f"tool_choice names {choice['function']['name'][:80]!r}, which is not in tools", "tool_choice"
            )
        if choice == "auto" and parser is None:
            raise InvalidRequest(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                '--tool-call-parser; send tool_choice "required", a named function or "none"',
                "tool_choice",
            )
        return cls(tools, choice, parser, parallel)

    @property
    def named(self) -> str | None:
        return self.choice["function"]["name"] if isinstance(self.choice, dict) else None

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar a named or `required` choice keeps the reply to (vLLM's schemas)."""
        functions = {tool["function"]["name"]: tool["function"] for tool in self.tools}
        if self.named is not None:
            return StructuredOutputsParams(json=_parameters(functions[self.named]))
        if self.choice != "required":
            return None
        defs: dict[str, Any] = {}
        options = []
        for name, function in functions.items():
            schema = dict(_parameters(function))
            for key, value in schema.pop("$defs", {}).items():
                if defs.setdefault(key, value) != value:
                    raise InvalidRequest(f"tools define $defs {key!r} twice, differently", "tools")
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return StructuredOutputsParams(json=schema)

    def stream(self) -> CallStream:
        """A new parser for one choice's text."""
        if self.named is not None:
            return NamedCall(self.named)
        if self.choice == "required":
            return RequiredCalls(self.parallel)
        if self.choice == "auto":
            return TOOL_CALL_PARSERS[self.parser](self.parallel)
        return CallStream()

    def skip_special_tokens(self, requested: bool) -> bool:
        """Whether the reply's text leaves out special tokens: not where the parser's tags may be some."""
        return requested and not (self.choice == "auto" and TOOL_CALL_PARSERS[self.parser].tags_are_special)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """ "tool_calls" when an `auto` or `required` reply called tools (a named one keeps "stop", as
        OpenAI and vLLM answer it)."""
        return "tool_calls" if reason is not None and called and self.named is None else reason


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}
