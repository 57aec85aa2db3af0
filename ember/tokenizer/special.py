"""Finding special-token text in raw text, in llama.cpp's order.

llama.cpp takes the special tokens longest first and, for each, cuts every occurrence out
of the text that is still raw (left to right, never overlapping a piece already cut). This is
not leftmost-longest matching: a longer token found later in the text wins over a shorter one
that starts earlier and overlaps it. We reproduce it in two steps: list every (start, token)
occurrence (a regex finds where tokens may start, a trie walk says which do), then accept
occurrences in llama.cpp's order.

Runs of one character (Gemma's "\n\n\n", "    ", "\t\t" tokens) would make that list grow with
the square of the run length, so they are cut by arithmetic instead: when no other special
token contains the character, a run is independent of everything else, and longest-first
cutting splits it into as many of the longest fitting token as fit, from the left, then the
rest likewise.
"""
from __future__ import annotations

import bisect
import re
from collections import defaultdict

Occurrence = tuple[int, int, int, int]  # (rank in llama.cpp's order, start, end, token id)


class SpecialMatcher:
    """Cuts the text of a fixed set of special tokens out of raw text."""

    def __init__(self, specials: list[tuple[int, str]]):
        # llama.cpp sorts by text length, longest first; ties keep id order here
        ordered = sorted(specials, key=lambda s: (-len(s[1]), s[0]))
        self._runs = run_tokens(ordered)  # char -> [(length, token)], longest first
        others = [(r, i, t) for r, (i, t) in enumerate(ordered) if not (t and t[0] in self._runs)]
        self._rank = {t: (r, i) for r, i, t in others}
        self._trie = build_trie(t for _, _, t in others)
        self._heads = heads_finder([t for _, _, t in others])
        self._run_finder = runs_finder(self._runs)

    def split(self, text: str) -> list[str | int]:
        """text -> raw pieces (str, never empty) and special token ids, in text order."""
        if not text:
            return []
        found = self._accept(self._occurrences(text)) + self._cut_runs(text)
        found.sort(key=lambda o: o[1])
        parts: list[str | int] = []
        pos = 0
        for _, start, end, token in found:
            if start > pos:
                parts.append(text[pos:start])
            parts.append(token)
            pos = end
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def _occurrences(self, text: str) -> list[Occurrence]:
        """Every occurrence of every (non-run) special token, overlapping ones included."""
        if self._heads is None:
            return []
        out = []
        n = len(text)
        for m in self._heads.finditer(text):
            start = end = m.start()
            node = self._trie
            while end < n:
                node = node.get(text[end])
                if node is None:
                    break
                end += 1
                if "" in node:
                    rank, token = self._rank[text[start:end]]
                    out.append((rank, start, end, token))
        out.sort()
        return out

    @staticmethod
    def _accept(candidates: list[Occurrence]) -> list[Occurrence]:
        """Greedy in processing order: an occurrence survives if it overlaps nothing taken before."""
        starts: list[int] = []
        taken: list[Occurrence] = []  # sorted by start, disjoint
        for occ in candidates:
            k = bisect.bisect_right(starts, occ[1])
            if k > 0 and taken[k - 1][2] > occ[1]:
                continue
            if k < len(taken) and taken[k][1] < occ[2]:
                continue
            starts.insert(k, occ[1])
            taken.insert(k, occ)
        return taken

    def _cut_runs(self, text: str) -> list[Occurrence]:
        if self._run_finder is None:
            return []
        out = []
        for m in self._run_finder.finditer(text):
            pos, left = m.start(), m.end() - m.start()
            for length, token in self._runs[text[pos]]:
                while left >= length:
                    out.append((0, pos, pos + length, token))
                    pos += length
                    left -= length
        return out


def run_tokens(ordered: list[tuple[int, str]]) -> dict[str, list[tuple[int, int]]]:
    """Tokens made of one repeated character, by character, for characters no other token contains."""
    runs: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, t in ordered:
        if t and t == t[0] * len(t):
            runs[t[0]].append((len(t), i))
    mixed = "".join(t for _, t in ordered if not (t and t == t[0] * len(t)))
    return {c: sorted(tokens, reverse=True) for c, tokens in runs.items() if c not in mixed}


def runs_finder(runs: dict[str, list[tuple[int, int]]]) -> re.Pattern | None:
    """Maximal runs of each run character that are long enough for its shortest token."""
    if not runs:
        return None
    return re.compile("|".join(f"{re.escape(c)}{{{tokens[-1][0]},}}" for c, tokens in sorted(runs.items())))


def build_trie(texts) -> dict:
    """Nested dicts by character; the key "" marks the end of a text."""
    trie: dict = {}
    for t in texts:
        node = trie
        for ch in t:
            node = node.setdefault(ch, {})
        node[""] = True
    return trie


def heads_finder(texts: list[str]) -> re.Pattern | None:
    """A regex matching (empty) wherever some text may start: at its first two characters.

    Cheap to compile even for thousands of texts; the trie walk then confirms each candidate.
    """
    heads = sorted({t[:2] for t in texts if t}, key=lambda h: (-len(h), h))
    if not heads:
        return None
    return re.compile("(?=" + "|".join(re.escape(h) for h in heads) + ")")
