"""The sampler chain: candidates are narrowed by each step in llama.cpp's default order
(top-k, top-p, min-p, then temperature), then one is drawn with the sequence's RNG.

Each step is a function (logits, params) -> logits that masks candidates with -inf,
so steps compose in any order and stay testable on small hand-made distributions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEG_INF = -np.inf


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    min_keep: int = 1
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_keep < 1:
            raise ValueError(f"min_keep must be >= 1, got {self.min_keep}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def greedy_params(cls) -> "SamplingParams":
        return cls(temperature=0.0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities along the last axis, computed in float64."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top_k(logits: np.ndarray, k: int, min_keep: int) -> np.ndarray:
    k = max(k, min_keep)
    if k <= 0 or k >= logits.size:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, NEG_INF)


def top_p(logits: np.ndarray, p: float, min_keep: int) -> np.ndarray:
    """Keep the most likely tokens whose cumulative probability first reaches p."""
    if p >= 1.0:
        return logits
    candidates = np.flatnonzero(logits > NEG_INF)
    order = candidates[np.argsort(-logits[candidates], kind="stable")]
    probs = np.exp(log_softmax(logits[order]))
    keep = int(np.searchsorted(np.cumsum(probs), p) + 1)
    keep = max(keep, min_keep)
    out = np.full_like(logits, NEG_INF)
    out[order[:keep]] = logits[order[:keep]]
    return out


def min_p(logits: np.ndarray, p: float, min_keep: int) -> np.ndarray:
    """Drop tokens whose probability is below p times the most likely one's."""
    if p <= 0.0:
        return logits
    threshold = logits.max() + np.log(p)
    kept = logits >= threshold
    if kept.sum() < min_keep:
        return top_k(logits, min_keep, min_keep)
    return np.where(kept, logits, NEG_INF)


class Sampler:
    """Samples one sequence's tokens; holds its RNG so a seed reproduces a run."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        logits = np.asarray(logits, np.float64)
        if p.greedy:
            return int(np.argmax(logits))
        logits = top_k(logits, p.top_k, p.min_keep)
        logits = top_p(logits, p.top_p, p.min_keep)
        logits = min_p(logits, p.min_p, p.min_keep)
        candidates = np.flatnonzero(logits > NEG_INF)
        probs = np.exp(log_softmax(logits[candidates] / p.temperature))
        return int(candidates[self.rng.choice(len(candidates), p=probs / probs.sum())])
