"""Nomic's BERT (nomic-embed-text): bert.py's encoder with rotary positions (NEOX order, no
position embeddings), a fused QKV projection and a SiLU-gated feed-forward."""
from __future__ import annotations

from dataclasses import replace

from .base import MAX_ROPE_BASE, Metadata, rope_dims, rope_scaling
from .bert import BertModel, Config


class NomicBertModel(BertModel):
    arch = "nomic-bert"

    @classmethod
    def config(cls, hp: Metadata) -> Config:
        c = super().config(hp)
        base = hp.float("rope.freq_base", 1000.0, above=0.0, at_most=MAX_ROPE_BASE)
        return replace(c, rope=rope_scaling(hp, rope_dims(hp, c.head_dim), neox=True, freq_base=base), gated=True)


Model = NomicBertModel
