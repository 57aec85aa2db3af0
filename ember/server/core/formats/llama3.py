"""Llama 3.1 / 3.2 / 3.3: a call is a JSON object
    {"name": "get_weather", "parameters": {"city": "Paris"}}
(optionally with "type": "function"), or after <|python_tag|> either such an object or a
built-in tool's `brave_search.call(query="...")`."""
from __future__ import annotations

import json
import re
from functools import lru_cache

from ..jsonscan import Incomplete, skip_ws
from ..replies import Draft, DraftCall, read_json_call
from .base import CALLS_RULE, ChatFormat, args_rules, key_tools, lit, name_until, repeated

PYTHON_TAG = "<|python_tag|>"
JSON_OPENERS = ('{"name"', '{"type"')
BUILTIN_ARG = re.compile(r'\s*([A-Za-z_]\w*)\s*=\s*("(?:\\.|[^"\\])*"|[^,)]*)\s*(,|\))')


class Llama3(ChatFormat):
    name = "llama3"
    openers = (PYTHON_TAG, *JSON_OPENERS)
    triggers = (PYTHON_TAG, JSON_OPENERS[0])
    markers = (PYTHON_TAG,)

    def matches(self, template: str) -> bool:
        return "<|start_header_id|>" in template and "ipython" in template

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key)

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        if opener != PYTHON_TAG:
            return read_call_object(text, start, draft)
        i = skip_ws(text, start + len(opener))
        if i == len(text):
            raise Incomplete
        if text[i] == "{":
            return read_call_object(text, i, draft)
        return _read_builtin(text, i, draft)


def read_call_object(s: str, i: int, draft: Draft) -> int:
    """{"name": ..., "parameters"/"arguments": {...}} at s[i] (other keys skipped)."""
    return read_json_call(s, i, draft, first_keys=("name", "type"))


def _read_builtin(s: str, i: int, draft: Draft) -> int:
    """name.call(arg="value", ...)"""
    name, i = name_until(s, i, ".call(")
    call = DraftCall(name)
    draft.calls.append(call)
    args, i = {}, skip_ws(s, i)
    if s.startswith(")", i):
        i += 1
    else:
        while True:
            m = BUILTIN_ARG.match(s, i)
            if m is None:
                raise Incomplete
            args[m.group(1)], i = _literal(m.group(2)), m.end()
            if m.group(3) == ")":
                break
    call.arguments, call.done = json.dumps(args, ensure_ascii=False), True
    return i


def _literal(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.strip()


@lru_cache(maxsize=64)
def _gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, args = args_rules(tools)
    calls = [f'{lit("{" + chr(34) + "name" + chr(34) + ": " + json.dumps(n) + ", " + chr(34) + "parameters" + chr(34) + ": ")} '
             f'{a} "}}"' for (n, _), a in zip(tools, args)]
    return (rules + f"{CALLS_RULE} ::= {lit(PYTHON_TAG)}? {repeated('lcall', 'lsep', parallel)}\n"
            f"lcall ::= {' | '.join(calls)}\n" 'lsep ::= [ \\n;]*\n')
