"""Ministral 3 / Mistral Small 3 text decoder: the Llama layout with YaRN rotary scaling (its
magnitude correction left out, as the reference does) and, where attention.temperature_scale is
given, queries tempered by position beyond the original context."""
from __future__ import annotations

import math
from dataclasses import replace

from ._decoder import Config, Decoder, base_config


class Mistral3Model(Decoder):
    arch = "mistral3"

    @classmethod
    def config(cls, hp) -> Config:
        c = base_config(hp, neox=False, freq_base=1e6)
        if c.rope.ext_factor:  # yarn: cancel the 1 + 0.1 ln(factor) magnitude the rotation applies
            c = replace(c, rope=replace(c.rope, attn_factor=1.0 / (1.0 + 0.1 * math.log(1.0 / c.rope.freq_scale))))
        temp = hp.float("attention.temperature_scale", 0.0, at_most=1e3)
        if temp:
            hp.check("rope.scaling.original_context_length", c.rope.n_ctx_orig > 0, c.rope.n_ctx_orig,
                     "a context length from 1 (attention temperature needs it)")
            c = replace(c, temp_length=c.rope.n_ctx_orig, temp_scale=temp)
        return c


Model = Mistral3Model
