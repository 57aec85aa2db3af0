"""What every family's chat format shares: the `ChatFormat` each family module subclasses, and
the pieces they build from (reading a reply whose markers may still be half-written, tools'
argument grammars under their own rule names, history messages in the template's shape).

A format reads a reply with `draft(text, final, reading)`; streaming re-reads the growing text, so
a format must never take back what it has said: content is held back while it may turn out
to be the start of a marker, and a call's arguments only ever grow.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from ....engine.engine import GrammarSpec
from ....gbnf.schema import schema_to_gbnf
from ....gbnf.schema.text import cp_escape, gbnf_literal
from ..jsonscan import Incomplete
from ..replies import Draft, Output, new_call_id
from ..request import Message, ToolSetup


CALLS_RULE = "ToolCalls"  # upper case: the converter's rule names are lower case


class ChatFormat:
    """One family's way of writing tool calls and reasoning (see the family modules).

    name         what /props calls it
    think        the reasoning markers (start, end), or None
    openers      texts that start a call: where a reply's calls begin, and (unless `triggers`
                 says otherwise) what switches on the lazy grammar of tool_choice `auto`
    markers      special tokens the reply must show as text for it to be read (the engine
                 hides control tokens otherwise)
    """

    name = "tagged"
    think: tuple[str, str] | None = None
    openers: tuple[str, ...] = ()
    triggers: tuple[str, ...] | None = None  # what starts the lazy grammar, where not the openers
    lazy_root = CALLS_RULE  # the rule a lazy grammar starts in (fed from its trigger on)
    markers: tuple[str, ...] = ()
    reasoning_key = "reasoning_content"  # the message field a template reads earlier reasoning from
    plain_text = True  # without tools or reasoning to take out, the reply is its content as written

    def matches(self, template: str) -> bool:
        raise NotImplementedError

    def thinking_markers(self) -> tuple[str, str, str] | None:
        """(what opens the reasoning, what closes it, what to write to close it early), or None."""
        return (self.think[0], self.think[1], self.think[1]) if self.think else None

    def configured(self, template: str) -> ChatFormat:
        """The format set up for this template's particulars (most have none)."""
        return self

    # ---- prompt ----

    def messages(self, messages: tuple[Message, ...], setup: ToolSetup) -> tuple[list[dict], dict]:
        """Template-ready messages and the tools as the template reads them."""
        out = [self.message(m) for m in messages]
        if not setup.active:
            return out, {"tools": None}
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters}} for t in setup.tools]
        # `functions`: the same list as JSON text, for templates written for llama.cpp's older tool formats
        return out, {"tools": tools, "functions": json.dumps(tools, indent=2, ensure_ascii=False)}

    def message(self, m: Message) -> dict:
        out = {"role": m.role, "content": m.content}
        if m.reasoning:
            out[self.reasoning_key] = m.reasoning
        if m.tool_calls:
            out["tool_calls"] = [{"id": self.call_id(c.id), "type": "function",
                                  "function": {"name": c.name, "arguments": self.arguments(c.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id:
            out["tool_call_id"] = self.call_id(m.tool_call_id)
        if m.name:
            out["name"] = m.name
        return out

    def arguments(self, text: str):
        """A call's arguments as the template wants them (most: the object; its tojson writes them)."""
        return loads_or_text(text)

    def call_id(self, given: str) -> str:
        return given

    def new_id(self) -> str:
        return new_call_id()

    # ---- grammar ----

    def grammar(self, setup: ToolSetup, thinking: bool = False) -> GrammarSpec | None:
        """The grammar of the calls `setup` allows, in the family's syntax; lazy (from the first
        opener on) for tool_choice `auto`. thinking: the prompt opened the reasoning, which a
        forced call lets the model finish first."""
        if not setup.active:
            return None
        gbnf = self.calls_gbnf(setup_key(setup))
        if setup.choice.mode != "auto":
            if thinking and self.think:
                return GrammarSpec(gbnf + after_thinking(self.think[1]), root=THEN_CALLS_RULE)
            return GrammarSpec(gbnf, root=CALLS_RULE)
        return GrammarSpec(gbnf, root=self.lazy_root, lazy_triggers=self.triggers or self.openers)

    def calls_gbnf(self, key: str) -> str:
        raise NotImplementedError

    # ---- reading the reply ----

    def draft(self, text: str, final: bool, reading: Reading) -> Draft:
        """What the whole reply says so far: reasoning (unless kept inline), then content and calls."""
        reasoning, rest = "", text
        if self.think and reading.split_reasoning:
            reasoning, rest = split_reasoning(text, self.think, reading.thinking, final)
            reasoning, rest = reasoning.strip(), rest.lstrip() if reasoning or rest != text else rest
        if reading.tools:
            draft = self.read(rest, final)
        else:
            draft = Draft(rest)
        draft.reasoning = reasoning
        return draft

    def read(self, text: str, final: bool) -> Draft:
        """Content and calls of `text` (reasoning already taken out): calls open with an
        opener, anything else is content."""
        draft, pos = Draft(), 0
        while True:
            start, opener = first_of(text, self.openers, pos)
            if start < 0:
                draft.content += text[pos:] if final else held(text[pos:], self.openers)
                break
            draft.content += text[pos:start]
            try:
                pos = self.read_calls(text, start, opener, draft)
            except Incomplete:
                break
            except ValueError:  # not a call after all: the opener is text
                draft.content += opener
                pos = start + len(opener)
        if final and draft.calls:
            draft.content = draft.content.strip()
        return draft

    def read_calls(self, text: str, start: int, opener: str, draft: Draft) -> int:
        """Read the call(s) that `opener` at text[start] begins into draft.calls; the index after them.
        Incomplete while they may still be arriving, ValueError where it is no call."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Reading:
    """How one reply is read: whether tools were offered, whether the prompt left the model
    inside its reasoning, and whether reasoning goes apart (reasoning_format) or stays inline."""

    tools: bool = False
    thinking: bool = False
    split_reasoning: bool = True


class FormatOutput(Output):
    """A reply in a family's format, read with `ChatFormat.draft`."""

    def __init__(self, fmt: ChatFormat, reading: Reading):
        super().__init__(fmt.new_id)
        self.fmt, self.reading = fmt, reading

    def draft(self, text: str, final: bool) -> Draft:
        return self.fmt.draft(text, final, self.reading)


# ---- reading helpers ----

def first_of(text: str, needles: tuple[str, ...], pos: int) -> tuple[int, str]:
    """(index, needle) of the earliest needle in text[pos:], (-1, "") without one."""
    best, found = -1, ""
    for n in needles:
        k = text.find(n, pos)
        if k >= 0 and (best < 0 or k < best):
            best, found = k, n
    return best, found


def partial_len(text: str, needles) -> int:
    """Length of the longest end of `text` that could be the start of one of `needles`."""
    return max((k for n in needles for k in range(1, len(n)) if text.endswith(n[:k])), default=0)


def held(text: str, needles) -> str:
    """`text` without an end that may be a marker still being written."""
    return text[:len(text) - partial_len(text, needles)]


def expect_text(s: str, i: int, literal: str) -> int:
    """Index after `literal` at s[i]; Incomplete while s ends inside it."""
    piece = s[i:i + len(literal)]
    if piece == literal:
        return i + len(literal)
    if literal.startswith(piece):
        raise Incomplete
    raise ValueError(f"expected {literal!r} at {i}")


def until(s: str, i: int, end: str) -> tuple[str, int]:
    """The text from i up to `end` and the index after `end`; Incomplete without it."""
    k = s.find(end, i)
    if k < 0:
        raise Incomplete
    return s[i:k], k + len(end)


NAME = re.compile(r"[A-Za-z0-9_\-.]+")


def name_until(s: str, i: int, end: str) -> tuple[str, int]:
    """A function name running up to `end`; ValueError for anything else before it."""
    try:
        name, after = until(s, i, end)
    except Incomplete:
        if NAME.fullmatch(s[i:]) or i == len(s) or partial_len(s[i:], (end,)):
            raise
        raise ValueError("not a function name") from None
    if not NAME.fullmatch(name.strip()):
        raise ValueError(f"not a function name: {name!r}")
    return name.strip(), after


def loads_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def split_reasoning(text: str, think: tuple[str, str], opened: bool, final: bool) -> tuple[str, str]:
    """(reasoning, the rest) of a reply that may open with `think`[0] (or, where the prompt
    opened it, begins inside the reasoning) and closes it with `think`[1]."""
    start, end = think
    lead = len(text) - len(text.lstrip())
    if not opened:
        if text[lead:].startswith(start):
            lead += len(start)
        elif not final and start.startswith(text[lead:]):
            return "", ""  # may be the opening marker still arriving
        else:
            return "", text
    else:
        lead = 0
    k = text.find(end, lead)
    if k < 0:
        body = text[lead:]
        return (body if final else held(body, (end,))), ""
    return text[lead:k], text[k + len(end):]


def thinking_opened(prompt: str, think: tuple[str, str] | None) -> bool:
    """Whether the prompt leaves a reasoning block open (the template began it for the model)."""
    if think is None:
        return False
    tail = prompt.rstrip()
    return tail.rfind(think[0]) > tail.rfind(think[1])


# ---- grammar helpers ----

def setup_key(setup: ToolSetup) -> str:
    """What a grammar depends on, as a hashable cache key (key order kept: it is the order the
    grammar writes properties in)."""
    tools = [[t.name, t.parameters] for t in setup.tools
             if setup.choice.mode != "function" or t.name == setup.choice.name]
    return json.dumps({"tools": tools, "parallel": setup.parallel})


def key_tools(key: str) -> tuple[list[tuple[str, dict]], bool]:
    d = json.loads(key)
    return [(n, p) for n, p in d["tools"]], d["parallel"]


_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z][A-Za-z0-9-]*|\s+|.')


def prefixed(gbnf: str, prefix: str) -> str:
    """GBNF text with every rule name prefixed, so several converted schemas live in one grammar."""
    return "".join(prefix + t if t[0].isalpha() else t for t in (m.group(0) for m in _TOKEN.finditer(gbnf)))


@lru_cache(maxsize=256)
def value_gbnf(schema_json: str, rule: str) -> str:
    """Rules for one JSON value valid against the schema, the top one named `rule`."""
    return prefixed(schema_to_gbnf(json.loads(schema_json), root="v"), rule + "-")


def args_rules(tools: list[tuple[str, dict]]) -> tuple[str, list[str]]:
    """(GBNF of each tool's arguments object, the rule name of each)."""
    text, names = "", []
    for i, (_, params) in enumerate(tools):
        text += value_gbnf(json.dumps(params), f"a{i}")
        names.append(f"a{i}-v")
    return text, names


THEN_CALLS_RULE = "ThinkThenCalls"


def after_thinking(end: str) -> str:
    """Rules for: the rest of an open reasoning block, its end marker, then the calls."""
    return (f"{THEN_CALLS_RULE} ::= thinktext {lit(end)} [ \\n]* {CALLS_RULE}\n"
            f"thinktext ::= {until_gbnf(end)}\n")


def until_gbnf(end: str) -> str:
    """GBNF for any text without `end` in it (for markers whose first character does not recur)."""
    options = [f"{lit(end[:k]) + ' ' if k else ''}[^{cp_escape(ord(end[k]))}]" for k in range(len(end))]
    return "( " + " | ".join(options) + " )*"


def lit(text: str) -> str:
    return gbnf_literal(text)


def alternatives(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "( " + " | ".join(parts) + " )"


def repeated(one: str, sep: str, parallel: bool) -> str:
    return f"{one} ( {sep} {one} )*" if parallel else one
