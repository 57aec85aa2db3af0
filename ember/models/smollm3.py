"""SmolLM3: the Llama layout without rotary on every fourth layer (NoPE layers 3, 7, 11 ...)."""
from __future__ import annotations

from ._decoder import Config, Decoder, base_config

NO_ROPE_PERIOD = 4


class SmolLM3Model(Decoder):
    arch = "smollm3"

    @classmethod
    def config(cls, hp) -> Config:
        return base_config(hp, neox=False, no_rope_period=NO_ROPE_PERIOD)


Model = SmolLM3Model
