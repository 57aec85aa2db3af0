"""A pattern as a regular tree over the characters a JSON string can carry, fitted to
minLength/maxLength where a tree can be (README.md, "Strings"), and pattern checks."""
from __future__ import annotations

from functools import lru_cache

from ..syntax import Alt, Chars, Repeat, Seq
from .automata import language_dfa, pattern_nfa
from .charset import ENCODABLE
from .errors import SchemaError, pointer
from .regex import RegexError, branches
from .trees import capped, flatten_seq, lengths, restrict

SMALL_PRODUCT_STATES = 128   # below this an exact pattern x length automaton is preferred
NEEDS_AUTOMATON = object()   # the bounds can only be met by the automaton route
_NOTHING = object()


@lru_cache(maxsize=1024)
def pattern_tree(pattern: str):
    """The pattern as a tree over string characters, search padding made explicit
    (None: it matches no string)."""
    pad = Repeat(Chars(ENCODABLE), 0, None)
    options = []
    for body, anchored_start, anchored_end in branches(pattern):
        items = ([] if anchored_start else [pad]) + [body] + ([] if anchored_end else [pad])
        options.append(Seq(tuple(items)))
    return restrict(options[0] if len(options) == 1 else Alt(tuple(options)), ENCODABLE)


@lru_cache(maxsize=1024)
def length_bounded_tree(pattern: str, lo: int, hi: int | None):
    """The pattern's tree meeting the length bounds: exactly when one counted repetition
    carries all the variable length (^[a-z][a-z0-9_]*$); else NEEDS_AUTOMATON when an exact
    pattern x length automaton stays small (or only it can meet minLength); else with every
    repetition capped alike (narrower than the schema: sound). None: no string fits."""
    tree = pattern_tree(pattern)
    if tree is None:
        return None
    shortest, longest = lengths(tree)
    if shortest >= lo and (hi is None or (longest is not None and longest <= hi)):
        return tree
    exact = _exact_length(tree, lo, hi)
    if exact is _NOTHING:
        return None
    if exact is not None:
        return exact
    if _small_product(pattern, lo, hi) or shortest < lo:
        return NEEDS_AUTOMATON
    return _cap_lengths(tree, hi) or NEEDS_AUTOMATON


def _exact_length(tree, lo: int, hi: int | None):
    """When one repetition of a fixed-width item carries all the variable length (everything
    else fixed), the length bounds become bounds on its count: exact. None otherwise;
    _NOTHING when no count fits."""
    items = list(flatten_seq(tree.items)) if isinstance(tree, Seq) else [tree]
    spans = [lengths(i) for i in items]
    variable = [k for k, (a, b) in enumerate(spans) if a != b]
    if len(variable) != 1 or not isinstance(items[variable[0]], Repeat):
        return None
    rep = items[variable[0]]
    width, width_max = lengths(rep.item)
    if width != width_max or width == 0:
        return None
    fixed = sum(a for k, (a, _) in enumerate(spans) if k != variable[0])
    count_lo = max(rep.min, -(-(lo - fixed) // width))
    count_hi = rep.max if hi is None else (hi - fixed) // width if rep.max is None \
        else min(rep.max, (hi - fixed) // width)
    if count_hi is not None and count_hi < count_lo:
        return _NOTHING
    items[variable[0]] = Repeat(rep.item, count_lo, count_hi)
    return Seq(tuple(items))


def _small_product(pattern: str, lo: int, hi: int | None) -> bool:
    """Whether the exact pattern x length automaton stays small."""
    try:
        base = language_dfa((pattern,), (), ())
    except RegexError:
        return False
    count = hi if hi is not None else lo
    return base is not None and len(base.trans) * (count + 1) <= SMALL_PRODUCT_STATES


def _cap_lengths(tree, limit: int):
    """A narrower tree whose longest match is <= limit: the largest uniform repetition cap
    that fits. None if even the minimal repetitions are too long."""
    if lengths(capped(tree, 0))[1] > limit:
        return None
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if lengths(capped(tree, mid))[1] <= limit:
            lo = mid
        else:
            hi = mid - 1
    return capped(tree, lo)


def check_pattern(pattern, path: tuple):
    """SchemaError unless `pattern` is a string in the supported regex subset."""
    if not isinstance(pattern, str):
        raise SchemaError("a pattern must be a string", pointer(path))
    try:
        pattern_nfa(pattern)
    except RegexError as e:
        raise SchemaError(f"pattern {pattern!r}: unsupported regex feature: {e}", pointer(path)) from None


def pattern_matches(pattern: str, text: str) -> bool:
    """ECMA reading, by our automaton (linear time: a hostile pattern cannot stall it)."""
    try:
        return pattern_nfa(pattern).matches(text)
    except RegexError as e:
        raise SchemaError(f"pattern {pattern!r}: unsupported regex feature: {e}") from None
