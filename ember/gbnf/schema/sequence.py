"""Comma-separated members between brackets, for objects and arrays alike."""
from __future__ import annotations

from .errors import SchemaError
from .rules import Rules
from .text import MAX_REPEAT, gbnf_literal, gbnf_repeat


class Sequence:
    """Members built as (position, count, first) states, one rule each, so the grammar stays
    linear in the members and deterministic at every key. Objects: declared members
    (required or optional) in order, then any number of `extra` pairs, with the member
    count in [lo, hi]. Arrays: prefix items by position, then `extra` items, length in
    [lo, hi]. A state is (non-empty continuation or None, whether it may stop there)."""

    def __init__(self, rules: Rules, ws: str, hint: str, open_: str, close: str):
        self.rules, self.ws, self.hint = rules, ws, hint
        self.open, self.close = gbnf_literal(open_), gbnf_literal(close)
        self.memo: dict = {}

    def object(self, members: list, extra, lo: int, hi: int | None) -> str | None:
        """members: (rule, required) per declared key, in order."""
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
        """items: the rule of each prefix item (None: that item allows no value)."""
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
        """The state at member i0; states reachable from (i0, count0, first0) are found going
        forward, then evaluated from the last member back (no recursion: member lists can
        be long)."""
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
        return self.rules.add(f"{self.hint}-{i}", expr)


def _union(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return a if b is None else b
    return f"{a} | {b}"
