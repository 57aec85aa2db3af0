"""Quantized matrix products of the CPU backend (ember_matmul, ember_get_rows, ember_dequantize)
against numpy references, on every SIMD path this CPU can run."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest
from gguf import quants as gq

from ember.backends.cpu._native import ffi, lib
from ember.quant.types import QK_K, GGMLType, layout

T = GGMLType
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]
FLOATS = [T.F32, T.F16, T.BF16]
ALL_TYPES = FLOATS + LEGACY + KQUANTS

# Byte offsets of the f16 scale fields of block types gguf cannot quantize: random bytes elsewhere.
SCALE_FIELDS = {T.IQ4_NL: [0], T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
                T.Q6_K: [208], T.IQ4_XS: [0]}

M = 37  # rows of W: not a multiple of any tile size
NS = [1, 2, 3, 7, 16, 33]


def _isa() -> str:
    return ffi.string(lib.ember_cpu_isa()).decode()


def _runnable_isas() -> list[str]:
    start, found = _isa(), []
    for name in ("scalar", "avx2", "avx512", "neon"):
        if lib.ember_cpu_set_isa(name.encode()) == 0:
            found.append(name)
    lib.ember_cpu_set_isa(start.encode())
    return found


ISAS = _runnable_isas()


@pytest.fixture(scope="module")
def pools():
    p1, p2 = lib.ember_pool_create(1), lib.ember_pool_create(2)
    yield p1, p2
    lib.ember_pool_destroy(p1)
    lib.ember_pool_destroy(p2)


@pytest.fixture
def isa_guard():
    start = _isa()
    yield
    assert lib.ember_cpu_set_isa(start.encode()) == 0


def make_weight(qtype: GGMLType, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """W (m, k) of `qtype` as raw row bytes (m, row_bytes)."""
    if qtype == T.F32:
        return rng.standard_normal((m, k), dtype=np.float32).view(np.uint8)
    if qtype in SCALE_FIELDS:
        lay = layout(qtype)
        blocks = rng.integers(0, 256, (m, k // lay.block_size, lay.type_size), dtype=np.uint8)
        for off in SCALE_FIELDS[qtype]:
            scale = (rng.uniform(0.002, 0.02, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2]))
            blocks[:, :, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(blocks.shape[:2] + (2,))
        return blocks.reshape(m, -1)
    return gq.quantize(rng.standard_normal((m, k), dtype=np.float32), qtype)


def dequant_ref(w: np.ndarray, qtype: GGMLType, k: int) -> np.ndarray:
    if qtype == T.F32:
        return w.view(np.float32).reshape(-1, k)
    return gq.dequantize(w, qtype).reshape(-1, k)


def quantize_activations_ref(x: np.ndarray, block: int) -> np.ndarray:
    """What the kernels multiply by: x rounded to int8 per block with d = amax / 127 (float32 steps)."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    d = amax / np.float32(127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def act_block(qtype: GGMLType) -> int | None:
    if qtype in FLOATS:
        return None
    return QK_K if qtype in KQUANTS else 32


def run_matmul(pool, qtype: GGMLType, w: np.ndarray, m: int, k: int, x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    size = lib.ember_matmul_scratch_size(int(qtype), k, n)
    assert size >= 0
    scratch = np.empty(size + 64, np.uint8)
    aligned = scratch[(-scratch.ctypes.data) % 64:]
    y = np.full((n, m), np.nan, np.float32)
    lib.ember_matmul(pool, int(qtype), ffi.from_buffer(w), m, k, ffi.cast("float *", ffi.from_buffer(x)), n,
                     ffi.cast("float *", ffi.from_buffer(y)), ffi.from_buffer(aligned))
    return y


def ks_for(qtype: GGMLType) -> list[int]:
    ks = [256, 512, 768, 1536]
    return ks if qtype in KQUANTS else ks + [576]


@dataclass(frozen=True)
class Case:
    """W and x of one shape with their float64 references (computed once, shared by the ISA paths)."""
    w: np.ndarray         # (M, row_bytes)
    x: np.ndarray         # (max(NS), k) f32
    y_rounded: np.ndarray  # x^ @ W^T: x^ the activations as the kernels round them
    mag: np.ndarray       # |x^| @ |W|^T: the scale of float32 summation error
    y_exact: np.ndarray   # x @ W^T
    bound: np.ndarray     # |y - y_exact| allowed by the int8 rounding of x (and float32 sums)


@functools.lru_cache(maxsize=None)
def case(qtype: GGMLType, k: int, m: int = M, n: int = max(NS)) -> Case:
    rng = np.random.default_rng(int(qtype) * 1000 + k)
    w = make_weight(qtype, m, k, rng)
    wf = dequant_ref(w, qtype, k).astype(np.float64)
    x = rng.standard_normal((n, k), dtype=np.float32)
    block = act_block(qtype)
    xq = x.astype(np.float64) if block is None else quantize_activations_ref(x, block)
    mag = np.abs(xq) @ np.abs(wf).T
    if block is None:
        bound = FLOAT_SUM_RTOL * mag
    else:
        # rounding to nearest moves each x_i by at most half a step, amax(block of i) / 254;
        # weighted by |w_i| and summed, that bounds the output error
        amax = np.repeat(np.abs(x.reshape(n, -1, block)).max(-1), block, axis=1).astype(np.float64)
        bound = (amax / 254 * 1.001) @ np.abs(wf).T + FLOAT_SUM_RTOL * mag
    return Case(w, x, xq @ wf.T, mag, x.astype(np.float64) @ wf.T, bound)


# float32 accumulation error relative to sum |w x|: observed up to ~2e-7 with k <= 1536
FLOAT_SUM_RTOL = 2e-6


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_reference(qtype, isa, pools, isa_guard):
    assert lib.ember_cpu_set_isa(isa.encode()) == 0
    for k in ks_for(qtype):
        c = case(qtype, k)
        for n in NS:
            y = run_matmul(pools[1], qtype, c.w, M, k, c.x[:n])
            err = np.abs(y - c.y_rounded[:n])
            assert np.all(err <= FLOAT_SUM_RTOL * c.mag[:n]), (k, n, float((err / c.mag[:n]).max()))
            assert np.all(np.abs(y - c.y_exact[:n]) <= c.bound[:n]), (k, n)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q2_K], ids=lambda t: t.name)
def test_long_rows_are_split_in_k(qtype, pools, isa_guard):
    """k above the 4096 values a packed panel holds: the panel kernels sum over k-slices
    (n = 30: above every type's threshold for the panel kernels)."""
    k, n = 4352, 30
    c = case(qtype, k, m=21, n=n)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        y = run_matmul(pools[1], qtype, c.w, 21, k, c.x)
        assert np.all(np.abs(y - c.y_rounded) <= FLOAT_SUM_RTOL * c.mag), isa


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_weights_take_any_k(qtype, pools, isa_guard):
    """Float rows have no blocks: k = 37 leaves a tail after the 16-wide vector loop."""
    k = 37
    c = case(qtype, k, m=11, n=5)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        y = run_matmul(pools[1], qtype, c.w, 11, k, c.x)
        assert np.all(np.abs(y - c.y_rounded) <= FLOAT_SUM_RTOL * c.mag), isa


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "scalar"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_simd_agrees_with_scalar(qtype, isa, pools, isa_guard):
    rng = np.random.default_rng(100 + int(qtype))
    k = 1536
    w = make_weight(qtype, M, k, rng)
    wf = np.abs(dequant_ref(w, qtype, k).astype(np.float64))
    x = rng.standard_normal((33, k), dtype=np.float32)
    mag = np.abs(x.astype(np.float64)) @ wf.T
    assert lib.ember_cpu_set_isa(b"scalar") == 0
    y_scalar = run_matmul(pools[1], qtype, w, M, k, x)
    assert lib.ember_cpu_set_isa(isa.encode()) == 0
    for n in (1, 5, 33):
        y = run_matmul(pools[1], qtype, w, M, k, x[:n])
        assert np.all(np.abs(y - y_scalar[:n]) <= 1e-5 * mag[:n]), n


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_one_and_two_threads_agree_exactly(qtype, pools):
    """Each output is computed by one thread with the same tiles, whatever the thread count
    (k = 512: Q4_1 rows are short enough to be walked 4 at a time; 1536: one at a time)."""
    rng = np.random.default_rng(5)
    m = 203
    for k in (512, 1536):
        w = make_weight(qtype, m, k, rng)
        for n in (1, 9, 70):
            x = rng.standard_normal((n, k), dtype=np.float32)
            y1 = run_matmul(pools[0], qtype, w, m, k, x)
            y2 = run_matmul(pools[1], qtype, w, m, k, x)
            np.testing.assert_array_equal(y1, y2)


def test_large_prompt_crosses_token_chunks(pools, isa_guard):
    """n large enough that the activations are swept in several L2-sized chunks."""
    k, n = 2048, 300
    c = case(T.Q4_0, k, m=45, n=n)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        y = run_matmul(pools[1], T.Q4_0, c.w, 45, k, c.x)
        assert np.all(np.abs(y - c.y_rounded) <= FLOAT_SUM_RTOL * c.mag), isa


@pytest.mark.parametrize("types", [(T.Q4_1, T.Q4_1, T.Q4_1), (T.Q5_0, T.Q5_0, T.Q8_0), (T.Q4_K, T.Q5_K),
                                   (T.F16, T.F32)], ids=lambda ts: "+".join(t.name for t in ts))
def test_multi_matches_separate_calls(types, pools):
    """One pass for several W sharing x (as q, k, v) gives exactly the separate products."""
    rng = np.random.default_rng(11)
    k, ms = 512, [45, 19, 19][:len(types)]
    ws = [make_weight(t, m, k, rng) for t, m in zip(types, ms)]
    for n in (1, 7, 40):
        x = rng.standard_normal((n, k), dtype=np.float32)
        ys = [np.full((n, m), np.nan, np.float32) for m in ms]
        scratch = np.empty(lib.ember_matmul_scratch_size(int(types[0]), k, n) + 64, np.uint8)
        rc = lib.ember_matmul_multi(
            pools[1], len(types), ffi.new("int[]", [int(t) for t in types]), [ffi.from_buffer(w) for w in ws],
            ffi.new("int64_t[]", ms), k, ffi.cast("float *", ffi.from_buffer(x)), n,
            [ffi.cast("float *", ffi.from_buffer(y)) for y in ys], ffi.from_buffer(scratch[(-scratch.ctypes.data) % 64:]))
        assert rc == 0
        for t, w, m, y in zip(types, ws, ms, ys):
            np.testing.assert_array_equal(y, run_matmul(pools[1], t, w, m, k, x))


def test_multi_refuses_mixed_activation_kinds(pools):
    k, n = 256, 2
    ws = [make_weight(t, 4, k, np.random.default_rng(0)) for t in (T.Q4_0, T.Q4_K)]
    assert lib.ember_matmul_act_kind(int(T.Q4_0)) != lib.ember_matmul_act_kind(int(T.Q4_K))
    x = np.zeros((n, k), np.float32)
    y = [np.zeros((n, 4), np.float32) for _ in ws]
    scratch = np.empty(lib.ember_matmul_scratch_size(int(T.Q4_K), k, n) + 64, np.uint8)
    rc = lib.ember_matmul_multi(pools[1], 2, ffi.new("int[]", [int(T.Q4_0), int(T.Q4_K)]),
                                [ffi.from_buffer(w) for w in ws], ffi.new("int64_t[]", [4, 4]), k,
                                ffi.cast("float *", ffi.from_buffer(x)), n,
                                [ffi.cast("float *", ffi.from_buffer(v)) for v in y], ffi.from_buffer(scratch))
    assert rc == -1


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_get_rows_and_dequantize_bit_exact(qtype, pools):
    rng = np.random.default_rng(int(qtype))
    m, k = 29, 512
    w = make_weight(qtype, m, k, rng)
    ref = dequant_ref(w, qtype, k)

    out = np.empty((m, k), np.float32)
    lib.ember_dequantize(int(qtype), ffi.from_buffer(w), ffi.cast("float *", ffi.from_buffer(out)), m * k)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))

    ids = np.array([3, 0, 28, 3, 17, 28, 1], np.int32)
    rows = np.empty((len(ids), k), np.float32)
    lib.ember_get_rows(pools[1], int(qtype), ffi.from_buffer(w), m, k, ffi.cast("int32_t *", ffi.from_buffer(ids)),
                       len(ids), ffi.cast("float *", ffi.from_buffer(rows)))
    np.testing.assert_array_equal(rows.view(np.uint32), ref[ids].view(np.uint32))


def test_scratch_size_and_support():
    assert lib.ember_matmul_scratch_size(int(T.F16), 64, 4) == 0  # float weights read x directly
    assert lib.ember_matmul_scratch_size(int(T.Q4_0), 64, 3) % 64 == 0
    assert lib.ember_matmul_scratch_size(int(T.Q4_K), 96, 1) == -1  # k not a whole super-block
    assert lib.ember_matmul_scratch_size(int(T.IQ2_XXS), 256, 1) == -1
    for t in ALL_TYPES:
        assert lib.ember_type_supported(int(t)) == 1
    assert lib.ember_type_supported(int(T.IQ2_XXS)) == 0
    assert lib.ember_type_supported(999) == 0
