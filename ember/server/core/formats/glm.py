"""GLM-4.5 / 4.6: a call is the function's name and key/value pairs in tags,
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>
a value written as is when it is a string, as JSON otherwise (read back as in qwen_xml.py:
JSON where it parses as JSON other than a string); reasoning is <think>...</think>."""
from __future__ import annotations

import json
from functools import lru_cache

from ..jsonscan import Incomplete
from ..replies import Draft, DraftCall
from .base import CALLS_RULE, ChatFormat, NAME, key_tools, lit, repeated, until, value_gbnf
from .qwen_xml import is_plain_string, json_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class GLM(ChatFormat):
    name = "glm-4.5"
    think = ("<think>", "</think>")
    openers = (OPEN,)

    def matches(self, template: str) -> bool:
        return OPEN in template and KEY in template

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key)

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        i = start + len(opener)
        cut = min(k for k in (text.find("\n", i), text.find(KEY, i), text.find(CLOSE, i), len(text)) if k >= 0)
        name = text[i:cut].strip()
        if cut == len(text):
            if name and not NAME.fullmatch(name) and "<" not in name:
                raise ValueError("not a function name")
            raise Incomplete
        if not NAME.fullmatch(name):
            raise ValueError(f"not a function name: {name!r}")
        call = DraftCall(name)
        draft.calls.append(call)
        pairs, i = [], cut
        while True:
            i = _skip(text, i)
            if text.startswith(CLOSE, i):
                break
            if len(text) - i < len(CLOSE) and (CLOSE.startswith(text[i:]) or KEY.startswith(text[i:])):
                raise Incomplete
            if not text.startswith(KEY, i):
                raise ValueError("expected an argument")
            key, i = until(text, i + len(KEY), KEY_END)
            i = _skip(text, i)
            if len(text) - i < len(VALUE) and VALUE.startswith(text[i:]):
                raise Incomplete
            if not text.startswith(VALUE, i):
                raise ValueError("expected an argument's value")
            value, i = until(text, i + len(VALUE), VALUE_END)
            pairs.append(json.dumps(key.strip()) + ": " + json_value(value))
            call.arguments = "{" + ", ".join(pairs)
        call.arguments, call.done = "{" + ", ".join(pairs) + "}", True
        return i + len(CLOSE)


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in "\n ":
        i += 1
    return i


@lru_cache(maxsize=64)
def _gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, calls = "", []
    for i, (name, params) in enumerate(tools):
        parts = []
        required = set(params.get("required") or ())
        for j, (pname, schema) in enumerate((params.get("properties") or {}).items()):
            if is_plain_string(schema):
                value = "gtext"
            else:
                rules += value_gbnf(json.dumps(schema), f"g{i}-{j}")
                value = f"g{i}-{j}-v"
            block = f'{lit(KEY + pname + KEY_END + chr(10) + VALUE)} {value} {lit(VALUE_END + chr(10))}'
            parts.append(block if pname in required else f"( {block} )?")
        calls.append(f'{lit(OPEN + name + chr(10))} {" ".join(parts) or chr(34) * 2} {lit(CLOSE)}')
    return (rules + f"{CALLS_RULE} ::= {repeated('gcall', 'gsep', parallel)}\n"
            f"gcall ::= {' | '.join(calls)}\n" 'gsep ::= [ \\n]?\n'
            'gtext ::= ( [^<] | "<" [^/] | "</" [^a] )*\n')
