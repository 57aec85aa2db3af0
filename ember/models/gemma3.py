"""Gemma 3 decoder: five sliding-window (local) layers to each global one, the local ones with
their own rotary base; per-head QK-norm; norms before and after attention and feed-forward;
GELU-tanh gate; embeddings scaled by sqrt(d). Norm weights in GGUF already include Gemma's +1."""
from __future__ import annotations

import math
from dataclasses import replace

from ._decoder import Config, Decoder, base_config

SWA_PERIOD = 6  # layers 5, 11, 17 ... attend globally (as llama.cpp fixes it for this family)
WINDOW = 512  # when the file does not say
LOCAL_ROPE_BASE = 10000.0


class Gemma3Model(Decoder):
    arch = "gemma3"

    @classmethod
    def config(cls, hp) -> Config:
        c = base_config(hp, neox=True, eps=1e-6, ctx=32768, freq_base=1e6, qk_norm="head", post_norm=True, gelu=True,
                        window=hp.int("attention.sliding_window", WINDOW, lo=1), swa_period=SWA_PERIOD)
        hp.check("attention.key_length", c.head_dim % 2 == 0, c.head_dim, "an even head size (all of it is rotated)")
        # The 27B model (62 layers) scales queries by 1/sqrt(d_model / n_head), the others by 1/sqrt(head_dim).
        scale_dim = c.d_model // c.n_head if c.n_layer == 62 else c.head_dim
        return replace(c, embd_scale=math.sqrt(c.d_model), attn_scale=1.0 / math.sqrt(scale_dim),
                       rope_local=replace(c.rope, freq_base=LOCAL_ROPE_BASE, freq_scale=1.0, ext_factor=0.0,
                                          attn_factor=1.0))


Model = Gemma3Model
