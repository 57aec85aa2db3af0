"""Mistral: calls follow [TOOL_CALLS], in one of two generations of the syntax,
    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]   Nemo
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                                           Small 3.2, Devstral, Ministral 3
(Small 3.2 may put [CALL_ID]id before [ARGS]); both are read either way. Call ids are 9
letters and digits, as the templates demand: others given in a conversation are mapped to
such ids. Ministral 3's reasoning is [THINK]...[/THINK]."""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from functools import lru_cache

from ..jsonscan import Incomplete, skip_ws, value_end
from ..replies import Draft, DraftCall, read_call_array
from ..request import Message
from .base import NAME, CALLS_RULE, ChatFormat, args_rules, key_tools, lit, partial_len, repeated

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
ALNUM = string.ascii_letters + string.digits
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


class Mistral(ChatFormat):
    name = "mistral"
    openers = (TOOL_CALLS,)
    markers = (TOOL_CALLS, ARGS, CALL_ID, "[THINK]", "[/THINK]")

    def matches(self, template: str) -> bool:
        return TOOL_CALLS in template and ARGS in template

    def calls_gbnf(self, key: str) -> str:
        return _args_gbnf(key)

    def call_id(self, given: str) -> str:
        if MISTRAL_ID.fullmatch(given):
            return given
        digest = hashlib.sha256(given.encode()).digest()
        return "".join(ALNUM[b % len(ALNUM)] for b in digest[:9])

    def new_id(self) -> str:
        return "".join(secrets.choice(ALNUM) for _ in range(9))

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        i = skip_ws(text, start + len(opener))
        if i == len(text):
            raise Incomplete
        if text[i] == "[":
            return read_call_array(text, i, draft)
        name, i = _name(text, i)
        call = DraftCall(name)
        draft.calls.append(call)
        try:
            end = value_end(text, i)
        except Incomplete:
            call.arguments = text[i:]
            raise
        call.arguments, call.done = text[i:end], True
        return end


class MistralReasoning(Mistral):
    name = "mistral-reasoning"
    think = ("[THINK]", "[/THINK]")

    def matches(self, template: str) -> bool:
        return super().matches(template) and "[THINK]" in template

    def message(self, m: Message) -> dict:
        """Earlier reasoning goes back as a thinking chunk of the content, as the template reads it."""
        out = super().message(m)
        reasoning = out.pop(self.reasoning_key, None)
        if reasoning:
            out["content"] = [{"type": "thinking", "thinking": reasoning}, {"type": "text", "text": m.content}]
        return out


class MistralNemo(Mistral):
    name = "mistral-nemo"

    def matches(self, template: str) -> bool:
        return TOOL_CALLS in template and ARGS not in template

    def calls_gbnf(self, key: str) -> str:
        return _array_gbnf(key)


def _name(s: str, i: int) -> tuple[str, int]:
    """The function name up to [ARGS] (a [CALL_ID]... between them skipped), and the index after [ARGS]."""
    k = s.find(ARGS, i)
    head = s[i:k] if k >= 0 else s[i:len(s) - partial_len(s[i:], (ARGS, CALL_ID))]
    name = head.split(CALL_ID)[0].strip()
    if not NAME.fullmatch(name) and (k >= 0 or name):
        raise ValueError(f"not a function name: {name!r}")
    if k < 0:
        raise Incomplete
    return name, k + len(ARGS)


@lru_cache(maxsize=64)
def _args_gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, args = args_rules(tools)
    calls = [f"{lit(TOOL_CALLS + n + ARGS)} {a}" for (n, _), a in zip(tools, args)]
    return rules + f"{CALLS_RULE} ::= {repeated('mcall', '', parallel)}\nmcall ::= {' | '.join(calls)}\n"


@lru_cache(maxsize=64)
def _array_gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, args = args_rules(tools)
    calls = [f'{lit("{" + json.dumps("name") + ": " + json.dumps(n) + ", " + json.dumps("arguments") + ": ")} {a} '
             f'{lit(", " + json.dumps("id") + ": ")} "\\"" [A-Za-z0-9]{{9}} "\\"" "}}"' for (n, _), a in zip(tools, args)]
    return (rules + f'{CALLS_RULE} ::= {lit(TOOL_CALLS + "[")} {repeated("mcall", lit(", "), parallel)} "]"\n'
            f"mcall ::= {' | '.join(calls)}\n")
