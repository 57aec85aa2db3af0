"""DeepSeek R1 (and its Qwen / Llama distills) and V3.1: calls in a block of special tokens,
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                                   R1
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>   V3.1
(both read either way); reasoning is <think>...</think>, which the R1 templates open in the
prompt."""
from __future__ import annotations

from functools import lru_cache

from ..jsonscan import Incomplete, skip_ws, value_end
from ..replies import Draft, DraftCall
from ..request import Message
from .base import CALLS_RULE, ChatFormat, args_rules, expect_text, key_tools, lit, name_until, repeated

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"


class DeepSeekV31(ChatFormat):
    name = "deepseek-v3.1"
    think = ("<think>", "</think>")
    openers = (CALLS_BEGIN, CALL_BEGIN)
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def matches(self, template: str) -> bool:
        return CALLS_BEGIN in template

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key, False)

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        i, n = start + (len(opener) if opener == CALLS_BEGIN else 0), len(draft.calls)
        while True:
            i = skip_ws(text, i)
            if text.startswith(CALLS_END, i):
                return i + len(CALLS_END)
            if CALLS_END.startswith(text[i:]):
                raise Incomplete
            try:
                i = _read_call(text, expect_text(text, i, CALL_BEGIN), draft)
            except ValueError:
                if len(draft.calls) > n:
                    return i  # the block ends without its closing marker
                raise


class DeepSeekR1(DeepSeekV31):
    """R1's templates differ in how they write a call's arguments: the Qwen distill's through
    tojson (an object), the Llama distill's as they are (JSON text), and only for an assistant
    message whose content is null."""

    name = "deepseek-r1"

    def __init__(self, arguments_as_text: bool = False):
        self.arguments_as_text = arguments_as_text

    def matches(self, template: str) -> bool:
        return CALLS_BEGIN in template and "tool['type'] + '<｜tool▁sep｜>'" in template

    def configured(self, template: str) -> ChatFormat:
        return DeepSeekR1("['arguments'] | tojson" not in template)

    def arguments(self, text: str):
        return text if self.arguments_as_text else super().arguments(text)

    def message(self, m: Message) -> dict:
        out = super().message(m)
        if m.tool_calls and not m.content:
            out["content"] = None
        return out

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key, True)


def _read_call(s: str, i: int, draft: Draft) -> int:
    head, i = name_until(s, i, SEP)
    fenced = head == "function"
    if fenced:
        name, i = name_until(s, i, "\n")
        i = expect_text(s, i, FENCE_OPEN)
    else:
        name = head
    call = DraftCall(name)
    draft.calls.append(call)
    try:
        end = value_end(s, i)
    except Incomplete:
        call.arguments = s[i:]
        raise
    call.arguments = s[i:end]
    if fenced:
        end = expect_text(s, end, FENCE_CLOSE)
    end = expect_text(s, skip_ws(s, end), CALL_END)
    call.done = True
    return end


@lru_cache(maxsize=64)
def _gbnf(key: str, fenced: bool) -> str:
    tools, parallel = key_tools(key)
    rules, args = args_rules(tools)
    if fenced:
        calls = [f"{lit(CALL_BEGIN + 'function' + SEP + n + chr(10) + FENCE_OPEN)} {a} {lit(FENCE_CLOSE + CALL_END)}"
                 for (n, _), a in zip(tools, args)]
    else:
        calls = [f"{lit(CALL_BEGIN + n + SEP)} {a} {lit(CALL_END)}" for (n, _), a in zip(tools, args)]
    return (rules + f"{CALLS_RULE} ::= {lit(CALLS_BEGIN)} {repeated('dcall', chr(34) + chr(92) + 'n' + chr(34) + '?', parallel)} "
            f"{lit(CALLS_END)}\ndcall ::= {' | '.join(calls)}\n")
