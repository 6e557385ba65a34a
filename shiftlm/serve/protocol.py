"""The OpenAI wire format: request bodies (pydantic), error bodies, and response chunks.

Only the fields shiftlm acts on are declared; unknown fields are ignored, as OpenAI-compatible servers
commonly do. `top_k` and `ignore_eos` are the usual vLLM extensions (the trace replay forces output
lengths with `ignore_eos`). A prompt may be text or a list of token ids.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shiftlm.serve.sequence import SamplingParams


class ApiError(Exception):
    """An error the client caused or must handle; rendered as OpenAI's `{"error": {...}}` body."""

    TYPES = {
        400: "invalid_request_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_exceeded",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        error_type = self.TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": error_type, "param": self.param, "code": self.status}
        }


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            n=self.n,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
