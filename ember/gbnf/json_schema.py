"""JSON Schema -> GBNF (llama.cpp's dialect).

A grammar from `schema_to_gbnf` never accepts text that fails the schema. Where exactness
would need more than a context-free grammar, or would blow the grammar up, it accepts a
documented subset of the valid texts instead; where even that is impossible, or a keyword is
unknown, it raises `SchemaError` naming the keyword and its place. The subset:

Layout
  Nothing before or after the root value. Inside objects and arrays one optional `ws`
  (a space, or a newline and up to 32 spaces/tabs) after `{ [ , :` and before `} ]`;
  none before `,` or `:`. json.dumps output, compact or indented, fits.
Objects
  Declared keys (`properties`, then `required` keys without a property schema) come in
  schema order; optional ones may be left out. Other keys (patternProperties,
  additionalProperties) follow the declared ones. Keys are written as
  json.dumps(ensure_ascii=False) writes them, so an escaped duplicate of a declared key
  cannot slip in. A key matching two or more patternProperties is never generated.
  strict=True (default): an absent additionalProperties closes an object that declares
  properties or patternProperties (llama.cpp does the same), and an absent items closes a
  prefixItems tuple. strict=False: absent means true, as JSON Schema says.
Strings
  Plain strings take every JSON escape; a surrogate pair counts as one character for
  minLength/maxLength. Strings under pattern or format are written with raw characters
  except `"` `\\` and the controls \\b \\f \\n \\r \\t, which use their short escapes (`/` may
  also be `\\/`); \\uXXXX escapes and other control characters are not accepted there.
  maxLength/maxItems/maxProperties above 10,000 count as 10,000 (GBNF repetition limit).
  A maxLength that pattern/format does not imply is met exactly when one counted repetition
  carries the variable length (^[a-z][a-z0-9_]*$ with maxLength 32 -> [a-z0-9_]{0,31}) or
  a pattern x length automaton stays under SMALL_PRODUCT_STATES; otherwise every repetition
  is capped alike to the largest count that keeps the longest match within maxLength
  (narrower, never wider: uri with maxLength 2083 allows 122 characters per component).
pattern
  ECMA-262 subset with search semantics (the match may start and end anywhere unless
  anchored): literals, `.`, classes and negated classes, \\d \\w \\s \\D \\W \\S, \\t \\n \\r \\f \\v
  \\0 \\xHH \\uHHHH, groups (capturing, (?:...), (?<name>...)), `|`, * + ? {n} {n,} {n,m}
  (lazy forms too; laziness does not change what matches), and ^ $ at the start/end of a
  top-level alternative. Lookaround, backreferences, \\b \\B, \\p{..}, \\cX and anchors
  elsewhere are errors. A pattern is written as a tree-shaped rule mirroring the regex.
  Where a grammar must intersect or exclude languages (several patterns or pattern plus
  format via allOf, patternProperties keys, a minLength the pattern does not imply), the
  patterns are compiled to one minimal DFA, one rule per state.
format
  date (calendar-exact, leap years included), time (HH:MM:SS, optional .1-9 digits,
  Z or +HH:MM/-HH:MM; no leap second), date-time (date "T" time), uuid (8-4-4-4-12 hex),
  email (dot-atom local part @ two or more host labels of letters and digits, inner hyphen
  runs of at most 2; no quoted local parts, IP literals or length limits), uri (RFC 3986
  URI with scheme, without IP-literal hosts), ipv4 (dotted quad, no leading zeros),
  int32/int64 (integer bounds), float/double (no constraint). Any other format is an error.
Numbers
  integer: "-"? digits, at most 16 digits, no fraction or exponent.
  number without bounds: JSON number, at most 16 integer digits, 20 fraction digits and
  3 exponent digits (every Python float repr fits).
  number with any bound: no exponent, at most 15 integer and 15 fraction digits, never
  "-0". Every accepted number satisfies its bounds both as an exact decimal and after
  rounding to an IEEE double (an exclusive bound is moved inward to the shortest decimal
  of the next double). So "number >= 1.5" accepts 1.5, 1.50, 2, 2.0; 1e3 and 15e-1 are
  rejected (exponent).
Types
  Without `type`, the types whose keywords appear are generated ({"properties": ...}
  gives objects only, {"minimum": 0} numbers only); with no typed keyword, any value.
enum / const
  Scalars exactly as compact json.dumps writes them; arrays and objects in the given
  order, with the usual optional whitespace.
anyOf / oneOf / allOf
  oneOf is treated as anyOf: a value matching several branches is not excluded.
  allOf is merged keyword by keyword (properties, additional/patternProperties, bounds,
  patterns, formats, items, enum); anyOf/oneOf inside allOf or beside other keywords is
  distributed over the branches.
$ref
  Local JSON pointers only (#, #/$defs/x, #/definitions/x, ...); recursion is fine as long
  as every cycle passes through an object or array. Siblings of $ref apply (as allOf).
Errors (SchemaError naming the keyword and a JSON pointer)
  not, if/then/else, multipleOf, contains/minContains/maxContains, propertyNames,
  dependentRequired/dependentSchemas/dependencies, unevaluatedProperties/Items,
  $dynamicRef/$recursiveRef, nullable (OpenAPI), uniqueItems: true (unless maxItems <= 1),
  remote or anchor $refs, unknown formats, unsupported regex features, and schemas that
  allow no value. Annotations (title, description, examples, default, $comment, $schema,
  $id, readOnly, deprecated, x-..., ...) are ignored.
"""
from __future__ import annotations

import bisect
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from functools import lru_cache

__all__ = ["SchemaError", "json_object_gbnf", "json_value_gbnf", "schema_to_gbnf"]

MAX_REPEAT = 10_000          # largest m/n in x{m,n} that ember.gbnf accepts
MAX_RULES = 20_000
MAX_SCHEMA_DEPTH = 128
MAX_DFA_STATES = 4_096
LENGTH_PRODUCT_STATES = 512  # automaton x length counter; a larger maxLength is tightened
SMALL_PRODUCT_STATES = 128   # below this an exact pattern x length automaton is preferred
MAX_NFA_STATES = 50_000
MAX_ANYOF_PRODUCT = 64       # branches produced by distributing anyOf through allOf
INT_DIGITS = 16              # integer type
NUM_INT_DIGITS = 15          # number type: 15 digits keep every value below 2**53
FRAC_DIGITS = 15             # bounded numbers
FREE_FRAC_DIGITS = 20        # unbounded numbers: every Python float repr fits
EXP_DIGITS = 3
WS_INDENT = 32


class SchemaError(ValueError):
    """The schema cannot be converted; `path` is a JSON pointer to the cause."""

    def __init__(self, message: str, path: str | None = None):
        self.message, self.path = message, path
        super().__init__(f"{path}: {message}" if path else message)


# ---------------------------------------------------------------------------------------
# Code point sets: sorted tuples of disjoint inclusive (lo, hi) ranges.

MAX_CP = 0x10FFFF


def _ranges(pairs) -> tuple:
    out: list[list[int]] = []
    for lo, hi in sorted(pairs):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(r) -> tuple:
    out, nxt = [], 0
    for lo, hi in r:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return tuple(out)


def _intersect(a, b) -> tuple:
    return _complement(_ranges(_complement(a) + _complement(b)))


def _minus(a, b) -> tuple:
    return _intersect(a, _complement(_ranges(b)))


def _chars(text: str) -> tuple:
    return _ranges((ord(c), ord(c)) for c in text)


def _contains(r, cp: int) -> bool:
    i = bisect.bisect_right(r, (cp, MAX_CP + 1)) - 1
    return i >= 0 and r[i][0] <= cp <= r[i][1]


SCALARS = _complement(((0xD800, 0xDFFF),))              # what UTF-8 can carry
DIGIT = ((0x30, 0x39),)
WORD = _ranges([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = _ranges([(9, 13), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                 (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
                 (0xFEFF, 0xFEFF)])
DOT = _minus(SCALARS, _chars("\n\r\u2028\u2029"))
# Inside a JSON string: raw characters, plus the ones with a short escape.
RAW_IN_STRING = _minus(SCALARS, [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x2F: "\\/", 8: "\\b", 12: "\\f", 10: "\\n",
                 13: "\\r", 9: "\\t"}
ENCODABLE = _ranges(list(RAW_IN_STRING) + [(cp, cp) for cp in SHORT_ESCAPES])


# ---------------------------------------------------------------------------------------
# GBNF text.

def _cp_escape(cp: int) -> str:
    if cp < 0x80 and chr(cp).isalnum():
        return chr(cp)
    if cp < 0x80:
        return f"\\x{cp:02X}"
    return f"\\u{cp:04X}" if cp <= 0xFFFF else f"\\U{cp:08X}"


def gbnf_class(r) -> str:
    """A character class; every non-alphanumeric character is hex-escaped (no `-`/`]`/`^` traps)."""
    parts = (_cp_escape(lo) if lo == hi else f"{_cp_escape(lo)}-{_cp_escape(hi)}" for lo, hi in r)
    return "[" + "".join(parts) + "]"


_LITERAL_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def gbnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in _LITERAL_ESCAPES:
            out.append(_LITERAL_ESCAPES[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(_cp_escape(ord(ch)) if ord(ch) >= 0x80 else f"\\x{ord(ch):02X}")
    return '"' + "".join(out) + '"'


def gbnf_repeat(atom: str, lo: int, hi: int | None) -> str | None:
    """atom{lo,hi} in the shortest notation; None for the empty string (hi == 0)."""
    if hi == 0:
        return None
    if (lo, hi) == (1, 1):
        return atom
    suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
    if suffix is None:
        suffix = f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"
    return atom + suffix


def _group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "( " + " | ".join(alternatives) + " )"


def _encode_in_string(ranges) -> str:
    """GBNF for one character of `ranges` as written inside a JSON string."""
    alternatives = []
    raw = _intersect(ranges, RAW_IN_STRING)
    if len(raw) == 1 and raw[0][0] == raw[0][1]:
        alternatives.append(gbnf_literal(chr(raw[0][0])))
    elif raw:
        alternatives.append(gbnf_class(raw))
    alternatives += [gbnf_literal(esc) for cp, esc in SHORT_ESCAPES.items() if _contains(ranges, cp)]
    return _group(alternatives)


# ---------------------------------------------------------------------------------------
# Regular expressions: AST, an ECMA-262 subset parser, Thompson NFA, DFA.

@dataclass(frozen=True, slots=True)
class _Chars:
    ranges: tuple


@dataclass(frozen=True, slots=True)
class _Seq:
    items: tuple


@dataclass(frozen=True, slots=True)
class _Alt:
    options: tuple


@dataclass(frozen=True, slots=True)
class _Repeat:
    node: object
    lo: int
    hi: int | None


@dataclass(frozen=True, slots=True)
class _Anchor:
    kind: str                       # "^" or "$"


class _RegexError(Exception):
    pass


_CLASS_ESCAPES = {"d": DIGIT, "D": _complement(DIGIT), "w": WORD, "W": _complement(WORD),
                  "s": SPACE, "S": _complement(SPACE)}
_CHAR_ESCAPES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")
_MAX_REGEX_NESTING = 64
_MAX_TRIE_DEPTH = 64         # excluded key names longer than this go through the automaton


class _RegexParser:
    """Recursive descent over one pattern; nesting is capped so recursion stays shallow."""

    def __init__(self, pattern: str):
        self.p, self.i, self.depth = pattern, 0, 0

    def parse(self):
        node = self._disjunction()
        if self.i < len(self.p):
            self._fail("unbalanced ')'")
        return node

    def _fail(self, what: str):
        raise _RegexError(f"{what} (at index {self.i})")

    def _peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def _disjunction(self):
        options = [self._alternative()]
        while self._peek() == "|":
            self.i += 1
            options.append(self._alternative())
        return options[0] if len(options) == 1 else _Alt(tuple(options))

    def _alternative(self):
        items = []
        while self.i < len(self.p) and self._peek() not in "|)":
            items.append(self._term())
        return items[0] if len(items) == 1 else _Seq(tuple(items))

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
        return _Repeat(node, *bounds)

    def _quantifier(self):
        c = self._peek()
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
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
        else:
            return None
        if self._peek() == "?":             # lazy: matches the same set of strings
            self.i += 1
        if self._peek() and self._peek() in "*+?{":
            self._fail("nothing to repeat")
        return lo, hi

    def _atom(self):
        c = self._peek()
        self.i += 1
        if c == ".":
            return _Chars(DOT)
        if c == "(":
            return self._group()
        if c == "[":
            return _Chars(self._class())
        if c == "\\":
            return _Chars(self._escape(in_class=False))
        if c in "*+?{":
            self.i -= 1
            self._fail("nothing to repeat")
        return _Chars(((ord(c), ord(c)),))

    def _group(self):
        if self.p.startswith("?:", self.i):
            self.i += 2
        elif self.p.startswith("?<", self.i) and self.p[self.i + 2:self.i + 3] not in ("=", "!"):
            end = self.p.find(">", self.i)
            if end < 0:
                self._fail("unterminated group name")
            self.i = end + 1
        elif self._peek() == "?":
            self._fail("lookaround or group flags '(?'")
        self.depth += 1
        if self.depth > _MAX_REGEX_NESTING:
            self._fail("groups nested too deeply")
        node = self._disjunction()
        self.depth -= 1
        if self._peek() != ")":
            self._fail("unterminated group")
        self.i += 1
        return node

    def _class(self) -> tuple:
        negate = self._peek() == "^"
        self.i += negate
        pairs: list = []
        while True:
            if self.i >= len(self.p):
                self._fail("unterminated character class")
            if self._peek() == "]":
                self.i += 1
                break
            first = self._class_atom()
            if self._peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("", "]"):
                save = self.i
                self.i += 1
                second = self._class_atom()
                if len(first) == 1 and len(second) == 1 and first[0][0] == first[0][1] \
                        and second[0][0] == second[0][1]:
                    if first[0][0] > second[0][0]:
                        self._fail("character range out of order")
                    pairs.append((first[0][0], second[0][0]))
                    continue
                # A class escape at either end: ECMA (Annex B) reads '-' literally.
                self.i = save
            pairs.extend(first)
        r = _ranges(pairs)
        return _minus(SCALARS, r) if negate else _intersect(r, SCALARS)

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
        unsupported = {"b": "word boundary \\b", "B": "non-word-boundary \\B",
                       "c": "control escape \\c", "k": "named backreference \\k",
                       "p": "Unicode property escape \\p", "P": "Unicode property escape \\P"}
        if c in unsupported:
            self._fail(unsupported[c])
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


def _anchored_branches(node) -> list[tuple]:
    """Split a parsed pattern into (body, anchored_start, anchored_end) per top-level branch."""
    branches = []
    for option in (node.options if isinstance(node, _Alt) else (node,)):
        items = list(option.items) if isinstance(option, _Seq) else [option]
        start = end = False
        while items and items[0] == _Anchor("^"):
            items.pop(0)
            start = True
        while items and items[-1] == _Anchor("$"):
            items.pop()
            end = True
        body = _Seq(tuple(items))
        if any(isinstance(n, _Anchor) for n in _walk(body)):
            raise _RegexError("'^' or '$' inside the pattern (only at the start/end of a branch)")
        branches.append((body, start, end))
    return branches


def _walk(node):
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if isinstance(n, _Seq):
            todo.extend(n.items)
        elif isinstance(n, _Alt):
            todo.extend(n.options)
        elif isinstance(n, _Repeat):
            todo.append(n.node)


class _NFA:
    """Thompson automaton: per state, epsilon targets and (ranges, target) edges."""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple]] = []
        self.start = self.state()
        self.accept = -1

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise _RegexError(f"pattern expands to more than {MAX_NFA_STATES} automaton states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def add(self, node, start: int, alphabet) -> int:
        """Append `node` after state `start`; return its end state."""
        if isinstance(node, _Chars):
            end = self.state()
            r = _intersect(node.ranges, alphabet)
            if r:
                self.edges[start].append((r, end))
            return end
        if isinstance(node, _Seq):
            for item in node.items:
                start = self.add(item, start, alphabet)
            return start
        if isinstance(node, _Alt):
            end = self.state()
            for option in node.options:
                self.eps[self.add(option, start, alphabet)].append(end)
            return end
        return self._add_repeat(node, start, alphabet)

    def _add_repeat(self, node: _Repeat, cur: int, alphabet) -> int:
        for _ in range(node.lo):
            cur = self.add(node.node, cur, alphabet)
        if node.hi is None:
            loop = self.state()
            self.eps[cur].append(loop)
            self.eps[self.add(node.node, loop, alphabet)].append(loop)
            return loop
        end = self.state()
        self.eps[cur].append(end)
        for _ in range(node.hi - node.lo):
            cur = self.add(node.node, cur, alphabet)
            self.eps[cur].append(end)
        return end

    def closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def matches(self, text: str) -> bool:
        current = self.closure({self.start})
        for ch in text:
            cp = ord(ch)
            current = self.closure({t for s in current for r, t in self.edges[s] if _contains(r, cp)})
        return self.accept in current


def _search_nfa(branches, alphabet) -> _NFA:
    """Search semantics: an unanchored end may be padded with any characters."""
    nfa = _NFA()
    accept = nfa.state()
    anything = _Repeat(_Chars(alphabet), 0, None)
    for body, anchored_start, anchored_end in branches:
        cur = nfa.start if anchored_start else nfa.add(anything, nfa.start, alphabet)
        cur = nfa.add(body, cur, alphabet)
        if not anchored_end:
            cur = nfa.add(anything, cur, alphabet)
        nfa.eps[cur].append(accept)
    nfa.accept = accept
    return nfa


@lru_cache(maxsize=1024)
def _pattern_nfa(pattern: str) -> _NFA:
    return _search_nfa(_anchored_branches(_RegexParser(pattern).parse()), ENCODABLE)


@lru_cache(maxsize=256)
def _literals_nfa(words: tuple) -> _NFA:
    branches = [(_Seq(tuple(_Chars(((ord(c), ord(c)),)) for c in w)), True, True) for w in words]
    return _search_nfa(branches, ENCODABLE)


@dataclass(slots=True)
class _DFA:
    atoms: list                     # atom index -> (lo, hi) code point range
    start: int
    accepting: list                 # state -> bool
    trans: list                     # state -> {atom index: state}


def _atoms(nfas, alphabet) -> list:
    """The coarsest ranges that no edge of any automaton splits."""
    cuts = {lo for lo, _ in alphabet} | {hi + 1 for _, hi in alphabet}
    for nfa in nfas:
        for edges in nfa.edges:
            for r, _ in edges:
                cuts.update(lo for lo, _ in r)
                cuts.update(hi + 1 for _, hi in r)
    points = sorted(cuts)
    return [(a, b - 1) for a, b in itertools.pairwise(points) if _contains(alphabet, a)]


def _atom_tables(nfa: _NFA, atoms: list) -> list:
    """Per NFA state: list of (atom index, target)."""
    starts = [lo for lo, _ in atoms]
    tables = []
    for edges in nfa.edges:
        row = []
        for r, target in edges:
            for lo, hi in r:
                k = bisect.bisect_left(starts, lo)
                while k < len(atoms) and atoms[k][1] <= hi:
                    row.append((k, target))
                    k += 1
        tables.append(row)
    return tables


@lru_cache(maxsize=512)
def _string_dfa(patterns: tuple, excluded: tuple, excluded_patterns: tuple,
                min_len: int, max_len: int | None) -> _DFA | None:
    """Strings matching every pattern, none of the excluded patterns or words, length in range.
    A maxLength that would need more than LENGTH_PRODUCT_STATES states is tightened."""
    base = _language_dfa(patterns, excluded, excluded_patterns)
    if base is None:
        return None
    shortest, longest = _length_range(base)
    if shortest >= min_len and (max_len is None or (longest is not None and longest <= max_len)):
        return base
    size = len(base.trans)
    if max_len is not None and size * (max_len + 1) > LENGTH_PRODUCT_STATES:
        max_len = max(LENGTH_PRODUCT_STATES // size - 1, min_len)      # narrower: still sound
    if size * ((min_len if max_len is None else max_len) + 1) > LENGTH_PRODUCT_STATES:
        raise _RegexError(f"minLength {min_len} needs more than {LENGTH_PRODUCT_STATES} automaton states")
    return _with_length(base, min_len, max_len)


@lru_cache(maxsize=512)
def _language_dfa(patterns: tuple, excluded: tuple, excluded_patterns: tuple) -> _DFA | None:
    positives = [_pattern_nfa(p) for p in patterns] or [_pattern_nfa("")]
    negatives = [_pattern_nfa(p) for p in excluded_patterns]
    if excluded:
        negatives.append(_literals_nfa(excluded))
    dfa = _subset_construction(positives, negatives, ENCODABLE)
    return None if dfa is None else _minimize(dfa)


def _subset_construction(positives, negatives, alphabet) -> _DFA | None:
    """The product of the determinized automata (negatives must not accept)."""
    nfas = positives + negatives
    atoms = _atoms(nfas, alphabet)
    tables = [_atom_tables(nfa, atoms) for nfa in nfas]
    start = tuple(nfa.closure({nfa.start}) for nfa in nfas)
    index, keys, accepting, trans = {start: 0}, [start], [], []
    while len(trans) < len(keys):
        sets = keys[len(trans)]
        accepting.append(all(nfa.accept in s for nfa, s in zip(positives, sets))
                         and not any(nfa.accept in s for nfa, s in zip(negatives, sets[len(positives):])))
        moves = [_moves(table, s) for table, s in zip(tables, sets)]
        out: dict = {}
        for a in range(len(atoms)):
            if any(a not in moves[k] for k in range(len(positives))):
                continue
            nxt = tuple(nfa.closure(m.get(a, ())) for nfa, m in zip(nfas, moves))
            if nxt not in index:
                if len(keys) >= MAX_DFA_STATES:
                    raise _RegexError(f"needs more than {MAX_DFA_STATES} automaton states")
                index[nxt] = len(keys)
                keys.append(nxt)
            out[a] = index[nxt]
        trans.append(out)
    return _prune(_DFA(atoms, 0, accepting, trans))


def _with_length(dfa: _DFA, min_len: int, max_len: int | None) -> _DFA | None:
    """Product with a length counter (counts past min_len merge when there is no max)."""
    cap = max_len if max_len is not None else min_len
    index, keys, accepting, trans = {(dfa.start, 0): 0}, [(dfa.start, 0)], [], []
    while len(trans) < len(keys):
        q, count = keys[len(trans)]
        accepting.append(dfa.accepting[q] and count >= min_len)
        out: dict = {}
        if max_len is None or count < max_len:
            for a, t in dfa.trans[q].items():
                key = (t, min(count + 1, cap))
                if key not in index:
                    index[key] = len(keys)
                    keys.append(key)
                out[a] = index[key]
        trans.append(out)
    return _prune(_DFA(dfa.atoms, 0, accepting, trans))


def _length_range(dfa: _DFA) -> tuple[int, int | None]:
    """Shortest accepted length, and the longest (None when a cycle makes it unbounded)."""
    dist, frontier, shortest = {dfa.start: 0}, [dfa.start], None
    while frontier and shortest is None:
        if any(dfa.accepting[s] for s in frontier):
            shortest = dist[frontier[0]]
            break
        nxt = []
        for s in frontier:
            for t in dfa.trans[s].values():
                if t not in dist:
                    dist[t] = dist[s] + 1
                    nxt.append(t)
        frontier = nxt
    longest: dict = {}
    for s in _topological(dfa):
        if s is None:
            return shortest or 0, None
        tails = [longest[t] + 1 for t in dfa.trans[s].values()]
        longest[s] = max(tails + ([0] if dfa.accepting[s] else []))
    return shortest or 0, longest[dfa.start]


def _topological(dfa: _DFA) -> list:
    """States with successors first; [None] if there is a cycle. (All states are live.)"""
    order, state = [], [0] * len(dfa.trans)            # 0 new, 1 on stack, 2 done
    for root in range(len(dfa.trans)):
        if state[root]:
            continue
        stack = [(root, iter(dfa.trans[root].values()))]
        state[root] = 1
        while stack:
            s, it = stack[-1]
            t = next(it, None)
            if t is None:
                stack.pop()
                state[s] = 2
                order.append(s)
            elif state[t] == 1:
                return [None]
            elif state[t] == 0:
                state[t] = 1
                stack.append((t, iter(dfa.trans[t].values())))
    return order


def _moves(table, states) -> dict:
    out: dict = {}
    for s in states:
        for a, t in table[s]:
            out.setdefault(a, set()).add(t)
    return out


def _prune(dfa: _DFA) -> _DFA | None:
    """Drop states from which no accepting state is reachable; None if that is the start."""
    back: list[list[int]] = [[] for _ in dfa.trans]
    for s, out in enumerate(dfa.trans):
        for t in out.values():
            back[t].append(s)
    live = {s for s, acc in enumerate(dfa.accepting) if acc}
    todo = list(live)
    while todo:
        for p in back[todo.pop()]:
            if p not in live:
                live.add(p)
                todo.append(p)
    if dfa.start not in live:
        return None
    trans = [{a: t for a, t in out.items() if t in live} for out in dfa.trans]
    return _renumber(_DFA(dfa.atoms, dfa.start, dfa.accepting, trans), {s: s for s in live})


def _minimize(dfa: _DFA) -> _DFA:
    """Hopcroft's partition refinement; missing transitions go to an explicit dead state."""
    n, dead, k = len(dfa.trans), len(dfa.trans), len(dfa.atoms)
    sources: list[dict] = [{} for _ in range(k)]       # atom -> target -> [sources]
    for s, out in enumerate(dfa.trans):
        for a in range(k):
            sources[a].setdefault(out.get(a, dead), []).append(s)
    for a in range(k):
        sources[a].setdefault(dead, []).append(dead)
    accepting = {s for s in range(n) if dfa.accepting[s]}
    blocks = [b for b in (accepting, set(range(n + 1)) - accepting) if b]
    owner = {s: i for i, b in enumerate(blocks) for s in b}
    work = {(0, a) for a in range(k)}
    while work:
        i, a = work.pop()
        hit: dict = {}
        for t in list(blocks[i]):
            for s in sources[a].get(t, ()):
                hit.setdefault(owner[s], set()).add(s)
        for j, part in hit.items():
            if len(part) == len(blocks[j]):
                continue
            blocks[j] -= part
            blocks.append(part)
            new = len(blocks) - 1
            for s in part:
                owner[s] = new
            for b in range(k):
                if (j, b) in work:
                    work.add((new, b))
                else:
                    work.add((new, b) if len(part) <= len(blocks[j]) else (j, b))
    return _renumber(dfa, {s: owner[s] for s in range(n)})


def _renumber(dfa: _DFA, group: dict) -> _DFA:
    """Collapse states by `group` (state -> class; states absent are dropped), BFS order from start."""
    order, seen = [group[dfa.start]], {group[dfa.start]}
    rep = {}
    for s, g in group.items():
        rep.setdefault(g, s)
    i = 0
    while i < len(order):
        for t in dfa.trans[rep[order[i]]].values():
            if group[t] not in seen:
                seen.add(group[t])
                order.append(group[t])
        i += 1
    number = {g: k for k, g in enumerate(order)}
    trans = [{a: number[group[t]] for a, t in dfa.trans[rep[g]].items()} for g in order]
    accepting = [dfa.accepting[rep[g]] for g in order]
    return _DFA(dfa.atoms, 0, accepting, trans)


# ---------------------------------------------------------------------------------------
# Decimal ranges as regex ASTs (emitted structurally: they are already unambiguous).

def _lit(text: str):
    return _Seq(tuple(_Chars(((ord(c), ord(c)),)) for c in text))


def _digit_range(lo: int, hi: int):
    return _Chars(((0x30 + lo, 0x30 + hi),))


def _any_digits(lo: int, hi: int | None):
    return _Seq(()) if hi == 0 else _Repeat(_Chars(DIGIT), lo, hi)


def _alt(options):
    options = [o for o in options if o is not None]
    if not options:
        return None
    return options[0] if len(options) == 1 else _Alt(tuple(options))


def _suffix_ge(s: str):
    """Digit strings of len(s) that are >= s."""
    if s.strip("0") == "":
        return _any_digits(len(s), len(s))
    d = int(s[0])
    bigger = _Seq((_digit_range(d + 1, 9), _any_digits(len(s) - 1, len(s) - 1))) if d < 9 else None
    return _alt([_Seq((_lit(s[0]), _suffix_ge(s[1:]))), bigger])


def _suffix_le(s: str):
    """Digit strings of len(s) that are <= s."""
    if s.strip("9") == "":
        return _any_digits(len(s), len(s))
    d = int(s[0])
    smaller = _Seq((_digit_range(0, d - 1), _any_digits(len(s) - 1, len(s) - 1))) if d > 0 else None
    return _alt([smaller, _Seq((_lit(s[0]), _suffix_le(s[1:])))])


def _same_length_range(a: str, b: str):
    """Digit strings x of len(a) == len(b) with a <= x <= b."""
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if i == len(a):
        return _lit(a)
    rest = len(a) - i - 1
    lo_free, hi_free = a[i + 1:].strip("0") == "", b[i + 1:].strip("9") == ""
    first, last = int(a[i]) + (not lo_free), int(b[i]) - (not hi_free)
    parts = [] if lo_free else [_Seq((_lit(a[i]), _suffix_ge(a[i + 1:])))]
    if first <= last:
        parts.append(_Seq((_digit_range(first, last), _any_digits(rest, rest))))
    if not hi_free:
        parts.append(_Seq((_lit(b[i]), _suffix_le(b[i + 1:]))))
    return _Seq((_lit(a[:i]), _alt(parts)))


def _uint_range(lo: int, hi: int):
    """Canonical decimal integers (no leading zeros) in [lo, hi]; lengths with every value merge."""
    parts, full = [], []
    for d in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (d - 1) if d > 1 else 0), min(hi, 10 ** d - 1)
        if d > 1 and a == 10 ** (d - 1) and b == 10 ** d - 1:
            full.append(d)
            continue
        if full:
            parts.append(_Seq((_digit_range(1, 9), _any_digits(full[0] - 1, full[-1] - 1))))
            full = []
        parts.append(_same_length_range(str(a), str(b)))
    if full:
        parts.append(_Seq((_digit_range(1, 9), _any_digits(full[0] - 1, full[-1] - 1))))
    return _alt(parts)


def _frac_tail(lo: str | None, hi: str | None, n: int):
    """Non-empty digit strings of length <= n whose zero-padded value lies in [lo, hi]
    (lo, hi: n-digit strings, None for no bound)."""
    if n == 0:
        return None
    lo0, hi0 = (int(lo[0]) if lo else 0), (int(hi[0]) if hi else 9)
    if lo0 > hi0:
        return None
    free_lo = lo is None or lo[1:].strip("0") == ""
    free_hi = hi is None or hi[1:].strip("9") == ""
    parts = []
    if lo0 == hi0:
        return _frac_branch(lo0, lo[1:] if lo else None, hi[1:] if hi else None, n)
    first, last = lo0 + (not free_lo), hi0 - (not free_hi)
    if not free_lo:
        parts.append(_frac_branch(lo0, lo[1:], None, n))
    if first <= last:
        parts.append(_Seq((_digit_range(first, last), _any_digits(0, n - 1))))
    if not free_hi:
        parts.append(_frac_branch(hi0, None, hi[1:], n))
    return _alt(parts)


def _frac_branch(d: int, lo: str | None, hi: str | None, n: int):
    """Digit d followed by a (possibly empty) rest whose padded value is in [lo, hi]."""
    rest_may_end = lo is None or lo.strip("0") == ""
    rest = _frac_tail(lo, hi, n - 1)
    if rest is None:
        return _lit(str(d)) if rest_may_end else None
    return _Seq((_lit(str(d)), _Repeat(rest, 0, 1) if rest_may_end else rest))


def _fraction(lo: str | None, hi: str | None, digits: int):
    """Optional '.digits' part: (node or None, whether it may be left out)."""
    may_skip = lo is None or lo.strip("0") == ""
    tail = _frac_tail(lo, hi, digits) if digits else None
    node = _Seq((_lit("."), tail)) if tail is not None else None
    return node, may_skip


def _with_fraction(int_node, lo, hi, digits):
    frac, may_skip = _fraction(lo, hi, digits)
    if frac is None:
        return int_node if may_skip else None
    return _Seq((int_node, _Repeat(frac, 0, 1) if may_skip else frac))


def _split_grid(v: Decimal, digits: int) -> tuple[int, str]:
    scaled = int(v.scaleb(digits))
    ip, fp = divmod(scaled, 10 ** digits)
    return ip, (str(fp).zfill(digits) if digits else "")


def _magnitude(lo: Decimal, hi: Decimal | None, digits: int, int_digits: int):
    """Unsigned decimals (grid 10**-digits) with lo <= value <= hi (hi None: < 10**int_digits)."""
    a, alpha = _split_grid(lo, digits)
    b, beta = (10 ** int_digits - 1, None) if hi is None else _split_grid(hi, digits)
    if a > b or a >= 10 ** int_digits:
        return None
    if a == b:
        return _with_fraction(_lit(str(a)), alpha, beta, digits)
    lo_free = alpha.strip("0") == ""
    hi_free = beta is None or beta.strip("9") == ""
    parts = [] if lo_free else [_with_fraction(_lit(str(a)), alpha, None, digits)]
    first, last = a + (not lo_free), b - (not hi_free)
    if first <= last:
        parts.append(_with_fraction(_uint_range(first, last), None, None, digits))
    if not hi_free:
        parts.append(_with_fraction(_lit(str(b)), None, beta, digits))
    return _alt(parts)


def _decimal_range(lo: Decimal | None, hi: Decimal | None, digits: int, int_digits: int):
    """Signed decimals on the grid within [lo, hi]; never '-0'."""
    limit = Decimal(10) ** int_digits
    if (lo is not None and lo >= limit) or (hi is not None and hi <= -limit) \
            or (lo is not None and hi is not None and lo > hi):
        return None
    lo = None if lo is not None and lo <= -limit else lo
    hi = None if hi is not None and hi >= limit else hi
    parts = []
    if hi is None or hi >= 0:
        parts.append(_magnitude(max(lo, Decimal(0)) if lo is not None else Decimal(0), hi,
                                digits, int_digits))
    if lo is None or lo < 0:
        step = Decimal(1).scaleb(-digits)
        m_lo = max(-hi, step) if hi is not None and hi < 0 else step
        m = _magnitude(m_lo, None if lo is None else -lo, digits, int_digits)
        parts.append(None if m is None else _Seq((_lit("-"), m)))
    return _alt(parts)


@lru_cache(maxsize=1024)
def _range_gbnf(lo: Decimal | None, hi: Decimal | None, digits: int, int_digits: int) -> str | None:
    with localcontext() as ctx:
        ctx.prec = 80
        node = _decimal_range(lo, hi, digits, int_digits)
    return None if node is None else _ast_gbnf(node)


def _ast_gbnf(node) -> str:
    """A regex AST as one GBNF expression."""
    if isinstance(node, _Chars):
        if len(node.ranges) == 1 and node.ranges[0][0] == node.ranges[0][1]:
            return gbnf_literal(chr(node.ranges[0][0]))
        return gbnf_class(node.ranges)
    if isinstance(node, _Seq):
        return _seq_gbnf(node.items)
    if isinstance(node, _Alt):
        return "( " + " | ".join(_ast_gbnf(o) for o in node.options) + " )"
    inner = _ast_gbnf(node.node)
    if not isinstance(node.node, (_Chars, _Alt)):
        inner = f"( {inner} )"
    return gbnf_repeat(inner, node.lo, node.hi) or '""'


def _seq_gbnf(items) -> str:
    out, literal = [], []
    for item in _flatten_seq(items):
        if isinstance(item, _Chars) and len(item.ranges) == 1 and item.ranges[0][0] == item.ranges[0][1]:
            literal.append(chr(item.ranges[0][0]))
            continue
        if literal:
            out.append(gbnf_literal("".join(literal)))
            literal = []
        out.append(_ast_gbnf(item))
    if literal:
        out.append(gbnf_literal("".join(literal)))
    return " ".join(out) if out else '""'


def _flatten_seq(items):
    for item in items:
        if isinstance(item, _Seq):
            yield from _flatten_seq(item.items)
        else:
            yield item


# ---------------------------------------------------------------------------------------
# Formats (as patterns, compiled like any other pattern).

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HOUR = r"(?:[01][0-9]|2[0-3])"
_TIME = rf"{_HOUR}:[0-5][0-9]:[0-5][0-9](?:\.[0-9]{{1,9}})?(?:Z|[+\-]{_HOUR}:[0-5][0-9])"
_HEX = "[0-9a-fA-F]"
_PCT = f"%{_HEX}{{2}}"
_UNRESERVED = r"A-Za-z0-9\-._~"
_SUB_DELIMS = r"!$&'()*+,;="
_PCHAR = rf"(?:[{_UNRESERVED}{_SUB_DELIMS}:@]|{_PCT})"
_AUTHORITY = (rf"(?:(?:[{_UNRESERVED}{_SUB_DELIMS}:]|{_PCT})*@)?"
              rf"(?:[{_UNRESERVED}{_SUB_DELIMS}]|{_PCT})*(?::[0-9]*)?")
# Paths as one loop each ((/seg)* == (/(seg|/)*)?): a maxLength then caps them evenly.
_HIER = rf"(?://{_AUTHORITY}(?:/(?:{_PCHAR}|/)*)?|/(?:{_PCHAR}(?:{_PCHAR}|/)*)?|{_PCHAR}(?:{_PCHAR}|/)*|)"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]"
# Host labels joined by dots; letters/digits, with runs of at most 2 inner hyphens (xn--).
_HOST_RUN = r"[A-Za-z0-9](?:(?:\.|-{1,2})?[A-Za-z0-9])*"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"

STRING_FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": f"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}$",
    "email": rf"^{_ATEXT}(?:\.?{_ATEXT})*@{_HOST_RUN}\.{_HOST_RUN}$",
    "uri": rf"^[A-Za-z][A-Za-z0-9+.\-]*:{_HIER}(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?$",
    "ipv4": rf"^{_OCTET}(?:\.{_OCTET}){{3}}$",
}
NUMERIC_FORMATS = {"int32": (-2 ** 31, 2 ** 31 - 1), "int64": (-2 ** 63, 2 ** 63 - 1),
                   "float": None, "double": None}


# ---------------------------------------------------------------------------------------
# Schema keywords.

ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "default", "$comment", "$schema", "$id",
    "$anchor", "$dynamicAnchor", "$vocabulary", "readOnly", "writeOnly", "deprecated",
    "contentEncoding", "contentMediaType", "contentSchema", "discriminator", "externalDocs",
    "$defs", "definitions"})
TYPE_NAMES = ("null", "boolean", "object", "array", "number", "integer", "string")
_PATTERNS = "ember:patterns"          # merged allOf patterns (internal)
_FORMATS = "ember:formats"            # merged allOf formats (internal)
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", _PATTERNS})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "patternProperties",
                             "minProperties", "maxProperties"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems",
                            "uniqueItems"})
COMBINATORS = frozenset({"$ref", "allOf", "anyOf", "oneOf"})
VALUE_KEYWORDS = frozenset({"type", "enum", "const", "format", _FORMATS})
SUPPORTED = (STRING_KEYWORDS | NUMBER_KEYWORDS | OBJECT_KEYWORDS | ARRAY_KEYWORDS
             | COMBINATORS | VALUE_KEYWORDS)
_ABSENT = object()


def _is_annotation(key: str) -> bool:
    return key in ANNOTATIONS or key.startswith("x-")


def _constraints(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if not _is_annotation(k)}


def _canonical(schema) -> str:
    try:
        return json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"schema is not JSON: {e}") from None


def _json_equal(a, b) -> bool:
    """JSON equality: 1 == 1.0, but true != 1; objects by keys, arrays in order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _json_type_matches(value, type_name: str) -> bool:
    checks = {
        "null": lambda v: v is None,
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer()),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    return checks[type_name](value)


def _normalize_draft4(schema: dict) -> dict:
    """Draft-4 boolean exclusiveMinimum/Maximum -> the numeric form."""
    out = schema
    for key, base in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        flag = out.get(key)
        if isinstance(flag, bool):
            out = dict(out)
            del out[key]
            if flag:
                if base not in out:
                    raise SchemaError(f"'{key}': true needs '{base}'")
                out[key] = out.pop(base)
    return out


# ---------------------------------------------------------------------------------------
# The converter.

@dataclass(slots=True)
class _Rules:
    """Named rule bodies in creation order; identical finished bodies share one name."""
    bodies: dict = field(default_factory=dict)       # name -> body (None while reserved)
    by_body: dict = field(default_factory=dict)

    def reserve(self, hint: str) -> str:
        base = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-") or "r"
        name, k = base, 1
        while name in self.bodies:
            name, k = f"{base}-{k}", k + 1
        if len(self.bodies) >= MAX_RULES:
            raise SchemaError(f"grammar needs more than {MAX_RULES} rules")
        self.bodies[name] = None
        return name

    def define(self, name: str, body: str):
        self.bodies[name] = body
        self.by_body.setdefault(body, name)

    def add(self, hint: str, body: str) -> str:
        if body in self.by_body:
            return self.by_body[body]
        name = self.reserve(hint)
        self.define(name, body)
        return name

    def release(self, name: str):
        del self.bodies[name]

    def text(self) -> str:
        return "".join(f"{name} ::= {body}\n" for name, body in self.bodies.items())


_PRIMITIVES = {           # fixed rules; <name> is a reference to another fixed rule
    "ws": '( " " | "\\n" ' + gbnf_class(_chars(" \t")) + f'{{0,{WS_INDENT}}} )?',
    "hex": "[0-9a-fA-F]",
    "char": (gbnf_class(RAW_IN_STRING) + ' | "\\\\" ( ' + gbnf_class(_chars('"\\/bfnrt'))
             + ' | "u" ( [0-9a-cA-CefEF] <hex>{3} | [dD] [0-7] <hex>{2}'
             + ' | [dD] [89abAB] <hex>{2} "\\\\u" [dD] [c-fC-F] <hex>{2} ) )'),
    "string": '"\\"" <char>* "\\""',
    "text-char": _encode_in_string(ENCODABLE),       # one character, one way to write it
    "integer": f'"-"? ( "0" | [1-9] [0-9]{{0,{INT_DIGITS - 1}}} )',
    "number": (f'"-"? ( "0" | [1-9] [0-9]{{0,{INT_DIGITS - 1}}} ) ( "." [0-9]{{1,{FREE_FRAC_DIGITS}}} )?'
               f' ( [eE] {gbnf_class(_chars("+-"))}? [0-9]{{1,{EXP_DIGITS}}} )?'),
    "boolean": '"true" | "false"',
    "null": '"null"',
    "value": "<object> | <array> | <string> | <number> | <boolean> | <null>",
    "object": '"{" <ws> ( <member> ( "," <ws> <member> )* <ws> )? "}"',
    "member": '<string> ":" <ws> <value>',
    "array": '"[" <ws> ( <value> ( "," <ws> <value> )* <ws> )? "]"',
}
_PRIMITIVE_REF = re.compile(r"<([a-z]+)>")


class _Converter:
    def __init__(self, schema, strict: bool, root: str):
        self.schema, self.strict = schema, strict
        self.rules = _Rules()
        self.root = root
        self.rules.reserve(root)
        self.done: dict = {}            # canonical schema -> rule name or None
        self.building: dict = {}        # canonical schema -> reserved name, while converting
        self.used_early: set = set()    # reserved names referenced before their body existed
        self.prims: dict = {}
        self.dfas: dict = {}

    # -- entry points ------------------------------------------------------------------

    def convert(self) -> str:
        name = self.visit(self.schema, (), frozenset(), force_name=self.root)
        if name is None:
            raise SchemaError("the schema allows no value", "#")
        if name != self.root:
            self.rules.define(self.root, name)
        return self.rules.text()

    def prim(self, name: str) -> str:
        """A fixed rule (ws, string, value, ...), with the fixed rules it uses."""
        if name not in self.prims:
            self.prims[name] = self.rules.reserve(name)
            body = _PRIMITIVE_REF.sub(lambda m: self.prim(m.group(1)), _PRIMITIVES[name])
            self.rules.define(self.prims[name], body)
        return self.prims[name]

    # -- visiting ----------------------------------------------------------------------

    def visit(self, schema, path: tuple, head: frozenset, force_name: str | None = None):
        """Rule name for `schema` (None: it allows nothing). `head` holds the schemas being
        converted since the last object/array: meeting one again is a cycle that consumes nothing."""
        if len(path) > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"schema nested deeper than {MAX_SCHEMA_DEPTH}", _pointer(path))
        key = _canonical(schema)
        if key in self.done:
            return self.done[key]
        if key in self.building:
            if key in head:
                raise SchemaError("$ref/allOf/anyOf cycle that never enters an object or array",
                                  _pointer(path))
            self.used_early.add(self.building[key])
            return self.building[key]
        name = force_name or self.rules.reserve(_hint(path))
        self.building[key] = name
        try:
            body = self._convert(schema, path, head | {key})
        finally:
            del self.building[key]
        self.done[key] = self._finish(name, body, forced=force_name is not None, path=path)
        return self.done[key]

    def _finish(self, name: str, body: str | None, forced: bool, path: tuple):
        if body is None:
            if name in self.used_early:
                raise SchemaError("recursive schema allows no value", _pointer(path))
            if not forced:
                self.rules.release(name)
            return None
        if not forced and name not in self.used_early:
            if body in self.rules.bodies and self.rules.bodies[body] is not None:
                self.rules.release(name)            # plain alias of an existing rule
                return body
            if body in self.rules.by_body:
                self.rules.release(name)
                return self.rules.by_body[body]
        self.rules.define(name, body)
        return name

    def _convert(self, schema, path: tuple, head: frozenset) -> str | None:
        if schema is True:
            return self.prim("value")
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object or a boolean, not {type(schema).__name__}",
                              _pointer(path))
        schema = self._checked(schema, path)
        if "$ref" in schema:
            return self._ref(schema, path, head)
        if "allOf" in schema:
            return self._all_of(schema, path, head)
        if "anyOf" in schema or "oneOf" in schema:
            return self._any_of(schema, path, head)
        if "enum" in schema or "const" in schema:
            return self._enum(schema, path)
        if not _constraints(schema):
            return self.prim("value")
        bodies = {t: self._typed(t, schema, path) for t in self._types(schema, path)}
        bodies = {t: b for t, b in bodies.items() if b is not None}
        if len(bodies) <= 1:
            return next(iter(bodies.values()), None)
        names = [b if b in self.rules.bodies else self.rules.add(f"{_hint(path)}-{t}", b)
                 for t, b in bodies.items()]
        return " | ".join(dict.fromkeys(names))

    def _checked(self, schema: dict, path: tuple) -> dict:
        for key in schema:
            if not isinstance(key, str):
                raise SchemaError("schema keys must be strings", _pointer(path))
            if key not in SUPPORTED and not _is_annotation(key):
                raise SchemaError(f"unsupported keyword '{key}'", _pointer(path + (key,)))
        try:
            return _normalize_draft4(schema)
        except SchemaError as e:
            raise SchemaError(e.message, _pointer(path)) from None

    def _typed(self, t: str, schema: dict, path: tuple) -> str | None:
        if t in ("null", "boolean"):
            return self.prim(t)
        builder = {"object": self._object, "array": self._array, "string": self._string,
                   "integer": self._integer, "number": self._number}[t]
        return builder(schema, path)

    def _types(self, schema: dict, path: tuple) -> list[str]:
        declared = schema.get("type")
        if declared is None:
            return self._inferred_types(schema, path)
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names:
            raise SchemaError("'type' must be a type name or a non-empty list of them",
                              _pointer(path + ("type",)))
        out = []
        for t in names:
            if t not in TYPE_NAMES:
                raise SchemaError(f"unknown type {t!r}", _pointer(path + ("type",)))
            if t not in out:
                out.append(t)
        if "number" in out and "integer" in out:
            out.remove("integer")
        return out

    def _inferred_types(self, schema: dict, path: tuple) -> list[str]:
        """Without 'type', keep only the types whose keywords appear (a subset of what is
        valid: {"properties": ...} yields objects only); no typed keyword: any value."""
        keys = set(schema)
        formats = self._formats(schema, path)
        out = []
        if keys & OBJECT_KEYWORDS:
            out.append("object")
        if keys & ARRAY_KEYWORDS:
            out.append("array")
        if keys & STRING_KEYWORDS or any(f in STRING_FORMATS for f in formats):
            out.append("string")
        if keys & NUMBER_KEYWORDS or any(f in NUMERIC_FORMATS for f in formats):
            out.append("number")
        return out or ["object", "array", "string", "number", "boolean", "null"]

    # -- references and combinators ----------------------------------------------------

    def resolve(self, ref, path: tuple):
        """The local schema a $ref points to, and its path."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"only local $ref ('#...') is supported, not {ref!r}",
                              _pointer(path + ("$ref",)))
        target, where = self.schema, ()
        pointer = ref[1:]
        if pointer and not pointer.startswith("/"):
            raise SchemaError(f"$ref {ref!r}: anchors are not supported", _pointer(path + ("$ref",)))
        for raw in pointer.split("/")[1:]:
            part = _unescape_pointer(raw)
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError(f"$ref {ref!r} does not resolve", _pointer(path + ("$ref",)))
            where += (part,)
        return target, where

    def _ref(self, schema: dict, path: tuple, head: frozenset):
        rest = _constraints(schema)
        del rest["$ref"]
        if rest:                                  # siblings of $ref apply too (2019-09+)
            return self._all_of({"allOf": [{"$ref": schema["$ref"]}, rest]}, path, head)
        target, where = self.resolve(schema["$ref"], path)
        return self.visit(target, where, head)

    def _all_of(self, schema: dict, path: tuple, head: frozenset):
        merged = _Merger(self, path).merge([schema])
        return self.visit(merged, path + ("allOf",), head)

    def _any_of(self, schema: dict, path: tuple, head: frozenset):
        rest = _constraints(schema)
        if "anyOf" in rest and "oneOf" in rest:
            return self._all_of({"allOf": [{"anyOf": rest.pop("anyOf")}, rest]}, path, head)
        key = "anyOf" if "anyOf" in rest else "oneOf"   # oneOf is treated as anyOf
        branches = rest.pop(key)
        if not isinstance(branches, list) or not branches:
            raise SchemaError(f"'{key}' must be a non-empty list", _pointer(path + (key,)))
        alternatives = []
        for i, branch in enumerate(branches):
            sub = {"allOf": [rest, branch]} if rest else branch
            rule = self.visit(sub, path + (key, str(i)), head)
            if rule is not None and rule not in alternatives:
                alternatives.append(rule)
        return " | ".join(alternatives) if alternatives else None

    def _enum(self, schema: dict, path: tuple):
        values = self._enum_values(schema, path)
        others = set(_constraints(schema)) - {"enum", "const", "type"}
        if others:
            raise SchemaError(f"'{min(others)}' next to enum/const is not supported", _pointer(path))
        if "type" in schema:
            types = self._types(schema, path)
            values = [v for v in values if any(_json_type_matches(v, t) for t in types)]
        literals = dict.fromkeys(self._value_gbnf(v) for v in values)
        return " | ".join(literals) if literals else None

    def _value_gbnf(self, value) -> str:
        """One fixed JSON value: scalars as compact json.dumps, containers with `ws` layout."""
        if isinstance(value, (list, dict)) and value:
            ws = self.prim("ws")
            if isinstance(value, list):
                inner = f' "," {ws} '.join(self._value_gbnf(v) for v in value)
                return f'"[" {ws} {inner} {ws} "]"'
            inner = f' "," {ws} '.join(
                f'{gbnf_literal(json.dumps(k, ensure_ascii=False))} ":" {ws} {self._value_gbnf(v)}'
                for k, v in value.items())
            return f'"{{" {ws} {inner} {ws} "}}"'
        if isinstance(value, (list, dict)):
            open_, close = ("[", "]") if isinstance(value, list) else ("{", "}")
            return f'"{open_}" {self.prim("ws")} "{close}"'
        return gbnf_literal(json.dumps(value, ensure_ascii=False))

    def _enum_values(self, schema: dict, path: tuple) -> list:
        values = None
        if "enum" in schema:
            if not isinstance(schema["enum"], list):
                raise SchemaError("'enum' must be a list", _pointer(path + ("enum",)))
            values = list(schema["enum"])
        if "const" in schema:
            c = schema["const"]
            values = [c] if values is None else [v for v in values if _json_equal(v, c)]
        for v in values:
            _canonical(v)                                  # rejects NaN/inf and non-JSON
        return values

    # -- objects -----------------------------------------------------------------------

    def _object(self, schema: dict, path: tuple) -> str | None:
        props = _dict_of_schemas(schema, "properties", path)
        patterns = _dict_of_schemas(schema, "patternProperties", path)
        for p in patterns:
            self._check_pattern(p, path + ("patternProperties", p))
        required = _string_list(schema, "required", path)
        additional = schema.get("additionalProperties", _ABSENT)
        closed_by_default = additional is _ABSENT and self.strict and bool(props or patterns)
        if additional is _ABSENT:
            additional = not closed_by_default
        elif not isinstance(additional, (bool, dict)):
            raise SchemaError("'additionalProperties' must be a schema", _pointer(path))
        lo = _count(schema, "minProperties", path, 0)
        hi = _count(schema, "maxProperties", path, None)
        if not (props or patterns or required) and additional is True and lo == 0 and hi is None:
            return self.prim("object")
        declared = list(props) + [r for r in required if r not in props]
        members = []
        for name in declared:
            # keys named only by `required` are declared too: strict mode leaves them open
            sub = _property_schema(name, props, patterns, True if closed_by_default else additional)
            where = path + (("properties", name) if name in props else ("required",))
            value = self.visit(sub, where, frozenset())
            if value is None:
                if name in required:
                    return None
                continue
            key = gbnf_literal(json.dumps(name, ensure_ascii=False))
            members.append((self.rules.add(_hint(where) + "-kv", f'{key} ":" {self.prim("ws")} {value}'),
                            name in required))
        extra = self._extra_members(declared, patterns, additional, path)
        return _Sequence(self, _hint(path), "{", "}").object(members, extra, lo, hi)

    def _extra_members(self, declared: list, patterns: dict, additional, path: tuple) -> str | None:
        """One rule for any key/value pair beyond the declared keys."""
        ws = self.prim("ws")
        alternatives = []
        for pattern, value_schema in patterns.items():
            others = tuple(p for p in patterns if p != pattern)
            where = path + ("patternProperties", pattern)
            key = self._key_rule((pattern,), tuple(declared), others, where)
            value = self.visit(value_schema, where, frozenset())
            if key is not None and value is not None:
                alternatives.append(f'{key} ":" {ws} {value}')
        if additional is not False:
            value = self.visit(additional, path + ("additionalProperties",), frozenset())
            key = self._key_rule((), tuple(declared), tuple(patterns), path)
            if key is not None and value is not None:
                alternatives.append(f'{key} ":" {ws} {value}')
        if not alternatives:
            return None
        return self.rules.add(_hint(path) + "-extra", " | ".join(alternatives))

    def _key_rule(self, patterns: tuple, excluded: tuple, excluded_patterns: tuple, path: tuple):
        """A key (quoted) matching the patterns but none of the excluded names or patterns."""
        if not excluded_patterns and not patterns:
            if not excluded:
                return self.prim("string")
            if max(map(len, excluded)) <= _MAX_TRIE_DEPTH:
                return self.rules.add(_hint(path) + "-key", self._key_not_in(excluded))
        if len(patterns) == 1 and not excluded and not excluded_patterns:
            body = self._pattern_string(patterns[0], 0, None)
            return None if body is None else self.rules.add(_hint(path) + "-key", body)
        return self._dfa_string(patterns, tuple(sorted(excluded)), excluded_patterns, 0, None,
                                _hint(path) + "-key", path)

    def _key_not_in(self, names) -> str:
        """Any key but `names`, as a trie of the names with an exit at every node (each
        character written one way, so an escaped spelling of a name cannot get through)."""
        trie: dict = {}
        for name in names:
            node = trie
            for ch in name:
                node = node.setdefault(ch, {})
            node[""] = {}
        quote = '"\\""'

        def rest(node) -> str:
            options = [] if "" in node else [quote]
            children = sorted(c for c in node if c and _contains(ENCODABLE, ord(c)))
            for c in children:
                options.append(f"{_encode_in_string(((ord(c), ord(c)),))} {rest(node[c])}")
            others = _minus(ENCODABLE, [(ord(c), ord(c)) for c in children])
            options.append(f'{_encode_in_string(others)} {self.prim("text-char")}* {quote}')
            return _group(options)

        return f"{quote} {rest(trie)}"

    # -- arrays ------------------------------------------------------------------------

    def _array(self, schema: dict, path: tuple) -> str | None:
        items = schema.get("items", _ABSENT)
        if isinstance(items, list):                         # draft 4-2019 tuple form
            prefix, rest, rest_key = items, schema.get("additionalItems", _ABSENT), "additionalItems"
        else:
            prefix, rest, rest_key = schema.get("prefixItems", []), items, "items"
        if not isinstance(prefix, list):
            raise SchemaError("'prefixItems' must be a list", _pointer(path))
        if rest is _ABSENT:
            rest = not (self.strict and prefix)
        lo = _count(schema, "minItems", path, 0)
        hi = _count(schema, "maxItems", path, None)
        unique = schema.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise SchemaError("'uniqueItems' must be a boolean", _pointer(path))
        if unique and (hi is None or hi > 1):
            raise SchemaError("unsupported keyword 'uniqueItems' (true, with maxItems above 1)",
                              _pointer(path + ("uniqueItems",)))
        if not prefix and rest is True and lo == 0 and hi is None:
            return self.prim("array")
        items = [self.visit(p, path + ("prefixItems", str(i)), frozenset()) for i, p in enumerate(prefix)]
        extra = self.visit(rest, path + (rest_key,), frozenset())
        return _Sequence(self, _hint(path), "[", "]").array(items, extra, lo, hi)

    # -- strings -----------------------------------------------------------------------

    def _string(self, schema: dict, path: tuple) -> str | None:
        lo = _count(schema, "minLength", path, 0)
        hi = _count(schema, "maxLength", path, None)
        if hi is not None and hi < lo:
            return None
        patterns = []
        if "pattern" in schema:
            patterns.append(schema["pattern"])
        patterns += schema.get(_PATTERNS, [])
        for i, p in enumerate(patterns):
            self._check_pattern(p, path + ("pattern",))
        patterns += [STRING_FORMATS[f] for f in self._formats(schema, path) if f in STRING_FORMATS]
        hi = None if hi is None else min(hi, MAX_REPEAT)          # narrower: still sound
        if not patterns:
            if lo == 0 and hi is None:
                return self.prim("string")
            chars = gbnf_repeat(self.prim("char"), lo, hi)
            return '"\\"" ' + chars + ' "\\""' if chars else '"\\"\\""'
        if len(set(patterns)) == 1:
            body = self._pattern_string(patterns[0], lo, hi)
            if body is not _ABSENT:
                return body
        return self._dfa_string(tuple(dict.fromkeys(patterns)), (), (), lo, hi, _hint(path) + "-str", path)

    def _pattern_string(self, pattern: str, lo: int, hi: int | None):
        """A pattern string written structurally (tree-shaped: cheap for the engine).
        Length bounds the pattern does not imply are met exactly by one counted repetition
        when the pattern allows (^[a-z][a-z0-9_]*$), else by a small automaton, else by
        capping every repetition alike (narrower than the schema: sound). _ABSENT: only
        the automaton route can do it."""
        ast = _length_bounded_ast(pattern, lo, hi)
        if ast is None or ast is _ABSENT:
            return ast
        return f'"\\"" {self._string_ast(ast)} "\\""'

    def _string_ast(self, node) -> str:
        """GBNF for the JSON text of the characters a regex AST matches."""
        if isinstance(node, _Chars):
            return self.prim("text-char") if node.ranges == ENCODABLE else _encode_in_string(node.ranges)
        if isinstance(node, _Alt):
            return "( " + " | ".join(self._string_ast(o) for o in node.options) + " )"
        if isinstance(node, _Repeat):
            inner = self._string_ast(node.node)
            if isinstance(node.node, _Seq):
                inner = f"( {inner} )"
            return gbnf_repeat(inner, node.lo, node.hi) or '""'
        out, run = [], []
        for item in _flatten_seq(node.items):
            text = _single_encoding(item)
            if text is not None:
                run.append(text)
                continue
            if run:
                out.append(gbnf_literal("".join(run)))
                run = []
            out.append(self._string_ast(item))
        if run:
            out.append(gbnf_literal("".join(run)))
        return " ".join(out) if out else '""'

    def _check_pattern(self, pattern, path: tuple):
        if not isinstance(pattern, str):
            raise SchemaError("a pattern must be a string", _pointer(path))
        try:
            _pattern_nfa(pattern)
        except _RegexError as e:
            raise SchemaError(f"pattern {pattern!r}: unsupported regex feature: {e}", _pointer(path)) from None

    def _formats(self, schema: dict, path: tuple) -> list[str]:
        formats = ([schema["format"]] if "format" in schema else []) + list(schema.get(_FORMATS, []))
        for f in formats:
            if f not in STRING_FORMATS and f not in NUMERIC_FORMATS:
                raise SchemaError(f"unsupported format {f!r}", _pointer(path + ("format",)))
        return formats

    def _dfa_string(self, patterns, excluded, excluded_patterns, lo, hi, hint, path):
        """A JSON string (quotes included) drawn from a DFA; one rule per state."""
        key = (patterns, excluded, excluded_patterns, lo, hi)
        if key not in self.dfas:
            try:
                dfa = _string_dfa(patterns, excluded, excluded_patterns, lo, hi)
            except _RegexError as e:
                raise SchemaError(f"pattern/format too complex: {e}", _pointer(path)) from None
            self.dfas[key] = None if dfa is None else self._emit_dfa(dfa, hint)
        return self.dfas[key]

    def _emit_dfa(self, dfa: _DFA, hint: str) -> str:
        quote = '"\\""'
        terminal = [acc and not out for acc, out in zip(dfa.accepting, dfa.trans)]
        names = {s: self.rules.reserve(f"{hint}-{s}") for s in range(len(dfa.trans)) if not terminal[s]}
        for s, name in names.items():
            alternatives = []
            for target, ranges in _group_atoms(dfa, s):
                encoded = _encode_in_string(ranges)
                alternatives.append(f"{encoded} {quote if terminal[target] else names[target]}")
            if dfa.accepting[s]:
                alternatives.append(quote)
            self.rules.define(name, " | ".join(alternatives))
        if terminal[dfa.start]:
            return '"\\"\\""'
        return self.rules.add(hint, f"{quote} {names[dfa.start]}")

    # -- numbers -----------------------------------------------------------------------

    def _integer(self, schema: dict, path: tuple) -> str | None:
        lo, hi = _integer_bounds(schema, self._formats(schema, path), path)
        if lo is None and hi is None:
            return self.prim("integer")
        return _range_gbnf(None if lo is None else Decimal(lo), None if hi is None else Decimal(hi), 0, INT_DIGITS)

    def _number(self, schema: dict, path: tuple) -> str | None:
        lo, hi = _number_bounds(schema, self._formats(schema, path), path)
        if lo is None and hi is None and not (set(schema) & NUMBER_KEYWORDS) \
                and not any(NUMERIC_FORMATS.get(f) for f in self._formats(schema, path)):
            return self.prim("number")
        return _range_gbnf(lo, hi, FRAC_DIGITS, NUM_INT_DIGITS)


class _Sequence:
    """Comma-separated members between brackets, built as (position, count, first) states,
    one rule each, so the grammar stays linear in the members and deterministic at every
    key. Objects: declared members (required or optional) in order, then any number of
    `extra` pairs, with the member count in [lo, hi]. Arrays: prefix items by position,
    then `extra` items, length in [lo, hi]."""

    def __init__(self, conv: _Converter, hint: str, open_: str, close: str):
        self.conv, self.hint = conv, hint
        self.open, self.close = gbnf_literal(open_), gbnf_literal(close)
        self.ws = conv.prim("ws")
        self.memo: dict = {}

    def object(self, members: list, extra, lo: int, hi: int | None) -> str | None:
        self._limits(lo, hi, extra)
        if self.hi is not None and extra is None and self.hi >= len(members):
            self.hi = None                           # cannot be exceeded
        if self.lo <= sum(req for _, req in members):
            self.lo = 0                              # always met
        if self.hi is not None and self.hi < self.lo:
            return None
        self.members, self.cap = members, self.hi if self.hi is not None else self.lo
        return self._wrap(*self._object_rest(0, 0, True))

    def array(self, items: list, extra, lo: int, hi: int | None) -> str | None:
        self._limits(lo, hi, extra)
        if self.hi is not None and self.hi < self.lo:
            return None
        self.items = items
        return self._wrap(*self._array_rest(0, True))

    def _limits(self, lo: int, hi: int | None, extra):
        if lo > MAX_REPEAT:
            raise SchemaError(f"minimum count {lo} is above the grammar limit {MAX_REPEAT}")
        self.lo, self.extra = lo, extra
        self.hi = None if hi is None else min(hi, MAX_REPEAT)   # narrower: still sound

    def _wrap(self, ne: str | None, may_be_empty: bool) -> str | None:
        if ne is None:
            return f"{self.open} {self.ws} {self.close}" if may_be_empty else None
        inner = f"( {ne} {self.ws} )?" if may_be_empty else f"{ne} {self.ws}"
        return f"{self.open} {self.ws} {inner} {self.close}"

    def _object_rest(self, i0: int, count0: int, first0: bool):
        """(non-empty continuation or None, whether it may stop here) for members i0.. ;
        states reachable from (i0, count0, first0) are found going forward, then
        evaluated from the last member back (no recursion: member lists can be long)."""
        levels = [{(count0, first0)}]
        for i in range(i0, len(self.members)):
            nxt = set()
            for count, first in levels[-1]:
                if self.hi is None or count < self.hi:
                    nxt.add((min(count + 1, self.cap), False))
                if not self.members[i][1]:
                    nxt.add((count, first))
            levels.append(nxt)
        for i in range(len(self.members), i0 - 1, -1):
            for count, first in levels[i - i0]:
                self.memo[(i, count, first)] = self._object_state(i, count, first)
        return self.memo[(i0, count0, first0)]

    def _object_state(self, i: int, count: int, first: bool):
        if i == len(self.members):
            ne, stop = self._extras(count, first)
        else:
            rule, required = self.members[i]
            take = None
            if self.hi is None or count < self.hi:
                take = self._then(first, rule, self.memo[(i + 1, min(count + 1, self.cap), False)])
            if required:
                ne, stop = take, False
            else:
                skip, stop = self.memo[(i + 1, count, first)]
                ne = _union(take, skip)
        return self._named(ne, i), stop

    def _array_rest(self, i0: int, first0: bool):
        """Like _object_rest; for arrays the position is the count."""
        last = len(self.items)
        for i in range(last, i0 - 1, -1):
            first = first0 and i == i0
            stop = i >= self.lo
            if self.hi is not None and i >= self.hi:
                ne = None
            elif i == last:
                ne, stop = self._extras(i, first)
            else:
                rule = self.items[i]
                ne = None if rule is None else self._then(first, rule, self.memo[(i + 1, False)])
            self.memo[(i, first)] = (self._named(ne, i), stop)
        return self.memo[(i0, first0)]

    def _then(self, first: bool, rule: str, rest) -> str | None:
        ne, may_stop = rest
        if ne is None and not may_stop:
            return None
        head = rule if first else f'"," {self.ws} {rule}'
        if ne is None:
            return head
        return f"{head} {ne}?" if may_stop else f"{head} {ne}"

    def _extras(self, count: int, first: bool):
        need = max(0, self.lo - count)
        room = None if self.hi is None else self.hi - count
        if self.extra is None or room == 0:
            return None, need == 0
        item = f'( "," {self.ws} {self.extra} )'
        if first:
            more = gbnf_repeat(item, max(need, 1) - 1, None if room is None else room - 1)
            ne = self.extra + (f" {more}" if more else "")
        else:
            ne = gbnf_repeat(item, max(need, 1), room)
        return ne, need == 0

    def _named(self, expr: str | None, i: int) -> str | None:
        if expr is None or " " not in expr:
            return expr
        return self.conv.rules.add(f"{self.hint}-{i}", expr)


def _union(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return a if b is None else b
    return f"{a} | {b}"


def _group_atoms(dfa: _DFA, state: int):
    """(target, ranges) for the transitions of a state, adjacent atoms merged."""
    by_target: dict = {}
    for a, t in sorted(dfa.trans[state].items()):
        by_target.setdefault(t, []).append(dfa.atoms[a])
    return [(t, _ranges(r)) for t, r in by_target.items()]


def _single_encoding(item) -> str | None:
    """The JSON text of a one-character item that has exactly one way to be written."""
    if not (isinstance(item, _Chars) and len(item.ranges) == 1 and item.ranges[0][0] == item.ranges[0][1]):
        return None
    cp = item.ranges[0][0]
    if cp == 0x2F:
        return None                                   # "/" or "\/"
    return chr(cp) if _contains(RAW_IN_STRING, cp) else SHORT_ESCAPES.get(cp)


@lru_cache(maxsize=1024)
def _pattern_ast(pattern: str):
    """The pattern as an AST over string characters, search padding made explicit
    (None: it matches no string)."""
    pad = _Repeat(_Chars(ENCODABLE), 0, None)
    options = []
    for body, anchored_start, anchored_end in _anchored_branches(_RegexParser(pattern).parse()):
        items = ([] if anchored_start else [pad]) + [body] + ([] if anchored_end else [pad])
        options.append(_Seq(tuple(items)))
    return _restrict(options[0] if len(options) == 1 else _Alt(tuple(options)), ENCODABLE)


def _restrict(node, alphabet):
    """node with every character set cut to alphabet; None if it can then match nothing."""
    if isinstance(node, _Chars):
        r = _intersect(node.ranges, alphabet)
        return _Chars(r) if r else None
    if isinstance(node, _Seq):
        items = [_restrict(i, alphabet) for i in node.items]
        return None if any(i is None for i in items) else _Seq(tuple(items))
    if isinstance(node, _Alt):
        options = [o for o in (_restrict(o, alphabet) for o in node.options) if o is not None]
        return None if not options else options[0] if len(options) == 1 else _Alt(tuple(options))
    inner = _restrict(node.node, alphabet)
    if inner is None:
        return _Seq(()) if node.lo == 0 else None
    return _Repeat(inner, node.lo, node.hi)


def _ast_lengths(node) -> tuple[int, int | None]:
    """Shortest and longest match (None: unbounded)."""
    if isinstance(node, _Chars):
        return 1, 1
    if isinstance(node, (_Seq, _Alt)):
        parts = [_ast_lengths(i) for i in (node.items if isinstance(node, _Seq) else node.options)]
        if not parts:
            return 0, 0
        longs = [b for _, b in parts]
        if isinstance(node, _Seq):
            return sum(a for a, _ in parts), None if None in longs else sum(longs)
        return min(a for a, _ in parts), None if None in longs else max(longs)
    a, b = _ast_lengths(node.node)
    if b == 0:
        return 0, 0
    return node.lo * a, None if node.hi is None or b is None else node.hi * b


def _capped(node, cap: int):
    """Every repetition limited to max(lo, cap) times."""
    if isinstance(node, _Chars):
        return node
    if isinstance(node, _Seq):
        return _Seq(tuple(_capped(i, cap) for i in node.items))
    if isinstance(node, _Alt):
        return _Alt(tuple(_capped(o, cap) for o in node.options))
    hi = max(node.lo, cap) if node.hi is None else min(node.hi, max(node.lo, cap))
    return _Repeat(_capped(node.node, cap), node.lo, hi)


@lru_cache(maxsize=1024)
def _length_bounded_ast(pattern: str, lo: int, hi: int | None):
    """The pattern's AST meeting the length bounds (see _pattern_string); None: no string
    fits; _ABSENT: needs the automaton."""
    ast = _pattern_ast(pattern)
    if ast is None:
        return None
    shortest, longest = _ast_lengths(ast)
    if shortest >= lo and (hi is None or (longest is not None and longest <= hi)):
        return ast
    exact = _exact_length(ast, lo, hi)
    if exact is _NOTHING:
        return None
    if exact is not None:
        return exact
    if _small_product(pattern, lo, hi) or shortest < lo:
        return _ABSENT
    return _cap_lengths(ast, hi) or _ABSENT


_NOTHING = object()


def _exact_length(ast, lo: int, hi: int | None):
    """When one repetition of a fixed-width item carries all the variable length (everything
    else fixed), the length bounds become bounds on its count: exact. None otherwise;
    _NOTHING when no count fits."""
    items = list(_flatten_seq(ast.items)) if isinstance(ast, _Seq) else [ast]
    spans = [_ast_lengths(i) for i in items]
    variable = [k for k, (a, b) in enumerate(spans) if a != b]
    if len(variable) != 1 or not isinstance(items[variable[0]], _Repeat):
        return None
    rep = items[variable[0]]
    width, width_max = _ast_lengths(rep.node)
    if width != width_max or width == 0:
        return None
    fixed = sum(a for k, (a, _) in enumerate(spans) if k != variable[0])
    count_lo = max(rep.lo, -(-(lo - fixed) // width))
    count_hi = rep.hi if hi is None else (hi - fixed) // width if rep.hi is None else min(rep.hi, (hi - fixed) // width)
    if count_hi is not None and count_hi < count_lo:
        return _NOTHING
    items[variable[0]] = _Repeat(rep.node, count_lo, count_hi)
    return _Seq(tuple(items))


def _small_product(pattern: str, lo: int, hi: int | None) -> bool:
    """Whether the exact pattern x length automaton stays small."""
    try:
        base = _language_dfa((pattern,), (), ())
    except _RegexError:
        return False
    count = hi if hi is not None else lo
    return base is not None and len(base.trans) * (count + 1) <= SMALL_PRODUCT_STATES


def _cap_lengths(ast, limit: int):
    """A narrower AST whose longest match is <= limit: the largest uniform repetition cap
    that fits (exact when one repetition carries all the variable length). None if even
    the minimal repetitions are too long."""
    if _ast_lengths(_capped(ast, 0))[1] > limit:
        return None
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _ast_lengths(_capped(ast, mid))[1] <= limit:
            lo = mid
        else:
            hi = mid - 1
    return _capped(ast, lo)


def _property_schema(name: str, props: dict, patterns: dict, additional):
    """What the value of key `name` must satisfy (properties + matching patternProperties,
    else additionalProperties)."""
    parts = [props[name]] if name in props else []
    parts += [s for p, s in patterns.items() if _pattern_matches(p, name)]
    if not parts:
        parts = [additional]
    return parts[0] if len(parts) == 1 else {"allOf": parts}


def _pattern_matches(pattern: str, text: str) -> bool:
    """ECMA reading, by our automaton (linear time: a hostile pattern cannot stall it)."""
    try:
        return _pattern_nfa(pattern).matches(text)
    except _RegexError as e:
        raise SchemaError(f"pattern {pattern!r}: unsupported regex feature: {e}") from None


# ---------------------------------------------------------------------------------------
# allOf merging.

class _Merger:
    """Flattens allOf/$ref into one schema; anyOf/oneOf inside are distributed."""

    def __init__(self, conv: _Converter, path: tuple):
        self.conv, self.path = conv, path

    def merge(self, schemas: list):
        parts, choices = [], []
        for s in schemas:
            if self._flatten(s, parts, choices, ()) is False:
                return False
        if choices:
            combos = list(itertools.islice(itertools.product(*choices), MAX_ANYOF_PRODUCT + 1))
            if len(combos) > MAX_ANYOF_PRODUCT:
                raise SchemaError(f"allOf of anyOf/oneOf expands to more than {MAX_ANYOF_PRODUCT} branches",
                                  _pointer(self.path))
            return {"anyOf": [{"allOf": parts + list(c)} for c in combos]}
        return self._combine(parts)

    def _flatten(self, schema, parts: list, choices: list, refs: tuple):
        if schema is True:
            return True
        if schema is False:
            return False
        if not isinstance(schema, dict):
            raise SchemaError("allOf entries must be schemas", _pointer(self.path))
        schema = self.conv._checked(schema, self.path)
        rest = _constraints(schema)
        if "$ref" in rest:
            ref = rest.pop("$ref")
            if ref in refs:
                raise SchemaError(f"$ref {ref!r} includes itself through allOf", _pointer(self.path))
            target, _ = self.conv.resolve(ref, self.path)
            if self._flatten(target, parts, choices, refs + (ref,)) is False:
                return False
        for sub in rest.pop("allOf", []):
            if self._flatten(sub, parts, choices, refs) is False:
                return False
        for key in ("anyOf", "oneOf"):
            if key in rest:
                branches = rest.pop(key)
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(f"'{key}' must be a non-empty list", _pointer(self.path))
                choices.append(branches)
        if rest:
            parts.append(rest)
        return True

    def _combine(self, parts: list):
        out: dict = {}
        for part in parts:
            for key, value in part.items():
                if key in OBJECT_KEYWORDS - {"minProperties", "maxProperties", "required"} \
                        or key in ("items", "prefixItems", "additionalItems"):
                    continue
                if key not in out:
                    out[key] = value
                elif self._merge_value(out, key, value) is False:
                    return False
        self._merge_objects(parts, out)
        self._merge_arrays(parts, out)
        return self._fold_lists(out)

    def _merge_value(self, out: dict, key: str, value):
        old = out[key]
        if key in ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum"):
            out[key] = max(old, value)
        elif key in ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum"):
            out[key] = min(old, value)
        elif key == "type":
            return self._merge_types(out, old, value)
        elif key == "required":
            out[key] = list(dict.fromkeys(list(old) + list(value)))
        elif key == "enum":
            out[key] = [v for v in old if any(_json_equal(v, w) for w in value)]
        elif key == "const":
            if not _json_equal(old, value):
                return False
        elif key == "uniqueItems":
            out[key] = bool(old or value)
        elif key in ("pattern", "format"):
            internal = _PATTERNS if key == "pattern" else _FORMATS
            if old != value:
                out.setdefault(internal, []).append(value)
        elif key in (_PATTERNS, _FORMATS):
            out[key] = list(old) + list(value)
        else:
            raise SchemaError(f"cannot merge '{key}' in allOf", _pointer(self.path))
        return True

    def _merge_types(self, out: dict, old, value):
        a = {old} if isinstance(old, str) else set(old)
        b = {value} if isinstance(value, str) else set(value)
        both = (a & b) | ({"integer"} if ("integer" in a and "number" in b)
                          or ("number" in a and "integer" in b) else set())
        if not both:
            return False
        out["type"] = [t for t in TYPE_NAMES if t in both]
        return True

    def _merge_objects(self, parts: list, out: dict):
        shaped = [p for p in parts if {"properties", "patternProperties", "additionalProperties"} & set(p)]
        if not shaped:
            return
        with_patterns = [p for p in shaped if p.get("patternProperties")]
        if len({_canonical(p["patternProperties"]) for p in with_patterns}) > 1:
            raise SchemaError("allOf with different patternProperties in more than one branch",
                              _pointer(self.path))
        names = list(dict.fromkeys(n for p in shaped for n in p.get("properties", {})))
        props = {}
        for name in names:
            needs = []
            for p in shaped:
                if name in p.get("properties", {}) or p.get("patternProperties") \
                        or "additionalProperties" in p:
                    needs.append(_property_schema(name, p.get("properties", {}),
                                                  p.get("patternProperties", {}),
                                                  p.get("additionalProperties", True)))
            props[name] = needs[0] if len(needs) == 1 else {"allOf": needs}
        out["properties"] = props
        extras = [p["additionalProperties"] for p in shaped
                  if "additionalProperties" in p and not p.get("patternProperties")]
        if with_patterns:
            own = with_patterns[0].get("additionalProperties", _ABSENT)
            out["patternProperties"] = {pat: _all(s, *extras) for pat, s in
                                        with_patterns[0]["patternProperties"].items()}
            if own is not _ABSENT:
                extras.append(own)
        if extras:
            out["additionalProperties"] = _all(*extras)

    def _merge_arrays(self, parts: list, out: dict):
        shaped = []
        for p in parts:
            items = p.get("items", _ABSENT)
            if isinstance(items, list):
                shaped.append((items, p.get("additionalItems", _ABSENT)))
            elif "prefixItems" in p or "items" in p:
                shaped.append((p.get("prefixItems", []), items))
        if not shaped:
            return
        length = max(len(prefix) for prefix, _ in shaped)
        prefix = []
        for i in range(length):
            needs = [pre[i] if i < len(pre) else rest for pre, rest in shaped
                     if i < len(pre) or rest is not _ABSENT]
            prefix.append(_all(*needs))
        rests = [rest for _, rest in shaped if rest is not _ABSENT]
        if prefix:
            out["prefixItems"] = prefix
        if rests:
            out["items"] = _all(*rests)

    def _fold_lists(self, out: dict):
        if "pattern" in out and _PATTERNS in out:
            out[_PATTERNS] = [p for p in out[_PATTERNS] if p != out["pattern"]]
        if "format" in out and _FORMATS in out:
            out[_FORMATS] = [f for f in out[_FORMATS] if f != out["format"]]
        if "const" in out:
            out["enum"] = [v for v in out.get("enum", [out["const"]]) if _json_equal(v, out["const"])]
            del out["const"]
        return out


def _all(*schemas):
    schemas = [s for s in schemas if s is not True]
    if not schemas:
        return True
    return schemas[0] if len(schemas) == 1 else {"allOf": list(schemas)}


# ---------------------------------------------------------------------------------------
# Bounds.

def _number(value, key: str, path: tuple):
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and math.isnan(value)):
        raise SchemaError(f"'{key}' must be a number", _pointer(path + (key,)))
    return value


def _shortest(x) -> Decimal:
    return Decimal(x) if isinstance(x, int) else Decimal(repr(float(x)))


def _integer_bounds(schema: dict, formats: list, path: tuple):
    """Closed integer bounds; float bounds are compared exactly (binary value and shortest
    decimal agree on which integers pass)."""
    lo = hi = None
    for key, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
        if key in schema:
            v = _number(schema[key], key, path)
            if math.isinf(v):
                if v > 0:
                    return 1, 0
                continue
            edge = max(Decimal(v), _shortest(v))
            b = int(edge.to_integral_value(ROUND_FLOOR)) + 1 if exclusive \
                else int(edge.to_integral_value(ROUND_CEILING))
            lo = b if lo is None else max(lo, b)
    for key, exclusive in (("maximum", False), ("exclusiveMaximum", True)):
        if key in schema:
            v = _number(schema[key], key, path)
            if math.isinf(v):
                if v < 0:
                    return 1, 0
                continue
            edge = min(Decimal(v), _shortest(v))
            b = int(edge.to_integral_value(ROUND_CEILING)) - 1 if exclusive \
                else int(edge.to_integral_value(ROUND_FLOOR))
            hi = b if hi is None else min(hi, b)
    for f in formats:
        if NUMERIC_FORMATS.get(f):
            flo, fhi = NUMERIC_FORMATS[f]
            lo, hi = max(lo, flo) if lo is not None else flo, min(hi, fhi) if hi is not None else fhi
    return lo, hi


def _number_bounds(schema: dict, formats: list, path: tuple):
    """Closed bounds on the 10**-FRAC_DIGITS grid such that every grid value inside
    satisfies the schema's bounds exactly and after rounding to a double."""
    limit = 10 ** NUM_INT_DIGITS
    lo = hi = None
    with localcontext() as ctx:
        ctx.prec = 80
        for key, sign in (("minimum", 1), ("exclusiveMinimum", 1), ("maximum", -1), ("exclusiveMaximum", -1)):
            if key not in schema:
                continue
            v = _number(schema[key], key, path)
            if (v >= limit and sign > 0) or (v <= -limit and sign < 0):
                return Decimal(1), Decimal(0)               # no value in the notation
            if (v <= -limit and sign > 0) or (v >= limit and sign < 0):
                continue                                     # no constraint in the notation
            if key.startswith("exclusive"):
                v = math.nextafter(float(v), math.inf * sign)
            edge = _shortest(v).scaleb(FRAC_DIGITS)
            edge = edge.to_integral_value(ROUND_CEILING if sign > 0 else ROUND_FLOOR).scaleb(-FRAC_DIGITS)
            if sign > 0:
                lo = edge if lo is None else max(lo, edge)
            else:
                hi = edge if hi is None else min(hi, edge)
    for f in formats:
        if NUMERIC_FORMATS.get(f):
            flo, fhi = NUMERIC_FORMATS[f]
            lo = Decimal(flo) if lo is None else max(lo, Decimal(flo))
            hi = Decimal(fhi) if hi is None else min(hi, Decimal(fhi))
    return lo, hi


# ---------------------------------------------------------------------------------------
# Small helpers.

def _count(schema: dict, key: str, path: tuple, default):
    if key not in schema:
        return default
    v = schema[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SchemaError(f"'{key}' must be a non-negative integer", _pointer(path + (key,)))
    return v


def _dict_of_schemas(schema: dict, key: str, path: tuple) -> dict:
    value = schema.get(key, {})
    if not isinstance(value, dict):
        raise SchemaError(f"'{key}' must be an object", _pointer(path + (key,)))
    return value


def _string_list(schema: dict, key: str, path: tuple) -> list:
    value = schema.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SchemaError(f"'{key}' must be a list of strings", _pointer(path + (key,)))
    return list(dict.fromkeys(value))


def _unescape_pointer(part: str) -> str:
    from urllib.parse import unquote
    return unquote(part).replace("~1", "/").replace("~0", "~")


def _pointer(path: tuple) -> str:
    text = "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)
    return text if len(text) <= 160 else "#/..." + text[-150:]


_SKIP_IN_HINT = {"properties", "$defs", "definitions", "allOf", "required", "patternProperties"}


def _hint(path: tuple) -> str:
    """A readable rule name from the last meaningful parts of a schema path."""
    words = []
    for i, part in enumerate(path):
        if part in _SKIP_IN_HINT and (i + 1 < len(path) or part == "required"):
            continue
        words.append({"items": "item", "prefixItems": "tuple", "additionalProperties": "extra",
                      "additionalItems": "item"}.get(part, part))
    text = "-".join(words[-2:]) or "root"
    return re.sub(r"[^A-Za-z0-9-]+", "-", text).strip("-").lower()[:40] or "r"


# ---------------------------------------------------------------------------------------
# Public API.

def _check_root(root: str):
    if not isinstance(root, str) or not re.fullmatch(r"[A-Za-z0-9-]+", root):
        raise SchemaError(f"root rule name {root!r} must be letters, digits and '-'")


def schema_to_gbnf(schema: dict | bool, *, root: str = "root", strict: bool = True) -> str:
    """GBNF text whose rule `root` accepts JSON texts valid against `schema` (see the
    module docstring for the accepted subset). Raises SchemaError."""
    _check_root(root)
    return _Converter(schema, strict, root).convert()


def json_object_gbnf(*, root: str = "root") -> str:
    """Any JSON object (response_format json_object)."""
    _check_root(root)
    return _Converter({"type": "object"}, False, root).convert()


def json_value_gbnf(*, root: str = "root") -> str:
    """Any JSON value."""
    _check_root(root)
    return _Converter(True, False, root).convert()
