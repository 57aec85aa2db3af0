"""Errors a client sees: one exception carrying an HTTP status and an OpenAI-style body.

Every client mistake becomes `APIError` with a 4xx status; the body is always
`{"error": {"message", "type", "param", "code"}}`, never a traceback.
"""
from __future__ import annotations

import json


class APIError(Exception):
    """A request that cannot be served, with what the client should see."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = headers or {}
        self.extra = extra or {}  # fields besides the four, for clients that look for them

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def sse(self) -> bytes:
        """The error as one server-sent event (for failures after a stream has started)."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """400 for a field with the wrong type or value."""
    return APIError(400, message, param=param, code=code)


def context_exceeded(param: str, n_prompt: int, n_ctx: int, at_least: bool = False) -> APIError:
    """The prompt does not fit: llama-server's error type and counts with OpenAI's code, so that
    clients written for either recognise it. `at_least`: n_prompt is a lower bound (the text was
    refused by its length, without tokenizing it)."""
    count = f"at least {n_prompt}" if at_least else str(n_prompt)
    return APIError(400, f"the request ({count} prompt tokens) exceeds the available context size ({n_ctx} tokens)",
                    type="exceed_context_size_error", param=param, code="context_length_exceeded",
                    extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


def not_ready(message: str) -> APIError:
    return APIError(503, message, type="unavailable_error", code="unavailable", headers={"Retry-After": "1"})


def queue_full(message: str) -> APIError:
    return APIError(503, message, type="server_overloaded", code="queue_full", headers={"Retry-After": "2"})


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
