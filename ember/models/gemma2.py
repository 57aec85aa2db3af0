"""Gemma 2: embeddings scaled by sqrt(d), norms before and after attention and feed-forward, GELU-tanh
gate, attention scores and final logits soft-capped (tanh), sliding-window attention on every
other layer. Norm weights in GGUF already include Gemma's +1."""
from __future__ import annotations

import math
from dataclasses import replace

from ._decoder import Config, Decoder, base_config

WINDOW = 4096  # when the file does not say
SWA_PERIOD = 2  # layers 0, 2, 4 ... are local


class Gemma2Model(Decoder):
    arch = "gemma2"

    @classmethod
    def config(cls, hp) -> Config:
        c = base_config(hp, neox=True, eps=1e-6, ctx=8192, pre_norm=True, post_norm=True, gelu=True,
                        attn_softcap=hp.float("attn_logit_softcapping", 50.0, above=0.0, at_most=1e6),
                        final_softcap=hp.float("final_logit_softcapping", 30.0, above=0.0, at_most=1e6),
                        window=hp.int("attention.sliding_window", WINDOW, lo=1),
                        swa_period=hp.int("attention.sliding_window_pattern", SWA_PERIOD, lo=1, hi=1 << 16))
        # The 27B model (46 layers) scales queries by 1/sqrt(d_model / n_head), the others by 1/sqrt(head_dim).
        scale_dim = c.d_model // c.n_head if c.n_layer == 46 else c.head_dim
        local_base = hp.float("rope.freq_base_swa", c.rope.freq_base, above=0.0, at_most=1e12)
        return replace(c, embd_scale=math.sqrt(c.d_model), attn_scale=1.0 / math.sqrt(scale_dim),
                       rope_local=replace(c.rope, freq_base=local_base))


Model = Gemma2Model
