"""Functionary v3.2: the prompt ends with ">>>" and the model names a recipient on the first
line of each part, "all" for the user or a function for a call, parts after the first opening
with ">>>" again:
    all
    Let me check.>>>get_weather
    {"city": "Paris"}
The `python` tool may take its code as is instead of JSON ({"code": ...})."""
from __future__ import annotations

import json
from functools import lru_cache

from ....engine.engine import GrammarSpec
from ..jsonscan import Incomplete, skip_ws, value_end
from ..replies import Draft, DraftCall
from ..request import ToolSetup
from .base import NAME, CALLS_RULE, ChatFormat, Reading, args_rules, held, key_tools, lit, setup_key

SEP = ">>>"
ANY_RULE = "AnyReply"


class Functionary(ChatFormat):
    name = "functionary-v3.2"
    plain_text = False  # even without tools the reply opens with its recipient

    def matches(self, template: str) -> bool:
        return ">>>all" in template and "<|start_header_id|>" in template

    def arguments(self, text: str):
        return text  # the template writes them as given

    def grammar(self, setup: ToolSetup, thinking: bool = False) -> GrammarSpec | None:
        """No lazy start: the reply's first line chooses, so `auto` allows "all" or a call there."""
        if not setup.active:
            return None
        return GrammarSpec(_gbnf(setup_key(setup)), root=ANY_RULE if setup.choice.mode == "auto" else CALLS_RULE)

    def draft(self, text: str, final: bool, reading: Reading) -> Draft:
        draft = Draft()
        parts = text.split(SEP)
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            head, nl, body = part.partition("\n")
            if not nl:
                if last and not final:
                    return draft  # the recipient is still being written
                draft.content += part
                continue
            if head.strip() == "all" or not reading.tools:
                draft.content += body if final or not last else held(body, (SEP,))
                continue
            if not NAME.fullmatch(head.strip()):
                draft.content += part
                continue
            if not _read_call(head.strip(), body, draft, last and not final):
                return draft
        return draft


def _read_call(name: str, body: str, draft: Draft, open_: bool) -> bool:
    """Read one call; False while its arguments are still arriving."""
    call = DraftCall(name)
    draft.calls.append(call)
    i = skip_ws(body, 0)
    if name == "python" and not body[i:i + 1] == "{":
        call.arguments = json.dumps({"code": body}) if not open_ else ""
        call.done = not open_
        return not open_
    try:
        end = value_end(body, i)
    except Incomplete:
        call.arguments = body[i:]
        return False
    call.arguments, call.done = body[i:end], True
    return True


@lru_cache(maxsize=64)
def _gbnf(key: str) -> str:
    tools, parallel = key_tools(key)
    rules, args = args_rules(tools)
    calls = [f"{lit(n + chr(10))} {a}" for (n, _), a in zip(tools, args)]
    more = f' ( {lit(SEP)} fcall )*' if parallel else ""
    return (rules + f"{CALLS_RULE} ::= fcall{more}\nfcall ::= {' | '.join(calls)}\n"
            f'{ANY_RULE} ::= {CALLS_RULE} | {lit("all" + chr(10))} ftext ( {lit(SEP)} {CALLS_RULE} )?\n'
            'ftext ::= ( [^>] | ">" [^>] | ">>" [^>] )*\n')
