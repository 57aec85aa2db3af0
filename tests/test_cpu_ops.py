"""The C kernels of api_ops.h against float64 numpy references, on every instruction-set path this CPU
runs and with one and two threads."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from ember.backends.cpu._native import ffi, lib
from kv_cases import AttnCase

F64 = np.float64


def runnable_isas() -> list[str]:
    original = ffi.string(lib.ember_cpu_isa())
    found = [name for name in ("scalar", "avx2", "avx512", "neon") if lib.ember_cpu_set_isa(name.encode()) == 0]
    lib.ember_cpu_set_isa(original)
    return found


ISAS = runnable_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    original = ffi.string(lib.ember_cpu_isa())
    assert lib.ember_cpu_set_isa(request.param.encode()) == 0
    yield request.param
    lib.ember_cpu_set_isa(original)


@pytest.fixture(scope="module")
def pools():
    made = {n: lib.ember_pool_create(n) for n in (1, 2)}
    yield made
    for p in made.values():
        lib.ember_pool_destroy(p)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def pool(request, pools):
    return pools[request.param]


def buf(a: np.ndarray, ctype: str = "float"):
    assert a.flags.c_contiguous
    return ffi.from_buffer(f"{ctype}[]", a)


def test_simd_paths_are_tested_where_the_cpu_has_them():
    features = ffi.string(lib.ember_cpu_features()).decode().split()
    if {"avx2", "fma", "f16c"} <= set(features):
        assert "avx2" in ISAS
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"} <= set(features):
        assert "avx512" in ISAS


# ---- elementwise ----

SIZES = [1, 7, 16, 17, 31, 1000, 70001]  # 70001: threaded, with an odd tail


def gate_values(rng, n: int) -> np.ndarray:
    g = (rng.standard_normal(n) * 3).astype(np.float32)
    extremes = np.array([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 8.0, -8.0], np.float32)
    g[: min(n, len(extremes))] = extremes[: min(n, len(extremes))]
    return g


def silu_ref(g, u):
    g = g.astype(F64)
    return g / (1.0 + np.exp(-g)) * u


def gelu_tanh_ref(g, u):
    # 0.5 g (1 + tanh(t)) written as g / (1 + exp(-2t)): equal, without float64's own cancellation for g < 0.
    g = g.astype(F64)
    t = np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-2.0 * t)) * u


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["silu", "gelu"])
def test_gated_activations(isa, pool, op, n):
    rng = np.random.default_rng(n)
    g, u = gate_values(rng, n), rng.standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    fn, ref = (lib.ember_silu_mul, silu_ref) if op == "silu" else (lib.ember_gelu_mul, gelu_tanh_ref)
    fn(pool, buf(g), buf(u), buf(out), n)
    # gelu: exp(-2t) for g < 0 amplifies the f32 rounding of t by |2t| (up to ~50 where it still matters).
    np.testing.assert_allclose(out, ref(g, u), rtol=2e-6 if op == "silu" else 1e-5, atol=1e-35)


@pytest.mark.parametrize("n", [1, 255, 257, 70000])
def test_gelu_alone_is_the_gated_form_against_ones(isa, pool, n):
    """The encoders' GELU (no gate) runs the vectorized gated kernel in 256-value runs: any length,
    split over threads, in place too."""
    rng = np.random.default_rng(n)
    g = gate_values(rng, n)
    out = np.full(n, np.nan, np.float32)
    lib.ember_gelu(pool, buf(g), buf(out), n)
    np.testing.assert_allclose(out, gelu_tanh_ref(g, np.ones(n, np.float32)), rtol=1e-5, atol=1e-35)
    lib.ember_gelu(pool, buf(g), buf(g), n)
    np.testing.assert_array_equal(g, out)


def test_gated_activation_may_write_over_its_gate(isa, pool):
    rng = np.random.default_rng(5)
    g, u = gate_values(rng, 999), rng.standard_normal(999).astype(np.float32)
    want = silu_ref(g, u)
    lib.ember_silu_mul(pool, buf(g), buf(u), buf(g), g.size)
    np.testing.assert_allclose(g, want, rtol=2e-6, atol=1e-35)


@pytest.mark.parametrize("n", SIZES)
def test_add_and_scale_round_like_numpy(pool, n):
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(a)
    lib.ember_add(pool, buf(a), buf(b), buf(out), n)
    np.testing.assert_array_equal(out, a + b)
    lib.ember_add(pool, buf(a), buf(b), buf(a), n)  # in place
    np.testing.assert_array_equal(a, out)
    lib.ember_scale(pool, buf(out), np.float32(-0.37), n)
    np.testing.assert_array_equal(out, a * np.float32(-0.37))


# ---- RMS norm ----


@pytest.mark.parametrize("n,d", [(1, 576), (7, 33), (3, 1), (200, 640)])  # 200 x 640: threaded
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(pool, n, d, weighted):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.01, 100, (n, 1))).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32) if weighted else None
    eps = 1e-6
    xd = x.astype(F64)
    want = xd / np.sqrt(np.mean(xd * xd, axis=1, keepdims=True) + eps) * (w if weighted else 1.0)
    out = np.full_like(x, np.nan)
    lib.ember_rms_norm(pool, buf(x), buf(w) if weighted else ffi.NULL, buf(out), n, d, eps)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    lib.ember_rms_norm(pool, buf(x), buf(w) if weighted else ffi.NULL, buf(x), n, d, eps)  # out aliases x
    np.testing.assert_array_equal(x, out)


def test_rms_norm_eps_dominates_a_zero_row(pool):
    x = np.zeros((2, 8), np.float32)
    x[1] = 1e-4
    out = np.empty_like(x)
    lib.ember_rms_norm(pool, buf(x), ffi.NULL, buf(out), 2, 8, 1e-5)
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_allclose(out[1], 1e-4 / math.sqrt(1e-8 + 1e-5), rtol=1e-6)


# ---- rotary embedding ----


@dataclass(frozen=True)
class Rope:
    n_rot: int
    neox: bool
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    with_freq_factors: bool = False


def as_float32_params(p: Rope) -> Rope:
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    return Rope(p.n_rot, p.neox, f32(p.freq_base), f32(p.freq_scale), f32(p.ext_factor), f32(p.attn_factor),
                f32(p.beta_fast), f32(p.beta_slow), p.n_ctx_orig, p.with_freq_factors)


def rope_ref(x: np.ndarray, pos: np.ndarray, p: Rope, freq_factors) -> np.ndarray:
    """ggml's rope (float64): theta = pos * base^(-2i/n_rot) / ff_i, YaRN blend on pairs [low, high]."""
    p = as_float32_params(p)  # what the kernel receives: at position 1e5, 0.7 vs float32(0.7) moves angles ~1e-3
    half = p.n_rot // 2
    i = np.arange(half, dtype=F64)
    extrap = pos.astype(F64)[:, None] * p.freq_base ** (-2.0 * i / p.n_rot)
    if freq_factors is not None:
        extrap = extrap / freq_factors.astype(F64)
    theta, mscale = p.freq_scale * extrap, p.attn_factor
    if p.ext_factor != 0.0:

        def corr_dim(turns):
            return p.n_rot * np.log(p.n_ctx_orig / (turns * 2 * np.pi)) / (2 * np.log(p.freq_base))

        low, high = max(0.0, np.floor(corr_dim(p.beta_fast))), min(p.n_rot - 1.0, np.ceil(corr_dim(p.beta_slow)))
        mix = (1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)) * p.ext_factor
        theta = theta * (1 - mix) + extrap * mix
        mscale *= 1.0 + 0.1 * np.log(1.0 / p.freq_scale)
    cos, sin = (np.cos(theta) * mscale)[:, None, :], (np.sin(theta) * mscale)[:, None, :]
    y = x.astype(F64)
    if p.neox:
        a, b = y[..., :half].copy(), y[..., half : p.n_rot].copy()
        y[..., :half], y[..., half : p.n_rot] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = y[..., 0 : p.n_rot : 2].copy(), y[..., 1 : p.n_rot : 2].copy()
        y[..., 0 : p.n_rot : 2], y[..., 1 : p.n_rot : 2] = a * cos - b * sin, a * sin + b * cos
    return y


ROPES = {
    "norm": Rope(64, False),
    "neox": Rope(256, True, freq_base=1e6),
    "norm_partial": Rope(32, False, freq_base=5e5),
    "neox_partial_linear": Rope(48, True, freq_scale=0.125),
    "yarn_norm": Rope(64, False, freq_scale=0.25, ext_factor=1.0, attn_factor=0.9, n_ctx_orig=2048),
    "yarn_neox": Rope(128, True, freq_scale=0.5, ext_factor=0.7, beta_fast=16, beta_slow=2, n_ctx_orig=4096),
    "freq_factors": Rope(64, False, freq_base=5e5, with_freq_factors=True),
}


ROPE_SHAPES = [(1, 9, 64), (5, 3, 256), (40, 9, 64)]  # (n_tok, n_head, head_dim); 40 x 9 x 64 is threaded


@pytest.mark.parametrize(
    "name,shape",
    [(name, s) for name in ROPES for s in ROPE_SHAPES if ROPES[name].n_rot <= s[2]],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_rope(pool, name, shape):
    p = ROPES[name]
    n_tok, n_head, head_dim = shape
    rng = np.random.default_rng(p.n_rot + n_tok)
    x = rng.standard_normal(shape).astype(np.float32)
    pos = rng.integers(0, 130000, n_tok).astype(np.int32)
    pos[0] = 0
    ff = rng.uniform(1.0, 8.0, p.n_rot // 2).astype(np.float32) if p.with_freq_factors else None
    want = rope_ref(x, pos, p, ff)
    lib.ember_rope(pool, buf(x), n_tok, n_head, head_dim, buf(pos, "int32_t"), p.n_rot, int(p.neox),
                   p.freq_base, p.freq_scale, buf(ff) if ff is not None else ffi.NULL, p.ext_factor,
                   p.attn_factor, p.beta_fast, p.beta_slow, p.n_ctx_orig)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(x[..., p.n_rot :], want[..., p.n_rot :].astype(np.float32))


def _rope_call(pool, p, x, pos, ff, x2=None):
    """ember_rope_pair on x (and x2, at the same positions)."""
    n_tok, n_head, head_dim = x.shape
    lib.ember_rope_pair(pool, buf(x), n_head, buf(x2) if x2 is not None else ffi.NULL,
                        x2.shape[1] if x2 is not None else 0, n_tok, head_dim, buf(pos, "int32_t"), p.n_rot,
                        int(p.neox), p.freq_base, p.freq_scale, buf(ff) if ff is not None else ffi.NULL,
                        p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow, p.n_ctx_orig)


@pytest.mark.parametrize("name", ["neox", "yarn_norm", "freq_factors"])
@pytest.mark.parametrize("n_tok,n_head,n_head2", [(1, 9, 3), (40, 9, 3), (3, 4, 1)])
def test_rope_pair_is_two_ropes(pool, name, n_tok, n_head, n_head2):
    """Queries and keys rotated in one call (a recorded step's fused pair) come out bit for bit as
    rotated one tensor at a time, threaded (40 tokens) or not."""
    p = ROPES[name]
    rng = np.random.default_rng(n_tok + n_head)
    head_dim = max(p.n_rot, 64)
    q = rng.standard_normal((n_tok, n_head, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_tok, n_head2, head_dim)).astype(np.float32)
    pos = rng.integers(0, 130000, n_tok).astype(np.int32)
    ff = rng.uniform(1.0, 8.0, p.n_rot // 2).astype(np.float32) if p.with_freq_factors else None
    q1, k1 = q.copy(), k.copy()
    _rope_call(pool, p, q1, pos, ff)
    _rope_call(pool, p, k1, pos, ff)
    _rope_call(pool, p, q, pos, ff, k)
    np.testing.assert_array_equal(q, q1)
    np.testing.assert_array_equal(k, k1)


def test_recorded_ropes_of_queries_and_keys_fuse():
    """A recorded step makes a rope followed by one of the same positions and parameters one op over
    both tensors, which replays as the two ropes computed; not a rope of other parameters, nor a
    second rope of the same tensor."""
    from ember.backends.base import AttentionBatch, RopeParams
    from ember.backends.cpu import Backend

    rng, be = np.random.default_rng(5), Backend(threads=2)
    pos = np.array([3, 70000], np.int32)
    batch = AttentionBatch(pos, np.zeros(2, np.int32), np.zeros((1, 1), np.int32), np.zeros(2, np.int64), 16)
    p, other = RopeParams(64, False), RopeParams(64, False, freq_base=5e5)
    q, k, v, twice = (rng.standard_normal((2, h * 64)).astype(np.float32) for h in (4, 2, 2, 8))
    want = [a.copy() for a in (q, k, v, twice)]
    for a, h, params in zip(want, (4, 2, 2, 8), (p, p, other, p)):  # unrecorded: one op at a time
        be.rope(a, h, batch, params)
    be.rope(want[3], 8, batch, p)
    with be.record() as rec:
        be.rope(q, 4, batch, p)
        be.rope(k, 2, batch, p)
        be.rope(v, 2, batch, other)
    assert [op.kind for op in rec.ops] == [lib.EMBER_OP_ROPE] * 2
    assert rec.ops[0].i[6] == 2 and rec.ops[1].p[3] == ffi.NULL
    with be.record() as rec2:
        be.rope(twice, 8, batch, p)
        be.rope(twice, 8, batch, p)
    assert len(rec2.ops) == 2
    for got, expected in zip((q, k, v, twice), want):
        np.testing.assert_array_equal(got, expected)


# ---- KV cache ----


def test_kv_store_lays_a_page_out_by_head(isa, pool):
    """parts = kv heads: within each page of 16 slots, one head's rows of every slot, then the next
    head's; slots the step does not write keep their bytes."""
    rng = np.random.default_rng(5)
    n_tok, n_kv, hd_k, hd_v, ps, n_slots = 21, 3, 64, 32, 16, 64
    k = rng.standard_normal((n_tok, n_kv * hd_k)).astype(np.float32)
    v = rng.standard_normal((n_tok, n_kv * hd_v)).astype(np.float32)
    slots = rng.permutation(n_slots)[:n_tok].astype(np.int64)
    k_cache = np.full((n_slots, n_kv * hd_k), 0x7E00, np.uint16)
    v_cache = np.full((n_slots, n_kv * hd_v), 0x7E00, np.uint16)
    lib.ember_kv_store(pool, buf(k), buf(v), buf(k_cache, "uint16_t"), buf(v_cache, "uint16_t"),
                       buf(slots, "int64_t"), n_tok, n_kv * hd_k, n_kv * hd_v, F16, F16, ps, n_kv)
    s0 = int(slots[0])  # head 1 of this slot: page s0 // ps, after the page's head-0 rows
    np.testing.assert_array_equal(k_cache.reshape(-1)[((s0 // ps * n_kv + 1) * ps + s0 % ps) * hd_k:][:hd_k],
                                  k[0, hd_k:2 * hd_k].astype(np.float16).view(np.uint16))
    k_rows, v_rows = from_parts(k_cache, ps, n_kv), from_parts(v_cache, ps, n_kv)
    np.testing.assert_array_equal(k_rows[slots], k.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(v_rows[slots], v.astype(np.float16).view(np.uint16))
    untouched = np.setdiff1d(np.arange(n_slots), slots)
    assert (k_rows[untouched] == 0x7E00).all() and (v_rows[untouched] == 0x7E00).all()


@pytest.mark.parametrize("k_dim,v_dim,n_tok", [(192, 192, 1), (256, 256, 37), (20, 12, 5), (7, 9, 300)])
def test_kv_store_rounds_like_numpy_float16(isa, pool, k_dim, v_dim, n_tok):
    rng = np.random.default_rng(k_dim)
    k = rng.standard_normal((n_tok, k_dim)).astype(np.float32)
    v = (rng.standard_normal((n_tok, v_dim)) * 1e-5).astype(np.float32)  # many f16 subnormals
    special = np.array([65519.0, 65520.0, 1e6, -np.inf, 5.960464477539063e-08, 2.98e-8, 6.1e-5, 1.00048828125],
                       np.float32)
    k.flat[: special.size] = special
    v.flat[: special.size] = -special
    n_slots = 2 * n_tok + 3
    slots = rng.permutation(n_slots)[:n_tok].astype(np.int64)
    k_cache = np.full((n_slots, k_dim), 0x7E00, np.uint16)
    v_cache = np.full((n_slots, v_dim), 0x7E00, np.uint16)
    lib.ember_kv_store(pool, buf(k), buf(v), buf(k_cache, "uint16_t"), buf(v_cache, "uint16_t"),
                       buf(slots, "int64_t"), n_tok, k_dim, v_dim, F16, F16, 1, 1)
    with np.errstate(over="ignore"):  # 1e6 -> inf on purpose
        np.testing.assert_array_equal(k_cache[slots], k.astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(v_cache[slots], v.astype(np.float16).view(np.uint16))
    untouched = np.setdiff1d(np.arange(n_slots), slots)
    assert (k_cache[untouched] == 0x7E00).all() and (v_cache[untouched] == 0x7E00).all()


# ---- paged attention ----


ATTN_CASES = {
    "mha_prefill": AttnCase(4, 4, 64, 64, 16, 0, 0.0, ((37, 37),)),
    "gqa3_decode_batch": AttnCase(9, 3, 64, 64, 16, 0, 0.0, ((300, 1), (45, 1), (1, 1))),
    "gqa3_prefill_chunk": AttnCase(9, 3, 64, 64, 16, 0, 0.0, ((180, 100), (20, 3)), interleave=True),
    "gqa4_hd256_window": AttnCase(4, 1, 256, 256, 256, 64, 0.0, ((700, 5), (70, 70))),
    "gqa4_softcap": AttnCase(8, 2, 64, 64, 16, 0, 30.0, ((150, 40),)),
    "hd256_long_decode": AttnCase(4, 1, 256, 256, 256, 0, 0.0, ((2000, 1),)),  # key range split over threads
    "gqa3_long_decode_window": AttnCase(9, 3, 64, 64, 16, 1000, 0.0, ((1500, 1), (1200, 2))),
    "odd_head_dims": AttnCase(6, 2, 40, 24, 16, 7, 0.0, ((50, 9),)),
    "tiny_head_dims_softcap": AttnCase(3, 1, 20, 12, 16, 0, 5.0, ((33, 4), (3, 3)), interleave=True),
    "wide_group": AttnCase(72, 1, 16, 16, 16, 0, 0.0, ((40, 3),)),
    "window_1": AttnCase(2, 1, 64, 64, 16, 1, 0.0, ((20, 20),)),
    "gqa8_short_runs": AttnCase(32, 4, 64, 64, 16, 0, 0.0, ((90, 3), (40, 1), (17, 1))),
    "hd256_decode_two_kv_heads": AttnCase(4, 2, 256, 256, 16, 0, 0.0, ((300, 1), (50, 1))),
}

F16_NAN = 0x7E00
F16 = 1  # the cache type id (ggml's)


@dataclass
class PagedBatch:
    q: np.ndarray  # (n_tok, n_head, hd_k)
    k_cache: np.ndarray  # (n_slots, n_kv_head, hd_k) f16 bits
    v_cache: np.ndarray  # (n_slots, n_kv_head, hd_v) f16 bits
    keys: list  # per sequence (len, n_kv_head, hd_k) float64, the f16 values
    values: list  # per sequence (len, n_kv_head, hd_v)
    tok_pos: np.ndarray
    tok_seq: np.ndarray  # row of block_tables
    tok_owner: np.ndarray  # index into seqs
    block_tables: np.ndarray


def make_batch(case: AttnCase, rng) -> PagedBatch:
    """Sequences on shuffled pages; every slot no sequence position owns holds NaN, so a read outside
    the attended range shows up in the output."""
    ps = case.page_size
    n_pages = [math.ceil(length / ps) for length, _ in case.seqs]
    max_pages = max(n_pages) + 2
    total = sum(n_pages) + 1  # the last page is a NaN page that unused table entries point at
    perm = rng.permutation(total - 1)
    k_cache = np.full((total * ps, case.n_kv_head, case.hd_k), F16_NAN, np.uint16)
    v_cache = np.full((total * ps, case.n_kv_head, case.hd_v), F16_NAN, np.uint16)
    rows = rng.permutation(len(case.seqs))  # sequence s lives in row rows[s] of the tables
    tables = np.full((len(case.seqs), max_pages), total - 1, np.int32)
    keys, values, toks = [], [], []
    start = 0
    for s, (length, n_q) in enumerate(case.seqs):
        pages = perm[start : start + n_pages[s]]
        start += n_pages[s]
        tables[rows[s], : n_pages[s]] = pages
        k = rng.standard_normal((length, case.n_kv_head, case.hd_k)).astype(np.float16)
        v = rng.standard_normal((length, case.n_kv_head, case.hd_v)).astype(np.float16)
        p = np.arange(length)
        slots = pages[p // ps] * ps + p % ps
        k_cache[slots], v_cache[slots] = k.view(np.uint16), v.view(np.uint16)
        keys.append(k.astype(F64))
        values.append(v.astype(F64))
        toks += [(s, pos) for pos in range(length - n_q, length)]
    if case.interleave:
        toks = [toks[i] for i in rng.permutation(len(toks))]
    owner = np.array([s for s, _ in toks], np.int32)
    q = rng.standard_normal((len(toks), case.n_head, case.hd_k)).astype(np.float32)
    return PagedBatch(q, k_cache, v_cache, keys, values, np.array([p for _, p in toks], np.int32),
                      rows[owner].astype(np.int32), owner, tables)


def attention_ref(case: AttnCase, b: PagedBatch, scale: float, sinks=None) -> np.ndarray:
    group = case.n_head // case.n_kv_head
    out = np.empty((len(b.tok_pos), case.n_head, case.hd_v))
    for t, (pos, s) in enumerate(zip(b.tok_pos, b.tok_owner)):
        first = max(0, pos - case.window + 1) if case.window > 0 else 0
        k, v = b.keys[s][first : pos + 1], b.values[s][first : pos + 1]
        for h in range(case.n_head):
            scores = k[:, h // group] @ b.q[t, h].astype(F64) * scale
            if case.softcap > 0:
                scores = case.softcap * np.tanh(scores / case.softcap)
            top = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
            p = np.exp(scores - top)
            sink = 0.0 if sinks is None else np.exp(float(sinks[h]) - top)
            out[t, h] = p @ v[:, h // group] / (p.sum() + sink)
    return out


def in_parts(rows: np.ndarray, page_size: int, parts: int) -> np.ndarray:
    """A cache of rows (n_slots, ...) laid out in `parts` (api_ops.h): within each page, part j of every
    slot's row, then part j + 1 ... (the same bytes, as many rows)."""
    n = rows.shape[0]
    flat = rows.reshape(n // page_size, page_size, parts, -1)
    return np.ascontiguousarray(flat.transpose(0, 2, 1, 3)).reshape(rows.shape)


def from_parts(cache: np.ndarray, page_size: int, parts: int) -> np.ndarray:
    """in_parts undone: each slot's row whole again."""
    n = cache.shape[0]
    flat = cache.reshape(n // page_size, parts, page_size, -1)
    return np.ascontiguousarray(flat.transpose(0, 2, 1, 3)).reshape(cache.shape)


def run_attention(pool, case: AttnCase, b: PagedBatch, scale: float, sinks=None, parts: int = 1) -> np.ndarray:
    """ember_attention over b's caches, laid out in `parts` first."""
    n_tok = len(b.tok_pos)
    out = np.full((n_tok, case.n_head, case.hd_v), np.nan, np.float32)
    k_cache, v_cache = (in_parts(c, case.page_size, parts) for c in (b.k_cache, b.v_cache))
    lib.ember_attention(pool, buf(b.q), buf(k_cache, "uint16_t"), buf(v_cache, "uint16_t"), buf(out), n_tok,
                        case.n_head, case.n_kv_head, case.hd_k, case.hd_v, buf(b.tok_pos, "int32_t"),
                        buf(b.tok_seq, "int32_t"), buf(b.block_tables, "int32_t"), b.block_tables.shape[1],
                        case.page_size, case.window, scale, case.softcap, F16, F16,
                        ffi.NULL if sinks is None else buf(sinks), parts)
    return out


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_attention(isa, pool, name):
    case = ATTN_CASES[name]
    b = make_batch(case, np.random.default_rng(len(name)))
    scale = 1.0 / math.sqrt(case.hd_k)
    out = run_attention(pool, case, b, scale)
    np.testing.assert_allclose(out, attention_ref(case, b, scale), rtol=1e-4, atol=3e-6)
    # a page's rows by kv head (the backend's layout): the same keys in the same order, the same bits
    np.testing.assert_array_equal(run_attention(pool, case, b, scale, parts=case.n_kv_head), out)


def test_attention_sharp_softmax(isa, pool):
    """Large scores: the running max must rescale earlier chunks exactly (no overflow, no lost keys)."""
    case = AttnCase(4, 2, 64, 64, 16, 0, 0.0, ((500, 3),))
    b = make_batch(case, np.random.default_rng(9))
    out = run_attention(pool, case, b, 2.0)
    np.testing.assert_allclose(out, attention_ref(case, b, 2.0), rtol=1e-4, atol=3e-6)


@pytest.mark.parametrize("name", ["gqa3_long_decode_window", "hd256_long_decode", "odd_head_dims"])
def test_attention_with_sinks(isa, pool, name):
    """gpt-oss's sinks: a score per head with no value, in the denominator; some heads' sinks above
    every score (the running max must take them), decode key ranges split over threads included."""
    case = ATTN_CASES[name]
    b = make_batch(case, np.random.default_rng(len(name) + 1))
    scale = 1.0 / math.sqrt(case.hd_k)
    sinks = np.random.default_rng(3).normal(0, 2, case.n_head).astype(np.float32)
    sinks[::2] = 40.0
    out = run_attention(pool, case, b, scale, sinks)
    np.testing.assert_allclose(out, attention_ref(case, b, scale, sinks), rtol=1e-4, atol=3e-6)


@pytest.mark.parametrize("n,vocab,k", [(1, 262144, 1), (1, 49152, 3), (5, 1000, 7), (3, 64, 60), (1, 10000, 64),
                                       (2, 5, 5)])
def test_top_k_matches_a_stable_sort(pool, n, vocab, k):
    """Each row's k largest, best first, the lower id first among equal values, NaN never chosen;
    one row is split across the threads and merged, several rows go whole to a thread."""
    rng = np.random.default_rng(n * 1000 + k)
    x = rng.standard_normal((n, vocab)).astype(np.float32)
    x[:, ::7] = x[:, 1:2]  # many ties with one value
    x[0, 3] = np.nan
    x[0, min(4, vocab - 1)] = -np.inf
    ids, vals = np.empty((n, k), np.int32), np.empty((n, k), np.float32)
    lib.ember_top_k(pool, buf(x), n, vocab, k, buf(ids, "int32_t"), buf(vals))
    order = np.argsort(-x, axis=1, kind="stable")  # NaN sorts last
    nans = np.isnan(x).sum(axis=1)
    for r in range(n):
        valid = min(k, vocab - nans[r])  # NaN is never chosen: a short row ends in id -1
        assert ids[r, :valid].tolist() == order[r, :valid].tolist()
        np.testing.assert_array_equal(vals[r, :valid], x[r, order[r, :valid]])
        assert (ids[r, valid:] == -1).all() and (vals[r, valid:] == -np.inf).all()


@pytest.mark.parametrize("pattern", ["rising", "falling", "best_at_block_ends", "mostly_nan", "ties_across_blocks"])
def test_top_k_block_skipping(pool, pattern):
    """The scan skips blocks holding nothing above the current k-th: rows whose best values come last,
    first, at the last slot of blocks, among NaN, or tied across blocks give a stable sort's choice."""
    vocab, k = 4099, 5  # blocks of 64 and a ragged end, split over the threads
    rng = np.random.default_rng(len(pattern))
    x = {"rising": np.arange(vocab, dtype=np.float32),
         "falling": -np.arange(vocab, dtype=np.float32),
         "best_at_block_ends": rng.standard_normal(vocab).astype(np.float32),
         "mostly_nan": np.full(vocab, np.nan, np.float32),
         "ties_across_blocks": np.zeros(vocab, np.float32)}[pattern]
    if pattern == "best_at_block_ends":
        x[63::64] = 10 + np.arange(len(x[63::64]), dtype=np.float32) % 3
    if pattern == "mostly_nan":
        x[[5, 700, 2048, 4098]] = [1.0, 3.0, 2.0, 3.0]  # fewer than k values: the row ends in -1
    if pattern == "ties_across_blocks":
        x[[10, 200, 1000, 3000, 4000, 4098]] = 1.0
    x = x[None, :]
    ids, vals = np.empty((1, k), np.int32), np.empty((1, k), np.float32)
    lib.ember_top_k(pool, buf(x), 1, vocab, k, buf(ids, "int32_t"), buf(vals))
    order = np.argsort(-x[0], kind="stable")
    valid = min(k, int((~np.isnan(x)).sum()))
    assert ids[0, :valid].tolist() == order[:valid].tolist()
    assert (ids[0, valid:] == -1).all()
