"""Phi-3 / Phi-4-mini: fused QKV and gate/up tensors, NEOX rotary over the first rope.dimension_count
dimensions of each head (partial rotary), LongRoPE: per-dimension frequency factors, the short
set up to the original context length and the long set beyond it, with the rotary magnitude
scaled by rope.scaling.attn_factor."""
from __future__ import annotations

from dataclasses import replace

from ._decoder import Config, Decoder, base_config


class Phi3Model(Decoder):
    arch = "phi3"

    def __init__(self, gguf, backend):
        super().__init__(gguf, backend)
        n = self.args.rope.n_rot // 2
        self.factors = {kind: self.weights.vector(f"rope_factors_{kind}.weight", n, optional=True)
                        for kind in ("short", "long")}
        self.set_context(self.args.rope.n_ctx_orig or self.args.n_ctx_train)

    @classmethod
    def config(cls, hp) -> Config:
        c = base_config(hp, neox=True)
        attn_factor = hp.float("rope.scaling.attn_factor", 1.0, above=0.0, at_most=1e3)
        return replace(c, rope=replace(c.rope, attn_factor=c.rope.attn_factor * attn_factor))

    def set_context(self, n_ctx: int) -> None:
        """The long factors where sequences may run past the original context, as llama.cpp picks them."""
        orig = self.args.rope.n_ctx_orig or self.args.n_ctx_train
        w = self.factors["long" if n_ctx > orig else "short"]
        if w is not None:
            self.args = replace(self.args, rope=replace(self.args.rope, freq_factors=w.data))


Model = Phi3Model
