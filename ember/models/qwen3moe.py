"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (NEOX rotary, RMSNorm of each query
and key head) and a mixture of experts in every layer: softmax router, top-k experts with their
weights renormalised to sum to one, SiLU-gated experts, no shared expert."""
from __future__ import annotations

from dataclasses import replace

from ._decoder import Config, Decoder, base_config
from ._moe import experts_config


class Qwen3MoeModel(Decoder):
    arch = "qwen3moe"

    @classmethod
    def config(cls, hp) -> Config:
        return replace(base_config(hp, neox=True, freq_base=1e6, qk_norm="head"), experts=experts_config(hp))


Model = Qwen3MoeModel
