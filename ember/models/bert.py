"""BERT encoders (sentence-transformers' MiniLM, BGE, E5, bert rerankers): token, token-type and
absolute position embeddings with a layer norm; per layer bidirectional attention with biases,
a residual and a layer norm, then a GELU feed-forward, a residual and a layer norm (nomic_bert.py:
the same with rotary positions and a SiLU-gated feed-forward). No
language-model head: the model gives hidden states for embeddings (and a classification head's
scores for reranking); it does not generate.

Attention is bidirectional within each sequence: the keys and values go through the paged cache as
in a decoder, and every token attends as if it stood at its sequence's last position, so it sees
the whole sequence (the engine runs encoder sequences whole, one step each).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backends import AttentionBatch, RopeParams
from .base import KVCache, Metadata, Model, ModelError, Step, check_layers
from ._decoder import attention_shape


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
    rope: RopeParams | None = None  # rotary positions (None: absolute position embeddings)
    gated: bool = False  # SiLU(gate) * up, no biases (else GELU(up + bias))

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim


class Layer:
    def __init__(self, w, i: int, c: Config):
        p, d = f"blk.{i}.", c.d_model
        if p + "attn_qkv.weight" in w.gguf.tensors:
            self.wq, self.wk, self.wv = w.split(p + "attn_qkv.weight", [c.q_dim, c.kv_dim, c.kv_dim], d)
        else:
            self.wq = w.get(p + "attn_q.weight", (c.q_dim, d))
            self.wk = w.get(p + "attn_k.weight", (c.kv_dim, d))
            self.wv = w.get(p + "attn_v.weight", (c.kv_dim, d))
        self.bq, self.bk, self.bv = (w.vector(p + f"attn_{n}.bias", size, optional=True)
                                     for n, size in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim)))
        self.wo = w.get(p + "attn_output.weight", (d, c.q_dim))
        self.bo = w.vector(p + "attn_output.bias", d, optional=True)
        self.attn_norm = w.vector(p + "attn_output_norm.weight", d)
        self.attn_norm_b = w.vector(p + "attn_output_norm.bias", d)
        self.w_up = w.get(p + "ffn_up.weight", (c.d_ff, d))
        self.w_down = w.get(p + "ffn_down.weight", (d, c.d_ff))
        self.w_gate = w.get(p + "ffn_gate.weight", (c.d_ff, d)) if c.gated else None
        # a gated feed-forward runs without biases (as llama.cpp runs nomic-bert's)
        self.b_up = None if c.gated else w.vector(p + "ffn_up.bias", c.d_ff, optional=True)
        self.b_down = None if c.gated else w.vector(p + "ffn_down.bias", d, optional=True)
        self.out_norm = w.vector(p + "layer_output_norm.weight", d)
        self.out_norm_b = w.vector(p + "layer_output_norm.bias", d)


def whole_sequences(attn: AttentionBatch) -> AttentionBatch:
    """The batch with every token placed at its sequence's last position: causal attention over it
    is bidirectional attention over each (whole) sequence."""
    last = np.zeros(int(attn.seq_rows.max()) + 1 if len(attn.seq_rows) else 0, np.int32)
    np.maximum.at(last, attn.seq_rows, attn.positions)
    return AttentionBatch(last[attn.seq_rows], attn.seq_rows, attn.block_tables, attn.slots, attn.page_size)


class BertModel(Model):
    arch = "bert"
    causal = False
    generates = False

    def __init__(self, gguf, backend):
        super().__init__(gguf, backend)
        hp = Metadata(gguf.metadata, self.arch)
        self.args = c = self.config(hp)
        check_layers(gguf, hp, c.n_layer)
        w = self.weights
        embd = gguf.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelError("tensor 'token_embd.weight' is missing from the file")
        self.n_vocab = embd.shape[0]
        self.tok_embd = w.get("token_embd.weight", (self.n_vocab, c.d_model), streamed=False)
        types = gguf.tensors.get("token_types.weight")
        self.type_embd = w.get("token_types.weight", (types.shape[0], c.d_model), streamed=False) if types is not None else None
        self.pos_embd = w.get("position_embd.weight", (c.n_ctx_train, c.d_model), streamed=False) if c.rope is None else None
        self.embd_norm = w.vector("token_embd_norm.weight", c.d_model)
        self.embd_norm_b = w.vector("token_embd_norm.bias", c.d_model)
        self.layers = [Layer(w, i, c) for i in range(c.n_layer)]
        self.n_ctx_train = c.n_ctx_train

    @classmethod
    def config(cls, hp: Metadata) -> Config:
        return Config(**attention_shape(hp), eps=hp.float("attention.layer_norm_epsilon", 1e-12, above=0.0, at_most=1.0),
                      n_ctx_train=hp.int("context_length", 512, lo=1))

    def forward(self, step: Step, cache: KVCache):
        raise ModelError("a BERT encoder gives embeddings; it has no language-model head to generate with")

    def hidden(self, step: Step, cache: KVCache) -> np.ndarray:
        return self.final_rows(self.trunk(step, cache), step)

    def trunk(self, step: Step, cache: KVCache):
        c, B, n = self.args, self.backend, step.n
        if self.pos_embd is not None and len(step.attn.positions) and int(step.attn.positions.max()) >= c.n_ctx_train:
            raise ModelError(f"a sequence longer than the model's {c.n_ctx_train} positions")
        x, e = self.buffers.get("x", n, c.d_model), self.buffers.get("e", n, c.d_model)
        B.get_rows(self.tok_embd, step.tokens, x)
        if self.type_embd is not None:  # every token is of type 0 ("sentence A"), as llama.cpp has it
            B.get_rows(self.type_embd, np.zeros(n, np.int32), e)
            B.add(x, e, x)
        if self.pos_embd is not None:
            B.get_rows(self.pos_embd, step.attn.positions, e)
            B.add(x, e, x)
        B.layer_norm(x, self.embd_norm, self.embd_norm_b, c.eps, x)
        everyone = whole_sequences(step.attn)
        for layer, kv in zip(self.layers, cache.layers):
            self.attention(layer, kv, x, step.attn, everyone)
            self.feed_forward(layer, x, n)
        return x

    def attention(self, L: Layer, kv, x, attn: AttentionBatch, everyone: AttentionBatch) -> None:
        c, B, buf, n = self.args, self.backend, self.buffers, attn.n_tokens
        q, k, v = buf.get("q", n, c.q_dim), buf.get("k", n, c.kv_dim), buf.get("v", n, c.kv_dim)
        B.matmuls([L.wq, L.wk, L.wv], x, [q, k, v])
        for b, out in ((L.bq, q), (L.bk, k), (L.bv, v)):
            if b is not None:
                B.add_bias(out, b)
        if c.rope is not None:
            B.rope(q, c.n_head, attn, c.rope)
            B.rope(k, c.n_kv_head, attn, c.rope)
        B.kv_store(kv, k, v, attn)
        att, h = buf.get("att", n, c.q_dim), buf.get("h", n, c.d_model)
        B.attention(q, kv, att, everyone, c.n_head, c.n_kv_head, 0, 1.0 / math.sqrt(c.head_dim))
        B.matmul(L.wo, att, h)
        if L.bo is not None:
            B.add_bias(h, L.bo)
        B.add(x, h, x)
        B.layer_norm(x, L.attn_norm, L.attn_norm_b, c.eps, x)

    def feed_forward(self, L: Layer, x, n: int) -> None:
        c, B, buf = self.args, self.backend, self.buffers
        up, h = buf.get("up", n, c.d_ff), buf.get("h", n, c.d_model)
        if L.w_gate is not None:
            gate = buf.get("gate", n, c.d_ff)
            B.matmuls([L.w_gate, L.w_up], x, [gate, up])
            B.silu_mul(gate, up, up)
        else:
            B.matmul(L.w_up, x, up)
            if L.b_up is not None:
                B.add_bias(up, L.b_up)
            B.gelu(up, up)
        B.matmul(L.w_down, up, h)
        if L.b_down is not None:
            B.add_bias(h, L.b_down)
        B.add(x, h, x)
        B.layer_norm(x, L.out_norm, L.out_norm_b, c.eps, x)


Model = BertModel
