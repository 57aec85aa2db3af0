"""Shared by the quantized KV cache tests of the CPU (test_kv_types.py) and CUDA (test_cuda_kv.py)
backends, without the CPU extension: paged batches over quantized rows, the float64 attention they
are checked against, and a model stepped over a page table."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ember.quant import dequantize, quantize
from ember.quant.types import GGMLType, layout


@dataclass(frozen=True)
class AttnCase:
    n_head: int
    n_kv_head: int
    hd_k: int
    hd_v: int
    page_size: int
    window: int
    softcap: float
    seqs: tuple  # (context length, query tokens at its end) per sequence
    interleave: bool = False  # tokens of different sequences interleaved in the batch


CASES = {
    "gqa3_prefill_chunk": AttnCase(9, 3, 64, 64, 16, 0, 0.0, ((180, 100), (20, 3))),
    "hd256_long_decode": AttnCase(4, 1, 256, 256, 256, 0, 0.0, ((2000, 1),)),  # key range split over threads
    "gqa3_long_decode_window": AttnCase(9, 3, 64, 64, 16, 1000, 0.0, ((1500, 1), (1200, 2))),
    "gqa4_softcap": AttnCase(8, 2, 64, 64, 16, 0, 30.0, ((150, 40),)),
}


def quantized_batch(case: AttnCase, rng, k_type: GGMLType, v_type: GGMLType):
    """Sequences on shuffled pages of caches of the given types, and the values those rows stand for
    (float64), per sequence."""
    ps = case.page_size
    n_pages = [math.ceil(length / ps) for length, _ in case.seqs]
    total = sum(n_pages) + 1
    perm = rng.permutation(total - 1)
    k_cache = np.zeros((total * ps, layout(k_type).row_bytes(case.n_kv_head * case.hd_k)), np.uint8)
    v_cache = np.zeros((total * ps, layout(v_type).row_bytes(case.n_kv_head * case.hd_v)), np.uint8)
    tables = np.full((len(case.seqs), max(n_pages) + 1), total - 1, np.int32)
    keys, values, toks, start = [], [], [], 0
    for s, (length, n_q) in enumerate(case.seqs):
        pages = perm[start:start + n_pages[s]]
        start += n_pages[s]
        tables[s, :n_pages[s]] = pages
        k = rng.standard_normal((length, case.n_kv_head * case.hd_k)).astype(np.float32)
        v = rng.standard_normal((length, case.n_kv_head * case.hd_v)).astype(np.float32)
        p = np.arange(length)
        slots = pages[p // ps] * ps + p % ps
        k_cache[slots], v_cache[slots] = quantize(k, k_type), quantize(v, v_type)
        keys.append(dequantize(k_cache[slots], k_type).astype(np.float64).reshape(length, case.n_kv_head, -1))
        values.append(dequantize(v_cache[slots], v_type).astype(np.float64).reshape(length, case.n_kv_head, -1))
        toks += [(s, pos) for pos in range(length - n_q, length)]
    q = rng.standard_normal((len(toks), case.n_head, case.hd_k)).astype(np.float32)
    pos = np.array([p for _, p in toks], np.int32)
    seq = np.array([s for s, _ in toks], np.int32)
    return q, k_cache, v_cache, keys, values, pos, seq, tables


class Ref:
    """What attention_ref reads of a batch."""

    def __init__(self, q, keys, values, pos, seq):
        self.q, self.keys, self.values, self.tok_pos, self.tok_owner = q, keys, values, pos, seq


def attention_ref(case: AttnCase, b: Ref, scale: float, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal attention in float64 over the values the rows stand for; sinks: a logit per head in
    each softmax's denominator."""
    group = case.n_head // case.n_kv_head
    out = np.empty((len(b.tok_pos), case.n_head, case.hd_v))
    for t, (pos, s) in enumerate(zip(b.tok_pos, b.tok_owner)):
        first = max(0, pos - case.window + 1) if case.window > 0 else 0
        k, v = b.keys[s][first:pos + 1], b.values[s][first:pos + 1]
        for h in range(case.n_head):
            scores = k[:, h // group] @ b.q[t, h].astype(np.float64) * scale
            if case.softcap > 0:
                scores = case.softcap * np.tanh(scores / case.softcap)
            top = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
            p = np.exp(scores - top)
            out[t, h] = p @ v[:, h // group] / (p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top)))
    return out


def step_logits(model, cache, tokens: list[int], n_prompt: int) -> list[np.ndarray]:
    """A prompt step of tokens[:n_prompt], then one decode step a token, on pages in reverse order."""
    from ember.backends import AttentionBatch
    from ember.models import Step

    P = cache.page_size
    table = np.arange(cache.n_pages)[::-1].astype(np.int32)[None, :]
    out, at = [], 0
    for end in [n_prompt] + list(range(n_prompt + 1, len(tokens) + 1)):
        pos = np.arange(at, end, dtype=np.int32)
        slots = table[0, pos // P].astype(np.int64) * P + pos % P
        attn = AttentionBatch(pos, np.zeros(len(pos), np.int32), table, slots, P)
        step = Step(np.asarray(tokens[at:end], np.int32), attn, np.array([len(pos) - 1], np.int32))
        out.append(np.array(model.forward(step, cache), np.float64)[0])
        at = end
    return out
