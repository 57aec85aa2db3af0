"""OLMo 2 (and OLMo 3, same architecture name): norms after attention and after the feed-forward
instead of before; RMSNorm of the whole query and key projections before NEOX rotary. Where the
file gives attention.sliding_window (OLMo 3), three layers of four are local, with plain rotary."""
from __future__ import annotations

from dataclasses import replace

from ._decoder import Config, Decoder, base_config, sliding_window

SWA_PERIOD = 4


class Olmo2Model(Decoder):
    arch = "olmo2"

    @classmethod
    def config(cls, hp) -> Config:
        c = base_config(hp, neox=True, qk_norm="full", pre_norm=False, post_norm=True, **sliding_window(hp, SWA_PERIOD))
        if not c.window:
            return c
        local_base = hp.float("rope.freq_base_swa", c.rope.freq_base, above=0.0, at_most=1e12)
        return replace(c, rope_local=replace(c.rope, freq_base=local_base, freq_scale=1.0, ext_factor=0.0,
                                             attn_factor=1.0))


Model = Olmo2Model
