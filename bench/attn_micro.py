"""Decode attention of the CPU kernel alone: n sequences x `rows` query tokens (1, or a drafted step's
rows) at a context of `ctx` tokens, through `layers` separate f16 caches (as a decode step walks its
layers), SmolLM2-135M's heads (9 query heads, 3 kv heads, head dim 64) by default. With --shared N the
sequences' first N keys are on the same pages (one system prompt in the prefix cache), which the kernel
reads once for all of them. Prints one JSON object: milliseconds per step (all layers; median of reps),
the KV bytes a step would read sequence by sequence, and that over the time.

    python bench/attn_micro.py [--seqs 8] [--rows 1] [--ctx 1400] [--shared 0] [--layers 30]
                               [--threads 1 2] [--reps 15] [--in-order] [--huge] [--parts 1]

Findings: bench/NOTES.md, "Decode attention of 8 sequences at 1,400 tokens on the CPU".
"""
from __future__ import annotations

import argparse
import json
import math
import mmap
import statistics
import time

import numpy as np

from ember.backends.cpu._native import ffi, lib

F16 = 1


def buf(a: np.ndarray, ctype: str = "float"):
    return ffi.from_buffer(f"{ctype}[]", a)


def cache_array(shape, huge: bool) -> np.ndarray:
    if not huge:
        return np.zeros(shape, np.uint16)
    m = mmap.mmap(-1, int(np.prod(shape)) * 2)
    m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, np.uint16).reshape(shape)


def make_layer(rng, n_seq: int, ctx: int, shared: int, n_kv: int, hd: int, ps: int, huge: bool, in_order: bool):
    pages, common = math.ceil(ctx / ps), shared // ps
    total = common + n_seq * (pages - common)
    # each sequence's pages in order (as a fresh cache hands them out), or scattered over the cache
    perm = (np.arange(total) if in_order else rng.permutation(total)).astype(np.int32)
    own = perm[common:].reshape(n_seq, pages - common)
    tables = np.concatenate([np.broadcast_to(perm[:common], (n_seq, common)), own], axis=1)
    k, v = cache_array((total * ps, n_kv, hd), huge), cache_array((total * ps, n_kv, hd), huge)
    k[:] = rng.standard_normal(k.shape).astype(np.float16).view(np.uint16)
    v[:] = rng.standard_normal(v.shape).astype(np.float16).view(np.uint16)
    return k, v, np.ascontiguousarray(tables)


def time_step(pool, layers, q, out, pos, seq, n_head, n_kv, hd, ps, parts: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for k, v, tables in layers:
            lib.ember_attention(pool, buf(q), buf(k, "uint16_t"), buf(v, "uint16_t"), buf(out), len(pos), n_head,
                                n_kv, hd, hd, buf(pos, "int32_t"), buf(seq, "int32_t"), buf(tables, "int32_t"),
                                tables.shape[1], ps, 0, 1.0 / math.sqrt(hd), 0.0, F16, F16, ffi.NULL, parts)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1, help="query tokens a sequence (drafted rows)")
    ap.add_argument("--ctx", type=int, default=1400)
    ap.add_argument("--shared", type=int, default=0, help="keys on pages every sequence shares")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--in-order", action="store_true", help="each sequence's pages consecutive in the cache")
    ap.add_argument("--huge", action="store_true", help="caches on memory advised for huge pages")
    ap.add_argument("--parts", type=int, default=0,
                    help="the caches' layout (api_ops.h): 1 = each slot's row whole; default: a part a kv head, "
                         "as the backend lays its caches out")
    a = ap.parse_args()
    parts = a.parts or a.kv_heads
    rng = np.random.default_rng(0)
    layers = [make_layer(rng, a.seqs, a.ctx, a.shared, a.kv_heads, a.head_dim, a.page_size, a.huge, a.in_order)
              for _ in range(a.layers)]
    n_tok = a.seqs * a.rows
    q = rng.standard_normal((n_tok, a.heads, a.head_dim)).astype(np.float32)
    out = np.empty((n_tok, a.heads, a.head_dim), np.float32)
    pos = np.tile(np.arange(a.ctx - a.rows, a.ctx, dtype=np.int32), a.seqs)
    seq = np.repeat(np.arange(a.seqs, dtype=np.int32), a.rows)
    kv_bytes = a.layers * a.seqs * a.ctx * a.kv_heads * a.head_dim * 2 * 2
    result = {"isa": ffi.string(lib.ember_cpu_isa()).decode(), "huge": a.huge, "in_order": a.in_order, "seqs": a.seqs,
              "rows": a.rows, "parts": parts, "ctx": a.ctx, "shared": a.shared, "layers": a.layers, "kv_mb_per_step": round(kv_bytes / 1e6, 1)}
    for n in a.threads:
        pool = lib.ember_pool_create(n)
        s = time_step(pool, layers, q, out, pos, seq, a.heads, a.kv_heads, a.head_dim, a.page_size, parts, a.reps)
        lib.ember_pool_destroy(pool)
        result[f"{n}t"] = {"ms": round(s * 1e3, 2), "gb_s": round(kv_bytes / s / 1e9, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
