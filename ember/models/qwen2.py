"""Qwen2 / Qwen2.5 (and the DeepSeek-R1 distills built on them): the shared decoder with q/k/v
biases and NEOX-ordered rotary."""
from __future__ import annotations

from ._decoder import Config, Decoder, base_config


class Qwen2Model(Decoder):
    arch = "qwen2"

    @classmethod
    def config(cls, hp) -> Config:
        return base_config(hp, neox=True, freq_base=1e6)


Model = Qwen2Model
