"""Reading a reply while it is generated: text -> deltas as it streams (content, and each tool
call's start and argument text), and the whole message (content and tool calls) at the end. The
deltas name no API: each API's formatter writes them in its own shape. The tool-call shapes are
described in tools.py; what a reply means is decided by its Output class."""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from .jsonscan import Incomplete, expect, key_at, skip_ws, string_prefix, value_end

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


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


Delta = Text | CallStart | CallArguments


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


@dataclass(slots=True)
class Reply:
    content: str | None
    tool_calls: list[ToolCall]


class Output:
    """Turns generated text into deltas while it streams, and into the final message at the
    end. Subclasses say what the text means (`draft`)."""

    def __init__(self):
        self.text = ""
        self._content_sent = 0
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
        return deltas, Reply(draft.content if draft.content or not calls else None, calls)

    def draft(self, text: str, final: bool) -> Draft:
        raise NotImplementedError

    def _deltas(self, draft: Draft) -> list[Delta]:
        out: list[Delta] = []
        if len(draft.content) > self._content_sent:
            out.append(Text(draft.content[self._content_sent:]))
            self._content_sent = len(draft.content)
        for i, call in enumerate(draft.calls):
            if i == len(self._calls):
                if call.name is None:
                    break
                self._calls.append(ToolCall(new_call_id(), call.name, ""))
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
        _read_call(s, i, draft)
    elif key == "tool_calls":
        i = expect(s, i, "[")
        while True:
            i = skip_ws(s, _read_call(s, i, draft))
            if i == len(s):
                raise Incomplete
            if s[i] == "]":
                return
            i = expect(s, i, ",")
    else:
        raise ValueError(f"unexpected key {key!r}")


def _read_call(s: str, i: int, draft: Draft) -> int:
    """Read {"name": ..., "arguments": ...} at s[i]; returns the index after it."""
    i = expect(s, i, "{")
    call = DraftCall()
    draft.calls.append(call)
    while True:
        key, i = key_at(s, i)
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


class TaggedOutput(Output):
    """Content with <tool_call>{...}</tool_call> blocks."""

    def draft(self, text: str, final: bool) -> Draft:
        draft, pos = Draft(), 0
        while True:
            start = text.find(OPEN_TAG, pos)
            if start < 0:
                tail = text[pos:]
                draft.content += tail if final else tail[:len(tail) - _partial_tag(tail)]
                break
            draft.content += text[pos:start]
            end = text.find(CLOSE_TAG, start)
            block = text[start + len(OPEN_TAG):end if end >= 0 else len(text)]
            try:
                _read_call(block, 0, draft)
            except (Incomplete, ValueError):
                pass
            if end < 0:
                break
            pos = end + len(CLOSE_TAG)
        if final and draft.calls:
            draft.content = draft.content.strip()
        return draft


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that could be the start of OPEN_TAG."""
    return max((k for k in range(1, len(OPEN_TAG)) if text.endswith(OPEN_TAG[:k])), default=0)
