"""Reading JSON that is still being generated: how much of a string or value has arrived.

The output of a grammar-constrained model is always a prefix of valid JSON, so anything
that does not decode yet is treated as incomplete. Decoding runs in the json module's C
scanner; only the bookkeeping between values is Python.
"""
from __future__ import annotations

import json
import re

_DECODER = json.JSONDecoder(strict=False)
_WS = re.compile(r"[ \t\n\r]*")
_PARTIAL_ESCAPE = re.compile(r"(\\+)(u[0-9a-fA-F]{0,3})?$")


class Incomplete(Exception):
    """The text ends before the value does."""


def skip_ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()


def expect(s: str, i: int, char: str) -> int:
    """Index after `char` (whitespace before it skipped)."""
    i = skip_ws(s, i)
    if i == len(s):
        raise Incomplete
    if s[i] != char:
        raise ValueError(f"expected {char!r} at {i}, found {s[i]!r}")
    return i + 1


def value_end(s: str, i: int) -> int:
    """End of the complete JSON value starting at s[i]."""
    if i >= len(s):
        raise Incomplete
    try:
        _, end = _DECODER.raw_decode(s, i)
    except json.JSONDecodeError:
        raise Incomplete from None
    if end == len(s) and s[i] in "-0123456789":
        raise Incomplete  # a number at the very end may still grow
    return end


def string_prefix(s: str, i: int) -> tuple[str, int | None]:
    """The decoded text of the JSON string opening at s[i], and the index after it (None while
    the string is unfinished: then the text stops before any half-written escape)."""
    if s[i] != '"':
        raise ValueError(f"expected a string at {i}")
    try:
        text, end = _DECODER.raw_decode(s, i)
        return text, end
    except json.JSONDecodeError:
        pass
    body = s[i + 1:]
    m = _PARTIAL_ESCAPE.search(body)
    if m and len(m.group(1)) % 2 == 1:
        body = body[:m.start() + len(m.group(1)) - 1]
    try:
        text = _DECODER.decode('"' + body + '"')
    except json.JSONDecodeError:
        return "", None
    if text and "\ud800" <= text[-1] <= "\udbff":
        text = text[:-1]  # half of a surrogate pair
    return text, None


def key_at(s: str, i: int) -> tuple[str, int]:
    """An object key and the index after its colon."""
    i = skip_ws(s, i)
    if i == len(s):
        raise Incomplete
    key, end = string_prefix(s, i)
    if end is None:
        raise Incomplete
    return key, expect(s, end, ":")
