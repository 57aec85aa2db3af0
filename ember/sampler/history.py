"""What the penalties remember of a sequence: a window of its last tokens with their counts,
and DRY's search of that window for repeats the next token would extend."""
from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np

from .vocab import DryBreakers

_FLOAT_MAX_LOG = 88.7228391  # log(FLT_MAX): DRY's exponent stops where float32 overflows


class TokenWindow:
    """The last `size` accepted tokens (None: all of them) and how often each occurs there."""

    def __init__(self, size: int | None):
        self.tokens: deque[int] = deque(maxlen=size)
        self.counts: Counter[int] = Counter()
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def push(self, token: int) -> None:
        if len(self.tokens) == self.tokens.maxlen:
            old = self.tokens[0]
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]
        self.tokens.append(token)
        self.counts[token] += 1
        self._arrays = None

    def counted(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct tokens ascending, their counts), cached until the next push."""
        if self._arrays is None:
            tokens = np.array(sorted(self.counts), np.int64)
            self._arrays = tokens, np.array([self.counts[t] for t in tokens.tolist()], np.int64)
        return self._arrays

    def clear(self) -> None:
        self.tokens.clear()
        self.counts.clear()
        self._arrays = None

    def copy(self) -> TokenWindow:
        twin = TokenWindow(self.tokens.maxlen)
        twin.tokens.extend(self.tokens)
        twin.counts = self.counts.copy()
        return twin


def dry_penalties(history: Sequence[int], breakers: DryBreakers, multiplier: float, base: float,
                  allowed_length: int) -> tuple[np.ndarray, np.ndarray]:
    """DRY: a token that would extend a repeat (a suffix of the history that occurred before,
    followed by that token) of length L >= allowed_length loses multiplier * base^(L - allowed).
    Repeats do not reach back across a sequence breaker. Returns (tokens ascending, penalties)."""
    latest_first = list(reversed(history))
    if len(latest_first) <= allowed_length:
        return _none()
    limit = repeat_limit(latest_first, breakers)
    if limit < allowed_length:
        return _none()
    longest: dict[int, int] = {}
    for k, match in enumerate(suffix_matches(latest_first)[1:], start=1):
        length = min(match, limit)
        if length >= allowed_length:
            # the suffix also ends k tokens back; the token after that occurrence would extend it
            token = latest_first[k - 1]
            longest[token] = max(longest.get(token, 0), length)
    tokens = np.array(sorted(longest), np.int64)
    tokens = tokens[~breakers.is_single(tokens)]  # a breaker token itself is never penalized
    lengths = np.array([longest[t] for t in tokens.tolist()], np.int64)
    return tokens, multiplier * base ** _capped_exponents(lengths - allowed_length, base)


def _none() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros(0)


def _capped_exponents(exponents: np.ndarray, base: float) -> np.ndarray:
    if base > 1.000001:
        cap = int(_FLOAT_MAX_LOG / math.log(base))
        if cap > 0:
            return np.minimum(exponents, cap)
    return exponents


def repeat_limit(latest_first: list[int], breakers: DryBreakers) -> int:
    """How far back a repeat may reach: up to the most recent complete sequence breaker."""
    for i, token in enumerate(latest_first):
        longest = -1
        for tail in breakers.tails.get(token, ()):
            # the tail's tokens follow the head, i.e. sit at latest_first[i-1], [i-2], ...
            if longest < len(tail) <= i and all(t == latest_first[i - 1 - o] for o, t in enumerate(tail)):
                longest = len(tail)
        if longest >= 0:
            return i - longest
    return len(latest_first)


def suffix_matches(s: list[int]) -> list[int]:
    """Z-algorithm: z[k] = length of the longest common prefix of s and s[k:] (z[0] = 0)."""
    n = len(s)
    z = [0] * n
    left = right = 0  # the rightmost match window seen: s[left:right] == s[0:right-left]
    for k in range(1, n):
        length = min(right - k, z[k - left]) if k < right else 0
        while k + length < n and s[length] == s[k + length]:
            length += 1
        z[k] = length
        if k + length > right:
            left, right = k, k + length
    return z
