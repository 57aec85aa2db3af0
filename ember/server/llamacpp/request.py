"""llama-server's request bodies -> typed requests: /completion, /tokenize, /detokenize (and
/apply-template, which reads a chat in OpenAI's shape). Its sampling, stop, constraint and prompt
fields are OpenAI's as llama-server extends them (openai/body.py).

`cache_prompt` and `id_slot` are accepted and have no effect: ember's prefix cache is shared
by every request, so there is no per-slot cache to pick or to skip.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.request import Generation, Limits
from ..errors import invalid
from ..fields import Fields
from ..openai import body as fields


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    gen: Generation  # what the core runs
    stream: bool = False
    return_tokens: bool = False
    fields: tuple[str, ...] = ()  # response_fields: "a/b" paths; empty: every field
    progress: bool = False  # return_progress
    per_token_timings: bool = False  # timings_per_token

    def __post_init__(self):
        if self.stream and len(self.gen.prompt.parts) > 1:
            raise ValueError("a stream has one prompt")


def parse_completion(body: Fields, limits: Limits, items: list | None = None) -> CompletionRequest:
    """items: the prompts, where the body's `prompt` is not where they come from (/infill)."""
    body.str("model")  # any name: one model is served
    n_predict = body.int("n_predict", None, lo=-1)
    if n_predict is None:
        n_predict = body.int("max_tokens", None, lo=-1)
    n_probs = body.int("n_probs", 0, lo=0, hi=100)
    stop, sampling = fields.stops(body, limits.max_stop), fields.sampling(body, limits)
    stream = body.bool("stream", False)
    constraint = fields.constraint(body)
    body.bool("cache_prompt", True)  # type-checked, no effect (see module doc)
    body.int("id_slot", -1, lo=-1)
    options = (body.bool("return_tokens", False), body.strings("response_fields"), body.bool("return_progress", False),
               body.bool("timings_per_token", False))
    items = fields.prompt_items(body) if items is None else items
    if stream and len(items) > 1:
        raise invalid("prompt", "streaming takes one prompt per request", "unsupported")
    limits.check_sequences(len(items), 1)
    gen = Generation(fields.prompts(items, limits), limits.max_tokens(n_predict), 1, stop, sampling, n_probs or None,
                     constraint, progress=stream and options[2],  # progress events stream only
                     speculative=fields.speculative(body, limits))
    return CompletionRequest(gen, stream, *options)


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


def parse_tokenize(body: Fields) -> TokenizeRequest:
    content = body.str("content")
    if content is None:
        raise invalid("content", "content is required", "missing_field")
    return TokenizeRequest(content, body.bool("add_special", False), body.bool("parse_special", True),
                           body.bool("with_pieces", False))


def parse_detokenize(body: Fields, limits: Limits) -> tuple[int, ...]:
    ids = []
    for i, t in enumerate(body.list("tokens", [])):
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid(f"tokens[{i}]", f"tokens[{i}] must be a token id", "invalid_type")
        ids.append(limits.check_token(t, f"tokens[{i}]"))
    return tuple(ids)
