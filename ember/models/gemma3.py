"""Gemma 3 decoder: interleaved sliding-window (local) and global attention layers,
QK-norm, norms before and after attention and feed-forward, GELU-tanh gated FFN,
embeddings scaled by sqrt(d). Norm weights in GGUF already include Gemma's +1."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..backends import RopeParams
from .base import MAX_ROPE_BASE, KVCache, Metadata, Model, Step, check_layers, rope_scaling

# Every sixth layer attends globally; the others see a sliding window.
GLOBAL_EVERY = 6
LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True, slots=True)
class ModelArgs:
    n_layer: int
    d_model: int
    d_ff: int
    n_head: int
    n_kv_head: int
    head_dim: int
    eps: float
    n_ctx_train: int
    window: int
    attn_scale: float
    rope_global: RopeParams
    rope_local: RopeParams

    @classmethod
    def from_metadata(cls, hp: Metadata) -> "ModelArgs":
        d_model, n_head = hp.int("embedding_length", lo=1), hp.int("attention.head_count", lo=1)
        n_kv_head = hp.int("attention.head_count_kv", n_head, lo=1, hi=n_head)
        hp.check("attention.head_count_kv", n_head % n_kv_head == 0, n_kv_head,
                 f"a divisor of attention.head_count ({n_head})")
        if hp.get("attention.key_length") is None:
            hp.check("attention.head_count", d_model % n_head == 0, n_head,
                     f"a divisor of embedding_length ({d_model}) where attention.key_length is not given")
        head_dim = hp.int("attention.key_length", d_model // n_head, lo=2)
        hp.check("attention.key_length", head_dim % 2 == 0, head_dim, "an even head size (all of it is rotated)")
        hp.check("attention.value_length", hp.get("attention.value_length", head_dim) == head_dim,
                 hp.get("attention.value_length"),
                 f"attention.key_length ({head_dim}): other value sizes are not supported")
        n_layer, n_ctx_train = hp.int("block_count", lo=1), hp.int("context_length", 32768, lo=1)
        freq_base = hp.float("rope.freq_base", 1e6, above=0.0, at_most=MAX_ROPE_BASE)
        rope_global = rope_scaling(hp, head_dim, neox=True, freq_base=freq_base)
        # The 27B model scales queries by 1/sqrt(d_model / n_head) instead of 1/sqrt(head_dim).
        scale_dim = d_model // n_head if n_layer == 62 else head_dim
        return cls(
            n_layer=n_layer, d_model=d_model, d_ff=hp.int("feed_forward_length", lo=1),
            n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
            eps=hp.float("attention.layer_norm_rms_epsilon", 1e-6, above=0.0, at_most=1.0),
            n_ctx_train=n_ctx_train,
            window=hp.int("attention.sliding_window", 512, lo=1),
            attn_scale=1.0 / math.sqrt(scale_dim),
            rope_global=rope_global,
            rope_local=replace(rope_global, freq_base=LOCAL_ROPE_BASE, freq_scale=1.0, ext_factor=0.0,
                               attn_factor=1.0),
        )

    def is_local(self, layer: int) -> bool:
        return (layer + 1) % GLOBAL_EVERY != 0


class Layer:
    def __init__(self, w, i: int, a: ModelArgs):
        p = f"blk.{i}."
        d, q_dim, kv_dim = a.d_model, a.n_head * a.head_dim, a.n_kv_head * a.head_dim
        self.local = a.is_local(i)
        self.attn_norm = w.vector(p + "attn_norm.weight", d)
        self.wq = w.get(p + "attn_q.weight", (q_dim, d))
        self.wk = w.get(p + "attn_k.weight", (kv_dim, d))
        self.wv = w.get(p + "attn_v.weight", (kv_dim, d))
        self.q_norm = w.vector(p + "attn_q_norm.weight", a.head_dim)
        self.k_norm = w.vector(p + "attn_k_norm.weight", a.head_dim)
        self.wo = w.get(p + "attn_output.weight", (d, q_dim))
        self.post_attn_norm = w.vector(p + "post_attention_norm.weight", d)
        self.ffn_norm = w.vector(p + "ffn_norm.weight", d)
        self.w_gate = w.get(p + "ffn_gate.weight", (a.d_ff, d))
        self.w_up = w.get(p + "ffn_up.weight", (a.d_ff, d))
        self.w_down = w.get(p + "ffn_down.weight", (d, a.d_ff))
        self.post_ffn_norm = w.vector(p + "post_ffw_norm.weight", d)


class Gemma3Model(Model):
    arch = "gemma3"

    def __init__(self, gguf, backend):
        super().__init__(gguf, backend)
        hp = Metadata(gguf.metadata, "gemma3")
        self.args = a = ModelArgs.from_metadata(hp)
        w = self.weights
        check_layers(gguf, hp, a.n_layer)
        self.embeddings(gguf, hp, a.d_model)
        self.layers = [Layer(w, i, a) for i in range(a.n_layer)]
        self.out_norm = w.vector("output_norm.weight", a.d_model)
        self.n_ctx_train = a.n_ctx_train

    def forward(self, step: Step, cache: KVCache):
        return self.logits(self.trunk(step, cache), step, self.out_norm, self.args.eps, self.head)

    def trunk(self, step: Step, cache: KVCache):
        a, B, n = self.args, self.backend, step.n
        x = self.buffers.get("x", n, a.d_model)
        self.embed(self.tok_embd, step, x)
        B.scale(x, math.sqrt(a.d_model))
        for layer, kv in zip(self.layers, cache.layers):
            self.attention(layer, kv, x, step)
            self.feed_forward(layer, x, n)
        return x

    def attention(self, L: Layer, kv, x, step: Step) -> None:
        a, B, buf, n = self.args, self.backend, self.buffers, step.n
        q_dim, kv_dim = a.n_head * a.head_dim, a.n_kv_head * a.head_dim
        h = buf.get("h", n, a.d_model)
        q, k, v = buf.get("q", n, q_dim), buf.get("k", n, kv_dim), buf.get("v", n, kv_dim)
        B.rms_norm(x, L.attn_norm, a.eps, h)
        B.matmuls([L.wq, L.wk, L.wv], h, [q, k, v])
        B.rms_norm(q, L.q_norm, a.eps, q)  # per head: rows of head_dim
        B.rms_norm(k, L.k_norm, a.eps, k)
        rope = a.rope_local if L.local else a.rope_global
        B.rope(q, a.n_head, step.attn, rope)
        B.rope(k, a.n_kv_head, step.attn, rope)
        B.kv_store(kv, k, v, step.attn)
        att = buf.get("att", n, q_dim)
        B.attention(q, kv, att, step.attn, a.n_head, a.n_kv_head, a.window if L.local else 0, a.attn_scale)
        B.matmul(L.wo, att, h)
        B.rms_norm(h, L.post_attn_norm, a.eps, h)
        B.add(x, h, x)

    def feed_forward(self, L: Layer, x, n: int) -> None:
        a, B, buf = self.args, self.backend, self.buffers
        h = buf.get("h", n, a.d_model)
        gate, up = buf.get("gate", n, a.d_ff), buf.get("up", n, a.d_ff)
        B.rms_norm(x, L.ffn_norm, a.eps, h)
        B.matmuls([L.w_gate, L.w_up], h, [gate, up])
        B.gelu_mul(gate, up, gate)
        B.matmul(L.w_down, gate, h)
        B.rms_norm(h, L.post_ffn_norm, a.eps, h)
        B.add(x, h, x)


Model = Gemma3Model
