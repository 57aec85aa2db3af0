"""Turning logits into tokens: llama.cpp's samplers as a configurable chain of small
functions, with per-sequence state (penalty windows, mirostat mu, a seeded random stream)
in a forkable Sampler."""
from .params import DEFAULT_SAMPLERS, SamplingParams
from .sampler import NoTokenAllowed, NonFiniteLogits, Sampler, SamplingError, TokenLogprobs, log_softmax
from .vocab import SamplerVocab

__all__ = ["DEFAULT_SAMPLERS", "NoTokenAllowed", "NonFiniteLogits", "Sampler", "SamplerVocab", "SamplingError",
           "SamplingParams", "TokenLogprobs", "log_softmax"]
