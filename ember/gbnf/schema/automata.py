"""Code point automata for string languages: Thompson NFAs of patterns, their product (with
excluded languages), length counters, Hopcroft minimization, and the length range.

Not the grammar engine's automaton (nfa.py, csrc/): that one is over UTF-8 bytes, with calls,
built lazily to match; these are intersected, complemented, minimized and written out as GBNF."""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from functools import lru_cache

from ..syntax import Alt, Chars, Repeat, Seq
from .charset import ENCODABLE, contains, intersect, merge
from .regex import RegexError, branches
from .trees import literal

MAX_NFA_STATES = 50_000
MAX_DFA_STATES = 4_096
LENGTH_PRODUCT_STATES = 512  # automaton x length counter; a larger maxLength is tightened


class NFA:
    """Thompson automaton: per state, epsilon targets and (ranges, target) edges."""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple]] = []
        self.start = self.state()
        self.accept = -1

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise RegexError(f"pattern expands to more than {MAX_NFA_STATES} automaton states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def add(self, node, start: int, alphabet) -> int:
        """Append `node` after state `start`; return its end state."""
        if isinstance(node, Chars):
            end = self.state()
            r = intersect(node.ranges, alphabet)
            if r:
                self.edges[start].append((r, end))
            return end
        if isinstance(node, Seq):
            for item in node.items:
                start = self.add(item, start, alphabet)
            return start
        if isinstance(node, Alt):
            end = self.state()
            for option in node.options:
                self.eps[self.add(option, start, alphabet)].append(end)
            return end
        return self._add_repeat(node, start, alphabet)

    def _add_repeat(self, node: Repeat, cur: int, alphabet) -> int:
        for _ in range(node.min):
            cur = self.add(node.item, cur, alphabet)
        if node.max is None:
            loop = self.state()
            self.eps[cur].append(loop)
            self.eps[self.add(node.item, loop, alphabet)].append(loop)
            return loop
        end = self.state()
        self.eps[cur].append(end)
        for _ in range(node.max - node.min):
            cur = self.add(node.item, cur, alphabet)
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
            current = self.closure({t for s in current for r, t in self.edges[s] if contains(r, cp)})
        return self.accept in current


def search_nfa(parts, alphabet) -> NFA:
    """Search semantics: an unanchored end may be padded with any characters.
    `parts`: (tree, anchored_start, anchored_end) per branch."""
    nfa = NFA()
    accept = nfa.state()
    anything = Repeat(Chars(alphabet), 0, None)
    for body, anchored_start, anchored_end in parts:
        cur = nfa.start if anchored_start else nfa.add(anything, nfa.start, alphabet)
        cur = nfa.add(body, cur, alphabet)
        if not anchored_end:
            cur = nfa.add(anything, cur, alphabet)
        nfa.eps[cur].append(accept)
    nfa.accept = accept
    return nfa


@lru_cache(maxsize=1024)
def pattern_nfa(pattern: str) -> NFA:
    return search_nfa(branches(pattern), ENCODABLE)


@lru_cache(maxsize=256)
def _words_nfa(words: tuple) -> NFA:
    return search_nfa([(literal(w), True, True) for w in words], ENCODABLE)


@dataclass(slots=True)
class DFA:
    atoms: list                     # atom index -> (lo, hi) code point range
    start: int
    accepting: list                 # state -> bool
    trans: list                     # state -> {atom index: state}

    def edges(self, state: int) -> list[tuple]:
        """(target, ranges) for the transitions of a state, adjacent atoms merged."""
        by_target: dict = {}
        for a, t in sorted(self.trans[state].items()):
            by_target.setdefault(t, []).append(self.atoms[a])
        return [(t, merge(r)) for t, r in by_target.items()]


@lru_cache(maxsize=512)
def string_dfa(patterns: tuple, excluded: tuple, excluded_patterns: tuple,
               min_len: int, max_len: int | None) -> DFA | None:
    """Strings matching every pattern, none of the excluded patterns or words, length in range.
    A maxLength that would need more than LENGTH_PRODUCT_STATES states is tightened."""
    base = language_dfa(patterns, excluded, excluded_patterns)
    if base is None:
        return None
    shortest, longest = length_range(base)
    if shortest >= min_len and (max_len is None or (longest is not None and longest <= max_len)):
        return base
    size = len(base.trans)
    if max_len is not None and size * (max_len + 1) > LENGTH_PRODUCT_STATES:
        max_len = max(LENGTH_PRODUCT_STATES // size - 1, min_len)      # narrower: still sound
    if size * ((min_len if max_len is None else max_len) + 1) > LENGTH_PRODUCT_STATES:
        raise RegexError(f"minLength {min_len} needs more than {LENGTH_PRODUCT_STATES} automaton states")
    return _with_length(base, min_len, max_len)


@lru_cache(maxsize=512)
def language_dfa(patterns: tuple, excluded: tuple, excluded_patterns: tuple) -> DFA | None:
    """The minimal DFA of strings matching every pattern and none of the excluded ones."""
    positives = [pattern_nfa(p) for p in patterns] or [pattern_nfa("")]
    negatives = [pattern_nfa(p) for p in excluded_patterns]
    if excluded:
        negatives.append(_words_nfa(excluded))
    dfa = _subset_construction(positives, negatives, ENCODABLE)
    return None if dfa is None else _minimize(dfa)


def _atoms(nfas, alphabet) -> list:
    """The coarsest ranges that no edge of any automaton splits."""
    cuts = {lo for lo, _ in alphabet} | {hi + 1 for _, hi in alphabet}
    for nfa in nfas:
        for edges in nfa.edges:
            for r, _ in edges:
                cuts.update(lo for lo, _ in r)
                cuts.update(hi + 1 for _, hi in r)
    points = sorted(cuts)
    return [(a, b - 1) for a, b in itertools.pairwise(points) if contains(alphabet, a)]


def _atom_tables(nfa: NFA, atoms: list) -> list:
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


def _subset_construction(positives, negatives, alphabet) -> DFA | None:
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
                    raise RegexError(f"needs more than {MAX_DFA_STATES} automaton states")
                index[nxt] = len(keys)
                keys.append(nxt)
            out[a] = index[nxt]
        trans.append(out)
    return _prune(DFA(atoms, 0, accepting, trans))


def _moves(table, states) -> dict:
    out: dict = {}
    for s in states:
        for a, t in table[s]:
            out.setdefault(a, set()).add(t)
    return out


def _with_length(dfa: DFA, min_len: int, max_len: int | None) -> DFA | None:
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
    return _prune(DFA(dfa.atoms, 0, accepting, trans))


def length_range(dfa: DFA) -> tuple[int, int | None]:
    """Shortest accepted length, and the longest (None when a cycle makes it unbounded)."""
    longest: dict = {}
    for s in _topological(dfa):
        if s is None:
            return _shortest(dfa), None
        tails = [longest[t] + 1 for t in dfa.trans[s].values()]
        longest[s] = max(tails + ([0] if dfa.accepting[s] else []))
    return _shortest(dfa), longest[dfa.start]


def _shortest(dfa: DFA) -> int:
    """Breadth-first distance from the start to the nearest accepting state."""
    dist, frontier = {dfa.start: 0}, [dfa.start]
    while frontier:
        if any(dfa.accepting[s] for s in frontier):
            return dist[frontier[0]]
        nxt = []
        for s in frontier:
            for t in dfa.trans[s].values():
                if t not in dist:
                    dist[t] = dist[s] + 1
                    nxt.append(t)
        frontier = nxt
    return 0


def _topological(dfa: DFA) -> list:
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


def _prune(dfa: DFA) -> DFA | None:
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
    return _renumber(DFA(dfa.atoms, dfa.start, dfa.accepting, trans), {s: s for s in live})


def _minimize(dfa: DFA) -> DFA:
    """Hopcroft's partition refinement; missing transitions go to an explicit dead state."""
    n, k = len(dfa.trans), len(dfa.atoms)
    sources = _sources(dfa)
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
            if len(part) < len(blocks[j]):
                _split(blocks, owner, work, j, part, k)
    return _renumber(dfa, {s: owner[s] for s in range(n)})


def _sources(dfa: DFA) -> list[dict]:
    """Per atom: target -> the states that reach it on that atom (state n is the dead state)."""
    n, dead, k = len(dfa.trans), len(dfa.trans), len(dfa.atoms)
    sources: list[dict] = [{} for _ in range(k)]
    for s, out in enumerate(dfa.trans):
        for a in range(k):
            sources[a].setdefault(out.get(a, dead), []).append(s)
    for a in range(k):
        sources[a].setdefault(dead, []).append(dead)
    return sources


def _split(blocks: list, owner: dict, work: set, j: int, part: set, k: int):
    """Moves `part` out of block j into a new block; the smaller half joins the work list."""
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


def _renumber(dfa: DFA, group: dict) -> DFA:
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
    return DFA(dfa.atoms, 0, accepting, trans)
