"""Turning logits into tokens: llama.cpp's samplers as a configurable chain of small
functions, with per-sequence state (penalty windows, mirostat mu, a seeded random stream)
in a forkable Sampler."""
from .params import DEFAULT_SAMPLERS, SamplingParams
from .sampler import Sampler, TokenLogprobs, log_softmax
from .vocab import SamplerVocab

__all__ = ["DEFAULT_SAMPLERS", "Sampler", "SamplerVocab", "SamplingParams", "TokenLogprobs", "log_softmax"]
