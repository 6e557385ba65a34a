"""What the engine raises, by cause; the HTTP front maps each to its status code in one table
(`http/protocol.py`, `ENGINE_ERRORS`). The engine knows nothing of HTTP."""

from __future__ import annotations


class EngineError(Exception):
    """Every error the engine hands to its callers."""


class InvalidRequest(EngineError, ValueError):
    """A request parameter is out of range; the message says which and what is allowed; `param` names
    the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt (plus at least one new token, or its max_tokens) does not fit the model's context."""


class Overloaded(EngineError):
    """Too many requests in flight (--max-pending); the client should retry later."""


class EngineDead(EngineError):
    """The engine stopped (a rank failed, or the server is shutting down)."""


class StepFailed(EngineError):
    """The step running this request raised; only its requests fail."""


class StepError(EngineError):
    """`Engine.step` raised: `request_ids` were in the step; `in_runner` when the model runner raised
    (with several ranks they may now disagree on the next collective: fatal). The cause is chained."""

    def __init__(self, message: str, request_ids: list[str], in_runner: bool):
        super().__init__(message)
        self.request_ids, self.in_runner = request_ids, in_runner
