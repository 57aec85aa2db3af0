"""ECMA-262 patterns (the subset README.md lists) parsed into regular trees, each top-level
branch with whether it is anchored at its start and end."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..syntax import Alt, Chars, Repeat, Seq, normalize_ranges, walk
from .charset import DIGIT, DOT, SCALARS, SPACE, WORD, intersect, minus
from .text import MAX_REPEAT

_CLASS_ESCAPES = {"d": DIGIT, "D": minus(SCALARS, DIGIT), "w": WORD, "W": minus(SCALARS, WORD),
                  "s": SPACE, "S": minus(SCALARS, SPACE)}
_CHAR_ESCAPES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
_UNSUPPORTED_ESCAPES = {"b": "word boundary \\b", "B": "non-word-boundary \\B",
                        "c": "control escape \\c", "k": "named backreference \\k",
                        "p": "Unicode property escape \\p", "P": "Unicode property escape \\P"}
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")
_MAX_NESTING = 64


class RegexError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Anchor:
    """'^' or '$' while parsing; `branches` takes them off (they never reach a tree)."""
    kind: str


def branches(pattern: str) -> list[tuple]:
    """(tree, anchored_start, anchored_end) per top-level branch of the pattern."""
    node = _Parser(pattern).parse()
    out = []
    for option in (node.options if isinstance(node, Alt) else (node,)):
        items = list(option.items) if isinstance(option, Seq) else [option]
        start = end = False
        while items and items[0] == _Anchor("^"):
            items.pop(0)
            start = True
        while items and items[-1] == _Anchor("$"):
            items.pop()
            end = True
        body = Seq(tuple(items))
        if any(isinstance(n, _Anchor) for n in walk(body)):
            raise RegexError("'^' or '$' inside the pattern (only at the start/end of a branch)")
        out.append((body, start, end))
    return out


class _Parser:
    """Recursive descent over one pattern; nesting is capped so recursion stays shallow."""

    def __init__(self, pattern: str):
        self.p, self.i, self.depth = pattern, 0, 0

    def parse(self):
        node = self._disjunction()
        if self.i < len(self.p):
            self._fail("unbalanced ')'")
        return node

    def _fail(self, what: str):
        raise RegexError(f"{what} (at index {self.i})")

    def _peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def _disjunction(self):
        options = [self._alternative()]
        while self._peek() == "|":
            self.i += 1
            options.append(self._alternative())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def _alternative(self):
        items = []
        while self.i < len(self.p) and self._peek() not in "|)":
            items.append(self._term())
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def _term(self):
        if self._peek() in ("^", "$"):
            node = _Anchor(self._peek())
            self.i += 1
        else:
            node = self._atom()
        bounds = self._quantifier()
        if bounds is None:
            return node
        if isinstance(node, _Anchor):
            self._fail(f"quantifier after anchor '{node.kind}'")
        return Repeat(node, *bounds)

    def _quantifier(self):
        c = self._peek()
        if c in ("*", "+", "?"):
            self.i += 1
            bounds = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            bounds = self._braces()
        else:
            return None
        if self._peek() == "?":             # lazy: matches the same set of strings
            self.i += 1
        if self._peek() and self._peek() in "*+?{":
            self._fail("nothing to repeat")
        return bounds

    def _braces(self) -> tuple[int, int | None]:
        m = _QUANTIFIER.match(self.p, self.i)
        if m is None:
            self._fail("'{' that does not start a quantifier (write \\{ for a literal brace)")
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        if hi is not None and hi < lo:
            self._fail(f"quantifier {m.group(0)} out of order")
        if lo > MAX_REPEAT or (hi or 0) > MAX_REPEAT:
            self._fail(f"quantifier {m.group(0)} above {MAX_REPEAT}")
        self.i = m.end()
        return lo, hi

    def _atom(self):
        c = self._peek()
        self.i += 1
        if c == ".":
            return Chars(DOT)
        if c == "(":
            return self._group()
        if c == "[":
            return Chars(self._class())
        if c == "\\":
            return Chars(intersect(self._escape(in_class=False), SCALARS))
        if c in "*+?{":
            self.i -= 1
            self._fail("nothing to repeat")
        return Chars(intersect(((ord(c), ord(c)),), SCALARS))    # a lone surrogate: matches nothing

    def _group(self):
        self._group_prefix()
        self.depth += 1
        if self.depth > _MAX_NESTING:
            self._fail("groups nested too deeply")
        node = self._disjunction()
        self.depth -= 1
        if self._peek() != ")":
            self._fail("unterminated group")
        self.i += 1
        return node

    def _group_prefix(self):
        """Skips '?:' or a '?<name>'; any other '(?' is lookaround or flags."""
        if self.p.startswith("?:", self.i):
            self.i += 2
        elif self.p.startswith("?<", self.i) and self.p[self.i + 2:self.i + 3] not in ("=", "!"):
            end = self.p.find(">", self.i)
            if end < 0:
                self._fail("unterminated group name")
            self.i = end + 1
        elif self._peek() == "?":
            self._fail("lookaround or group flags '(?'")

    def _class(self) -> tuple:
        negate = self._peek() == "^"
        self.i += negate
        pairs: list = []
        while True:
            if self.i >= len(self.p):
                self._fail("unterminated character class")
            if self._peek() == "]":
                self.i += 1
                return normalize_ranges(pairs, negated=negate)
            first = self._class_atom()
            if self._peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("", "]"):
                if self._class_range(first, pairs):
                    continue
            pairs.extend(first)

    def _class_range(self, first: tuple, pairs: list) -> bool:
        """Reads '-x' after `first` as a range when both ends are single characters."""
        save = self.i
        self.i += 1
        second = self._class_atom()
        if len(first) == 1 and len(second) == 1 and first[0][0] == first[0][1] \
                and second[0][0] == second[0][1]:
            if first[0][0] > second[0][0]:
                self._fail("character range out of order")
            pairs.append((first[0][0], second[0][0]))
            return True
        self.i = save                      # a class escape at either end: ECMA (Annex B) reads '-' literally
        return False

    def _class_atom(self) -> tuple:
        c = self._peek()
        self.i += 1
        if c == "\\":
            return self._escape(in_class=True)
        return ((ord(c), ord(c)),)

    def _escape(self, in_class: bool) -> tuple:
        if self.i >= len(self.p):
            self._fail("trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES:
            return ((_CHAR_ESCAPES[c],) * 2,)
        if c == "b" and in_class:
            return ((8, 8),)
        if c == "0" and not self._peek().isdigit():
            return ((0, 0),)
        if c in ("x", "u"):
            return self._hex_escape(2 if c == "x" else 4)
        if c in _UNSUPPORTED_ESCAPES:
            self._fail(_UNSUPPORTED_ESCAPES[c])
        if c.isdigit():
            self._fail(f"backreference \\{c}")
        if c.isalnum() or c == "_":
            self._fail(f"unknown escape \\{c}")
        return ((ord(c), ord(c)),)

    def _hex_escape(self, n: int) -> tuple:
        digits = self.p[self.i:self.i + n]
        if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
            self._fail("\\x needs 2 and \\u needs 4 hex digits (\\u{...} needs the u flag)")
        self.i += n
        cp = int(digits, 16)
        if 0xD800 <= cp <= 0xDFFF:
            self._fail("surrogate escape")
        return ((cp, cp),)
