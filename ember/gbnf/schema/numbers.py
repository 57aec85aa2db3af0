"""Integers and numbers: schema bounds made exact on a decimal grid, the decimals between
two bounds as a regular tree (already unambiguous, so written out as it is), and the
integer/number rules of a schema."""
from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from functools import lru_cache

from ..syntax import Alt, Chars, Repeat, Seq
from .charset import DIGIT
from .errors import SchemaError, pointer
from .formats import NUMERIC_FORMATS, schema_formats
from .keywords import NUMBER_KEYWORDS
from .text import tree_gbnf
from .trees import literal

INT_DIGITS = 16              # integer type
NUM_INT_DIGITS = 15          # number type: 15 digits keep every value below 2**53
FRAC_DIGITS = 15             # bounded numbers
FREE_FRAC_DIGITS = 20        # unbounded numbers: every Python float repr fits
EXP_DIGITS = 3


def integer_rule(conv, schema: dict, path: tuple) -> str | None:
    lo, hi = integer_bounds(schema, schema_formats(schema, path), path)
    if lo is None and hi is None:
        return conv.prim("integer")
    return range_gbnf(None if lo is None else Decimal(lo), None if hi is None else Decimal(hi), 0, INT_DIGITS)


def number_rule(conv, schema: dict, path: tuple) -> str | None:
    formats = schema_formats(schema, path)
    lo, hi = number_bounds(schema, formats, path)
    if lo is None and hi is None and not (set(schema) & NUMBER_KEYWORDS) \
            and not any(NUMERIC_FORMATS.get(f) for f in formats):
        return conv.prim("number")
    return range_gbnf(lo, hi, FRAC_DIGITS, NUM_INT_DIGITS)


# --- bounds

def _bound(value, key: str, path: tuple):
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and math.isnan(value)):
        raise SchemaError(f"'{key}' must be a number", pointer(path + (key,)))
    return value


def _shortest(x) -> Decimal:
    return Decimal(x) if isinstance(x, int) else Decimal(repr(float(x)))


def integer_bounds(schema: dict, formats: list, path: tuple):
    """Closed integer bounds (lo > hi: none fits); float bounds are compared exactly (binary
    value and shortest decimal agree on which integers pass)."""
    lo = hi = None
    for key, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
        if key in schema:
            v = _bound(schema[key], key, path)
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
            v = _bound(schema[key], key, path)
            if math.isinf(v):
                if v < 0:
                    return 1, 0
                continue
            edge = min(Decimal(v), _shortest(v))
            b = int(edge.to_integral_value(ROUND_CEILING)) - 1 if exclusive \
                else int(edge.to_integral_value(ROUND_FLOOR))
            hi = b if hi is None else min(hi, b)
    return _format_bounds(lo, hi, formats, int)


def number_bounds(schema: dict, formats: list, path: tuple):
    """Closed bounds on the 10**-FRAC_DIGITS grid such that every grid value inside
    satisfies the schema's bounds exactly and after rounding to a double."""
    limit = 10 ** NUM_INT_DIGITS
    lo = hi = None
    with localcontext() as ctx:
        ctx.prec = 80
        for key, sign in (("minimum", 1), ("exclusiveMinimum", 1), ("maximum", -1), ("exclusiveMaximum", -1)):
            if key not in schema:
                continue
            v = _bound(schema[key], key, path)
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
    return _format_bounds(lo, hi, formats, Decimal)


def _format_bounds(lo, hi, formats: list, kind):
    """lo, hi narrowed by the bounds of int32/int64 formats (as `kind`)."""
    for f in formats:
        if NUMERIC_FORMATS.get(f):
            flo, fhi = (kind(b) for b in NUMERIC_FORMATS[f])
            lo = flo if lo is None else max(lo, flo)
            hi = fhi if hi is None else min(hi, fhi)
    return lo, hi


# --- decimals in a range, as trees

@lru_cache(maxsize=1024)
def range_gbnf(lo: Decimal | None, hi: Decimal | None, digits: int, int_digits: int) -> str | None:
    """GBNF for the signed decimals with `digits` fraction digits at most and fewer than
    `int_digits` integer digits within [lo, hi]; None when there are none."""
    with localcontext() as ctx:
        ctx.prec = 80
        node = _decimal_range(lo, hi, digits, int_digits)
    return None if node is None else tree_gbnf(node)


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
        parts.append(None if m is None else Seq((literal("-"), m)))
    return _alt(parts)


def _magnitude(lo: Decimal, hi: Decimal | None, digits: int, int_digits: int):
    """Unsigned decimals (grid 10**-digits) with lo <= value <= hi (hi None: < 10**int_digits)."""
    a, alpha = _split_grid(lo, digits)
    b, beta = (10 ** int_digits - 1, None) if hi is None else _split_grid(hi, digits)
    if a > b or a >= 10 ** int_digits:
        return None
    if a == b:
        return _with_fraction(literal(str(a)), alpha, beta, digits)
    lo_free = alpha.strip("0") == ""
    hi_free = beta is None or beta.strip("9") == ""
    parts = [] if lo_free else [_with_fraction(literal(str(a)), alpha, None, digits)]
    first, last = a + (not lo_free), b - (not hi_free)
    if first <= last:
        parts.append(_with_fraction(_uint_range(first, last), None, None, digits))
    if not hi_free:
        parts.append(_with_fraction(literal(str(b)), None, beta, digits))
    return _alt(parts)


def _split_grid(v: Decimal, digits: int) -> tuple[int, str]:
    """Integer part and the `digits`-digit fraction string of a grid value."""
    scaled = int(v.scaleb(digits))
    ip, fp = divmod(scaled, 10 ** digits)
    return ip, (str(fp).zfill(digits) if digits else "")


def _uint_range(lo: int, hi: int):
    """Canonical decimal integers (no leading zeros) in [lo, hi]; lengths with every value merge."""
    parts, full = [], []
    for d in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (d - 1) if d > 1 else 0), min(hi, 10 ** d - 1)
        if d > 1 and a == 10 ** (d - 1) and b == 10 ** d - 1:
            full.append(d)
            continue
        if full:
            parts.append(_full_lengths(full))
            full = []
        parts.append(_same_length_range(str(a), str(b)))
    if full:
        parts.append(_full_lengths(full))
    return _alt(parts)


def _full_lengths(lengths: list[int]):
    """Every integer with a digit count in `lengths` (consecutive, all above 1)."""
    return Seq((_digit_range(1, 9), _any_digits(lengths[0] - 1, lengths[-1] - 1)))


def _same_length_range(a: str, b: str):
    """Digit strings x of len(a) == len(b) with a <= x <= b."""
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if i == len(a):
        return literal(a)
    rest = len(a) - i - 1
    lo_free, hi_free = a[i + 1:].strip("0") == "", b[i + 1:].strip("9") == ""
    first, last = int(a[i]) + (not lo_free), int(b[i]) - (not hi_free)
    parts = [] if lo_free else [Seq((literal(a[i]), _suffix_ge(a[i + 1:])))]
    if first <= last:
        parts.append(Seq((_digit_range(first, last), _any_digits(rest, rest))))
    if not hi_free:
        parts.append(Seq((literal(b[i]), _suffix_le(b[i + 1:]))))
    return Seq((literal(a[:i]), _alt(parts)))


def _suffix_ge(s: str):
    """Digit strings of len(s) that are >= s."""
    if s.strip("0") == "":
        return _any_digits(len(s), len(s))
    d = int(s[0])
    bigger = Seq((_digit_range(d + 1, 9), _any_digits(len(s) - 1, len(s) - 1))) if d < 9 else None
    return _alt([Seq((literal(s[0]), _suffix_ge(s[1:]))), bigger])


def _suffix_le(s: str):
    """Digit strings of len(s) that are <= s."""
    if s.strip("9") == "":
        return _any_digits(len(s), len(s))
    d = int(s[0])
    smaller = Seq((_digit_range(0, d - 1), _any_digits(len(s) - 1, len(s) - 1))) if d > 0 else None
    return _alt([smaller, Seq((literal(s[0]), _suffix_le(s[1:])))])


def _with_fraction(int_node, lo, hi, digits):
    """int_node followed by the fraction part [lo, hi] allows (None: nothing fits)."""
    frac, may_skip = _fraction(lo, hi, digits)
    if frac is None:
        return int_node if may_skip else None
    return Seq((int_node, Repeat(frac, 0, 1) if may_skip else frac))


def _fraction(lo: str | None, hi: str | None, digits: int):
    """Optional '.digits' part: (node or None, whether it may be left out)."""
    may_skip = lo is None or lo.strip("0") == ""
    tail = _frac_tail(lo, hi, digits) if digits else None
    node = Seq((literal("."), tail)) if tail is not None else None
    return node, may_skip


def _frac_tail(lo: str | None, hi: str | None, n: int):
    """Non-empty digit strings of length <= n whose zero-padded value lies in [lo, hi]
    (lo, hi: n-digit strings, None for no bound)."""
    if n == 0:
        return None
    lo0, hi0 = (int(lo[0]) if lo else 0), (int(hi[0]) if hi else 9)
    if lo0 > hi0:
        return None
    if lo0 == hi0:
        return _frac_branch(lo0, lo[1:] if lo else None, hi[1:] if hi else None, n)
    free_lo = lo is None or lo[1:].strip("0") == ""
    free_hi = hi is None or hi[1:].strip("9") == ""
    first, last = lo0 + (not free_lo), hi0 - (not free_hi)
    parts = [] if free_lo else [_frac_branch(lo0, lo[1:], None, n)]
    if first <= last:
        parts.append(Seq((_digit_range(first, last), _any_digits(0, n - 1))))
    if not free_hi:
        parts.append(_frac_branch(hi0, None, hi[1:], n))
    return _alt(parts)


def _frac_branch(d: int, lo: str | None, hi: str | None, n: int):
    """Digit d followed by a (possibly empty) rest whose padded value is in [lo, hi]."""
    rest_may_end = lo is None or lo.strip("0") == ""
    rest = _frac_tail(lo, hi, n - 1)
    if rest is None:
        return literal(str(d)) if rest_may_end else None
    return Seq((literal(str(d)), Repeat(rest, 0, 1) if rest_may_end else rest))


def _digit_range(lo: int, hi: int):
    return Chars(((0x30 + lo, 0x30 + hi),))


def _any_digits(lo: int, hi: int | None):
    return Seq(()) if hi == 0 else Repeat(Chars(DIGIT), lo, hi)


def _alt(options):
    """The options that exist (not None), as one node; None when there are none."""
    options = [o for o in options if o is not None]
    if not options:
        return None
    return options[0] if len(options) == 1 else Alt(tuple(options))
