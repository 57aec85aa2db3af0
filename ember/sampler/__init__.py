"""Turning logits into tokens: a chain of small samplers with a per-sequence seeded RNG."""
from .chain import Sampler, SamplingParams, log_softmax

__all__ = ["Sampler", "SamplingParams", "log_softmax"]
