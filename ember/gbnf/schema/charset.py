"""Code point sets: sorted tuples of disjoint inclusive (lo, hi) ranges (the form of
`syntax.Chars`), their algebra, and the sets that ECMA regexes and JSON strings name."""
from __future__ import annotations

import bisect

from ..syntax import MAX_CODE_POINT, SURROGATES


def merge(pairs) -> tuple:
    """Sorted, disjoint ranges covering the given (lo, hi) pairs."""
    out: list[list[int]] = []
    for lo, hi in sorted(pairs):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(r) -> tuple:
    out, nxt = [], 0
    for lo, hi in r:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


def intersect(a, b) -> tuple:
    return complement(merge(complement(a) + complement(b)))


def minus(a, b) -> tuple:
    return intersect(a, complement(merge(b)))


def chars(text: str) -> tuple:
    return merge((ord(c), ord(c)) for c in text)


def contains(r, cp: int) -> bool:
    i = bisect.bisect_right(r, (cp, MAX_CODE_POINT + 1)) - 1
    return i >= 0 and r[i][0] <= cp <= r[i][1]


def single(r) -> int | None:
    """The code point of a one-character set, else None."""
    return r[0][0] if len(r) == 1 and r[0][0] == r[0][1] else None


SCALARS = complement((SURROGATES,))                     # what UTF-8 can carry
DIGIT = ((0x30, 0x39),)
WORD = merge([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = merge([(9, 13), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
               (0xFEFF, 0xFEFF)])
DOT = minus(SCALARS, chars("\n\r\u2028\u2029"))
# Inside a JSON string: raw characters, plus the ones with a short escape.
RAW_IN_STRING = minus(SCALARS, [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x2F: "\\/", 8: "\\b", 12: "\\f", 10: "\\n",
                 13: "\\r", 9: "\\t"}
ENCODABLE = merge(list(RAW_IN_STRING) + [(cp, cp) for cp in SHORT_ESCAPES])
