"""gpt-oss (OpenAI's harmony format): the reply is a series of messages, each a header naming
its channel and a body,
    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
`analysis` is reasoning, `final` the content, a `commentary` message addressed
`to=functions.NAME` a call (its body the arguments); the recipient may also stand before the
channel. Earlier reasoning goes back to the template as `thinking`."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..replies import Draft, DraftCall
from .base import CALLS_RULE, ChatFormat, Reading, args_rules, held, key_tools, lit

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_\-.]+)")
LAZY_RULE = "LazyCall"


@dataclass(slots=True)
class Part:
    channel: str
    recipient: str | None
    body: str
    closed: bool
    raw: str  # the message as written, header included


class Harmony(ChatFormat):
    name = "gpt-oss"
    openers = ("to=functions.",)
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
    reasoning_key = "thinking"
    lazy_root = LAZY_RULE
    plain_text = False  # channels, always

    def matches(self, template: str) -> bool:
        return CHANNEL in template and "<|start|>assistant" in template

    def thinking_markers(self) -> tuple[str, str, str]:
        return (CHANNEL + "analysis" + MESSAGE, ENDS[0], ENDS[0] + START + "assistant" + CHANNEL + "final" + MESSAGE)

    def calls_gbnf(self, key: str) -> str:
        return _gbnf(key)

    def draft(self, text: str, final: bool, reading: Reading) -> Draft:
        draft = Draft()
        for part in _parts(text, final):
            if part is None:  # text outside any message: the model wrote no header
                continue
            if part.channel == "analysis" and part.recipient is None:
                if reading.split_reasoning:
                    draft.reasoning += part.body
                else:
                    draft.content += part.raw
            elif part.recipient is not None and reading.tools:
                call = DraftCall(part.recipient, part.body, part.closed or final)
                draft.calls.append(call)
            else:
                draft.content += part.body
        return draft


def _parts(text: str, final: bool):
    """The messages of `text`, the last one possibly unfinished (its body held back where it may
    end in a half-written marker)."""
    pos = 0
    while pos < len(text):
        header_end = text.find(MESSAGE, pos)
        if header_end < 0:
            if final and not text[pos:].startswith((START, CHANNEL)):
                yield Part("final", None, text[pos:], True, text[pos:])
            elif not final and not _may_be_header(text[pos:]):
                yield Part("final", None, held(text[pos:], (START, CHANNEL)), False, text[pos:])
            return
        header = text[pos:header_end]
        body_at = header_end + len(MESSAGE)
        end, marker = _first_end(text, body_at)
        body = text[body_at:end] if end >= 0 else (text[body_at:] if final else held(text[body_at:], ENDS))
        yield _part(header, body, end >= 0, text[pos:end + len(marker) if end >= 0 else len(text)])
        if end < 0:
            return
        pos = end + len(marker)
        if text.startswith(START, pos):
            pos += len(START)
            pos = _skip_role(text, pos)


def _part(header: str, body: str, closed: bool, raw: str) -> Part:
    m = RECIPIENT.search(header)
    channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else "final"
    channel = channel.split()[0] if channel.split() else "final"
    return Part(channel, m.group(1) if m else None, body, closed, raw)


def _first_end(text: str, i: int) -> tuple[int, str]:
    found = [(k, e) for e in ENDS if (k := text.find(e, i)) >= 0]
    return min(found) if found else (-1, "")


def _skip_role(text: str, pos: int) -> int:
    """Past the role after <|start|> ("assistant"), up to a recipient or the channel."""
    if text.startswith("assistant", pos):
        return pos + len("assistant")
    return len(text) if "assistant".startswith(text[pos:]) else pos  # the role still arriving


def _may_be_header(tail: str) -> bool:
    """Whether text with no <|message|> yet may still become a message's header."""
    s = tail.lstrip()
    return any(h.startswith(s) or s.startswith(h) for h in (CHANNEL, START, "to="))


@lru_cache(maxsize=64)
def _gbnf(key: str) -> str:
    """A call (after an optional analysis message); the lazy rule starts at the recipient, which
    the model may write in the channel's header or before it."""
    tools, _ = key_tools(key)
    rules, args = args_rules(tools)
    calls = [f"{lit('to=functions.' + n)} hhead {lit(MESSAGE)} {a} {lit('<|call|>')}" for (n, _), a in zip(tools, args)]
    return (rules + f"{CALLS_RULE} ::= ( {lit(CHANNEL + 'analysis' + MESSAGE)} htext {lit('<|end|>' + START + 'assistant')} )? "
            f"{lit(CHANNEL + 'commentary ')} {LAZY_RULE}\n"
            f"{LAZY_RULE} ::= {' | '.join(calls)}\n"
            f'hhead ::= {lit(" " + CONSTRAIN + "json")} | {lit(CHANNEL + "commentary")} ( {lit(" " + CONSTRAIN)}? " json" )?\n'
            f'htext ::= ( [^<] | "<" [^|] | "<|" [^e] )*\n')
