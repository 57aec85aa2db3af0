"""Kimi K2: calls in a section of special tokens, each named by an id `functions.NAME:INDEX`,
    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
(no line breaks between the markers)."""
from __future__ import annotations

from functools import lru_cache

from ..jsonscan import Incomplete, skip_ws, value_end
from ..replies import Draft, DraftCall
from .base import NAME, CALLS_RULE, ChatFormat, args_rules, expect_text, key_tools, lit, repeated, until

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class Kimi(ChatFormat):
    name = "kimi-k2"
    think = ("<think>", "</think>")
    openers = (SECTION_BEGIN,)
    markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)

    def matches(self, template: str) -> bool:
        return SECTION_BEGIN in template

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key)

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        i = start + len(opener)
        while True:
            i = skip_ws(text, i)
            if text.startswith(SECTION_END, i):
                return i + len(SECTION_END)
            if SECTION_END.startswith(text[i:]) and not CALL_BEGIN.startswith(text[i:]):
                raise Incomplete
            i = _read_call(text, expect_text(text, i, CALL_BEGIN), draft)


def _read_call(s: str, i: int, draft: Draft) -> int:
    ident, i = until(s, i, ARG_BEGIN)
    name = ident.strip().removeprefix("functions.").rsplit(":", 1)[0]
    if not NAME.fullmatch(name):
        raise ValueError(f"not a call id: {ident!r}")
    call = DraftCall(name)
    draft.calls.append(call)
    i = skip_ws(s, i)
    try:
        end = value_end(s, i)
    except Incomplete:
        call.arguments = s[i:]
        raise
    call.arguments = s[i:end]
    end = expect_text(s, skip_ws(s, end), CALL_END)
    call.done = True
    return end


@lru_cache(maxsize=64)
def _gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, args = args_rules(tools)
    calls = [f'{lit(CALL_BEGIN + "functions." + n + ":")} [0-9] {lit(ARG_BEGIN)} {a} {lit(CALL_END)}'
             for (n, _), a in zip(tools, args)]
    return (rules + f"{CALLS_RULE} ::= {lit(SECTION_BEGIN)} {repeated('kcall', '', parallel)} {lit(SECTION_END)}\n"
            f"kcall ::= {' | '.join(calls)}\n")
