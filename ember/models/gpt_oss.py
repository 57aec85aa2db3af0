"""gpt-oss (OpenAI's open-weight MoE, `gpt-oss` in GGUF): attention with q/k/v/output biases and a
learned sink logit per head, sliding-window (attention.sliding_window) and full layers alternating
(even layers local), NEOX rotary with YaRN; a mixture of experts after `post_attention_norm` whose
router and experts have biases, top-k of the router's logits with a softmax over the chosen (the same
weights as softmax, top-k and renormalisation), and the clamped SwiGLU (alpha 1.702, limit 7). The
experts are MXFP4 in the released files."""
from __future__ import annotations

from dataclasses import replace

from ._decoder import Config, Decoder, base_config, sliding_window
from ._moe import experts_config


class GptOssModel(Decoder):
    arch = "gpt-oss"

    @classmethod
    def config(cls, hp) -> Config:
        c = base_config(hp, neox=True, freq_base=150000.0, ffn_norm="post_attention_norm", sinks=True,
                        **sliding_window(hp, period=2))
        return replace(c, experts=experts_config(hp, act="swiglu_oai"))


Model = GptOssModel
