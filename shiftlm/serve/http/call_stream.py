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


def call_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    """One whole call as a `tool_calls` item (a stream chunk's and, merged, the message's)."""
    return {
        "index": index,
        "id": call_id(),
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
