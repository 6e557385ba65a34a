"""The OpenAI wire format: request bodies (pydantic), error bodies, and response pieces.

The fields of OpenAI's completions and chat APIs that shiftlm implements are declared here, with
vLLM's usual extensions (`top_k`, `min_tokens`, `ignore_eos`, `repetition_penalty`, `stop_token_ids`,
`structured_outputs`, `skip_special_tokens`), and chat's `tools` (http/tools.py). A field shiftlm does
not implement (suffix, ...) is refused with a 400 that names it, never silently ignored: a client
that relies on it must learn at once. Only fields that change nothing about the output (`user`,
`metadata`, ...) are accepted and ignored.

A completion prompt may be a string, a list of strings, a list of token ids, or a list of such lists
(one choice set per prompt, as OpenAI and vLLM answer them).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shiftlm.serve.engine.errors import EngineDead, EngineError, InvalidRequest, Overloaded, StepFailed
from shiftlm.serve.engine.sampling import SEED_MODULUS
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.engine.structured import StructuredOutputsParams


class ApiError(Exception):
    """An error the client caused or must handle; rendered as OpenAI's `{"error": {...}}` body."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "not_found_error",
        408: "timeout_error",
        413: "invalid_request_error",
        429: "rate_limit_exceeded",
        500: "server_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after = retry_after  # seconds, sent as Retry-After (429 and 503)

    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": str(max(1, round(self.retry_after)))}

    def body(self) -> dict[str, Any]:
        error_type = self.TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": error_type, "param": self.param, "code": self.status}
        }


MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (400 beyond): bounds its sampling cost
_TOKEN_ID = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: "²" and "٣" pass str.isdigit, not int()


def parse_logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs, parsed once: keys are decimal integers (aliases such as
    " 007" and "7" name one token, the last one sent wins), at most MAX_LOGIT_BIAS of them."""
    if not raw:
        return ()
    if len(raw) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"logit_bias has {len(raw)} entries; at most {MAX_LOGIT_BIAS} are accepted", "logit_bias"
        )
    bias: dict[int, float] = {}
    for key, value in raw.items():
        text = key.strip()
        if not _TOKEN_ID.fullmatch(text):
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key[:20]!r}", "logit_bias")
        bias[int(text)] = value
    return tuple(bias.items())


RETRY_AFTER_BUSY = 1.0  # seconds a 429 asks the client to wait (Retry-After)
RETRY_AFTER_DOWN = 10.0  # and a 503: a supervisor restarts a failed server within about this

# The one table from the engine's errors to HTTP: (error, status, Retry-After), the first match wins.
# A bad parameter or a prompt past the context is a 400 as vLLM answers it.
ENGINE_ERRORS: tuple[tuple[type[EngineError], int, float | None], ...] = (
    (InvalidRequest, 400, None),
    (Overloaded, 429, RETRY_AFTER_BUSY),
    (StepFailed, 500, None),
    (EngineDead, 503, RETRY_AFTER_DOWN),
)


def api_error(err: EngineError) -> ApiError:
    """An engine error as its HTTP error (`ENGINE_ERRORS`); 429 and 503 carry Retry-After."""
    for kind, status, retry_after in ENGINE_ERRORS:
        if isinstance(err, kind):
            return ApiError(status, str(err), getattr(err, "param", None), retry_after)
    return ApiError(500, f"internal error: {type(err).__name__}: {err}")


# Accepted and ignored: they do not change what is generated.
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "request_id"}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # `schema` would shadow pydantic's
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` (extra body): exactly one of these."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`"temperature": null` means the default, as OpenAI's API treats it (clients send nulls)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower is served first
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar the output keeps to: `structured_outputs`, else `response_format`'s."""
        fmt, chosen = self.response_format, self.structured_outputs
        if chosen is not None:
            if fmt is not None and fmt.type != "text":
                raise InvalidRequest(
                    "send response_format or structured_outputs, not both", "structured_outputs"
                )
            choice = None if chosen.choice is None else tuple(chosen.choice)
            return StructuredOutputsParams(
                chosen.json_, chosen.regex, choice, chosen.grammar, bool(chosen.json_object)
            )
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequest("response_format json_schema needs json_schema.schema", "response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def unsupported_field(self) -> str | None:
        """The first field the client sent that shiftlm does not implement (None if all are)."""
        for name, value in (self.model_extra or {}).items():
            if name not in IGNORED_FIELDS and value is not None:
                return name
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return None

    def sampling_params(
        self,
        default_max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        vocab_size: int | None = None,
        structured: StructuredOutputsParams | None = None,
        after_thinking: bool = False,
        defaults: tuple[tuple[str, float | int], ...] = (),
    ) -> SamplingParams:
        """The request's SamplingParams (`structured`: its tools' grammar, else its own, which holds
        the reply from the end of its thinking if `after_thinking`; `defaults`: the model's
        generation_config values of the fields it did not send); `top_k` past
        the vocabulary (or -1) keeps every token, as in vLLM, so no integer a client sends can
        overflow the sampler's int64 tensors."""
        for name, value in defaults:
            if name != "max_tokens" and name not in self.model_fields_set:
                setattr(self, name, value)
        top_k = 0 if self.top_k == -1 else self.top_k
        if vocab_size is not None and top_k >= vocab_size:
            top_k = 0
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=top_k,
            min_p=self.min_p,
            # any integer is a seed: reduced to what torch.Generator.manual_seed accepts
            seed=None if self.seed is None else self.seed % SEED_MODULUS,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=parse_logit_bias(self.logit_bias),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=self.min_tokens,
            cache_salt=self.cache_salt,
            priority=self.priority,
            structured_outputs=structured or self.structured(),
            structured_after_thinking=after_thinking,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(item, int) for item in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict = "{}"  # a JSON string on the wire; a dict as some clients send it


class ToolCallMessage(BaseModel):
    """A call an earlier assistant message made (OpenAI's `message.tool_calls` item)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None  # a `tool` message: the call it answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatRendering(BaseModel):
    """What renders a conversation's prompt: /v1/chat/completions' fields that /tokenize takes too."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None

    def tool_dicts(self) -> list[dict] | None:
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]


class ChatCompletionRequest(ChatRendering, SamplingFields):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out (--reasoning-parser)

    def unsupported_field(self) -> str | None:
        for message in self.messages:
            for name, value in (message.model_extra or {}).items():
                if value is not None:
                    return f"messages.{name}"
        return super().unsupported_field()

    def sampling_params(
        self,
        default_max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        vocab_size: int | None = None,
        structured: StructuredOutputsParams | None = None,
        after_thinking: bool = False,
        defaults: tuple[tuple[str, float | int], ...] = (),
    ) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(
            default_max_tokens, logprobs, prompt_logprobs, vocab_size, structured, after_thinking, defaults
        )


class TokenizeRequest(ChatRendering):
    """vLLM's /tokenize: a prompt, or chat messages as /v1/chat/completions renders them."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, the template's own for messages
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
