"""JSON Schema -> GBNF: every keyword, the bench/schemas corpus, and property tests.

Grammars are checked with a small independent GBNF recognizer written here (memoized
end-position sets; slow, simple), and with ember.gbnf's own matcher when it is there.
Validity is judged by the `jsonschema` package (with format checking) plus exact checks
written here for formats jsonschema leaves unchecked.
"""
from __future__ import annotations

import datetime
import json
import re
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ember.gbnf.schema import (
    SchemaError,
    json_object_gbnf,
    json_value_gbnf,
    schema_to_gbnf,
)

jsonschema = pytest.importorskip("jsonschema")

CORPUS = Path(__file__).resolve().parent.parent / "bench" / "schemas"
sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))


# ---------------------------------------------------------------------------------------
# An independent GBNF recognizer.

def _parse_gbnf(text: str) -> dict:
    rules = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        if not line.strip():
            continue
        name, body = line.split("::=", 1)
        parser = _BodyParser(body)
        rules[name.strip()] = parser.alternatives()
        assert parser.i == len(parser.s), f"trailing text in rule {name}: {parser.s[parser.i:]!r}"
    return rules


class _BodyParser:
    """alternatives := seq ('|' seq)*; seq := (atom quantifier?)*. Nodes are tuples."""

    def __init__(self, s: str):
        self.s, self.i = s, 0

    def _skip(self):
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1

    def alternatives(self):
        options = [self.sequence()]
        self._skip()
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            options.append(self.sequence())
            self._skip()
        return ("alt", tuple(options))

    def sequence(self):
        items = []
        while True:
            self._skip()
            if self.i >= len(self.s) or self.s[self.i] in "|)":
                return tuple(items)
            atom = self.atom()
            lo, hi = self.quantifier()
            items.append((atom, lo, hi))

    def atom(self):
        c = self.s[self.i]
        if c == '"':
            self.i += 1
            out = []
            while self.s[self.i] != '"':
                out.append(self.char())
            self.i += 1
            return ("lit", "".join(out))
        if c == "[":
            self.i += 1
            negated = self.s[self.i] == "^"
            self.i += negated
            ranges = []
            while self.s[self.i] != "]":
                lo = self.char()
                hi = lo
                if self.s[self.i] == "-" and self.s[self.i + 1] != "]":
                    self.i += 1
                    hi = self.char()
                ranges.append((ord(lo), ord(hi)))
            self.i += 1
            return ("cls", tuple(ranges), negated)
        if c == "(":
            self.i += 1
            alt = self.alternatives()
            assert self.s[self.i] == ")"
            self.i += 1
            return ("group", alt)
        if c == ".":
            self.i += 1
            return ("cls", (), True)
        m = re.compile(r"[A-Za-z0-9-]+").match(self.s, self.i)
        assert m, f"bad atom at {self.s[self.i:]!r}"
        self.i = m.end()
        return ("ref", m.group(0))

    def char(self) -> str:
        c = self.s[self.i]
        if c != "\\":
            self.i += 1
            return c
        e = self.s[self.i + 1]
        self.i += 2
        if e in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[e]
            cp = int(self.s[self.i:self.i + n], 16)
            self.i += n
            return chr(cp)
        return {"n": "\n", "r": "\r", "t": "\t"}.get(e, e)

    def quantifier(self):
        if self.i >= len(self.s):
            return 1, 1
        c = self.s[self.i]
        if c in "*+?":
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        m = re.compile(r"\{(\d+)(,(\d*))?\}").match(self.s, self.i)
        if not m:
            return 1, 1
        self.i = m.end()
        lo = int(m.group(1))
        return lo, lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)


class Recognizer:
    """Does rule `root` derive exactly `text`? Memoized sets of end positions."""

    def __init__(self, gbnf: str, root: str = "root"):
        self.rules, self.root = _parse_gbnf(gbnf), root
        for name, body in self.rules.items():
            for ref in _refs(body):
                assert ref in self.rules, f"rule {name} uses undefined {ref}"

    def accepts(self, text: str) -> bool:
        self.s, self.memo, self.active = text, {}, set()
        return len(text) in self._rule(self.root, 0)

    def _rule(self, name: str, pos: int) -> frozenset:
        key = (name, pos)
        if key not in self.memo:
            assert key not in self.active, f"left recursion through {name}"
            self.active.add(key)
            self.memo[key] = self._alt(self.rules[name], pos)
            self.active.discard(key)
        return self.memo[key]

    def _alt(self, alt, pos: int) -> frozenset:
        out = set()
        for seq in alt[1]:
            positions = {pos}
            for item in seq:
                positions = {e for p in positions for e in self._item(item, p)}
                if not positions:
                    break
            out |= positions
        return frozenset(out)

    def _item(self, item, pos: int) -> set:
        atom, lo, hi = item
        reached, frontier, out, k = {pos}, {pos}, set(), 0
        if lo == 0:
            out.add(pos)
        while frontier and (hi is None or k < hi):
            k += 1
            frontier = {e for p in frontier for e in self._atom(atom, p)}
            if hi is None:
                frontier -= reached
                reached |= frontier
            if k >= lo:
                out |= frontier
        return out

    def _atom(self, atom, pos: int):
        kind = atom[0]
        if kind == "lit":
            return {pos + len(atom[1])} if self.s.startswith(atom[1], pos) else set()
        if kind == "cls":
            if pos >= len(self.s):
                return set()
            cp = ord(self.s[pos])
            inside = any(lo <= cp <= hi for lo, hi in atom[1])
            return {pos + 1} if inside != atom[2] else set()
        if kind == "ref":
            return self._rule(atom[1], pos)
        return self._alt(atom[1], pos)


def _refs(node):
    if node[0] == "alt":
        for seq in node[1]:
            for atom, _, _ in seq:
                yield from _refs(atom)
    elif node[0] == "ref":
        yield node[1]
    elif node[0] == "group":
        yield from _refs(node[1])


_ENGINE: dict = {}


def _engine():
    """ember.gbnf's parser and matcher over a 256-token byte vocabulary, when available."""
    if "vocab" not in _ENGINE:
        try:
            from ember.gbnf import Grammar, TokenVocab
            _ENGINE["grammar"], _ENGINE["vocab"] = Grammar, TokenVocab([bytes([b]) for b in range(256)])
        except ImportError:
            _ENGINE["vocab"] = None
    return _ENGINE["vocab"]


def engine_accepts(gbnf: str, text: str) -> bool | None:
    vocab = _engine()
    if vocab is None:
        return None
    matcher = _ENGINE["grammar"].parse(gbnf).compile(vocab).matcher()
    return matcher.accept_bytes(text.encode()) and matcher.can_end


class Checker:
    """A schema's grammar, with the recognizer and (when present) the engine."""

    def __init__(self, schema, strict: bool = True):
        self.schema = schema
        self.gbnf = schema_to_gbnf(schema, strict=strict)
        self.recognizer = Recognizer(self.gbnf)

    def accepts(self, text: str) -> bool:
        ours = self.recognizer.accepts(text)
        theirs = engine_accepts(self.gbnf, text)
        assert theirs is None or theirs == ours, f"engine {theirs} vs recognizer {ours} on {text!r}"
        return ours

    def accepts_value(self, value) -> bool:
        return self.accepts(compact(value))


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def layouts(value) -> list[str]:
    return [compact(value), json.dumps(value, ensure_ascii=False),
            json.dumps(value, ensure_ascii=False, indent=2)]


# ---------------------------------------------------------------------------------------
# Validity oracle.

_FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
_TIME = re.compile(r"^(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d+)?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)$")


def _strict_format_checker():
    checker = jsonschema.FormatChecker()
    checker.checkers = dict(_FORMAT_CHECKER.checkers)

    @checker.checks("date", raises=ValueError)
    def is_date(v):
        return not isinstance(v, str) or (re.fullmatch(r"\d{4}-\d{2}-\d{2}", v) is not None
                                          and datetime.date.fromisoformat(v) is not None)

    @checker.checks("time")
    def is_time(v):
        return not isinstance(v, str) or _TIME.match(v) is not None

    @checker.checks("date-time", raises=ValueError)
    def is_date_time(v):
        if not isinstance(v, str) or "T" not in v:
            return not isinstance(v, str)
        d, t = v.split("T", 1)
        return is_date(d) and is_time(t)

    @checker.checks("uri")
    def is_uri(v):
        return not isinstance(v, str) or _is_uri(v)

    @checker.checks("uuid", raises=ValueError)
    def is_uuid(v):
        return not isinstance(v, str) or (len(v) == 36 and uuid.UUID(v) is not None)

    return checker


FORMATS = _strict_format_checker()
_PCT = re.compile(r"%(?![0-9A-Fa-f]{2})")


_URI_PLAIN = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=%")


def _is_uri(v: str) -> bool:
    """RFC 3986 URI without IP-literal hosts, checked piecewise (independently of the grammar)."""
    m = re.fullmatch(r"([A-Za-z][A-Za-z0-9+.-]*):([^#?]*)(\?[^#]*)?(#.*)?", v, re.DOTALL)
    if not m or _PCT.search(v):
        return False
    hier, query, fragment = m.group(2), (m.group(3) or "?")[1:], (m.group(4) or "#")[1:]
    if not set(query + fragment) <= _URI_PLAIN | set(":@/?"):
        return False
    path = hier
    if hier.startswith("//"):
        authority, slash, rest = hier[2:].partition("/")
        path = slash + rest
        userinfo, _, hostport = authority.rpartition("@")
        host, _, port = hostport.partition(":")
        if not set(userinfo) <= _URI_PLAIN | {":"} or not set(host) <= _URI_PLAIN \
                or not set(port) <= set("0123456789"):
            return False
    return set(path) <= _URI_PLAIN | set(":@/")


def valid(schema, value) -> bool:
    cls = jsonschema.validators.validator_for(schema if isinstance(schema, dict) else {},
                                              default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=FORMATS).is_valid(value)


def closed(schema, strict=True):
    """The schema with strict mode's defaults made explicit, for jsonschema to judge: objects
    declaring properties get additionalProperties false, tuples get items false; an allOf is
    closed as a whole (unevaluatedProperties), its branches and the $defs they use are not."""
    if not strict or not isinstance(schema, dict):
        return schema
    in_all_of = {b["$ref"] for b in _subschemas(schema) if isinstance(b, dict) and "$ref" in b
                 and b.get("_in_all_of")}
    in_all_of |= {ref for s in _subschemas(schema) if isinstance(s, dict)
                  for b in s.get("allOf", []) if isinstance(b, dict) for ref in [b.get("$ref")] if ref}
    return _close(schema, in_all_of, "#", True)


def _subschemas(schema):
    todo = [schema]
    while todo:
        s = todo.pop()
        yield s
        if isinstance(s, dict):
            todo.extend(v for v in s.values() if isinstance(v, (dict, list)))
        elif isinstance(s, list):
            todo.extend(s)


def _close(s, keep_open: set, path: str, close_top: bool):
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k in ("properties", "patternProperties"):
            out[k] = {n: _close(sub, keep_open, f"{path}/{k}/{n}", True) for n, sub in v.items()}
        elif k in ("$defs", "definitions"):
            out[k] = {n: _close(sub, keep_open, f"#/{k}/{n}", f"#/{k}/{n}" not in keep_open) for n, sub in v.items()}
        elif k in ("items", "additionalProperties", "additionalItems") and isinstance(v, dict):
            out[k] = _close(v, keep_open, path, True)
        elif k in ("anyOf", "oneOf", "prefixItems"):
            out[k] = [_close(b, keep_open, path, True) for b in v]
        elif k == "allOf":
            out[k] = [_close(b, keep_open, path, False) for b in v]
        else:
            out[k] = v
    if close_top and "additionalProperties" not in out:
        if "allOf" in out:
            out["unevaluatedProperties"] = False
        elif "properties" in out or "patternProperties" in out:
            out["additionalProperties"] = False
    if close_top and "prefixItems" in out and "items" not in out:
        out["items"] = False
    return out


# ---------------------------------------------------------------------------------------
# The corpus.

def corpus_names() -> list[str]:
    return sorted(p.name[:-5] for p in CORPUS.glob("*.json")
                  if not p.name.endswith((".examples.json", ".invalid.json")))


def corpus(name: str):
    schema = json.loads((CORPUS / f"{name}.json").read_text())
    examples = json.loads((CORPUS / f"{name}.examples.json").read_text())
    invalid_path = CORPUS / f"{name}.invalid.json"
    invalid = json.loads(invalid_path.read_text()) if invalid_path.exists() else []
    return schema, examples, invalid


def test_corpus_is_big_enough():
    names = corpus_names()
    assert len(names) >= 30
    for name in names:
        _, examples, invalid = corpus(name)
        assert len(examples) >= 2, name
        assert invalid, name


@pytest.mark.parametrize("name", corpus_names())
def test_corpus_schema(name):
    schema, examples, invalid = corpus(name)
    checker = Checker(schema)
    for value in examples:
        assert valid(schema, value), f"{name}: example is not valid: {value}"
        for text in layouts(value):
            assert checker.accepts(text), f"{name}: grammar rejects {text}"
    for value in invalid:
        assert not valid(closed(schema), value), f"{name}: 'invalid' example is valid: {value}"
        assert not checker.accepts_value(value), f"{name}: grammar accepts invalid {value}"


@pytest.mark.parametrize("name", corpus_names())
def test_corpus_mutations_never_accepted_when_invalid(name):
    """Soundness on near misses: any mutation the grammar accepts must be valid."""
    schema, examples, _ = corpus(name)
    checker = Checker(schema)
    strict_schema = closed(schema)
    for value in examples:
        for mutant in _mutations(value):
            if checker.accepts_value(mutant):
                assert valid(strict_schema, mutant), f"{name}: grammar accepts invalid {mutant}"


def _mutations(value, depth=0):
    """Values one edit away: drop/add a key, change a scalar, drop/duplicate an item."""
    yield from _scalar_mutations(value)
    if depth > 3:
        return
    if isinstance(value, dict):
        for k in value:
            yield {kk: vv for kk, vv in value.items() if kk != k}
            for m in _mutations(value[k], depth + 1):
                yield {**value, k: m}
        yield {**value, "unexpected": 1}
    elif isinstance(value, list):
        for i in range(len(value)):
            yield value[:i] + value[i + 1:]
            for m in _mutations(value[i], depth + 1):
                yield value[:i] + [m] + value[i + 1:]
        yield value + value[-1:]
        yield value + value


def _scalar_mutations(value):
    if isinstance(value, bool):
        yield not value
        yield 1
    elif isinstance(value, (int, float)):
        for v in (value + 1, value - 1, -value, value * 1000, value + 0.5, str(value), None):
            yield v
    elif isinstance(value, str):
        for v in ("", value + "x", value[:-1], value.upper(), value + "\n", "a" * 300, 1):
            yield v
    elif value is None:
        yield 0


# ---------------------------------------------------------------------------------------
# Keywords one by one.

def check(schema, good, bad, strict=True):
    checker = Checker(schema, strict=strict)
    for v in good:
        for text in layouts(v):
            assert checker.accepts(text), f"rejects {text!r}\n{checker.gbnf}"
    for v in bad:
        text = v if isinstance(v, str) and v.startswith("RAW:") else None
        accepted = checker.accepts(text[4:]) if text else checker.accepts_value(v)
        assert not accepted, f"accepts {v!r}\n{checker.gbnf}"
    return checker


def test_type_keywords():
    check({"type": "string"}, ["", "a\"b\\c\n\u00e9\U0001F600"], [1, None, "RAW:'x'"])
    check({"type": "integer"}, [0, -5, 1234567890123456], [1.5, "1", True, "RAW:01", "RAW:-0.0", "RAW:1e3"])
    check({"type": "number"}, [0, -1.5, 1e-7, 12.25, 3e20], ["1", "RAW:.5", "RAW:1.", "RAW:NaN"])
    check({"type": "boolean"}, [True, False], [0, "true"])
    check({"type": "null"}, [None], [0, "null", False])
    check({"type": ["string", "null"]}, ["x", None], [1, False])
    check({"type": ["integer", "number"]}, [1, 1.5], ["1"])
    check({"type": "array"}, [[], [1, "a", None, [], {}]], [{}, "[]"])
    check({"type": "object"}, [{}, {"a": [1, {"b": None}]}], [[], "{}"])
    check({}, [1, "x", None, [], {"a": 1}], ["RAW:", "RAW: 1", "RAW:1 "])
    check(True, [1, "x"], [])


def test_string_escapes_and_lengths():
    c = check({"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "abc", "\U0001F600\u00e9"],
              ["a", "abcd", ""])
    assert c.accepts('"\\ud83d\\ude00x"')                       # a surrogate pair is one char
    assert not c.accepts('"\\ud83d\\ude00"')
    assert not c.accepts('"\\ud83dx"')                           # lone surrogate
    assert c.accepts('"\\u00e9\\/"') and c.accepts('"\\n\\t\\""')
    assert not c.accepts('"a\nb"')                               # raw control character
    assert not c.accepts('"\\x41b"') and not c.accepts('"\\ab"')
    check({"type": "string", "maxLength": 0}, [""], ["a"])
    with pytest.raises(SchemaError, match="no value"):
        schema_to_gbnf({"type": "string", "minLength": 3, "maxLength": 2})


def test_enum_and_const():
    check({"enum": ["a", 1, None, True, [1, 2], {"k": "v"}, "q\"uote", "é"]},
          ["a", 1, None, True, [1, 2], {"k": "v"}, "q\"uote", "é"], ["b", 2, False, [1], {}])
    check({"const": {"x": [1, "y"]}}, [{"x": [1, "y"]}], [{"x": [1]}, {}])
    check({"type": "string", "enum": ["a", 1, "b"]}, ["a", "b"], [1])
    check({"type": "integer", "enum": [1, 1.0, 2.5, True]}, [1, 1.0], [2.5, True])
    with pytest.raises(SchemaError, match="no value"):
        schema_to_gbnf({"type": "string", "enum": [1, 2]})
    with pytest.raises(SchemaError, match="minLength"):
        schema_to_gbnf({"enum": ["a"], "minLength": 2})


def test_object_required_optional_order_and_strict():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                               "c": {"type": "boolean"}}, "required": ["b"]}
    c = check(schema, [{"b": "x"}, {"a": 1, "b": "x"}, {"b": "x", "c": True}, {"a": 1, "b": "", "c": False}],
              [{}, {"a": 1}, {"b": "x", "d": 1}, {"b": 1}])
    assert not c.accepts('{"b":"x","a":1}')                      # schema order only
    assert not c.accepts('{"a":1,"a":1,"b":"x"}')
    assert not c.accepts('{"b":"x",}') and not c.accepts('{,"b":"x"}')
    assert c.accepts('{ "a" : 1, "b": "x" }') is False           # no space before ':'
    loose = check(schema, [{"b": "x", "d": [1]}, {"b": "x", "zz": None, "yy": {}}], [{"b": "x", "a": 1, "c": 1}],
                  strict=False)
    assert not loose.accepts('{"b":"x","a":1}')
    assert not loose.accepts('{"b":"x","b":"y"}')                # extra keys exclude declared ones
    assert not loose.accepts('{"b":"x","\\u0061":"y"}')          # escaped duplicate of "a"
    check({"type": "object", "properties": {}, "additionalProperties": False}, [{}], [{"a": 1}])
    check({"type": "object", "required": ["id"]}, [{"id": 1}, {"id": "x", "more": 2}], [{}, {"more": 2}])
    check({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},
          [{"a": 1, "b": 2}], [{"a": 1}, {"b": 2}])


def test_additional_and_pattern_properties():
    check({"type": "object", "additionalProperties": {"type": "integer"}},
          [{}, {"x": 1, "y": 2}], [{"x": "s"}])
    check({"type": "object", "properties": {"id": {"type": "string"}},
           "additionalProperties": {"type": "number"}},
          [{"id": "a"}, {"id": "a", "w": 1.5}, {"w": 2}], [{"id": 1}, {"id": "a", "w": "x"}, {"id": "a", "id2": "x"}])
    schema = {"type": "object", "patternProperties": {"^x-": {"type": "string"}, "^n_": {"type": "integer"}},
              "additionalProperties": False}
    check(schema, [{}, {"x-a": "s", "n_b": 3}, {"n_1": 1, "x-z": "t"}],
              [{"x-a": 1}, {"n_b": "s"}, {"other": 1}])
    schema = {"type": "object", "properties": {"x-fixed": {"type": "string", "maxLength": 2}},
              "patternProperties": {"^x-": {"type": "string", "minLength": 1}}}
    check(schema, [{"x-fixed": "ab"}, {"x-fixed": "a", "x-more": "z"}], [{"x-fixed": ""}, {"x-more": ""}, {"y": "s"}])


def test_min_max_properties():
    schema = {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "minProperties": 1,
              "maxProperties": 2}
    check(schema, [{"a": 1}, {"b": 1, "c": 2}], [{}, {"a": 1, "b": 2, "c": 3}])
    check({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2, "maxProperties": 3},
          [{"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}], [{}, {"a": 1}, {"a": 1, "b": 2, "c": 3, "d": 4}])
    check({"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": True,
           "maxProperties": 2}, [{"a": 1}, {"a": 1, "z": 2}], [{"a": 1, "y": 1, "z": 2}])


def test_arrays():
    check({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
          [[1], [1, 2, 3]], [[], [1, 2, 3, 4], ["a"]])
    check({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
          [[], ["a"], ["a", 1]], [[1], ["a", 1, 2], ["a", "b"]])
    check({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "boolean"}, "minItems": 2},
          [["a", True], ["a", True, False]], [["a"], [], ["a", 1]])
    check({"type": "array", "prefixItems": [{"type": "string"}]}, [["a"], ["a", 1, None]], [[1]], strict=False)
    check({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, [[], [1]], [[1, 2]])
    check({"type": "array", "items": False}, [[]], [[1]])
    check({"type": "array", "uniqueItems": True, "maxItems": 1}, [[], [1]], [[1, 2]])
    with pytest.raises(SchemaError, match="uniqueItems"):
        schema_to_gbnf({"type": "array", "uniqueItems": True})
    check({"type": "array", "uniqueItems": False}, [[1, 1]], [])


def test_integer_bounds():
    check({"type": "integer", "minimum": -5, "maximum": 130},
          [-5, -1, 0, 9, 10, 99, 100, 130], [-6, 131, 1000, -10, 5.0])
    check({"type": "integer", "exclusiveMinimum": 0}, [1, 10 ** 15], [0, -1])
    check({"type": "integer", "exclusiveMaximum": -3}, [-4, -1000], [-3, 0])
    check({"type": "integer", "minimum": 1.5, "maximum": 3.9}, [2, 3], [1, 4])
    check({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, [1], [0])        # draft 4
    check({"type": "integer", "format": "int32"}, [2 ** 31 - 1, -2 ** 31], [2 ** 31, -2 ** 31 - 1])
    with pytest.raises(SchemaError, match="no value"):
        schema_to_gbnf({"type": "integer", "minimum": 5, "maximum": 4})
    with pytest.raises(SchemaError, match="no value"):
        schema_to_gbnf({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2})


def test_number_bounds():
    c = check({"type": "number", "minimum": 1.5}, [1.5, 2, 2.0, 1.75, 1e5], [1.4999, -2, 0])
    assert c.accepts("1.50") and c.accepts("15") and not c.accepts("1e3") and not c.accepts("15e-1")
    assert not c.accepts("-0") and not c.accepts("01.5")
    c = check({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, [1, 0.5, 0.999], [0, 1.0001, -0.5, 1e-15])
    assert not c.accepts("0.0") and not c.accepts("-0.1") and not c.accepts("0.0000000000000001")
    assert c.accepts("0.000000000000001") and c.accepts("1.000")
    c = check({"type": "number", "minimum": -273.15, "exclusiveMaximum": 1000}, [-273.15, 0, 999.99, -0.5],
              [-273.16, 1000, 1000.5])
    assert not c.accepts("-0") and not c.accepts("-0.0") and c.accepts("0.0")
    check({"type": "number", "maximum": -0.5}, [-0.5, -1, -100.25], [-0.49, 0])
    check({"type": "number", "minimum": 0.1, "maximum": 0.1}, [0.1], [0.11, 0.09])


def test_string_formats():
    check({"type": "string", "format": "date"}, ["2024-02-29", "2000-02-29", "1999-12-31", "0001-01-01"],
              ["2023-02-29", "1900-02-29", "2024-04-31", "2024-13-01", "0000-01-01", "24-01-01", "2024-1-1"])
    check({"type": "string", "format": "time"}, ["23:59:59Z", "00:00:00.123+05:30", "12:00:00-08:00"],
          ["24:00:00Z", "12:00:00", "12:60:00Z", "12:00:00.Z"])
    check({"type": "string", "format": "date-time"}, ["2024-01-31T10:00:00Z", "2024-02-29T00:00:00.5-01:00"],
          ["2024-01-31 10:00:00Z", "2024-01-32T10:00:00Z"])
    check({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"],
          ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"])
    check({"type": "string", "format": "email"}, ["a.b+c@example.co.uk", "x_y@mail-1.io"],
          ["a@b", "@x.com", "a..b@x.com", "a@-x.com", "a b@x.com", "a@x.com."])
    check({"type": "string", "format": "uri"},
          ["https://example.com/a/b?x=1&y=%20#frag", "mailto:a@b.c", "urn:isbn:0451450523", "file:///tmp/x",
           "http://user:pw@[host]".replace("[host]", "h") + ":8080/"],
          ["example.com", "http://a b", "1http://x", "http://x/%zz", "://x"])
    check({"type": "string", "format": "ipv4"}, ["192.168.0.1", "0.0.0.0", "255.255.255.255"],
          ["256.0.0.1", "01.2.3.4", "1.2.3"])
    check({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
          ["https://api.example.com/v1/items?page=2&sort=" + "x" * 100 + "#top"], ["", "x"])
    check({"type": "string", "format": "email", "maxLength": 254}, ["first.last@mail.example.com"], [])
    # a small maxLength on a many-part format caps every part alike: narrow, but sound
    check({"type": "string", "format": "uri", "maxLength": 40}, ["a:b", "ab:c?d#e"],
          ["https://example.com/" + "a" * 21, "https://ex.com/a?b=c"])
    with pytest.raises(SchemaError, match="format 'color'"):
        schema_to_gbnf({"type": "string", "format": "color"})
    check({"type": ["integer", "string"], "format": "date"}, [5, "2024-01-01"], ["x"])


def test_patterns():
    check({"type": "string", "pattern": "^[A-Z]{3}$"}, ["ABC"], ["AB", "ABCD", "abc"])
    check({"type": "string", "pattern": "abc"}, ["abc", "xxabcyy", "\nabc\""], ["ab", "acb"])
    check({"type": "string", "pattern": "^\\+[1-9][0-9]{7,14}$"}, ["+14155552671"], ["14155552671", "+0123456789"])
    check({"type": "string", "pattern": "^(?:foo|bar)+\\d?$"}, ["foo", "barfoo7"], ["fo", "foo77"])
    check({"type": "string", "pattern": "^a|b$"}, ["a", "ax", "b", "xb"], ["x", "ba"])
    check({"type": "string", "pattern": "^[^\"\\\\]*$"}, ["plain"], ["a\"b", "a\\b"])
    check({"type": "string", "pattern": "^.$"}, ["\u00e9", "\""], ["\n", "ab"])
    check({"type": "string", "pattern": "^\\s\\S\\w\\W\\D$"}, [" a_!x"], ["  _!x"])
    check({"type": "string", "pattern": "^[\\w.-]+$", "maxLength": 5}, ["a.b-c", "x"], ["", "a.b-cd", "a b"])
    check({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, ["abc"], ["ab", "abC"])
    check({"type": "string", "pattern": "^x", "format": "email"}, ["x@y.z"], ["y@x.z"])
    check({"type": "string", "pattern": "^(?<year>\\d{4})-\\d{2}$"}, ["2024-05"], ["2024-5"])
    check({"type": "string", "pattern": "^a*?b+?c??$"}, ["b", "aabbc"], ["ac"])
    check({"type": "string", "pattern": "^\\x41\\u00e9\\t\\/\\.$"}, ["A\u00e9\t/."], ["A\u00e9\t/x"])
    c = check({"type": "string", "pattern": "^[a/]$"}, ["a", "/"], ["b"])
    assert c.accepts('"\\/"')
    for bad, word in [("(?=a)", "lookaround"), ("a\\1", "backreference"), ("\\bword", "word boundary"),
                      ("a^b", "inside"), ("\\p{L}", "Unicode property"), ("a{2", "quantifier"),
                      ("(a", "unterminated group"), ("[a", "unterminated character class"), ("*a", "repeat"),
                      ("[z-a]", "out of order"), ("a{3,1}", "out of order"), ("\\q", "unknown escape")]:
        with pytest.raises(SchemaError, match=re.escape(word)):
            schema_to_gbnf({"type": "string", "pattern": bad})
    check({"type": "string", "pattern": "^(a|b)*a(a|b){14}$"}, ["a" * 15, "b" + "a" * 15], ["b" * 15])
    with pytest.raises(SchemaError, match="too complex"):          # intersections need the automaton
        schema_to_gbnf({"allOf": [{"type": "string", "pattern": "^(a|b)*a(a|b){14}$"}, {"pattern": "^b"}]})


def test_any_one_all_of():
    check({"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 5}]}, ["x", 5], [4, None])
    check({"oneOf": [{"type": "string"}, {"type": "null"}]}, ["x", None], [1])
    check({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
           "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
          [{"a": 1}, {"b": 2}, {"a": 1, "b": 2}], [{}])
    schema = {"allOf": [{"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
                        {"properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]},
                        {"properties": {"n": {"maximum": 10}}}]}
    check(schema, [{"id": "x", "n": 0}, {"id": "x", "n": 10}], [{"id": "x"}, {"id": "x", "n": 11}, {"n": 1}])
    check({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "z$"}, {"maxLength": 3}]},
          ["az", "abz"], ["a", "abcz", "bz"])
    check({"allOf": [{"type": ["integer", "string"]}, {"type": "number", "maximum": 3}]}, [3, -1], [4, "a"])
    check({"allOf": [{"enum": [1, 2, 3]}, {"enum": [2, 3, 4]}, {"const": 3}]}, [3], [2, 4])
    check({"allOf": [{"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}},
                     {"maxItems": 2, "items": {"maxLength": 1}}]},
          [[1], [1, "a"]], [[1, "ab"], [1, "a", "b"], ["a"]])
    check({"allOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                     {"properties": {"b": {}}}]}, [{}, {"a": 1}], [{"b": 1}])
    check({"allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, {"anyOf": [{"type": "string"},
                                                                                        {"type": "null"}]}]},
          ["s"], [1, None])
    with pytest.raises(SchemaError, match="no value"):
        schema_to_gbnf({"allOf": [{"type": "string"}, {"type": "integer"}]})


def test_refs_and_recursion():
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"]}}, "$ref": "#/$defs/node"}
    check(tree, [{"value": 1}, {"value": 1, "children": [{"value": 2, "children": []}]}],
          [{"value": 1, "children": [{}]}, {"children": []}])
    check({"definitions": {"a~b/c": {"type": "string"}}, "type": "array",
           "items": {"$ref": "#/definitions/a~0b~1c"}}, [["x"]], [[1]])
    check({"type": "object", "properties": {"self": {"$ref": "#"}, "n": {"type": "integer"}}},
          [{}, {"self": {"self": {"n": 1}}}], [{"self": 1}])
    check({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, ["ab"], ["abc"])
    expr = {"$defs": {"e": {"anyOf": [{"type": "number"}, {"type": "array", "prefixItems": [
        {"enum": ["+", "*"]}, {"$ref": "#/$defs/e"}, {"$ref": "#/$defs/e"}], "minItems": 3}]}},
        "$ref": "#/$defs/e"}
    check(expr, [1, ["+", 1, ["*", 2, 3]]], [["+", 1], ["-", 1, 2]])
    for bad, word in [({"$ref": "#"}, "cycle"), ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
                                                 "$ref": "#/$defs/a"}, "cycle"),
                      ({"$ref": "http://x/y.json"}, "local"), ({"$ref": "#/$defs/missing"}, "does not resolve"),
                      ({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, "itself")]:
        with pytest.raises(SchemaError, match=word):
            schema_to_gbnf(bad)


def test_unsupported_keywords_are_named():
    for kw, value in [("not", {}), ("if", {}), ("multipleOf", 2), ("contains", {}), ("propertyNames", {}),
                      ("dependentRequired", {}), ("unevaluatedProperties", False), ("nullable", True),
                      ("$dynamicRef", "#x"), ("minContains", 1)]:
        with pytest.raises(SchemaError, match=re.escape(f"'{kw}'")):
            schema_to_gbnf({"type": "object", "properties": {"a": {"type": "string", kw: value}}})
    with pytest.raises(SchemaError, match=re.escape("#/properties/a/not")):
        schema_to_gbnf({"type": "object", "properties": {"a": {"not": {}}}})
    # annotations are fine
    schema_to_gbnf({"title": "t", "description": "d", "examples": [1], "default": 1, "$comment": "c",
                    "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "x", "readOnly": True,
                    "deprecated": False, "x-vendor": 1, "type": "integer"})


def test_bad_values_give_clear_errors():
    for schema, word in [({"type": "strin"}, "unknown type"), ({"type": "string", "minLength": -1}, "minLength"),
                         ({"properties": []}, "properties"), ({"required": "a"}, "required"),
                         ({"enum": 3}, "enum"), ({"minimum": "3"}, "minimum"), (3, "schema must be"),
                         ({"anyOf": []}, "anyOf"), ({"const": float("nan")}, "not JSON"),
                         ({"type": "string", "pattern": 5}, "pattern")]:
        with pytest.raises(SchemaError, match=word):
            schema_to_gbnf(schema)
    deep = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaError, match="nested deeper"):
        schema_to_gbnf(deep)
    with pytest.raises(SchemaError, match="root rule name"):
        schema_to_gbnf({}, root="my root")


@pytest.mark.parametrize("schema, where, word", [
    ({"type": "string", "format": ["date"]}, "#/format", "unsupported format"),
    ({"anyOf": [{"format": {}}]}, "#/anyOf/0/format", "unsupported format"),
    ({"allOf": 5}, "#", "'allOf' must be a list"),
    ({"allOf": {}}, "#", "'allOf' must be a list"),
    ({"allOf": [{"minLength": "a"}, {"minLength": 2}]}, "#/allOf/minLength", "non-negative integer"),
    ({"allOf": [{"minimum": 1}, {"minimum": [0]}]}, "#/allOf/minimum", "must be a number"),
    ({"allOf": [{"required": 5}, {"required": ["a"]}]}, "#/allOf/required", "list of strings"),
    ({"allOf": [{"enum": 5}, {"enum": [1]}]}, "#/allOf/enum", "must be a list"),
    ({"allOf": [{"const": 1, "enum": 5}]}, "#/allOf/enum", "must be a list"),
    ({"allOf": [{"type": 5}, {"type": "string"}]}, "#/allOf/type", "type name"),
    ({"allOf": [{"type": [[1]]}, {"type": "string"}]}, "#/allOf/type", "type name"),
    ({"allOf": [{"properties": ["a"]}, {"properties": {"a": {}}}]}, "#/allOf/properties", "must be an object"),
    ({"properties": {"a": {}}, "allOf": [{"patternProperties": 3}]}, "#/allOf/patternProperties", "object"),
    ({"allOf": [{"prefixItems": 3}, {"items": {}}]}, "#/allOf", "'prefixItems' must be a list"),
    ({"type": "string", "ember:patterns": 5}, "#/ember:patterns", "must be a list"),
    ({"allOf": [{"pattern": "a", "ember:patterns": "b"}]}, "#/allOf/ember:patterns", "must be a list"),
])
def test_malformed_values_inside_allof_and_formats_are_schema_errors(schema, where, word):
    """Values that merging or format lookup cannot read are named, never a TypeError."""
    with pytest.raises(SchemaError, match=re.escape(word)) as e:
        schema_to_gbnf(schema)
    assert e.value.path == where


def test_root_name_and_rule_names_are_gbnf_words():
    gbnf = schema_to_gbnf({"type": "object", "properties": {"we ird/ name": {"type": "string"}}}, root="top")
    assert gbnf.startswith("top ::= ")
    for line in gbnf.splitlines():
        assert re.fullmatch(r"[a-z0-9-]+ ::= .+", line), line
    assert Recognizer(gbnf, root="top").accepts('{"we ird/ name":"x"}')


def test_whitespace_is_bounded():
    c = Checker({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}})
    assert c.accepts('{\n  "a": [\n    1,\n    2\n  ]\n}')
    assert c.accepts('{ "a": [ 1, 2 ] }')
    assert not c.accepts('{  "a": [1]}')                          # two spaces
    assert not c.accepts('{"a" : [1]}')                           # space before ':'
    assert not c.accepts('{"a": [1 , 2]}')                        # space before ','
    assert not c.accepts("{\n" + " " * 33 + '"a": []}')
    assert c.accepts("{\n" + "\t" * 32 + '"a": []}')
    assert not c.accepts(' {"a": []}') and not c.accepts('{"a": []}\n')


def test_json_object_grammar():
    r = Recognizer(json_object_gbnf())
    for v in [{}, {"a": [1, 2.5, -3e-7, True, None, "s\u00e9", {"b": {}}]}]:
        for text in layouts(v):
            assert r.accepts(text)
    for text in ["[]", "1", '"x"', "{", '{"a":}', "{'a':1}", '{"a":1,}', "null"]:
        assert not r.accepts(text)
    v = Recognizer(json_value_gbnf())
    assert all(v.accepts(t) for t in ["[]", "1", '"x"', "null", "{}"])


# ---------------------------------------------------------------------------------------
# Property tests: grammar acceptance == validity.

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_small_decimals = st.decimals(min_value=-1000, max_value=1000, places=3, allow_nan=False, allow_infinity=False)


def _probe_texts(d: Decimal, integer: bool) -> list[str]:
    """Texts in the notation bounded numbers use: no exponent, never '-0'."""
    texts = [str(int(d))] if d == d.to_integral_value() else []
    if not integer:
        texts.append(format(d, "f"))
    return [t for t in texts if not (t.startswith("-") and Decimal(t) == 0)]


@SETTINGS
@given(lo=st.one_of(st.none(), _small_decimals), hi=st.one_of(st.none(), _small_decimals),
       lo_open=st.booleans(), hi_open=st.booleans(), integer=st.booleans(),
       probes=st.lists(_small_decimals, min_size=1, max_size=12))
def test_property_numeric_bounds(lo, hi, lo_open, hi_open, integer, probes):
    schema = {"type": "integer" if integer else "number"}
    for bound, is_open, names in ((lo, lo_open, ("minimum", "exclusiveMinimum")),
                                  (hi, hi_open, ("maximum", "exclusiveMaximum"))):
        if bound is not None:
            schema[names[is_open]] = float(bound) if bound != bound.to_integral_value() else int(bound)
    try:
        checker = Checker(schema)
    except SchemaError as e:
        assert "no value" in str(e)
        assume(False)
    for d in probes + [x for x in (lo, hi) if x is not None]:
        for text in _probe_texts(d, integer):
            assert checker.accepts(text) == valid(schema, json.loads(text)), (schema, text, checker.gbnf)


@SETTINGS
@given(digits=st.text("0123456789", min_size=1, max_size=20), frac=st.text("0123456789", max_size=20),
       neg=st.booleans(), lo=st.floats(-1e6, 1e6), span=st.floats(0, 1e6), lo_open=st.booleans(),
       hi_open=st.booleans())
def test_property_number_bounds_sound_for_any_digits(digits, frac, neg, lo, span, lo_open, hi_open):
    """Every accepted text satisfies the bounds exactly and as a double, whatever its length."""
    hi = lo + span
    schema = {"type": "number", ("exclusiveMinimum" if lo_open else "minimum"): lo,
              ("exclusiveMaximum" if hi_open else "maximum"): hi}
    try:
        checker = Checker(schema)
    except SchemaError:
        assume(False)
    text = ("-" if neg else "") + digits + ("." + frac if frac else "")
    if checker.accepts(text):
        exact, double = Decimal(text), float(text)
        assert (exact > Decimal(repr(lo)) if lo_open else exact >= Decimal(repr(lo))), text
        assert (exact < Decimal(repr(hi)) if hi_open else exact <= Decimal(repr(hi))), text
        assert (double > lo if lo_open else double >= lo) and (double < hi if hi_open else double <= hi), text
        assert valid(schema, json.loads(text))


PATTERNS = ["^[a-c]+$", "ab", "^a.c", "b*$", "^(ab|ba){1,3}$", "^[^a]*a[^a]*$", "^\\d{2,3}-?x?$",
            "(?:ca|ab)c", "^.{2}$", "^[\\w\"\\\\]+\\s$", "^$", "a|^b|c$"]


@SETTINGS
@given(pattern=st.sampled_from(PATTERNS), lengths=st.tuples(st.integers(0, 4), st.one_of(st.none(), st.integers(0, 6))),
       texts=st.lists(st.text("abcx1- \"\\\t", max_size=8), min_size=1, max_size=8))
def test_property_pattern_strings(pattern, lengths, texts):
    schema = {"type": "string", "pattern": pattern, "minLength": lengths[0]}
    if lengths[1] is not None:
        schema["maxLength"] = lengths[1]
    try:
        checker = Checker(schema)
    except SchemaError as e:
        assert "no value" in str(e)
        assume(False)
    for text in texts:
        assert checker.accepts_value(text) == valid(schema, text), (schema, text, checker.gbnf)


CAPPED_PATTERNS = ["^(ab|c)*d(e|fg)*$", "a(bc)*", "^([a-c]+-)*[a-c]+$", "^\\d+(\\.\\d+)?[a-c]*$", "x|^y+$"]


@SETTINGS
@given(pattern=st.sampled_from(CAPPED_PATTERNS), hi=st.integers(1, 9),
       texts=st.lists(st.text("abcdefg-.12xy", max_size=10), min_size=1, max_size=8))
def test_property_pattern_strings_capped(pattern, hi, texts):
    """With the exact automaton route disabled, capped repetitions stay sound."""
    from ember.gbnf.schema import patterns as module
    schema = {"type": "string", "pattern": pattern, "maxLength": hi}
    with mock.patch.object(module, "SMALL_PRODUCT_STATES", 0):
        try:
            checker = Checker(schema)
        except SchemaError as e:
            assert "no value" in str(e)
            assume(False)
    for text in texts:
        if checker.accepts_value(text):
            assert valid(schema, text), (schema, text, checker.gbnf)


_values = st.sampled_from([None, True, 0, -3, 7, 2.5, "", "s", "x-y", [], [1], {"k": 1}])


@SETTINGS
@given(data=st.data(), strict=st.booleans(), extra=st.sampled_from(["absent", True, False, {"type": "integer"}]),
       counts=st.tuples(st.integers(0, 3), st.one_of(st.none(), st.integers(0, 4))))
def test_property_objects(data, strict, extra, counts):
    props = {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": ["null", "boolean"]},
             "d": {"type": "array", "items": {"type": "integer"}, "maxItems": 1}}
    required = data.draw(st.lists(st.sampled_from(list(props)), unique=True, max_size=3))
    schema = {"type": "object", "properties": props, "required": required, "minProperties": counts[0]}
    if counts[1] is not None:
        schema["maxProperties"] = counts[1]
    if extra != "absent":
        schema["additionalProperties"] = extra
    try:
        checker = Checker(schema, strict=strict)
    except SchemaError as e:
        assert "no value" in str(e)
        assume(False)
    oracle = closed(schema, strict)
    for _ in range(6):
        keys = data.draw(st.lists(st.sampled_from(list(props)), unique=True, max_size=4))
        value = {k: data.draw(_values) for k in props if k in keys}
        for k in data.draw(st.lists(st.sampled_from(["e", "f", "x-y"]), unique=True, max_size=2)):
            value[k] = data.draw(_values)
        assert checker.accepts_value(value) == valid(oracle, value), (schema, value, checker.gbnf)


@SETTINGS
@given(data=st.data(), strict=st.booleans(), rest=st.sampled_from(["absent", False, {"type": "string"}]),
       counts=st.tuples(st.integers(0, 3), st.one_of(st.none(), st.integers(0, 4))))
def test_property_arrays(data, strict, rest, counts):
    prefix = data.draw(st.lists(st.sampled_from([{"type": "integer"}, {"type": "string"}, {"enum": [None, 0]}]),
                                max_size=3))
    schema = {"type": "array", "minItems": counts[0]}
    if prefix:
        schema["prefixItems"] = prefix
    if rest != "absent":
        schema["items"] = rest
    if counts[1] is not None:
        schema["maxItems"] = counts[1]
    try:
        checker = Checker(schema, strict=strict)
    except SchemaError as e:
        assert "no value" in str(e)
        assume(False)
    oracle = closed(schema, strict)
    for _ in range(6):
        value = data.draw(st.lists(st.sampled_from([0, 5, "s", None, True]), max_size=6))
        assert checker.accepts_value(value) == valid(oracle, value), (schema, value, checker.gbnf)


_json = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 15, 10 ** 15)
                     | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=8)


@SETTINGS
@given(value=_json)
def test_property_generic_json(value):
    r = Recognizer(json_object_gbnf())
    for text in layouts(value):
        assert r.accepts(text) == isinstance(value, dict), text
