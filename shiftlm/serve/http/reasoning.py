"""Reasoning content on /v1/chat/completions: the thinking of a reasoning model (DeepSeek-R1, Qwen3,
QwQ) split from its answer, as vLLM's `--reasoning-parser` does.

    split = REASONING_PARSERS["qwen3"](opened=False)  # opened: the prompt left <think> open
    reasoning, content = split.feed(delta)              # per stream delta; split.finish() at the end

The thinking is what comes before `</think>` (a leading `<think>` dropped); it goes to the message's
`reasoning_content` (and a stream delta's), the rest to `content`, where tool calls are parsed. The
reply starts inside the thinking when the prompt left a `<think>` open (the templates of DeepSeek-R1's
distills, QwQ and Qwen3's *-Thinking-2507 models end so). Otherwise the parsers differ: `deepseek_r1`
takes the reply to begin in the thinking all the same, so a reply without `</think>` is thinking cut
short (`max_tokens`); with `qwen3` the model writes `<think>` itself when it thinks, so a reply that
does not open one is all answer (thinking off: `chat_template_kwargs: {"enable_thinking": false}`). Streamed and whole, the same
parser gives one answer (tests/serve/test_reasoning.py).
"""

from __future__ import annotations

from shiftlm.serve.http.call_stream import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplit:
    """Splits one reply into (reasoning, content) deltas; `starts_thinking`: the reply begins inside
    the thinking even without `<think>` (the prompt opened it)."""

    starts_thinking = True

    def __init__(self, opened: bool = False):
        """`opened`: the prompt left a `<think>` open (`tokenizer.opens_thinking`): the reply starts
        inside the thinking, whichever the parser."""
        self.buffer = ""  # text not sent yet: what may still be the start of a tag
        self.state = "thinking" if opened else "start"  # start (may open <think>) -> thinking -> answer

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return "", ""  # nothing but whitespace yet, or the start of <think>
            if head.startswith(OPEN):
                self.buffer, self.state = head[len(OPEN) :], "thinking"
            else:
                self.state = "thinking" if self.starts_thinking else "answer"
        if self.state == "thinking":
            at = self.buffer.find(CLOSE)
            if at < 0:
                cut = len(self.buffer) - partial_suffix(self.buffer, CLOSE)
                reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:at], self.buffer[at + len(CLOSE) :], "answer"
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        thinking = self.state == "thinking" or (self.state == "start" and self.starts_thinking)
        return (rest, "") if thinking else ("", rest)


class Qwen3Split(ThinkSplit):
    starts_thinking = False


REASONING_PARSERS: dict[str, type[ThinkSplit]] = {"deepseek_r1": ThinkSplit, "qwen3": Qwen3Split}
