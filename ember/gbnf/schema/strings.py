"""String schemas: plain (counted characters), one pattern or format written as a tree,
or patterns, formats, length bounds and excluded keys combined through one minimal DFA."""
from __future__ import annotations

from ..syntax import Alt, Chars, Repeat, Seq
from .automata import DFA, string_dfa
from .charset import ENCODABLE, RAW_IN_STRING, SHORT_ESCAPES, contains
from .errors import SchemaError, pointer
from .formats import STRING_FORMATS, schema_formats
from .keywords import PATTERNS, count
from .patterns import NEEDS_AUTOMATON, check_pattern, length_bounded_tree
from .regex import RegexError
from .rules import Rules, hint
from .text import EMPTY_STRING, MAX_REPEAT, QUOTE, encode_in_string, gbnf_literal, gbnf_repeat
from .trees import flatten_seq, single_char


def string_rule(conv, schema: dict, path: tuple) -> str | None:
    lo = count(schema, "minLength", path, 0)
    hi = count(schema, "maxLength", path, None)
    if hi is not None and hi < lo:
        return None
    merged = schema.get(PATTERNS, [])
    if not isinstance(merged, list):
        raise SchemaError(f"'{PATTERNS}' must be a list", pointer(path + (PATTERNS,)))
    patterns = ([schema["pattern"]] if "pattern" in schema else []) + merged
    for p in patterns:
        check_pattern(p, path + ("pattern",))
    patterns += [STRING_FORMATS[f] for f in schema_formats(schema, path) if f in STRING_FORMATS]
    hi = None if hi is None else min(hi, MAX_REPEAT)          # narrower: still sound
    if not patterns:
        return _plain_string(conv, lo, hi)
    if len(set(patterns)) == 1:
        body = pattern_string(conv, patterns[0], lo, hi)
        if body is not NEEDS_AUTOMATON:
            return body
    return dfa_string(conv, tuple(dict.fromkeys(patterns)), (), (), lo, hi, hint(path) + "-str", path)


def _plain_string(conv, lo: int, hi: int | None) -> str:
    if lo == 0 and hi is None:
        return conv.prim("string")
    chars = gbnf_repeat(conv.prim("char"), lo, hi)
    return f"{QUOTE} {chars} {QUOTE}" if chars else EMPTY_STRING


def pattern_string(conv, pattern: str, lo: int, hi: int | None):
    """A pattern string written structurally (tree-shaped: cheap for the engine); None when
    no string fits, NEEDS_AUTOMATON when only the automaton can meet the bounds."""
    tree = length_bounded_tree(pattern, lo, hi)
    if tree is None or tree is NEEDS_AUTOMATON:
        return tree
    return f"{QUOTE} {_in_string(conv, tree)} {QUOTE}"


def _in_string(conv, node) -> str:
    """GBNF for the JSON text of the characters a tree matches."""
    if isinstance(node, Chars):
        return conv.prim("text-char") if node.ranges == ENCODABLE else encode_in_string(node.ranges)
    if isinstance(node, Alt):
        return "( " + " | ".join(_in_string(conv, o) for o in node.options) + " )"
    if isinstance(node, Repeat):
        inner = _in_string(conv, node.item)
        if isinstance(node.item, Seq):
            inner = f"( {inner} )"
        return gbnf_repeat(inner, node.min, node.max) or '""'
    out, run = [], []
    for item in flatten_seq(node.items):
        text = _single_encoding(item)
        if text is not None:
            run.append(text)
            continue
        if run:
            out.append(gbnf_literal("".join(run)))
            run = []
        out.append(_in_string(conv, item))
    if run:
        out.append(gbnf_literal("".join(run)))
    return " ".join(out) if out else '""'


def _single_encoding(item) -> str | None:
    """The JSON text of a one-character item that has exactly one way to be written."""
    cp = single_char(item)
    if cp is None or cp == 0x2F:                      # "/" may also be "\/"
        return None
    return chr(cp) if contains(RAW_IN_STRING, cp) else SHORT_ESCAPES.get(cp)


def dfa_string(conv, patterns: tuple, excluded: tuple, excluded_patterns: tuple, lo: int, hi: int | None,
               name: str, path: tuple):
    """A JSON string (quotes included) drawn from a DFA of strings matching every pattern,
    none of the excluded patterns or words, length in [lo, hi]; one rule per state."""
    key = (patterns, excluded, excluded_patterns, lo, hi)
    if key not in conv.dfas:
        try:
            dfa = string_dfa(patterns, excluded, excluded_patterns, lo, hi)
        except RegexError as e:
            raise SchemaError(f"pattern/format too complex: {e}", pointer(path)) from None
        conv.dfas[key] = None if dfa is None else _emit_dfa(conv.rules, dfa, name)
    return conv.dfas[key]


def _emit_dfa(rules: Rules, dfa: DFA, name: str) -> str:
    terminal = [acc and not out for acc, out in zip(dfa.accepting, dfa.trans)]
    names = {s: rules.reserve(f"{name}-{s}") for s in range(len(dfa.trans)) if not terminal[s]}
    for s, rule in names.items():
        alternatives = [f"{encode_in_string(ranges)} {QUOTE if terminal[target] else names[target]}"
                        for target, ranges in dfa.edges(s)]
        if dfa.accepting[s]:
            alternatives.append(QUOTE)
        rules.define(rule, " | ".join(alternatives))
    if terminal[dfa.start]:
        return EMPTY_STRING
    return rules.add(name, f"{QUOTE} {names[dfa.start]}")
