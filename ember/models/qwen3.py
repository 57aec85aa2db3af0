"""Qwen3 (dense): NEOX rotary, RMSNorm of each query and key head before the rotation, head size
read from attention.key_length (not embedding_length / head_count)."""
from __future__ import annotations

from ._decoder import Config, Decoder, base_config


class Qwen3Model(Decoder):
    arch = "qwen3"

    @classmethod
    def config(cls, hp) -> Config:
        return base_config(hp, neox=True, freq_base=1e6, qk_norm="head")


Model = Qwen3Model
