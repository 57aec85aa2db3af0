"""Float64 numpy backend: the exact computation every fast kernel is checked against.

Weights are dequantized once with the numpy references of `ember.quant` and kept in
float64; the KV cache is float64 too, so nothing is rounded on the way. Slow and
memory-hungry by design: use it for tests and as an oracle, not to serve.
"""
from __future__ import annotations

import numpy as np

from ..quant import dequantize, quantize
from ..quant.types import GGMLType
from .base import KV_TYPES, AttentionBatch, Capabilities, KVLayer, RopeParams, Weight

F = np.float64


class Backend:
    name = "reference"
    capabilities = Capabilities(top_k=True, kv_types=frozenset(KV_TYPES.values()))

    def __init__(self, device: str = "reference", threads: int | None = None):
        self.n_threads = 1

    def supports(self, qtype) -> bool:
        from ..quant import DEQUANTIZABLE

        return qtype in DEQUANTIZABLE

    def weight(self, tensor, streamed: bool = True) -> Weight:
        rows = dequantize(tensor.array(), tensor.type).astype(F).reshape(tensor.shape)
        return Weight(tensor.name, tensor.type, tuple(tensor.shape), rows)

    def settle(self) -> None:  # the reference reads the file's mapping as it is
        pass

    def empty(self, shape, dtype=np.float32):
        return np.empty(shape, dtype=F if dtype == np.float32 else dtype)

    def from_numpy(self, a: np.ndarray):
        return a.astype(F) if a.dtype == np.float32 else a

    def to_numpy(self, a) -> np.ndarray:
        return np.asarray(a)

    def kv_cache(self, n_slots: int, k_dim: int, v_dim: int, k_type=GGMLType.F16, v_type=GGMLType.F16):
        return KVLayer(np.zeros((n_slots, k_dim), F), np.zeros((n_slots, v_dim), F), k_type, v_type)

    def get_rows(self, w: Weight, ids, out) -> None:
        out[...] = w.data[np.asarray(ids)]

    def matmul(self, w: Weight, x, out) -> None:
        out[...] = x @ w.data.T

    def matmuls(self, ws, x, outs) -> None:
        for w, out in zip(ws, outs):
            self.matmul(w, x, out)

    def gather_rows(self, x, rows, out) -> None:
        out[...] = x[np.asarray(rows)]

    def top_k(self, logits, k: int, ids, vals) -> None:
        """ids (n, k) and vals (n, k) = each row's k largest logits, best first (lowest id on ties):
        what a device backend returns instead of whole rows."""
        order = np.argsort(-np.asarray(logits), axis=1, kind="stable")[:, :k]
        ids[...] = order
        vals[...] = np.take_along_axis(np.asarray(logits), order, axis=1)

    def add_bias(self, x, b: Weight) -> None:
        x += b.data

    def rms_norm(self, x, w, eps, out) -> None:
        d = w.shape[-1] if w is not None else x.shape[-1]
        rows = x.reshape(-1, d)
        y = rows / np.sqrt(np.mean(rows * rows, axis=1, keepdims=True) + eps)
        if w is not None:
            y = y * w.data
        out.reshape(-1, d)[...] = y

    def rope(self, x, n_head: int, batch: AttentionBatch, p: RopeParams) -> None:
        n = batch.n_tokens
        heads = x.reshape(n, n_head, -1)
        cos, sin = rope_angles(batch.positions, p)  # (n, n_rot/2)
        half = p.n_rot // 2
        if p.neox:
            a, b = heads[..., :half].copy(), heads[..., half : p.n_rot].copy()
            heads[..., :half] = a * cos[:, None] - b * sin[:, None]
            heads[..., half : p.n_rot] = a * sin[:, None] + b * cos[:, None]
        else:
            a, b = heads[..., 0 : p.n_rot : 2].copy(), heads[..., 1 : p.n_rot : 2].copy()
            heads[..., 0 : p.n_rot : 2] = a * cos[:, None] - b * sin[:, None]
            heads[..., 1 : p.n_rot : 2] = a * sin[:, None] + b * cos[:, None]

    def silu_mul(self, gate, up, out) -> None:
        out[...] = gate / (1.0 + np.exp(-gate)) * up

    def gelu_mul(self, gate, up, out) -> None:
        g = gate
        out[...] = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3))) * up

    def add(self, a, b, out) -> None:
        np.add(a, b, out=out)

    def layer_norm(self, x, w, b, eps, out) -> None:
        mean = x.mean(axis=1, keepdims=True)
        y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=1, keepdims=True) + eps)
        out[...] = y * (w.data if w is not None else 1.0) + (b.data if b is not None else 0.0)

    def gelu(self, x, out) -> None:
        out[...] = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    def tanh(self, x) -> None:
        np.tanh(x, out=x)

    def scale(self, x, s: float) -> None:
        x *= s

    def softcap(self, x, cap: float) -> None:
        x[...] = cap * np.tanh(x / cap)

    def pos_scale(self, x, batch: AttentionBatch, length: int, scale: float, offset: float = 0.0) -> None:
        pos = np.asarray(batch.positions, F)
        x *= (1.0 + scale * np.log(np.floor((pos + offset) / length) + 1.0))[:, None]

    def kv_store(self, cache, k, v, batch: AttentionBatch) -> None:
        cache.k[batch.slots] = _stored(hadamard(k, cache.k_rot), cache.k_type)
        cache.v[batch.slots] = _stored(hadamard(v, cache.v_rot), cache.v_type)

    def attention(self, q, cache, out, batch: AttentionBatch, n_head, n_kv_head, window, scale, softcap=0.0,
                  sinks=None):
        k_cache, v_cache = cache
        if isinstance(cache, KVLayer) and (cache.k_rot or cache.v_rot):
            rotated = np.empty_like(out)
            self.attention(hadamard(q, cache.k_rot), KVLayer(k_cache, v_cache), rotated, batch, n_head, n_kv_head,
                           window, scale, softcap)
            out[...] = hadamard(rotated, cache.v_rot)
            return
        n = batch.n_tokens
        hd_k = k_cache.shape[1] // n_kv_head
        hd_v = v_cache.shape[1] // n_kv_head
        group = n_head // n_kv_head
        for t in range(n):
            pos = int(batch.positions[t])
            first = max(0, pos - window + 1) if window > 0 else 0
            slots = token_slots(batch, t, np.arange(first, pos + 1))
            keys = k_cache[slots].reshape(-1, n_kv_head, hd_k)
            vals = v_cache[slots].reshape(-1, n_kv_head, hd_v)
            qt = q[t].reshape(n_head, hd_k)
            for h in range(n_head):
                s = keys[:, h // group] @ qt[h] * scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                top = s.max() if sinks is None else max(s.max(), sinks.data[h])
                p = np.exp(s - top)
                sink = 0.0 if sinks is None else np.exp(sinks.data[h] - top)
                out[t].reshape(n_head, hd_v)[h] = p @ vals[:, h // group] / (p.sum() + sink)


    def route_experts(self, logits, k: int, norm: bool, ids, weights) -> None:
        z = np.asarray(logits, F)
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        ids[...] = np.argsort(-p, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(p, np.asarray(ids, np.int64), axis=1)
        weights[...] = w / np.maximum(w.sum(axis=1, keepdims=True), 6.103515625e-5) if norm else w

    def expert_matmuls(self, ws, x, ids, outs) -> None:
        sel = np.asarray(ids).reshape(-1)
        rows = np.arange(len(sel)) // (1 if len(x) == len(sel) else ids.shape[1])
        for e in np.unique(sel):
            mine = np.flatnonzero(sel == e)
            for w, out in zip(ws, outs):
                out[mine] = x[rows[mine]] @ w.data[e].T

    def expert_bias(self, y, b, ids) -> None:
        y += b.data[np.asarray(ids).reshape(-1)]

    def swiglu_oai(self, gate, up, out, alpha: float, limit: float) -> None:
        g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
        out[...] = g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)

    def expert_sum(self, y, weights, out) -> None:
        n, k = weights.shape
        out[...] = np.einsum("tu,tud->td", weights, y.reshape(n, k, -1))


def hadamard(x: np.ndarray, block: int) -> np.ndarray:
    """x (n, d) rotated in blocks of `block` values by the orthonormal Walsh-Hadamard matrix (x where
    block is 0)."""
    if not block:
        return x
    h = np.ones((1, 1))
    while len(h) < block:
        h = np.block([[h, h], [h, -h]])
    x = np.asarray(x, F)
    return (x.reshape(len(x), -1, block) @ (h / np.sqrt(block))).reshape(x.shape)


def _stored(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """The values a cache of type t holds for x: exact for F16 (this backend's float64 reference),
    else rounded through the numpy quantizer of the type."""
    if t == GGMLType.F16:
        return x
    return dequantize(quantize(np.asarray(x, np.float32), t), t, np.shape(x)).astype(F)


def token_slots(batch: AttentionBatch, t: int, positions: np.ndarray) -> np.ndarray:
    """Cache slots of `positions` in the sequence of token t."""
    table = batch.block_tables[batch.seq_rows[t]]
    return table[positions // batch.page_size].astype(np.int64) * batch.page_size + positions % batch.page_size


def rope_angles(positions: np.ndarray, p: RopeParams) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n, n_rot/2) of ggml's rope with YaRN, linear scaling and frequency factors."""
    half = p.n_rot // 2
    i = np.arange(half, dtype=F)
    theta_extrap = np.asarray(positions, F)[:, None] * p.freq_base ** (-2.0 * i / p.n_rot)
    if p.freq_factors is not None:
        theta_extrap = theta_extrap / np.asarray(p.freq_factors, F)[None, :]
    theta_interp = p.freq_scale * theta_extrap
    theta, mscale = theta_interp, p.attn_factor
    if p.ext_factor != 0.0:
        low, high = yarn_corr_dims(p)
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * p.ext_factor
        theta = theta_interp * (1 - mix) + theta_extrap * mix
        mscale *= 1.0 + 0.1 * np.log(1.0 / p.freq_scale)
    return np.cos(theta) * mscale, np.sin(theta) * mscale


def yarn_corr_dims(p: RopeParams) -> tuple[float, float]:
    """The rotation-dimension range over which YaRN blends interpolation and extrapolation."""

    def corr_dim(n_rot_turns: float) -> float:
        return p.n_rot * np.log(p.n_ctx_orig / (n_rot_turns * 2 * np.pi)) / (2 * np.log(p.freq_base))

    low = np.floor(corr_dim(p.beta_fast))
    high = np.ceil(corr_dim(p.beta_slow))
    return max(0.0, low), min(p.n_rot - 1.0, high)
