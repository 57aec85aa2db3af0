"""Granite 3.3: calls are a JSON list after <|tool_call|>,
    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
and with `thinking` on the reply is <think>...</think><response>...</response>. Its template
writes no tool_calls of earlier turns, so they go into the message's content in that syntax."""
from __future__ import annotations

import json
from functools import lru_cache

from ..replies import Draft, read_call_array
from ..request import Message
from .base import CALLS_RULE, ChatFormat, Reading, args_rules, held, key_tools, lit, repeated

TOOL_CALL = "<|tool_call|>"
RESPONSE, RESPONSE_END = "<response>", "</response>"


class Granite(ChatFormat):
    name = "granite"
    think = ("<think>", "</think>")
    openers = (TOOL_CALL,)
    markers = (TOOL_CALL,)

    def matches(self, template: str) -> bool:
        return TOOL_CALL in template and "<|start_of_role|>" in template

    def message(self, m: Message) -> dict:
        out = super().message(m)
        if m.tool_calls:
            calls = [{"name": c.name, "arguments": self.arguments(c.arguments)} for c in m.tool_calls]
            out["content"] = m.content + TOOL_CALL + json.dumps(calls, ensure_ascii=False)
        return out

    def draft(self, text: str, final: bool, reading: Reading) -> Draft:
        draft = super().draft(text, final, reading)
        content = draft.content.replace(RESPONSE, "").replace(RESPONSE_END, "")
        draft.content = content if final else held(content, (RESPONSE, RESPONSE_END))
        return draft

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        return read_call_array(text, start + len(opener), draft)

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key)


@lru_cache(maxsize=64)
def _gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, args = args_rules(tools)
    calls = [f'{lit("{" + json.dumps("name") + ": " + json.dumps(n) + ", " + json.dumps("arguments") + ": ")} {a} "}}"'
             for (n, _), a in zip(tools, args)]
    return (rules + f'{CALLS_RULE} ::= {lit(TOOL_CALL + "[")} {repeated("rcall", lit(", "), parallel)} "]"\n'
            f"rcall ::= {' | '.join(calls)}\n")
