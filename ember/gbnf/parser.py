"""GBNF text -> rules (`syntax.Rule`), with llama.cpp's syntax and a GrammarError for every mistake.

    root ::= "a" [b-z]* (x | y){2,5}     # rules, literals, classes, groups, repetition
    x    ::= <[128]> | !<think> | .      # token references and any character

Differences from llama.cpp, all on the side of clearer errors: a rule defined twice, an empty or
reversed character class, a raw line break inside a literal or class, and a surrogate code
point are errors. Rule names may also contain '_' (llama.cpp's README allows it, its parser not).

The parser runs in a loop with an explicit stack of open groups (no recursion), so nesting is
only bounded by `GrammarLimits.max_nesting_depth`.
"""
from __future__ import annotations

import re

from .errors import GrammarError, GrammarLimits, error_at, position
from .syntax import (Alt, Chars, Literal, MAX_CODE_POINT, Ref, Repeat, Rule, Seq, Token, normalize_ranges,
                     ANY_CHAR, walk)

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_SPACE = re.compile(r"(?:[ \t]+|#[^\r\n]*)*")
_SPACE_NL = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)*")
_NEWLINE = re.compile(r"\r\n|\r|\n")
_LITERAL = re.compile(r'"((?:[^"\\\r\n]|\\[^\r\n])*)"')
_CHARS = re.compile(r"\[(\^?)((?:[^\]\\\r\n]|\\[^\r\n])*)\]")
_TOKEN = re.compile(r"(!?)<(?:\[([0-9]+)\]|([^>\r\n]+))>")
_REPEAT = re.compile(r"\{[ \t]*([0-9]+)[ \t]*(?:(,)[ \t]*([0-9]*)[ \t]*)?\}")
_ESCAPE = re.compile(r"\\(?:x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|([tnr\\\"\[\]-]))")
_SIMPLE_ESCAPES = {"t": 9, "n": 10, "r": 13}
_OPENERS = {'"': "string literal", "[": "character class", "<": "token reference", "{": "repetition"}


def parse_rules(text: str, limits: GrammarLimits) -> dict[str, Rule]:
    """All rules of a grammar text, by name; every rule reference is checked to exist."""
    rules = _Parser(text, limits).rules()
    check_references(text, rules)
    return rules


def check_references(text: str, rules: dict[str, Rule]) -> None:
    for rule in rules.values():
        for node in walk(rule.body):
            if isinstance(node, Ref) and node.name not in rules:
                raise error_at(text, node.at, f"undefined rule '{node.name}' (used in rule '{rule.name}')")


class _Group:
    """A '(' not yet closed (or the rule body itself): its finished alternatives and the open one."""
    __slots__ = ("alternatives", "items", "at")

    def __init__(self, at: int | None):
        self.alternatives: list[list] = []
        self.items: list = []
        self.at = at

    def close(self):
        self.alternatives.append(self.items)
        options = [sequence(items) for items in self.alternatives]
        return options[0] if len(options) == 1 else Alt(tuple(options))


def sequence(items: list):
    return items[0] if len(items) == 1 else Seq(tuple(items))


class _Parser:
    def __init__(self, text: str, limits: GrammarLimits):
        self.text, self.limits, self.n = text, limits, len(text)

    def fail(self, at: int, message: str) -> GrammarError:
        return error_at(self.text, at, message)

    def skip(self, pos: int, newlines: bool) -> int:
        return (_SPACE_NL if newlines else _SPACE).match(self.text, pos).end()

    # --- rules

    def rules(self) -> dict[str, Rule]:
        rules: dict[str, Rule] = {}
        self.check_rule_count()
        pos = self.skip(0, True)
        while pos < self.n:
            rule, pos = self.rule(pos)
            if rule.name in rules:
                line, col = position(self.text, rules[rule.name].at)
                raise self.fail(rule.at, f"rule '{rule.name}' is defined twice (first at line {line}, column {col})")
            rules[rule.name] = rule
            if len(rules) > self.limits.max_rules:
                raise self.fail(rule.at, f"more than {self.limits.max_rules} rules")
        return rules

    def check_rule_count(self) -> None:
        """Fail at once on too many definitions, before parsing any of them."""
        limit = self.limits.max_rules
        if self.text.count("::=") > limit:
            at = -1
            for _ in range(limit + 1):
                at = self.text.find("::=", at + 1)
            raise self.fail(at, f"more than {limit} rules")

    def rule(self, start: int) -> tuple[Rule, int]:
        m = _NAME.match(self.text, start)
        if not m:
            raise self.fail(start, f"expected a rule name, found {self.describe(start)}")
        pos = self.skip(m.end(), False)
        if not self.text.startswith("::=", pos):
            raise self.fail(pos, f"expected '::=' after rule name '{m.group()}', found {self.describe(pos)}")
        body, pos = self.alternatives(self.skip(pos + 3, True))
        if pos < self.n:
            end = _NEWLINE.match(self.text, pos)
            if not end:
                raise self.fail(pos, f"unexpected {self.describe(pos)} in rule '{m.group()}'")
            pos = end.end()
        return Rule(m.group(), body, start), self.skip(pos, True)

    # --- expressions

    def alternatives(self, pos: int):
        groups = [_Group(None)]
        while pos < self.n:
            c = self.text[pos]
            if c == "(":
                if len(groups) > self.limits.max_nesting_depth:
                    raise self.fail(pos, f"groups nested deeper than {self.limits.max_nesting_depth}")
                groups.append(_Group(pos))
                pos = self.skip(pos + 1, True)
                continue
            if c == "|":
                self.next_alternative(groups[-1], pos)
                pos = self.skip(pos + 1, True)
                continue
            if c == ")":
                if len(groups) == 1:
                    raise self.fail(pos, "unmatched ')'")
                node = groups.pop().close()
                groups[-1].items.append(node)
                end = pos + 1
            elif c in "*+?{":
                end = self.repetition(pos, groups[-1].items)
            else:
                node, end = self.symbol(pos)
                if node is None:
                    break
                groups[-1].items.append(node)
            pos = self.skip(end, len(groups) > 1)
        if len(groups) > 1:
            if pos < self.n:
                raise self.fail(pos, f"unexpected {self.describe(pos)}")
            raise self.fail(groups[-1].at, "unclosed '('")
        return groups[0].close(), pos

    def next_alternative(self, group: _Group, pos: int) -> None:
        group.alternatives.append(group.items)
        group.items = []
        if len(group.alternatives) >= self.limits.max_alternatives:
            raise self.fail(pos, f"more than {self.limits.max_alternatives} alternatives")

    def symbol(self, pos: int):
        """(node, end) for the terminal or reference at pos, or (None, pos) where none starts."""
        c = self.text[pos]
        if c == '"':
            m = _LITERAL.match(self.text, pos)
            if not m:
                raise self.unterminated(pos)
            return Literal(self.unescape(m.start(1), m.end(1)).encode("utf-8")), m.end()
        if c == "[":
            m = _CHARS.match(self.text, pos)
            if not m:
                raise self.unterminated(pos)
            return self.char_class(m), m.end()
        if c == "<" or c == "!":
            m = _TOKEN.match(self.text, pos)
            if not m:
                raise self.unterminated(pos) if c == "<" else self.fail(pos, "'!' must be followed by a token reference <...>")
            item = int(m.group(2)) if m.group(2) is not None else "<" + m.group(3) + ">"
            return Token(item, bool(m.group(1)), pos), m.end()
        if c == ".":
            return ANY_CHAR, pos + 1
        m = _NAME.match(self.text, pos)
        if m:
            return Ref(m.group(), pos), m.end()
        return None, pos

    def repetition(self, pos: int, items: list) -> int:
        c = self.text[pos]
        if c == "{":
            m = _REPEAT.match(self.text, pos)
            if not m:
                raise self.fail(pos, "malformed repetition: expected {m}, {m,} or {m,n}")
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
            end = m.end()
        else:
            lo, hi, end = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c] + (pos + 1,)
        limit = self.limits.max_repetition
        if lo > limit or (hi is not None and hi > limit):
            raise self.fail(pos, f"repetition count {max(lo, hi or 0)} exceeds the limit of {limit}")
        if hi is not None and hi < lo:
            raise self.fail(pos, f"repetition {{{lo},{hi}}}: the maximum is below the minimum")
        if not items:
            raise self.fail(pos, f"'{c}' has nothing to repeat")
        items[-1] = Repeat(items[-1], lo, hi)
        return end

    # --- characters

    def char_class(self, m: re.Match) -> Chars:
        body_start, body = m.start(2), m.group(2)
        if not body:
            raise self.fail(m.start(), "empty character class")
        ranges, i = [], 0
        while i < len(body):
            lo, i = self.char_at(body, i, body_start)
            hi = lo
            if i + 1 < len(body) and body[i] == "-":
                dash = i
                hi, i = self.char_at(body, i + 1, body_start)
                if hi < lo:
                    raise self.fail(body_start + dash, f"character range {_show(lo)}-{_show(hi)} is reversed")
            ranges.append((lo, hi))
        return Chars(normalize_ranges(ranges, negated=bool(m.group(1))))

    def char_at(self, body: str, i: int, offset: int) -> tuple[int, int]:
        if body[i] != "\\":
            return ord(body[i]), i + 1
        m = _ESCAPE.match(body, i)
        if not m:
            raise self.fail(offset + i, f"invalid escape '{body[i:i + 2]}'")
        return self.escaped(m, offset + i), m.end()

    def unescape(self, start: int, end: int) -> str:
        body = self.text[start:end]
        if "\\" not in body:
            return body
        out, i = [], 0
        while (j := body.find("\\", i)) >= 0:
            out.append(body[i:j])
            m = _ESCAPE.match(body, j)
            if not m:
                raise self.fail(start + j, f"invalid escape '{body[j:j + 2]}'")
            out.append(chr(self.escaped(m, start + j)))
            i = m.end()
        out.append(body[i:])
        return "".join(out)

    def escaped(self, m: re.Match, at: int) -> int:
        simple = m.group(4)
        if simple is not None:
            return _SIMPLE_ESCAPES.get(simple, ord(simple))
        cp = int(m.group(1) or m.group(2) or m.group(3), 16)
        if cp > MAX_CODE_POINT:
            raise self.fail(at, f"code point U+{cp:X} is beyond U+10FFFF")
        if 0xD800 <= cp <= 0xDFFF:
            raise self.fail(at, f"code point U+{cp:04X} is a surrogate, which UTF-8 cannot encode")
        return cp

    # --- messages

    def unterminated(self, pos: int) -> GrammarError:
        what = _OPENERS[self.text[pos]]
        stop = self.text.find("\n", pos)
        rest = self.text[pos:stop if stop >= 0 else self.n]
        bad = _ESCAPE_ANYWHERE.search(rest)
        if bad and what != "token reference":
            return self.fail(pos + bad.start(), f"invalid escape '{bad.group()}' in {what}")
        return self.fail(pos, f"unterminated {what} (no closing {_CLOSERS[what]} on this line)")

    def describe(self, pos: int) -> str:
        if pos >= self.n:
            return "end of grammar"
        return f"'{self.text[pos]}'" if self.text[pos].isprintable() else f"character U+{ord(self.text[pos]):04X}"


# an escape that _ESCAPE would reject: a backslash not followed by a known escape letter
_ESCAPE_ANYWHERE = re.compile(r"\\(?!x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|[tnr\\\"\[\]-]).?")
_CLOSERS = {"string literal": "'\"'", "character class": "']'", "token reference": "'>'"}


def _show(cp: int) -> str:
    return chr(cp) if 0x20 < cp < 0x7F else f"U+{cp:04X}"


def decode_text(text) -> str:
    """Grammar source as str: bytes must be UTF-8, str must not hold lone surrogates."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        raw = bytes(text)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            good = raw[:e.start].decode("utf-8")
            raise GrammarError(f"grammar text is not valid UTF-8 (byte 0x{raw[e.start]:02X})",
                               *position(good + "?", len(good))) from None
    if not isinstance(text, str):
        raise TypeError(f"grammar text must be str or bytes, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GrammarError("grammar text holds a lone surrogate, which is not valid UTF-8",
                           *position(text, e.start)) from None
    return text
