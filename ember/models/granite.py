"""Granite 3.x (dense): the Llama layout with four scales: embeddings (embedding_scale), each
block's output before the residual add (residual_scale), attention scores (attention.scale, in
place of 1/sqrt(head_dim)) and logits (divided by logit_scale). rope.scaling.finetuned = false
turns rotary off."""
from __future__ import annotations

from dataclasses import replace

from ._decoder import Config, Decoder, base_config


class GraniteModel(Decoder):
    arch = "granite"

    @classmethod
    def config(cls, hp) -> Config:
        rotary = hp.get("rope.scaling.finetuned", True)
        hp.check("rope.scaling.finetuned", isinstance(rotary, bool), rotary, "true or false")

        def scale(key: str, default: float) -> float:
            return hp.float(key, default, above=0.0, at_most=1e6)

        c = base_config(hp, neox=False, no_rope_period=0 if rotary else 1, embd_scale=scale("embedding_scale", 1.0),
                        residual_scale=scale("residual_scale", 1.0), logit_scale=scale("logit_scale", 1.0))
        return replace(c, attn_scale=scale("attention.scale", c.attn_scale))


Model = GraniteModel
