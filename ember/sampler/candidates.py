"""The candidate set the samplers narrow down, and the selection helpers that keep one
step cheap on a 262,144-token vocabulary: nothing sorts the whole vocabulary, and the
full-vocabulary logits are read in place (float32) until a step has to change them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEG_INF = np.float32(-np.inf)
SMALL_SET = 4096  # below this, selecting by argpartition over everything is as cheap as anything
SORT_LIMIT = 16384  # larger sets are left unsorted where llama.cpp would sort them (see mass_prefix)


@dataclass(slots=True)
class Candidates:
    ids: np.ndarray  # (n,) int64 token ids
    logits: np.ndarray  # (n,) float32; -inf = banned
    is_sorted: bool = False  # logits in descending order
    full: bool = False  # ids is the whole vocabulary in order (position == token id)
    owned: bool = True  # logits may be written in place (False: they are the caller's array)

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def writable(self) -> Candidates:
        if not self.owned:
            self.logits, self.owned = self.logits.copy(), True
        return self

    def select(self, pos: np.ndarray, is_sorted: bool) -> Candidates:
        """The candidates at positions `pos`, in that order."""
        return Candidates(self.ids[pos], self.logits[pos], is_sorted)

    def sorted(self) -> Candidates:
        """Most likely first; banned (-inf) candidates are dropped on the way."""
        if self.is_sorted:
            return self
        return self.select(top_positions(self.logits, self.size), True)

    def locate(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For ascending unique `tokens`: (positions here that hold one of them, index of that token)."""
        if self.full:
            inside = np.flatnonzero(tokens < self.size)
            return tokens[inside], inside
        pos = np.flatnonzero(np.isin(self.ids, tokens))
        return pos, np.searchsorted(tokens, self.ids[pos])


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 probabilities of float32 logits; -inf entries get 0."""
    z = logits.astype(np.float64)
    z -= z.max()
    np.exp(z, out=z)
    z /= z.sum()
    return z


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) of a float32 vector, in one pass of float32 work."""
    top = float(logits.max())
    if top == -np.inf:
        return top
    e = np.subtract(logits, np.float32(top))
    np.exp(e, out=e)
    return top + float(np.log(e.sum(dtype=np.float64)))


def top_positions(x: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest finite values of x (fewer if fewer are finite), largest first;
    equal values in position order."""
    pos = np.sort(top_set(x, k))
    return pos[np.argsort(-x[pos], kind="stable")]


def top_set(x: np.ndarray, k: int) -> np.ndarray:
    """The positions top_positions() returns, in no particular order (no sort)."""
    pos = _at_least_top_k(x, k) if k < x.size else np.flatnonzero(x > NEG_INF)
    if pos.size > k:
        values = x[pos]
        kth = np.partition(values, pos.size - k)[pos.size - k]
        tied = pos[values == kth]  # ties at the cut go to the lower positions
        pos = np.concatenate([pos[values > kth], tied[:k - int(np.count_nonzero(values > kth))]])
    return pos[x[pos] > NEG_INF]


_BUCKETS, _BUCKET_SPAN = 4096, 32.0  # logit buckets below the top; the last one takes the rest


def mass_prefix(x: np.ndarray, fraction: float) -> np.ndarray:
    """Positions of the shortest run of x's largest values (x taken in descending order) whose
    share of sum(exp(x)) reaches `fraction`; the last position is where that walk stops. Without
    sorting x: the mass per logit bucket locates the bucket where the walk stops, and only that
    bucket is sorted. The other positions come in no particular order."""
    depth = (np.float32(x.max()) - x) * np.float32(_BUCKETS / _BUCKET_SPAN)
    bucket = np.minimum(depth, _BUCKETS - 1).astype(np.int32)
    weights = np.exp(x.astype(np.float64) - logsumexp(x))  # float64: the cut must not move with rounding
    running = np.cumsum(np.bincount(bucket, weights=weights, minlength=_BUCKETS))
    last = int(np.searchsorted(running, min(fraction, running[-1]), side="left"))
    edge = np.flatnonzero((bucket == last) & (x > NEG_INF))
    edge = edge[np.argsort(-x[edge], kind="stable")]
    need = fraction - (running[last - 1] if last > 0 else 0.0)
    k = min(int(np.searchsorted(np.cumsum(weights[edge]), need, side="left")) + 1, edge.size)
    return np.concatenate([np.flatnonzero(bucket < last), edge[:k]])


def _at_least_top_k(x: np.ndarray, k: int) -> np.ndarray:
    """A small superset of the top k positions: split x into G interleaved groups; the k-th
    largest group maximum is a value at least k elements reach, so everything below it goes."""
    n = x.size
    groups = 1 << max(0, int(16 * k - 1).bit_length())  # >= 16 k groups keeps the superset near k
    if n < SMALL_SET or groups > n // 4:
        return np.arange(n)
    rows = n // groups
    maxima = x[:rows * groups].reshape(rows, groups).max(axis=0)
    if rows * groups < n:
        maxima = np.append(maxima, x[rows * groups:].max())
    bound = np.partition(maxima, maxima.size - k)[maxima.size - k]
    if np.isnan(bound):
        raise ValueError("logits contain NaN")
    return np.flatnonzero(x >= bound) if bound > NEG_INF else np.flatnonzero(x > NEG_INF)


def mask_logits(x: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A copy of float32 `x` with -inf where `allowed` (bool) is False, without a branch per
    element: banned entries get their bits forced to those of -inf."""
    banned = allowed.view(np.uint8).astype(np.uint32)
    banned -= np.uint32(1)  # allowed -> 0, banned -> all ones
    out = np.bitwise_or(x.view(np.uint32), banned)
    banned &= np.uint32(0x007FFFFF)
    out ^= banned  # all ones ^ mantissa bits = the bits of -inf
    return out.view(np.float32)
