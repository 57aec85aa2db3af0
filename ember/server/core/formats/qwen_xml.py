"""Qwen3-Coder and Qwen3.5: calls in XML, one value per parameter,
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
A value is written as is when it is a string, as JSON otherwise; reading it back, a value that
parses as a JSON number, object, array, boolean or null is taken as that, anything else as the
string written (so a string argument that reads as a number comes back as the number; the
arguments stream one whole parameter at a time). Reasoning (Qwen3.5) is <think>...</think>."""
from __future__ import annotations

import json
from functools import lru_cache

from ..jsonscan import Incomplete
from ..replies import Draft, DraftCall
from .base import (CALLS_RULE, ChatFormat, expect_text, key_tools, lit, name_until, repeated,
                   value_gbnf)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, PARAM, PARAM_END, FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"


class QwenXML(ChatFormat):
    name = "qwen3-coder"
    think = ("<think>", "</think>")
    openers = (OPEN,)

    def matches(self, template: str) -> bool:
        return OPEN in template and FUNCTION in template and PARAM in template

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key)

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        i = _skip_nl(text, start + len(opener))
        name, i = name_until(text, expect_text(text, i, FUNCTION), ">")
        call = DraftCall(name)
        draft.calls.append(call)
        values: list[str] = []
        while True:
            i = _skip_nl(text, i)
            if text.startswith(FUNCTION_END, i):
                break
            if len(text) - i < len(FUNCTION_END) and FUNCTION_END.startswith(text[i:]):
                raise Incomplete
            key, i = name_until(text, expect_text(text, i, PARAM), ">")
            end = text.find(PARAM_END, i)
            if end < 0:
                raise Incomplete
            values.append(json.dumps(key) + ": " + json_value(_strip_nl(text[i:end])))
            call.arguments = "{" + ", ".join(values)
            i = end + len(PARAM_END)
        call.arguments = "{" + ", ".join(values) + "}"
        call.done = True
        i = _skip_nl(text, i + len(FUNCTION_END))
        return expect_text(text, i, CLOSE)


def _skip_nl(s: str, i: int) -> int:
    while i < len(s) and s[i] in "\n ":
        i += 1
    return i


def _strip_nl(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def json_value(raw: str) -> str:
    """A parameter's value as JSON text: JSON where it is JSON (numbers, objects, true, ...), else a string."""
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return json.dumps(raw if isinstance(value, str) else value, ensure_ascii=False)


@lru_cache(maxsize=64)
def _gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, calls = "", []
    for i, (name, params) in enumerate(tools):
        body, more = _params(i, params)
        rules += more
        calls.append(f'{lit(OPEN + chr(10) + FUNCTION + name + ">" + chr(10))} {body} {lit(FUNCTION_END + chr(10) + CLOSE)}')
    return (rules + f"{CALLS_RULE} ::= {repeated('xcall', 'xsep', parallel)}\n"
            f"xcall ::= {' | '.join(calls)}\n" 'xsep ::= [ \\n]?\n'

            f'xtext ::= ( [^<] | "<" [^/] | "</" [^p] | "</p" [^a] | "</pa" [^r] )*\n')


def _params(i: int, params: dict) -> tuple[str, str]:
    """(the sequence of a tool's <parameter=...> blocks, the rules their values need): the
    schema's properties in order, required ones always, the others optional."""
    props = params.get("properties") or {}
    required = set(params.get("required") or ())
    parts, rules = [], ""
    for j, (pname, schema) in enumerate(props.items()):
        if is_plain_string(schema):
            value = "xtext"
        else:
            rules += value_gbnf(json.dumps(schema), f"p{i}-{j}")
            value = f"p{i}-{j}-v"
        block = f'{lit(PARAM + pname + ">" + chr(10))} {value} {lit(chr(10) + PARAM_END + chr(10))}'
        parts.append(block if pname in required else f"( {block} )?")
    return (" ".join(parts) if parts else '""'), rules


def is_plain_string(schema) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string" and not (schema.keys() - {
        "type", "description", "title"})
