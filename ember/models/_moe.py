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


@dataclass(frozen=True, slots=True)
class Experts:
    n_expert: int
    n_used: int  # experts each token takes
    d_ff: int  # width of each expert's MLP
    norm: bool = True  # the chosen experts' probabilities divided by their sum

    def __post_init__(self):
        if not 1 <= self.n_used <= self.n_expert <= MAX_EXPERTS:
            raise ValueError(f"experts: need 1 <= used ({self.n_used}) <= count ({self.n_expert}) <= {MAX_EXPERTS}")


def experts_config(hp: Metadata, norm: bool = True) -> Experts:
    """expert_count, expert_used_count and expert_feed_forward_length (else, as llama.cpp reads it,
    feed_forward_length / expert_used_count)."""
    n_expert = hp.int("expert_count", lo=1, hi=MAX_EXPERTS)
    n_used = hp.int("expert_used_count", lo=1, hi=n_expert)
    d_ff = hp.int("expert_feed_forward_length", hp.int("feed_forward_length", lo=1) // n_used, lo=1)
    return Experts(n_expert, n_used, d_ff, norm)


class ExpertWeights:
    """One layer's router and stacked experts, by GGUF name."""

    def __init__(self, w, prefix: str, d_model: int, e: Experts):
        self.router = w.get(prefix + "ffn_gate_inp.weight", (e.n_expert, d_model))
        self.gate = w.get(prefix + "ffn_gate_exps.weight", (e.n_expert, e.d_ff, d_model))
        self.up = w.get(prefix + "ffn_up_exps.weight", (e.n_expert, e.d_ff, d_model))
        self.down = w.get(prefix + "ffn_down_exps.weight", (e.n_expert, d_model, e.d_ff))


def moe_feed_forward(B, buf, W: ExpertWeights, e: Experts, h, out, gelu: bool = False) -> None:
    """out (n, d) = the experts' weighted sum for the normed input h (n, d)."""
    n, k = h.shape[0], e.n_used
    logits = buf.get("router", n, e.n_expert)
    B.matmul(W.router, h, logits)
    ids, weights = buf.get("expert_ids", n, k, np.int32), buf.get("expert_weights", n, k)
    B.route_experts(logits, k, e.norm, ids, weights)
    gate, up = buf.get("expert_gate", n * k, e.d_ff), buf.get("expert_up", n * k, e.d_ff)
    B.expert_matmuls([W.gate, W.up], h, ids, [gate, up])
    (B.gelu_mul if gelu else B.silu_mul)(gate, up, gate)
    y = buf.get("expert_out", n * k, h.shape[1])
    B.expert_matmuls([W.down], gate, ids, [y])
    B.expert_sum(y, weights, out)
