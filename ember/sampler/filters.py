"""The samplers of the chain as pure functions: Candidates (+ their parameters) -> Candidates.

Each follows the llama.cpp sampler of the same name in what it keeps, in its min_keep
rule and in the order it leaves the candidates in (the final draw walks them in order).
Random choices are made by the caller and passed in, so every function here is exact and
testable on a small hand-made distribution.
"""
from __future__ import annotations

import math

import numpy as np

from .candidates import (
    NEG_INF,
    SMALL_SET,
    SORT_LIMIT,
    Candidates,
    logsumexp,
    mass_prefix,
    softmax,
    top_positions,
)


def top_k(c: Candidates, k: int) -> Candidates:
    """The k most likely, most likely first. k <= 0 disables."""
    if k <= 0:
        return c
    if c.is_sorted:
        return c if k >= c.size else c.select(np.arange(k), True)
    return c.select(top_positions(c.logits, k), True)


def top_p(c: Candidates, p: float, min_keep: int) -> Candidates:
    """The most likely tokens whose probabilities first sum to >= p (at least min_keep)."""
    if p >= 1.0 or c.size == 0:
        return c
    if c.is_sorted or c.size <= SMALL_SET:
        c = c.sorted()
        return c.select(np.arange(nucleus_size(softmax(c.logits), p, min_keep)), True)
    # a large unsorted set: the top few hundred usually hold mass p; if not, bucket by logit
    lse, m = logsumexp(c.logits), max(256, min_keep)
    head = top_positions(c.logits, m)
    probs = np.exp(c.logits[head].astype(np.float64) - lse)
    if head.size < m or float(probs.sum()) >= p:
        return c.select(head[:nucleus_size(probs, p, min_keep)], True)
    nucleus = c.select(mass_prefix(c.logits, p), False)
    return nucleus.sorted() if nucleus.size <= SORT_LIMIT else nucleus


def nucleus_size(sorted_probs: np.ndarray, p: float, min_keep: int) -> int:
    """How many of the sorted probabilities top_p keeps."""
    hit = np.cumsum(sorted_probs) >= p
    hit[:max(min_keep, 1) - 1] = False
    return int(np.argmax(hit)) + 1 if hit.any() else sorted_probs.size


def min_p(c: Candidates, p: float, min_keep: int) -> Candidates:
    """Tokens at least p times as likely as the most likely one (at least min_keep)."""
    if p <= 0.0 or c.size == 0:
        return c
    top = c.logits[0] if c.is_sorted else c.logits.max()
    keep = np.flatnonzero(c.logits >= np.float32(top + math.log(p)))
    if keep.size >= max(min_keep, 1):
        return c if keep.size == c.size else c.select(keep, c.is_sorted)
    return c.select(top_positions(c.logits, min_keep), True)


def typical(c: Candidates, p: float, min_keep: int) -> Candidates:
    """Locally typical sampling: tokens whose surprise is closest to the entropy, until their
    probabilities sum to more than p; leaves them in that (not probability) order."""
    if p >= 1.0 or c.size == 0:
        return c
    c = c.sorted()
    probs = softmax(c.logits)
    with np.errstate(divide="ignore"):
        surprise = -np.log(probs)
    entropy = float(np.sum(probs[probs > 0] * surprise[probs > 0]))
    order = np.argsort(np.abs(surprise - entropy), kind="stable")
    hit = np.cumsum(probs[order]) > p
    hit[:max(min_keep, 1) - 1] = False
    keep = int(np.argmax(hit)) + 1 if hit.any() else c.size
    return c.select(order[:keep], False)


def top_n_sigma(c: Candidates, n: float) -> Candidates:
    """Tokens whose logit is within n standard deviations (of the finite logits) of the top."""
    if n <= 0.0 or c.size <= 1:
        return c
    x = c.logits
    values = x if x.min() > NEG_INF else x[x > NEG_INF]
    count = values.size
    if count == 0:
        return c
    mean = float(values.sum()) / count
    std = math.sqrt(max(float(np.dot(values, values)) / count - mean * mean, 0.0))
    keep = np.flatnonzero(x >= np.float32(float(values.max()) - n * std))
    return c.select(keep[np.argsort(-x[keep], kind="stable")], True)


def xtc(c: Candidates, threshold: float, min_keep: int) -> Candidates:
    """Exclude Top Choices (once the caller's coin says so): of the tokens with probability
    >= threshold, drop all but the least likely one."""
    if c.size <= SMALL_SET:
        c = c.sorted()
    lse = logsumexp(c.logits)
    bound = lse + math.log(threshold) - 1e-3 if threshold > 0 else -math.inf
    near = np.flatnonzero((c.logits >= np.float32(bound)) & (c.logits > NEG_INF))
    above = near[np.exp(c.logits[near].astype(np.float64) - lse) >= threshold]
    n_drop = above.size - 1
    if n_drop <= 0 or c.size - n_drop < min_keep:
        return c
    drop = above[np.argsort(-c.logits[above], kind="stable")[:n_drop]]
    keep = np.ones(c.size, bool)
    keep[drop] = False
    return c.select(np.flatnonzero(keep), c.is_sorted)


def temperature(c: Candidates, t: float) -> Candidates:
    """Divide the logits by t; t <= 0 keeps only the (first) most likely token."""
    if c.size == 0:
        return c
    if t <= 0.0:
        return c.select(np.array([int(np.argmax(c.logits))]), True)
    return Candidates(c.ids, c.logits / np.float32(t), c.is_sorted, c.full)


def dynamic_temperature(c: Candidates, t: float, spread: float, exponent: float) -> Candidates:
    """Temperature in [t - spread, t + spread] (not below 0), higher when the candidates'
    normalized entropy is higher: t_lo + (t_hi - t_lo) * (H / log n) ** exponent."""
    if spread <= 0.0:
        return temperature(c, t)
    if c.size <= 1:
        return c
    if c.size <= SMALL_SET:
        c = c.sorted()
    return temperature(c, entropy_temperature(softmax(c.logits), t, spread, exponent))


def entropy_temperature(probs: np.ndarray, t: float, spread: float, exponent: float) -> float:
    lo, hi = max(0.0, t - spread), t + spread
    nz = probs[probs > 0]
    normalized = float(-np.sum(nz * np.log(nz))) / math.log(probs.size)
    return lo + (hi - lo) * normalized ** exponent


def shift(c: Candidates, tokens: np.ndarray, deltas: np.ndarray) -> Candidates:
    """Add deltas to the logits of `tokens` (ascending, unique) where they are candidates."""
    pos, which = c.locate(tokens)
    if pos.size:
        c = c.writable()
        c.logits[pos] += deltas[which].astype(np.float32)
        c.is_sorted = False
    return c


def penalize(c: Candidates, tokens: np.ndarray, counts: np.ndarray, repeat: float, frequency: float,
             presence: float) -> Candidates:
    """Repetition penalty (divide positive logits, multiply negative ones) then frequency and
    presence penalties, for `tokens` (ascending, unique) seen `counts` times."""
    pos, which = c.locate(tokens)
    if pos.size == 0:
        return c
    c = c.writable()
    x = c.logits[pos]
    x = np.where(x <= 0, x * np.float32(repeat), x / np.float32(repeat))
    c.logits[pos] = x - (counts[which] * frequency + presence).astype(np.float32)
    c.is_sorted = False
    return c
