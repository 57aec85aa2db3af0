"""Regular trees: `gbnf.syntax` nodes over code points (Chars, Seq, Alt, Repeat), as the
regex parser, the number ranges and the formats build them, and what is asked of them:
lengths, a narrower alphabet, capped repetitions. A one-character Chars is a literal."""
from __future__ import annotations

from ..syntax import Alt, Chars, Repeat, Seq
from .charset import intersect, single


def char(cp: int) -> Chars:
    return Chars(((cp, cp),))


def literal(text: str) -> Seq:
    return Seq(tuple(char(ord(c)) for c in text))


def single_char(node) -> int | None:
    """The code point a node stands for when it is one fixed character."""
    return single(node.ranges) if isinstance(node, Chars) else None


def flatten_seq(items):
    """The items of nested sequences, in order."""
    for item in items:
        if isinstance(item, Seq):
            yield from flatten_seq(item.items)
        else:
            yield item


def lengths(node) -> tuple[int, int | None]:
    """Shortest and longest match (None: unbounded)."""
    if isinstance(node, Chars):
        return 1, 1
    if isinstance(node, (Seq, Alt)):
        parts = [lengths(i) for i in (node.items if isinstance(node, Seq) else node.options)]
        if not parts:
            return 0, 0
        longs = [b for _, b in parts]
        if isinstance(node, Seq):
            return sum(a for a, _ in parts), None if None in longs else sum(longs)
        return min(a for a, _ in parts), None if None in longs else max(longs)
    a, b = lengths(node.item)
    if b == 0:
        return 0, 0
    return node.min * a, None if node.max is None or b is None else node.max * b


def restrict(node, alphabet):
    """node with every character set cut to alphabet; None if it can then match nothing."""
    if isinstance(node, Chars):
        r = intersect(node.ranges, alphabet)
        return Chars(r) if r else None
    if isinstance(node, Seq):
        items = [restrict(i, alphabet) for i in node.items]
        return None if any(i is None for i in items) else Seq(tuple(items))
    if isinstance(node, Alt):
        options = [o for o in (restrict(o, alphabet) for o in node.options) if o is not None]
        return None if not options else options[0] if len(options) == 1 else Alt(tuple(options))
    inner = restrict(node.item, alphabet)
    if inner is None:
        return Seq(()) if node.min == 0 else None
    return Repeat(inner, node.min, node.max)


def capped(node, cap: int):
    """Every repetition limited to max(min, cap) times."""
    if isinstance(node, Chars):
        return node
    if isinstance(node, Seq):
        return Seq(tuple(capped(i, cap) for i in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(capped(o, cap) for o in node.options))
    hi = max(node.min, cap) if node.max is None else min(node.max, max(node.min, cap))
    return Repeat(capped(node.item, cap), node.min, hi)
