"""Reading a reply while it is generated: text -> deltas as it streams (content, and each tool
call's start and argument text), and the whole message (content and tool calls) at the end. The
deltas name no API: each API's formatter writes them in its own shape. The tool-call shapes are
described in tools.py and formats/; what a reply means is decided by its Output class."""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from .jsonscan import Incomplete, expect, key_at, skip_ws, string_prefix, value_end

@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Text:
    """More content."""

    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    """More reasoning (the text between the family's thinking markers)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """Tool call `index` begins (its arguments follow as CallArguments)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    """More of tool call `index`'s arguments (JSON text)."""

    index: int
    text: str


Delta = Text | Reasoning | CallStart | CallArguments


@dataclass(slots=True)
class DraftCall:
    name: str | None = None
    arguments: str = ""  # raw JSON text so far
    done: bool = False


@dataclass(slots=True)
class Draft:
    """What the generated text says so far."""

    content: str = ""
    calls: list[DraftCall] = field(default_factory=list)
    reasoning: str = ""


@dataclass(slots=True)
class Reply:
    content: str | None
    tool_calls: list[ToolCall]
    reasoning: str | None = None


class Output:
    """Turns generated text into deltas while it streams, and into the final message at the
    end. Subclasses say what the text means (`draft`)."""

    def __init__(self, new_id=new_call_id):
        self.text = ""
        self.new_id = new_id  # the family's call ids
        self._content_sent = 0
        self._reasoning_sent = 0
        self._calls: list[ToolCall] = []  # calls whose header went out
        self._args_sent: list[int] = []

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        return self._deltas(self.draft(self.text, final=False)) if piece else []

    def finish(self, piece: str = "") -> tuple[list[Delta], Reply]:
        """Deltas still owed, and the whole reply."""
        self.text += piece
        draft = self.draft(self.text, final=True)
        deltas = self._deltas(draft)
        calls = [ToolCall(c.id, c.name, d.arguments) for c, d in zip(self._calls, draft.calls) if d.done]
        return deltas, Reply(draft.content if draft.content or not calls else None, calls, draft.reasoning or None)

    def draft(self, text: str, final: bool) -> Draft:
        raise NotImplementedError

    def _deltas(self, draft: Draft) -> list[Delta]:
        out: list[Delta] = []
        if len(draft.reasoning) > self._reasoning_sent:
            out.append(Reasoning(draft.reasoning[self._reasoning_sent:]))
            self._reasoning_sent = len(draft.reasoning)
        if len(draft.content) > self._content_sent:
            out.append(Text(draft.content[self._content_sent:]))
            self._content_sent = len(draft.content)
        for i, call in enumerate(draft.calls):
            if i == len(self._calls):
                if call.name is None:
                    break
                self._calls.append(ToolCall(self.new_id(), call.name, ""))
                self._args_sent.append(0)
                out.append(CallStart(i, self._calls[i].id, call.name))
            if len(call.arguments) > self._args_sent[i]:
                out.append(CallArguments(i, call.arguments[self._args_sent[i]:]))
                self._args_sent[i] = len(call.arguments)
        return out


class PlainOutput(Output):
    """No tools: the text is the content."""

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        return [Text(piece)] if piece else []

    def finish(self, piece: str = "") -> tuple[list[Delta], Reply]:
        self.text += piece
        return ([Text(piece)] if piece else []), Reply(self.text, [])


class EnvelopeOutput(Output):
    """The generic protocol's JSON reply. A reply that is not the expected JSON (cut short by
    max_tokens) comes back as plain content, without calls."""

    def draft(self, text: str, final: bool) -> Draft:
        draft = Draft()
        try:
            _read_envelope(text, draft)
        except (Incomplete, ValueError):
            if final and not _is_json(text) and not draft.content:
                return Draft(content=text)
        return draft


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _read_envelope(s: str, draft: Draft) -> None:
    key, i = key_at(s, expect(s, 0, "{"))
    if key == "response":
        i = skip_ws(s, i)
        if i == len(s):
            raise Incomplete
        draft.content, end = string_prefix(s, i)
        if end is None:
            raise Incomplete
    elif key == "tool_call":
        read_json_call(s, i, draft)
    elif key == "tool_calls":
        read_call_array(s, i, draft)
    else:
        raise ValueError(f"unexpected key {key!r}")


def read_call_array(s: str, i: int, draft: Draft) -> int:
    """Read a JSON array of calls ([{"name": ..., "arguments": ...}, ...]) at s[i]; returns the index
    after it."""
    i = expect(s, i, "[")
    while True:
        i = skip_ws(s, read_json_call(s, i, draft))
        if i == len(s):
            raise Incomplete
        if s[i] == "]":
            return i + 1
        i = expect(s, i, ",")


def read_json_call(s: str, i: int, draft: Draft, first_keys: tuple[str, ...] | None = None) -> int:
    """Read {"name": ..., "arguments": ...} (or "parameters") at s[i]; returns the index after it.
    With `first_keys`, an object whose first key is not one of them is not a call (ValueError), and
    the call joins the draft only once its first key has been read."""
    i = expect(s, i, "{")
    call = DraftCall()
    if first_keys is None:
        draft.calls.append(call)
    first = True
    while True:
        key, i = key_at(s, i)
        if first and first_keys is not None:
            if key not in first_keys:
                raise ValueError("not a call")
            draft.calls.append(call)
        first = False
        i = skip_ws(s, i)
        if key == "name":
            name, end = string_prefix(s, i) if i < len(s) else ("", None)
            if end is None:
                raise Incomplete
            call.name, i = name, end
        elif key in ("arguments", "parameters"):
            try:
                end = value_end(s, i)
            except Incomplete:
                call.arguments = s[i:]
                raise
            call.arguments, i = s[i:end], end
        else:
            i = value_end(s, i)
        i = skip_ws(s, i)
        if i == len(s):
            raise Incomplete
        if s[i] == "}":
            call.done = call.name is not None
            return i + 1
        i = expect(s, i, ",")
