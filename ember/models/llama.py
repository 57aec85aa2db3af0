"""Llama-family decoder (Llama 2/3, Mistral, SmolLM...): RMSNorm, rotary attention with
grouped-query heads, SwiGLU feed-forward. Optional q/k/v/o biases (Qwen2-style files)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .base import MAX_ROPE_BASE, KVCache, Metadata, Model, Step, check_layers, rope_dims, rope_scaling
from ..backends import RopeParams


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
    rope: RopeParams

    @classmethod
    def from_metadata(cls, hp: Metadata) -> "ModelArgs":
        d_model, n_head = hp.int("embedding_length", lo=1), hp.int("attention.head_count", lo=1)
        n_kv_head = hp.int("attention.head_count_kv", n_head, lo=1, hi=n_head)
        hp.check("attention.head_count_kv", n_head % n_kv_head == 0, n_kv_head,
                 f"a divisor of attention.head_count ({n_head})")
        if hp.get("attention.key_length") is None:
            hp.check("attention.head_count", d_model % n_head == 0, n_head,
                     f"a divisor of embedding_length ({d_model}) where attention.key_length is not given")
        head_dim = hp.int("attention.key_length", d_model // n_head, lo=1)
        hp.check("attention.value_length", hp.get("attention.value_length", head_dim) == head_dim,
                 hp.get("attention.value_length"),
                 f"attention.key_length ({head_dim}): other value sizes are not supported")
        freq_base = hp.float("rope.freq_base", 10000.0, above=0.0, at_most=MAX_ROPE_BASE)
        return cls(
            n_layer=hp.int("block_count", lo=1), d_model=d_model, d_ff=hp.int("feed_forward_length", lo=1),
            n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
            eps=hp.float("attention.layer_norm_rms_epsilon", 1e-5, above=0.0, at_most=1.0),
            n_ctx_train=hp.int("context_length", 4096, lo=1),
            rope=rope_scaling(hp, rope_dims(hp, head_dim), neox=False, freq_base=freq_base),
        )


class Layer:
    def __init__(self, w, i: int, a: ModelArgs):
        p = f"blk.{i}."
        d, q_dim, kv_dim = a.d_model, a.n_head * a.head_dim, a.n_kv_head * a.head_dim
        self.attn_norm = w.vector(p + "attn_norm.weight", d)
        self.wq = w.get(p + "attn_q.weight", (q_dim, d))
        self.wk = w.get(p + "attn_k.weight", (kv_dim, d))
        self.wv = w.get(p + "attn_v.weight", (kv_dim, d))
        self.wo = w.get(p + "attn_output.weight", (d, q_dim))
        self.bq, self.bk, self.bv, self.bo = (
            w.vector(p + f"attn_{n}.bias", size, optional=True)
            for n, size in (("q", q_dim), ("k", kv_dim), ("v", kv_dim), ("output", d)))
        self.ffn_norm = w.vector(p + "ffn_norm.weight", d)
        self.w_gate = w.get(p + "ffn_gate.weight", (a.d_ff, d))
        self.w_up = w.get(p + "ffn_up.weight", (a.d_ff, d))
        self.w_down = w.get(p + "ffn_down.weight", (d, a.d_ff))


class LlamaModel(Model):
    arch = "llama"

    def __init__(self, gguf, backend, arch: str = "llama"):
        super().__init__(gguf, backend)
        hp = Metadata(gguf.metadata, arch)
        a = ModelArgs.from_metadata(hp)
        w = self.weights
        factors = w.vector("rope_freqs.weight", a.rope.n_rot // 2, optional=True)  # per rotated pair
        self.args = a = replace(a, rope=replace(a.rope, freq_factors=factors.data)) if factors is not None else a
        check_layers(gguf, hp, a.n_layer)
        self.embeddings(gguf, hp, a.d_model)
        self.layers = [Layer(w, i, a) for i in range(a.n_layer)]
        self.out_norm = w.vector("output_norm.weight", a.d_model)
        self.n_ctx_train = a.n_ctx_train

    def forward(self, step: Step, cache: KVCache):
        return self.logits(self.trunk(step, cache), step, self.out_norm, self.args.eps, self.head)

    def trunk(self, step: Step, cache: KVCache):
        a, n = self.args, step.n
        x = self.buffers.get("x", n, a.d_model)
        self.embed(self.tok_embd, step, x)
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
        for b, out in ((L.bq, q), (L.bk, k), (L.bv, v)):
            if b is not None:
                B.add_bias(out, b)
        B.rope(q, a.n_head, step.attn, a.rope)
        B.rope(k, a.n_kv_head, step.attn, a.rope)
        B.kv_store(kv, k, v, step.attn)
        att = buf.get("att", n, q_dim)
        B.attention(q, kv, att, step.attn, a.n_head, a.n_kv_head, 0, 1.0 / math.sqrt(a.head_dim))
        B.matmul(L.wo, att, h)
        if L.bo is not None:
            B.add_bias(h, L.bo)
        B.add(x, h, x)

    def feed_forward(self, L: Layer, x, n: int) -> None:
        a, B, buf = self.args, self.backend, self.buffers
        h = buf.get("h", n, a.d_model)
        gate, up = buf.get("gate", n, a.d_ff), buf.get("up", n, a.d_ff)
        B.rms_norm(x, L.ffn_norm, a.eps, h)
        B.matmuls([L.w_gate, L.w_up], h, [gate, up])
        B.silu_mul(gate, up, gate)
        B.matmul(L.w_down, gate, h)
        B.add(x, h, x)


Model = LlamaModel
