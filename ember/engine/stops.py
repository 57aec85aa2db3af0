"""Stop strings found in a sequence's text as it streams, in time proportional to the new text.

Each stop string has a KMP matcher: its state is the length of the longest suffix of the text so
far that is a prefix of the stop string. Its failure table is built only as far as the text has
followed the string, so a long stop string costs nothing until the text matches it, and each new
character costs O(1) amortized per stop string, however long the strings are.

Text is held back while it could be the start of a stop string (the largest state); when a stop
string is complete, the text is cut before it: before the earliest-starting one where several
are complete after the same piece.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable


class _Kmp:
    __slots__ = ("s", "pi", "state")

    def __init__(self, s: str):
        self.s = s
        self.pi = [0]  # pi[q]: longest proper border of s[:q + 1], built up to the longest state seen
        self.state = 0

    def scan(self, piece: str) -> tuple[int, int]:
        """Follow piece: (index in piece just past the first completed occurrence, or -1; work done
        (characters passed, failure links followed, table entries built))."""
        s, pi, m = self.s, self.pi, self.state
        i, n, work = 0, len(piece), 0
        while i < n:
            if m == 0:  # nothing matched: skip to the next place the string could start, at C speed
                j = piece.find(s[0], i)
                work += (n if j < 0 else j) - i
                if j < 0:
                    break
                i = j
            c = piece[i]
            while m and s[m] != c:
                m = pi[m - 1]
                work += 1
            if s[m] == c:
                m += 1
                if m == len(s):
                    self.state = m
                    return i + 1, work + 1
                if m > len(pi):
                    work += self._extend(m)
            i += 1
            work += 1
        self.state = m
        return -1, work

    def _extend(self, length: int) -> int:
        """The failure table up to pi[length - 1]; returns the steps taken (amortized O(1) each)."""
        s, pi, work = self.s, self.pi, 0
        while len(pi) < length:
            q = len(pi)
            k = pi[q - 1]
            while k and s[q] != s[k]:
                k = pi[k - 1]
                work += 1
            pi.append(k + 1 if s[q] == s[k] else k)
            work += 1
        return work


class StopMatcher:
    """One sequence's stop strings (empty ones are ignored) and the text it holds back."""

    __slots__ = ("_kmps", "_held", "_n_held", "work")

    def __init__(self, stops: Iterable[str]):
        self._kmps = [_Kmp(s) for s in dict.fromkeys(stops) if s]
        self._held: deque[str] = deque()
        self._n_held = 0
        self.work = 0  # characters examined, over every stop string (bounded in tests)

    def feed(self, piece: str) -> tuple[str, bool]:
        """The text that may be sent now, and whether a stop string is complete (then the text ends
        just before it, and this matcher is done)."""
        cut, keep = -1, 0
        for kmp in self._kmps:
            end, work = kmp.scan(piece)
            self.work += work
            if end >= 0:
                start = self._n_held + end - len(kmp.s)
                cut = start if cut < 0 else min(cut, start)
            keep = max(keep, kmp.state)
        if cut >= 0:
            text = "".join(self._held) + piece
            self._held.clear()
            self._n_held = 0
            return text[:cut], True
        text = self._release(self._n_held + len(piece) - keep, piece)
        self._n_held = keep
        return text, False

    def _release(self, n: int, piece: str) -> str:
        """The first n characters of the held text and piece; the rest is held."""
        out, held = [], self._held
        while n and held:
            head = held[0]
            if len(head) <= n:
                out.append(held.popleft())
                n -= len(head)
            else:
                out.append(head[:n])
                held[0] = head[n:]
                n = 0
        out.append(piece[:n])
        if n < len(piece):
            held.append(piece[n:])
        return "".join(out)

    def flush(self) -> str:
        """Everything held back (the sequence ended without completing a stop string)."""
        text = "".join(self._held)
        self._held.clear()
        self._n_held = 0
        return text
