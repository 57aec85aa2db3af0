"""The decoder most families share, configured by what each changes: RMSNorm before (and/or after)
attention and feed-forward, rotary grouped-query attention, a gated feed-forward. A family module
reads its metadata into a `Config` and its tensors through `Layer`; the forward pass is this one.

What a family may change: q/k/v/output biases; per-head or whole-projection QK norm; norms before,
after, or both ("sandwich"); SiLU or GELU-tanh gate; fused QKV and gate/up tensors; partial rotary
and rotary frequency factors; layers without rotary; sliding-window layers with their own rotary;
embedding, residual, attention and logit scales; attention-score and final-logit soft-caps; query
temperature by position; attention sinks. The feed-forward is one gated MLP per layer, or a mixture of experts
(`Config.experts`, see _moe.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..backends import RopeParams
from ._moe import Experts, ExpertWeights, moe_feed_forward
from .base import MAX_ROPE_BASE, KVCache, Metadata, Model, Step, check_layers, rope_dims, rope_scaling


@dataclass(frozen=True, slots=True)
class Config:
    n_layer: int
    d_model: int
    d_ff: int
    n_head: int
    n_kv_head: int
    head_dim: int
    eps: float
    n_ctx_train: int
    rope: RopeParams
    attn_scale: float  # multiplies q.k
    rope_local: RopeParams | None = None  # rotary of sliding-window layers (None: `rope`)
    window: int = 0  # sliding window of the local layers (0: none)
    swa_period: int = 0  # layer i is local when i % period < period - 1 (0: every layer, if window)
    no_rope_period: int = 0  # layer i has no rotary when (i + 1) % period == 0 (0: never)
    qk_norm: str = ""  # "head": RMSNorm of each head of q and k; "full": of the whole projections
    pre_norm: bool = True  # attn_norm / ffn_norm before each block
    post_norm: bool = False  # post_attention_norm / post_ffw_norm after each block
    gelu: bool = False  # GELU-tanh gate instead of SiLU
    embd_scale: float = 1.0
    residual_scale: float = 1.0  # multiplies each block's output before the residual add
    logit_scale: float = 1.0  # logits are divided by it
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    temp_length: int = 0  # > 0: queries *= 1 + temp_scale * log(floor(pos / temp_length) + 1)
    temp_scale: float = 0.0
    experts: Experts | None = None  # a mixture of experts in place of the gated MLP
    ffn_norm: str = "ffn_norm"  # the pre-norm of the feed-forward (gpt-oss: post_attention_norm)
    sinks: bool = False  # attn_sinks: a logit per head in each softmax's denominator (gpt-oss)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def is_local(self, layer: int) -> bool:
        if self.window <= 0:
            return False
        return self.swa_period <= 1 or layer % self.swa_period < self.swa_period - 1

    def has_rope(self, layer: int) -> bool:
        return self.no_rope_period <= 0 or (layer + 1) % self.no_rope_period != 0


def attention_shape(hp: Metadata) -> dict:
    """Widths and heads: n_head, n_kv_head (a divisor), head_dim (key_length, else d_model / n_head)."""
    d_model, n_head = hp.int("embedding_length", lo=1), hp.int("attention.head_count", lo=1)
    n_kv_head = hp.int("attention.head_count_kv", n_head, lo=1, hi=n_head)
    hp.check("attention.head_count_kv", n_head % n_kv_head == 0, n_kv_head,
             f"a divisor of attention.head_count ({n_head})")
    if hp.get("attention.key_length") is None:
        hp.check("attention.head_count", d_model % n_head == 0, n_head,
                 f"a divisor of embedding_length ({d_model}) where attention.key_length is not given")
    head_dim = hp.int("attention.key_length", d_model // n_head, lo=2)
    hp.check("attention.value_length", hp.get("attention.value_length", head_dim) == head_dim,
             hp.get("attention.value_length"), f"attention.key_length ({head_dim}): other value sizes are not supported")
    return dict(n_layer=hp.int("block_count", lo=1), d_model=d_model, d_ff=hp.int("feed_forward_length", lo=1),
                n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim)


def base_config(hp: Metadata, neox: bool, eps: float | None = None, ctx: int = 4096, freq_base: float = 10000.0,
                **changes) -> Config:
    """A Config from the metadata every family has (shape, norm epsilon, context, rotary with its
    scaling), with `changes` on top."""
    shape = attention_shape(hp)
    base = hp.float("rope.freq_base", freq_base, above=0.0, at_most=MAX_ROPE_BASE)
    rope = rope_scaling(hp, rope_dims(hp, shape["head_dim"]), neox=neox, freq_base=base)
    args = dict(shape, eps=hp.float("attention.layer_norm_rms_epsilon", eps, above=0.0, at_most=1.0),
                n_ctx_train=hp.int("context_length", ctx, lo=1), rope=rope,
                attn_scale=1.0 / math.sqrt(shape["head_dim"]))
    args.update(changes)
    return Config(**args)


def sliding_window(hp: Metadata, period: int) -> dict:
    """attention.sliding_window (0 or absent: none) and its layer pattern (sliding_window_pattern,
    or the family's `period`)."""
    window = hp.int("attention.sliding_window", 0)
    if window == 0:
        return {}
    return dict(window=window, swa_period=hp.int("attention.sliding_window_pattern", period, lo=1, hi=1 << 16))


class Layer:
    """One block's tensors, by GGUF name; which are read follows the Config."""

    def __init__(self, w, i: int, c: Config):
        p, d = f"blk.{i}.", c.d_model
        self.local, self.rotary = c.is_local(i), c.has_rope(i)
        self.attn_norm = w.vector(p + "attn_norm.weight", d) if c.pre_norm else None
        if p + "attn_qkv.weight" in w.gguf.tensors:
            self.wq, self.wk, self.wv = w.split(p + "attn_qkv.weight", [c.q_dim, c.kv_dim, c.kv_dim], d)
        else:
            self.wq = w.get(p + "attn_q.weight", (c.q_dim, d))
            self.wk = w.get(p + "attn_k.weight", (c.kv_dim, d))
            self.wv = w.get(p + "attn_v.weight", (c.kv_dim, d))
        self.bq, self.bk, self.bv, self.bo = (
            w.vector(p + f"attn_{n}.bias", size, optional=True)
            for n, size in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim), ("output", d)))
        if c.qk_norm:
            full = c.qk_norm == "full"
            self.q_norm = w.vector(p + "attn_q_norm.weight", c.q_dim if full else c.head_dim)
            self.k_norm = w.vector(p + "attn_k_norm.weight", c.kv_dim if full else c.head_dim)
        self.wo = w.get(p + "attn_output.weight", (d, c.q_dim))
        self.post_attn_norm = w.vector(p + "post_attention_norm.weight", d) if c.post_norm else None
        self.sinks = w.vector(p + "attn_sinks.weight", c.n_head) if c.sinks else None
        self.ffn_norm = w.vector(p + f"{c.ffn_norm}.weight", d) if c.pre_norm else None
        self.post_ffn_norm = w.vector(p + "post_ffw_norm.weight", d) if c.post_norm else None
        self.experts = ExpertWeights(w, p, d, c.experts) if c.experts else None
        if not self.experts:
            self.mlp(w, p, c)

    def mlp(self, w, p: str, c: Config) -> None:
        d = c.d_model
        if p + "ffn_gate.weight" in w.gguf.tensors:
            self.w_gate = w.get(p + "ffn_gate.weight", (c.d_ff, d))
            self.w_up = w.get(p + "ffn_up.weight", (c.d_ff, d))
        else:  # gate and up stacked in ffn_up (Phi-3)
            self.w_gate, self.w_up = w.split(p + "ffn_up.weight", [c.d_ff, c.d_ff], d)
        self.w_down = w.get(p + "ffn_down.weight", (d, c.d_ff))


class Decoder(Model):
    """A family's model: `config(hp)` reads its metadata; the rest is shared."""

    arch = ""

    def __init__(self, gguf, backend):
        super().__init__(gguf, backend)
        hp = Metadata(gguf.metadata, self.arch)
        self.args = c = self.config(hp)
        check_layers(gguf, hp, c.n_layer)
        self.embeddings(gguf, hp, c.d_model)
        w = self.weights
        self.layers = [Layer(w, i, c) for i in range(c.n_layer)]
        self.out_norm = w.vector("output_norm.weight", c.d_model)
        self.out_bias = w.vector("output.bias", self.n_vocab, optional=True)
        self.n_ctx_train = c.n_ctx_train

    @classmethod
    def config(cls, hp: Metadata) -> Config:
        raise NotImplementedError

    def forward(self, step: Step, cache: KVCache):
        return self.logits(self.trunk(step, cache), step, self.out_norm, self.args.eps, self.head)

    def trunk(self, step: Step, cache: KVCache):
        c, B, n = self.args, self.backend, step.n
        x = self.buffers.get("x", n, c.d_model)
        self.embed(self.tok_embd, step, x)
        if c.embd_scale != 1.0:
            B.scale(x, c.embd_scale)
        for layer, kv in zip(self.layers, cache.layers):
            self.attention(layer, kv, x, step)
            self.feed_forward(layer, x, n)
        return x

    def finish_logits(self, out) -> None:
        c, B = self.args, self.backend
        if self.out_bias is not None:
            B.add_bias(out, self.out_bias)
        if c.logit_scale != 1.0:
            B.scale(out, 1.0 / c.logit_scale)
        if c.final_softcap > 0:
            B.softcap(out, c.final_softcap)

    def attention(self, L: Layer, kv, x, step: Step) -> None:
        c, B, buf, n = self.args, self.backend, self.buffers, step.n
        h = buf.get("h", n, c.d_model)
        q, k, v = buf.get("q", n, c.q_dim), buf.get("k", n, c.kv_dim), buf.get("v", n, c.kv_dim)
        if L.attn_norm is not None:
            B.rms_norm(x, L.attn_norm, c.eps, h)
            B.matmuls([L.wq, L.wk, L.wv], h, [q, k, v])
        else:
            B.matmuls([L.wq, L.wk, L.wv], x, [q, k, v])
        for b, out in ((L.bq, q), (L.bk, k), (L.bv, v)):
            if b is not None:
                B.add_bias(out, b)
        if c.qk_norm:  # rows of the weight's length: one head, or the whole projection
            B.rms_norm(q, L.q_norm, c.eps, q)
            B.rms_norm(k, L.k_norm, c.eps, k)
        if L.rotary:
            rope = c.rope_local if L.local and c.rope_local is not None else c.rope
            B.rope(q, c.n_head, step.attn, rope)
            B.rope(k, c.n_kv_head, step.attn, rope)
        B.kv_store(kv, k, v, step.attn)
        if c.temp_length:  # after the store (queries only): norm, rotary and store stay one fused group on CUDA
            B.pos_scale(q, step.attn, c.temp_length, c.temp_scale)
        att = buf.get("att", n, c.q_dim)
        B.attention(q, kv, att, step.attn, c.n_head, c.n_kv_head, c.window if L.local else 0, c.attn_scale,
                    c.attn_softcap, L.sinks)
        B.matmul(L.wo, att, h)
        if L.bo is not None:
            B.add_bias(h, L.bo)
        self.residual(x, h, L.post_attn_norm)

    def feed_forward(self, L: Layer, x, n: int) -> None:
        c, B, buf = self.args, self.backend, self.buffers
        h = buf.get("h", n, c.d_model)
        if L.experts:
            if L.ffn_norm is not None:
                B.rms_norm(x, L.ffn_norm, c.eps, h)
            moe_feed_forward(B, buf, L.experts, c.experts, h if L.ffn_norm is not None else x, h)
            self.residual(x, h, L.post_ffn_norm)
            return
        gate, up = buf.get("gate", n, c.d_ff), buf.get("up", n, c.d_ff)
        if L.ffn_norm is not None:
            B.rms_norm(x, L.ffn_norm, c.eps, h)
            B.matmuls([L.w_gate, L.w_up], h, [gate, up])
        else:
            B.matmuls([L.w_gate, L.w_up], x, [gate, up])
        (B.gelu_mul if c.gelu else B.silu_mul)(gate, up, gate)
        B.matmul(L.w_down, gate, h)
        self.residual(x, h, L.post_ffn_norm)

    def residual(self, x, h, post_norm) -> None:
        """x += the block's output h (normed after, scaled, where the family does)."""
        c, B = self.args, self.backend
        if post_norm is not None:
            B.rms_norm(h, post_norm, c.eps, h)
        if c.residual_scale != 1.0:
            B.scale(h, c.residual_scale)
        B.add(x, h, x)
