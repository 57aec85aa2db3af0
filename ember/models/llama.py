"""Llama-family decoder (Llama 2/3, Mistral 7B/Nemo, SmolLM...): the shared decoder with RMSNorm
before each block, normal-ordered rotary (with Llama 3.1's per-pair frequency factors where the
file has rope_freqs), grouped-query attention and a SwiGLU feed-forward. Optional q/k/v/o biases."""
from __future__ import annotations

from dataclasses import replace

from ._decoder import Config, Decoder, base_config


class LlamaModel(Decoder):
    arch = "llama"

    def __init__(self, gguf, backend):
        super().__init__(gguf, backend)
        factors = self.weights.vector("rope_freqs.weight", self.args.rope.n_rot // 2, optional=True)
        if factors is not None:
            self.args = replace(self.args, rope=replace(self.args.rope, freq_factors=factors.data))

    @classmethod
    def config(cls, hp) -> Config:
        return base_config(hp, neox=False, eps=1e-5)


Model = LlamaModel
