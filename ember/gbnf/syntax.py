"""The parsed form of a GBNF grammar: one expression tree per rule.

Characters are Unicode code points; a character class is a sorted tuple of disjoint
inclusive ranges that never contains surrogates (U+D800..U+DFFF cannot be UTF-8).
Offsets (`at`) index the grammar text, for error messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


@dataclass(slots=True, frozen=True)
class Literal:
    data: bytes                  # UTF-8 of the literal's characters


@dataclass(slots=True, frozen=True)
class Chars:
    ranges: tuple[tuple[int, int], ...]   # code point ranges, disjoint, sorted


@dataclass(slots=True, frozen=True)
class Ref:
    name: str
    at: int


@dataclass(slots=True, frozen=True)
class Token:
    """A whole vocabulary token: by id (`<[12]>`) or text (`<think>`); negated: any other token."""
    item: Union[int, str]
    negated: bool
    at: int


@dataclass(slots=True, frozen=True)
class Seq:
    items: tuple


@dataclass(slots=True, frozen=True)
class Alt:
    options: tuple


@dataclass(slots=True, frozen=True)
class Repeat:
    item: object
    min: int
    max: int | None              # None: unbounded


Expr = Union[Literal, Chars, Ref, Token, Seq, Alt, Repeat]


@dataclass(slots=True, frozen=True)
class Rule:
    name: str
    body: Expr
    at: int


def children(e) -> tuple:
    """Direct sub-expressions (none for terminals and references)."""
    if isinstance(e, Seq):
        return e.items
    if isinstance(e, Alt):
        return e.options
    if isinstance(e, Repeat):
        return (e.item,)
    return ()


def walk(e):
    """Every sub-expression of e, e included, without recursion (nesting can be deep)."""
    todo = [e]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(children(node))


def normalize_ranges(ranges, negated: bool = False) -> tuple[tuple[int, int], ...]:
    """Sort and merge ranges, complement them if negated, and cut out surrogates."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if negated:
        merged = complement(merged)
    out = []
    for lo, hi in merged:
        if hi < SURROGATES[0] or lo > SURROGATES[1]:
            out.append((lo, hi))
            continue
        if lo < SURROGATES[0]:
            out.append((lo, SURROGATES[0] - 1))
        if hi > SURROGATES[1]:
            out.append((SURROGATES[1] + 1, hi))
    return tuple(out)


def complement(merged: list[list[int]]) -> list[list[int]]:
    out, nxt = [], 0
    for lo, hi in merged:
        if lo > nxt:
            out.append([nxt, lo - 1])
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append([nxt, MAX_CODE_POINT])
    return out


ANY_CHAR = Chars(normalize_ranges([(0, MAX_CODE_POINT)]))
