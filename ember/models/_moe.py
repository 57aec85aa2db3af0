"""Mixture-of-experts feed-forward: a router picks each token's experts, each chosen expert is a
gated MLP, and their outputs are summed by the router's weights. The experts of a layer are stacked
3-D tensors (ffn_{gate,up,down}_exps: expert, rows, columns); the backend groups a step's tokens by
expert (`expert_matmuls`), so each chosen expert's weights are read once per step and the others not
at all, and keeps the routing on its side (no host round trip)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import Metadata

MAX_EXPERTS = 256  # of one layer (DeepSeek-V3 has 256; the CPU kernels' bound)
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU


@dataclass(frozen=True, slots=True)
class Experts:
    n_expert: int
    n_used: int  # experts each token takes
    d_ff: int  # width of each expert's MLP
    norm: bool = True  # the chosen experts' probabilities divided by their sum
    act: str = "silu"  # the experts' gate: "silu", "gelu", or "swiglu_oai" (gpt-oss: clamped, alpha 1.702)

    def __post_init__(self):
        if self.act not in ("silu", "gelu", "swiglu_oai"):
            raise ValueError(f"experts: unknown activation {self.act!r}")
        if not 1 <= self.n_used <= self.n_expert <= MAX_EXPERTS:
            raise ValueError(f"experts: need 1 <= used ({self.n_used}) <= count ({self.n_expert}) <= {MAX_EXPERTS}")


def experts_config(hp: Metadata, norm: bool = True, act: str = "silu") -> Experts:
    """expert_count, expert_used_count and expert_feed_forward_length (else, as llama.cpp reads it,
    feed_forward_length / expert_used_count)."""
    n_expert = hp.int("expert_count", lo=1, hi=MAX_EXPERTS)
    n_used = hp.int("expert_used_count", lo=1, hi=n_expert)
    d_ff = hp.int("expert_feed_forward_length", hp.int("feed_forward_length", lo=1) // n_used, lo=1)
    return Experts(n_expert, n_used, d_ff, norm, act)


class ExpertWeights:
    """One layer's router and stacked experts, by GGUF name, with their biases where the file has
    them (gpt-oss)."""

    def __init__(self, w, prefix: str, d_model: int, e: Experts):
        p, n = prefix, e.n_expert
        self.router = w.get(p + "ffn_gate_inp.weight", (n, d_model))
        self.gate = w.get(p + "ffn_gate_exps.weight", (n, e.d_ff, d_model))
        self.up = w.get(p + "ffn_up_exps.weight", (n, e.d_ff, d_model))
        self.down = w.get(p + "ffn_down_exps.weight", (n, d_model, e.d_ff))
        self.router_b = w.vector(p + "ffn_gate_inp.bias", n, optional=True)
        self.gate_b, self.up_b, self.down_b = (
            w.get(p + f"ffn_{name}_exps.bias", (n, size), optional=True)
            for name, size in (("gate", e.d_ff), ("up", e.d_ff), ("down", d_model)))


def moe_feed_forward(B, buf, W: ExpertWeights, e: Experts, h, out) -> None:
    """out (n, d) = the experts' weighted sum for the normed input h (n, d)."""
    n, k = h.shape[0], e.n_used
    logits = buf.get("router", n, e.n_expert)
    B.matmul(W.router, h, logits)
    if W.router_b is not None:
        B.add_bias(logits, W.router_b)
    ids, weights = buf.get("expert_ids", n, k, np.int32), buf.get("expert_weights", n, k)
    B.route_experts(logits, k, e.norm, ids, weights)
    gate, up = buf.get("expert_gate", n * k, e.d_ff), buf.get("expert_up", n * k, e.d_ff)
    B.expert_matmuls([W.gate, W.up], h, ids, [gate, up])
    for bias, rows in ((W.gate_b, gate), (W.up_b, up)):
        if bias is not None:
            B.expert_bias(rows, bias, ids)
    if e.act == "swiglu_oai":
        B.swiglu_oai(gate, up, gate, OAI_ALPHA, OAI_LIMIT)
    else:
        (B.gelu_mul if e.act == "gelu" else B.silu_mul)(gate, up, gate)
    y = buf.get("expert_out", n * k, h.shape[1])
    B.expert_matmuls([W.down], gate, ids, [y])
    if W.down_b is not None:
        B.expert_bias(y, W.down_b, ids)
    B.expert_sum(y, weights, out)
