"""OpenAI's request bodies -> typed requests: /v1/chat/completions and /v1/completions.

Sampling fields beyond OpenAI's (top_k, min_p, repeat_penalty, ...) are accepted with
llama-server's names. With one model served, any `model` name is accepted (clients send their
own, like "gpt-4o").
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.request import Generation, Limits
from ..errors import invalid
from ..fields import Fields
from . import body as fields
from .messages import chat


@dataclass(frozen=True, slots=True)
class ChatRequest:
    gen: Generation  # what the core runs
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    gen: Generation
    stream: bool = False
    include_usage: bool = False


def parse_chat(body: Fields, limits: Limits) -> ChatRequest:
    conversation = chat(body)
    body.str("model")  # any name: one model is served
    limit = body.int("max_completion_tokens", None, lo=0)
    if limit is None:
        limit = body.int("max_tokens", None, lo=0)
    stream, include_usage = fields.stream(body)
    n = body.int("n", 1, lo=1, hi=limits.max_sequences)
    stop, sampling = fields.stops(body, limits.max_stop), fields.sampling(body, limits)
    logprobs = _chat_logprobs(body)
    constraint = fields.constraint(body)
    if constraint is not None and conversation.tools.active:
        raise invalid(constraint.param, f"{constraint.param} cannot be combined with tools (unless tool_choice is "
                                        "\"none\")", "conflicting_fields")
    gen = Generation(conversation, limits.max_tokens(limit), n, stop, sampling, logprobs, constraint,
                     speculative=fields.speculative(body, limits))
    return ChatRequest(gen, stream, include_usage)


def _chat_logprobs(body: Fields) -> int | None:
    wanted = body.bool("logprobs", False)
    top = body.int("top_logprobs", None, lo=0, hi=20)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def parse_completion(body: Fields, limits: Limits) -> CompletionRequest:
    if body.bool("echo", False):
        raise invalid("echo", "echo is not supported", "unsupported")
    if body.has("suffix"):
        raise invalid("suffix", "suffix (fill-in-the-middle) is not supported", "unsupported")
    body.str("model")
    limit = body.int("max_tokens", None, lo=0)
    stream, include_usage = fields.stream(body)
    n = body.int("n", 1, lo=1, hi=limits.max_sequences)
    stop, sampling = fields.stops(body, limits.max_stop), fields.sampling(body, limits)
    logprobs = body.int("logprobs", None, lo=0, hi=20)  # the number of alternatives
    constraint = fields.constraint(body)
    items = fields.prompt_items(body)
    limits.check_sequences(len(items), n)
    gen = Generation(fields.prompts(items, limits), limits.max_tokens(limit), n, stop, sampling, logprobs, constraint,
                     speculative=fields.speculative(body, limits))
    return CompletionRequest(gen, stream, include_usage)
