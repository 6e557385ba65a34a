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

Each choice's text goes through one stream (call_stream.CallStream): the parsers of "auto" are in
tool_parsers.py, those of a named and a `required` choice here.
"""

from __future__ import annotations

from typing import Any

from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.structured import StructuredOutputsParams
from shiftlm.serve.http.call_stream import (
    FUNCTION_NAME,
    CallStream,
    Deltas,
    call_delta,
    json_or_none,
    parse_call,
)
from shiftlm.serve.http.tool_parsers import TOOL_CALL_PARSERS


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
        value = json_or_none(self.text)
        found = [parse_call(item) for item in value] if isinstance(value, list) else [None]
        if not found or None in found:
            return self.text, []
        return "", self._calls(found)


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
            if not FUNCTION_NAME.fullmatch(name):
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
