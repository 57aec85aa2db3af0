"""Mirostat v1 and v2: sample so that the surprise (-log2 p) of chosen tokens tracks tau,
adjusting the truncation value mu after every draw. Both replace llama.cpp's whole chain
(only logit bias and temperature run before them) and, like the rest, take the random
draw from the caller."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .candidates import (
    SORT_LIMIT,
    Candidates,
    logsumexp,
    mass_prefix,
    softmax,
    top_positions,
    top_set,
)

Draw = Callable[[], float]  # a uniform number in [0, 1)
ZIPF_TOKENS = 100  # llama.cpp's m: tokens used to estimate the Zipf exponent


def mirostat_v1(c: Candidates, tau: float, eta: float, mu: float, n_vocab: int,
                draw: Draw) -> tuple[Candidates, np.ndarray, int, float]:
    """Estimate the Zipf exponent s from the top tokens, keep the top k that makes the
    expected surprise mu, draw. Returns (kept candidates, their probabilities, index, new mu)."""
    head = top_positions(c.logits, ZIPF_TOKENS)
    if head.size <= 1:
        return _draw_and_update(c.select(head, True), draw, tau, eta, mu)
    s_hat = zipf_exponent(np.exp(c.logits[head].astype(np.float64) - logsumexp(c.logits)))
    k = truncation_size(s_hat, mu, n_vocab)
    return _draw_and_update(c.select(top_set(c.logits, k), False), draw, tau, eta, mu)


def zipf_exponent(sorted_probs: np.ndarray) -> float:
    """Least-squares fit of log(p_i / p_i+1) = s * log((i+2) / (i+1)) over the given tokens."""
    i = np.arange(sorted_probs.size - 1, dtype=np.float64)
    t = np.log((i + 2) / (i + 1))
    with np.errstate(divide="ignore"):
        b = np.log(sorted_probs[:-1] / sorted_probs[1:])
    return float(np.sum(t * b) / np.sum(t * t))


def truncation_size(s_hat: float, mu: float, n_vocab: int) -> int:
    """k = (eps * 2^mu / (1 - N^-eps)) ^ (1 / s), eps = s - 1; at least 1."""
    eps = s_hat - 1.0
    with np.errstate(all="ignore"):
        k = np.power(eps * 2.0 ** mu / (1.0 - np.power(float(n_vocab), -eps)), 1.0 / s_hat)
    if np.isnan(k) or k < 1:
        return 1
    return n_vocab if k >= n_vocab else int(k)


def mirostat_v2(c: Candidates, tau: float, eta: float, mu: float,
                draw: Draw) -> tuple[Candidates, np.ndarray, int, float]:
    """Keep the tokens whose surprise is at most mu (at least the top one), draw."""
    bound = logsumexp(c.logits) - mu * math.log(2.0)  # -log2 p <= mu  <=>  logit >= lse - mu ln 2
    keep = np.flatnonzero(c.logits >= np.float32(bound))
    if keep.size == 0:
        keep = top_positions(c.logits, 1)
    return _draw_and_update(c.select(keep, False), draw, tau, eta, mu)


def draw_discrete(probs: np.ndarray, draw: Draw) -> int:
    """std::discrete_distribution: first cumulative probability >= u (no draw for one token)."""
    if probs.size == 1:
        return 0
    cumulative = np.cumsum(probs / probs.sum())
    cumulative[-1] = 1.0
    return int(np.searchsorted(cumulative, draw(), side="left"))


def _draw_and_update(c: Candidates, draw: Draw, tau: float, eta: float,
                     mu: float) -> tuple[Candidates, np.ndarray, int, float]:
    """Draw from the kept tokens walked most likely first (as llama.cpp, which sorts them), then
    move mu by the surprise of the choice."""
    if c.size == 0:
        raise ValueError("no token is left to sample (every token is banned)")
    if c.size <= SORT_LIMIT:
        c = c.sorted()
    probs = softmax(c.logits)
    if c.is_sorted or c.size == 1:
        index = draw_discrete(probs, draw)
    else:  # many tokens (mu has grown large): find the walk's stop without sorting them
        index = int(mass_prefix(c.logits, draw())[-1])
    surprise = -math.log2(probs[index])
    return c, probs, index, mu - eta * (surprise - tau)
