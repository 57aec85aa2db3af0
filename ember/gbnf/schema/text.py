"""GBNF text (llama.cpp's dialect) for the pieces a converted schema is made of: literals,
classes, repetitions, one character as a JSON string writes it, and a regular tree
(`trees`) as one expression."""
from __future__ import annotations

from ..errors import GrammarLimits
from ..syntax import Alt, Chars, Seq
from .charset import RAW_IN_STRING, SHORT_ESCAPES, contains, intersect, single
from .trees import flatten_seq, single_char

MAX_REPEAT = GrammarLimits().max_repetition       # largest m/n in x{m,n} that ember.gbnf accepts
QUOTE = '"\\""'                                   # a JSON string's quote, as a GBNF literal
EMPTY_STRING = '"\\"\\""'

_LITERAL_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def cp_escape(cp: int) -> str:
    if cp < 0x80 and chr(cp).isalnum():
        return chr(cp)
    if cp < 0x80:
        return f"\\x{cp:02X}"
    return f"\\u{cp:04X}" if cp <= 0xFFFF else f"\\U{cp:08X}"


def gbnf_class(r) -> str:
    """A character class; every non-alphanumeric character is hex-escaped (no `-`/`]`/`^` traps)."""
    parts = (cp_escape(lo) if lo == hi else f"{cp_escape(lo)}-{cp_escape(hi)}" for lo, hi in r)
    return "[" + "".join(parts) + "]"


def gbnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in _LITERAL_ESCAPES:
            out.append(_LITERAL_ESCAPES[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(cp_escape(ord(ch)) if ord(ch) >= 0x80 else f"\\x{ord(ch):02X}")
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


def group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "( " + " | ".join(alternatives) + " )"


def encode_in_string(ranges) -> str:
    """GBNF for one character of `ranges` as written inside a JSON string."""
    alternatives = []
    raw = intersect(ranges, RAW_IN_STRING)
    if single(raw) is not None:
        alternatives.append(gbnf_literal(chr(raw[0][0])))
    elif raw:
        alternatives.append(gbnf_class(raw))
    alternatives += [gbnf_literal(esc) for cp, esc in SHORT_ESCAPES.items() if contains(ranges, cp)]
    return group(alternatives)


def tree_gbnf(node) -> str:
    """A regular tree as one GBNF expression over its characters."""
    if isinstance(node, Chars):
        cp = single(node.ranges)
        return gbnf_class(node.ranges) if cp is None else gbnf_literal(chr(cp))
    if isinstance(node, Seq):
        return _seq_gbnf(node.items)
    if isinstance(node, Alt):
        return "( " + " | ".join(tree_gbnf(o) for o in node.options) + " )"
    inner = tree_gbnf(node.item)
    if not isinstance(node.item, (Chars, Alt)):
        inner = f"( {inner} )"
    return gbnf_repeat(inner, node.min, node.max) or '""'


def _seq_gbnf(items) -> str:
    """Items in order, runs of fixed characters joined into one literal."""
    out, run = [], []
    for item in flatten_seq(items):
        cp = single_char(item)
        if cp is not None:
            run.append(chr(cp))
            continue
        if run:
            out.append(gbnf_literal("".join(run)))
            run = []
        out.append(tree_gbnf(item))
    if run:
        out.append(gbnf_literal("".join(run)))
    return " ".join(out) if out else '""'
