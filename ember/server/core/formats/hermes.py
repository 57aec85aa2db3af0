"""Hermes 2 Pro / 3, Qwen 2.5, QwQ, Qwen3, Granite 4.0 and any template that renders `tools`
without a syntax of its own: calls are
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
anywhere in the reply, several per turn; reasoning (Qwen3, QwQ) is <think>...</think>."""
from __future__ import annotations

from functools import lru_cache

from ..jsonscan import Incomplete, skip_ws
from ..replies import Draft, read_json_call
from .base import CALLS_RULE, ChatFormat, args_rules, key_tools, lit, repeated

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ChatFormat):
    name = "hermes"
    think = ("<think>", "</think>")
    openers = (OPEN,)

    def matches(self, template: str) -> bool:
        return OPEN in template and "<function=" not in template and "<arg_key>" not in template

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key)

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        i = start + len(opener)
        k = text.find(CLOSE, i)
        block = text[i:k if k >= 0 else len(text)]
        read_json_call(block, skip_ws(block, 0), draft)
        if k < 0:
            raise Incomplete
        return k + len(CLOSE)


class Tagged(Hermes):
    """A template that reads `tools` in a way no family here knows: the Hermes syntax is asked for."""

    name = "tagged"

    def matches(self, template: str) -> bool:
        return False  # the fallback for templates that render tools; chosen by detect()


@lru_cache(maxsize=64)
def _gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, args = args_rules(tools)
    calls = [f'{lit(OPEN)} "\\n"? "{{" {lit(_head(n))} {a} ws-h "}}" "\\n"? {lit(CLOSE)}'
             for (n, _), a in zip(tools, args)]
    return (rules + f"{CALLS_RULE} ::= {repeated('hcall', 'ws-h', parallel)}\n"
            f"hcall ::= {' | '.join(calls)}\nws-h ::= [ \\n]?\n")


def _head(name: str) -> str:
    return '"name": "' + name + '", "arguments": '
