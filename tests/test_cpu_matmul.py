"""Quantized matrix products of the CPU backend (ember_matmul, ember_get_rows, ember_dequantize)
against numpy references, on every SIMD path this CPU can run. Activations are rounded to int16 per
block of 32 for the 32-value block types, and to int8 per super-block of 256 for the K-quants exactly
as llama.cpp's Q8_K: the quantizers are checked byte for byte, and the products against float64 sums
over those values."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest
from gguf import quants as gq

from ember.backends.base import BackendError
from ember.backends.cpu import Backend
from ember.backends.cpu._native import ffi, lib
from ember.quant import quantize_q8_K
from ember.quant.types import QK_K, GGMLType, layout

T = GGMLType
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.MXFP4]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]
LOW_BIT = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0]
FLOATS = [T.F32, T.F16, T.BF16]
ALL_TYPES = FLOATS + LEGACY + KQUANTS + LOW_BIT
Q8K_TYPES = KQUANTS + LOW_BIT  # activations rounded as llama.cpp's Q8_K
WITH_MIN = (T.Q4_1, T.Q5_1)  # legacy types whose blocks add m * (the activations' sum, s)

@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_exact_few_token_products(qtype, pools, isa_guard):
    """Speculative steps and prompt chunks of 2-33 rows: the exact Q4_0 / Q4_1 / Q8_0 products (on
    AVX-512 rows in lanes, in passes of up to 16 tokens, 37 rows: two groups of 16 and a ragged one; on
    AVX2 microtiles, then panels) match the reference on every ISA, and 1 and 2 threads agree bit for bit."""
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        for k in (576, 1536):
            c = case(qtype, k, n=33)
            one = run_matmul(pools[1], qtype, c.w, M, k, c.x[:1])
            for n in range(2, 34):
                y = run_matmul(pools[1], qtype, c.w, M, k, c.x[:n])
                err = np.abs(y - c.y_rounded[:n])
                assert np.all(err <= FLOAT_SUM_RTOL * c.mag[:n]), (isa, k, n, float((err / c.mag[:n]).max()))
                np.testing.assert_array_equal(run_matmul(pools[0], qtype, c.w, M, k, c.x[:n]), y, err_msg=f"{isa} {k} {n}")
                if isa == "avx512":  # rows in lanes: a token's sums whatever the other rows (a cached 1-row step)
                    np.testing.assert_array_equal(y[:1], one, err_msg=f"{k} {n}")


# Byte offsets of the f16 scale fields of block types gguf cannot quantize: random bytes elsewhere.
SCALE_FIELDS = {T.IQ4_NL: [0], T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
                T.Q6_K: [208], T.IQ4_XS: [0], T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0],
                T.IQ3_S: [0], T.IQ1_S: [0], T.IQ1_M: [], T.TQ1_0: [52], T.TQ2_0: [64]}

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
        if qtype == T.IQ1_M:  # the f16 scale is the top nibbles of the four scale words at 48
            d = (rng.uniform(0.002, 0.02, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2]))
            nibbles = (d.astype(np.float16).view(np.uint16)[..., None] >> np.array([0, 4, 8, 12])) & 15
            words = blocks[:, :, 48:56].copy().view("<u2") & 0x0FFF
            blocks[:, :, 48:56] = (words | (nibbles << 12).astype(np.uint16)).view(np.uint8)
        return blocks.reshape(m, -1)
    return gq.quantize(rng.standard_normal((m, k), dtype=np.float32), qtype)


def dequant_ref(w: np.ndarray, qtype: GGMLType, k: int) -> np.ndarray:
    if qtype == T.F32:
        return w.view(np.float32).reshape(-1, k)
    return gq.dequantize(w, qtype).reshape(-1, k)


def f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


@dataclass(frozen=True)
class Acts:
    """x quantized as the kernels quantize it: q (n, k) and per block d, and for the legacy types s
    (d * sum(q) in float32); xq = q * d as float64."""
    q: np.ndarray
    d: np.ndarray  # (n, k / block)
    s: np.ndarray | None
    block: int

    @property
    def xq(self) -> np.ndarray:
        n, k = self.q.shape
        return (self.q.reshape(n, -1, self.block) * self.d[..., None].astype(np.float64)).reshape(n, k)


EXACT, LLAMA = lib.EMBER_ROUND_EXACT, lib.EMBER_ROUND_LLAMA


def quantize_q16_ref(x: np.ndarray, rounding: int = EXACT) -> Acts:
    """The 32-value types' activations, in float32 as the kernels compute them: exact,
    c = round_even(x * 32767 / amax), d = amax / 32767, s = d * sum(c); as llama.cpp's Q8_0 / Q8_1,
    c = round_even(x * 127 / amax), d = f16(amax / 127), s = f16(amax / 127 * sum(c))."""
    top = np.float32(32767 if rounding == EXACT else 127)
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, top / amax, np.float32(0)).astype(np.float32)
    c = np.rint(xb * inv[..., None]).astype(np.int16)
    step = (amax / top).astype(np.float32)
    s = (step * c.sum(axis=-1, dtype=np.int32).astype(np.float32)).astype(np.float32)
    if rounding == LLAMA:
        return Acts(c.reshape(x.shape), f16(step), f16(s), 32)
    return Acts(c.reshape(x.shape), step, s, 32)


def quantize_q8k_ref(x: np.ndarray) -> Acts:
    blocks = quantize_q8_K(x.reshape(-1, QK_K)).view(quant_block_q8k()).reshape(x.shape[0], -1)
    return Acts(blocks["qs"].reshape(x.shape), blocks["d"].astype(np.float32), None, QK_K)


def quant_block_q8k() -> np.dtype:
    return np.dtype([("d", "<f4"), ("qs", "i1", QK_K), ("bsums", "<i2", QK_K // 16)])


def acts_ref(x: np.ndarray, qtype: GGMLType, rounding: int = EXACT) -> Acts | None:
    if qtype in FLOATS:
        return None
    return quantize_q8k_ref(x) if qtype in Q8K_TYPES else quantize_q16_ref(x, rounding)


def block_mins(w: np.ndarray, qtype: GGMLType, k: int) -> np.ndarray:
    """m of each block of Q4_1 / Q5_1 rows (m, k / 32), as float64."""
    lay = layout(qtype)
    return w.reshape(w.shape[0], k // 32, lay.type_size)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


def product_ref(w: np.ndarray, wf: np.ndarray, qtype: GGMLType, x: np.ndarray, acts: Acts | None) -> np.ndarray:
    """What the kernels compute, in float64: xq @ W^T, with the Q4_1/Q5_1 mins times s instead of d * sum(q)."""
    if acts is None:
        return x.astype(np.float64) @ wf.T
    y = acts.xq @ wf.T
    if qtype in WITH_MIN:
        n, k = x.shape
        dsum = acts.d.astype(np.float64) * acts.q.reshape(n, -1, 32).sum(axis=-1)
        y += (acts.s.astype(np.float64) - dsum) @ block_mins(w, qtype, k).T
    return y


def run_matmul(pool, qtype: GGMLType, w: np.ndarray, m: int, k: int, x: np.ndarray, rounding: int = EXACT) -> np.ndarray:
    n = x.shape[0]
    size = lib.ember_matmul_scratch_size(int(qtype), k, n)
    assert size >= 0
    scratch = np.empty(size + 64, np.uint8)
    aligned = scratch[(-scratch.ctypes.data) % 64:]
    y = np.full((n, m), np.nan, np.float32)
    lib.ember_matmul(pool, int(qtype), ffi.from_buffer(w), m, k, ffi.cast("float *", ffi.from_buffer(x)), n,
                     ffi.cast("float *", ffi.from_buffer(y)), ffi.from_buffer(aligned), rounding)
    return y


def ks_for(qtype: GGMLType) -> list[int]:
    ks = [256, 512, 768, 1536]
    return ks if qtype in Q8K_TYPES else ks + [576]


@dataclass(frozen=True)
class Case:
    """W and x of one shape with their float64 references (computed once, shared by the ISA paths)."""
    w: np.ndarray         # (M, row_bytes)
    x: np.ndarray         # (max(NS), k) f32
    y_rounded: np.ndarray  # what the kernels compute, in float64 (x as they round it)
    mag: np.ndarray       # |x^| @ |W|^T: the scale of float32 summation error
    y_exact: np.ndarray   # x @ W^T
    bound: np.ndarray     # |y - y_exact| allowed by the rounding of x (and float32 sums)


def max_step_error(amax: np.ndarray, block: int, rounding: int) -> np.ndarray:
    """How far the kernels may move a value of a block with max |x| amax: half a step, amax / 254
    (int8), or amax / 65534 (exact int16); llama.cpp's Q8_0 adds the f16 rounding of d (2^-11 of it)
    over up to 127 steps."""
    if block == 32 and rounding == EXACT:
        return amax / 65534.0 * 1.001
    return amax * (1 / 254.0 + (2.0**-11 if block == 32 else 0.0)) * 1.001


@functools.lru_cache(maxsize=None)
def case(qtype: GGMLType, k: int, m: int = M, n: int = max(NS), rounding: int = EXACT) -> Case:
    rng = np.random.default_rng(int(qtype) * 1000 + k)
    w = make_weight(qtype, m, k, rng)
    wf = dequant_ref(w, qtype, k).astype(np.float64)
    x = rng.standard_normal((n, k), dtype=np.float32)
    acts = acts_ref(x, qtype, rounding)
    xq = x.astype(np.float64) if acts is None else acts.xq
    mag = np.abs(xq) @ np.abs(wf).T
    if acts is None:
        bound = FLOAT_SUM_RTOL * mag
    else:
        # each x_i moves by at most max_step_error of its block; weighted by |w_i| and summed,
        # that bounds the output error
        amax = np.repeat(np.abs(x.reshape(n, -1, acts.block)).max(-1), acts.block, axis=1).astype(np.float64)
        bound = max_step_error(amax, acts.block, rounding) @ np.abs(wf).T + FLOAT_SUM_RTOL * mag
        if qtype in WITH_MIN and rounding == LLAMA:  # s rounded to f16: 2^-11 of it
            bound += 2.0**-11 * np.abs(acts.s.astype(np.float64)) @ np.abs(block_mins(w, qtype, k)).T
    return Case(w, x, product_ref(w, wf, qtype, x, acts), mag, x.astype(np.float64) @ wf.T, bound)


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


@pytest.mark.skipif("avx512" not in ISAS, reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_k32_decode_rows_with_and_without_gfni(qtype, pools, isa_guard):
    """One token against Q4_K / Q5_K rows (AVX-512: two rows at a time, the odd one paired with itself): the
    nibbles split by GFNI's affine transform and by shifts and masks give the same bits; a row's sum does not
    depend on how the rows are split over threads; both match the reference."""
    assert lib.ember_cpu_set_isa(b"avx512") == 0
    has_gfni = "gfni" in ffi.string(lib.ember_cpu_features()).decode().split()
    try:
        for k in (256, 768, 2048):
            c = case(qtype, k)
            runs = {}
            for gfni in ([1, 0] if has_gfni else [0]):
                assert lib.ember_cpu_set_gfni(gfni) == 0
                for threads in (0, 1):
                    runs[gfni, threads] = y = run_matmul(pools[threads], qtype, c.w, M, k, c.x[:1])
                    assert np.all(np.abs(y - c.y_rounded[:1]) <= FLOAT_SUM_RTOL * c.mag[:1]), (k, gfni, threads)
            first = next(iter(runs.values()))
            for key, y in runs.items():
                np.testing.assert_array_equal(y, first, err_msg=f"{k} {key}")
        if not has_gfni:
            assert lib.ember_cpu_set_gfni(1) == -1
    finally:
        lib.ember_cpu_set_gfni(int(has_gfni))


@pytest.mark.parametrize("isa", ISAS)
def test_q8_0_decode_rows_against_int8_activations(isa, pools, isa_guard):
    """One token against lone Q8_0 rows with int8 activations (the output heads' decode path; on AVX-512
    two blocks a 512-bit step, each thread's run of rows in one call with the activations' terms formed
    once where a row has at most 128 pairs of blocks): 352, 544 and 1056 leave a last block alone, 352
    and 576 an odd number of pairs, 640 is Gemma 3's width, 8192 fills the run's table of terms and 8288
    is past it (terms formed per row). Five tokens leave the fifth alone in a microtile, where a lone
    long row takes the same row kernel with its terms formed per row; two tokens take the microtiles:
    the same integer sums, so the same outputs within the float sums' rounding."""
    assert lib.ember_cpu_set_isa(isa.encode()) == 0
    for k in (352, 544, 576, 640, 1056, 8192, 8288):
        c = case(T.Q8_0, k, n=5, rounding=LLAMA)
        for pool in pools:
            for n in (1, 2, 5):
                y = run_matmul(pool, T.Q8_0, c.w, M, k, c.x[:n], LLAMA)
                err = np.abs(y - c.y_rounded[:n])
                assert np.all(err <= FLOAT_SUM_RTOL * c.mag[:n]), (k, n, float((err / c.mag[:n]).max()))
                assert np.all(np.abs(y - c.y_exact[:n]) <= c.bound[:n]), (k, n)
                if n == 1:
                    y1 = y[0]
                else:
                    assert np.all(np.abs(y1 - y[0]) <= FLOAT_SUM_RTOL * c.mag[0]), (k, n)


@pytest.mark.parametrize("isa", ISAS)
def test_q5_0_decode_rows_against_int8_activations(isa, pools, isa_guard):
    """One token against Q5_0 rows with int8 activations, each thread's run of rows in one call, short
    rows alone too (on AVX-512 two blocks a 512-bit step, as the Q8_0 rows above): 640 is Gemma 3's
    width (440-byte rows), 352 and 544 leave a last block alone, 352 and 576 an odd number of pairs,
    8192 (256 blocks) fills the run's table of activation terms and 8224 (257 blocks) is past it. Two
    tokens take the microtiles: the same integer sums, so the same outputs within the float sums'
    rounding."""
    assert lib.ember_cpu_set_isa(isa.encode()) == 0
    m = 45
    for k in (352, 544, 576, 640, 8192, 8224):
        c = case(T.Q5_0, k, m=m, n=2, rounding=LLAMA)
        for pool in pools:
            y = run_matmul(pool, T.Q5_0, c.w, m, k, c.x[:1], LLAMA)
            err = np.abs(y - c.y_rounded[:1])
            assert np.all(err <= FLOAT_SUM_RTOL * c.mag[:1]), (k, float((err / c.mag[:1]).max()))
            assert np.all(np.abs(y - c.y_exact[:1]) <= c.bound[:1]), k
            y2 = run_matmul(pool, T.Q5_0, c.w, m, k, c.x, LLAMA)
            assert np.all(np.abs(y[0] - y2[0]) <= FLOAT_SUM_RTOL * c.mag[0]), k


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quant_decode_row_runs(qtype, isa, pools, isa_guard):
    """One token against many K-quant rows: on AVX-512 each thread's run of rows goes to the kernel in
    one call (its first and last rows, and the split between the threads, must each be right); 1024 is
    Gemma 3's o-projection width. Two tokens take the per-row tiles: the same sums."""
    assert lib.ember_cpu_set_isa(isa.encode()) == 0
    m = 203
    for k in (256, 1024):
        c = case(qtype, k, m=m, n=2)
        for pool in pools:
            y = run_matmul(pool, qtype, c.w, m, k, c.x[:1])
            err = np.abs(y - c.y_rounded[:1])
            assert np.all(err <= FLOAT_SUM_RTOL * c.mag[:1]), (k, float((err / c.mag[:1]).max()))
            assert np.all(np.abs(y - c.y_exact[:1]) <= c.bound[:1]), k
            np.testing.assert_array_equal(y[0], run_matmul(pool, qtype, c.w, m, k, c.x)[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_llama_rounding_of_32_value_types(qtype, isa, pools, isa_guard):
    """The 32-value block types with activations rounded as llama.cpp's Q8_0 / Q8_1 (the products
    of models that also hold K-quants, and of the 4- and 5-bit types everywhere), through microtiles
    (below 12 tokens; their int8 values: short rows several at a time, and 1536-value rows one at a
    time) and panels."""
    assert lib.ember_cpu_set_isa(isa.encode()) == 0
    for k in (512, 576, 1536):
        c = case(qtype, k, rounding=LLAMA)
        for n in (1, 3, 7, 33):
            y = run_matmul(pools[1], qtype, c.w, M, k, c.x[:n], LLAMA)
            err = np.abs(y - c.y_rounded[:n])
            assert np.all(err <= FLOAT_SUM_RTOL * c.mag[:n]), (k, n, float((err / c.mag[:n]).max()))
            assert np.all(np.abs(y - c.y_exact[:n]) <= c.bound[:n]), (k, n)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q2_K], ids=lambda t: t.name)
def test_long_rows_are_split_in_k(qtype, pools, isa_guard):
    """k above the 2048 values a packed panel holds: the panel kernels sum over k-slices
    (n = 30: above every type's threshold for the panel kernels)."""
    k, n = 4352, 30
    c = case(qtype, k, m=21, n=n)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        y = run_matmul(pools[1], qtype, c.w, 21, k, c.x)
        assert np.all(np.abs(y - c.y_rounded) <= FLOAT_SUM_RTOL * c.mag), isa


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_int8_panels_of_32_value_types(qtype, pools, isa_guard):
    """The 32-value types' int8 panels (activations rounded as llama.cpp, AVX-512; other ISAs their own
    kernels): k above the 2048 values a panel holds (slices summed), 21 rows (a panel cut short), from
    4 and 6 tokens (their thresholds) to 30 (a ragged last tile of tokens), one and two threads."""
    k, m = 4352, 21
    c = case(qtype, k, m=m, n=30, rounding=LLAMA)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        for n in (4, 5, 6, 30):
            for pool in pools:
                y = run_matmul(pool, qtype, c.w, m, k, c.x[:n], LLAMA)
                err = np.abs(y - c.y_rounded[:n])
                assert np.all(err <= FLOAT_SUM_RTOL * c.mag[:n]), (isa, n, float((err / c.mag[:n]).max()))
                assert np.all(np.abs(y - c.y_exact[:n]) <= c.bound[:n]), (isa, n)


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_weights_take_any_k(qtype, pools, isa_guard):
    """Float rows have no blocks: k = 37 leaves a tail after the vector loop; 21 tokens take the
    prompt kernels where the ISA has them (a panel cut short at 11 rows, a ragged last tile of tokens)."""
    k = 37
    for n in (5, 21):
        c = case(qtype, k, m=11, n=n)  # float weights multiply x itself, whatever the activation precision
        for isa in ISAS:
            assert lib.ember_cpu_set_isa(isa.encode()) == 0
            for pool in pools:
                y = run_matmul(pool, qtype, c.w, 11, k, c.x)
                assert np.all(np.abs(y - c.y_rounded) <= FLOAT_SUM_RTOL * c.mag), (isa, n)


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_prompt_kernels_block_k_rows_and_tokens(qtype, pools, isa_guard):
    """The float prompt kernels pack 512 values of k at a time (k = 1100: two partial sums added in
    y, then a short slice), pack several panels of the rows a thread claims together (600 rows on
    one thread: runs of 64 rows, a short panel at the end) and sweep them with chunks of 128 tokens
    (150 tokens: a short chunk, a ragged last tile)."""
    k, m, n = 1100, 600, 150
    c = case(qtype, k, m=m, n=n)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        for pool in pools:
            y = run_matmul(pool, qtype, c.w, m, k, c.x)
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


def run_multi(pool, types, ws, ms, k: int, x: np.ndarray, rounding: int) -> list[np.ndarray]:
    """One ember_matmul_multi call: the products of the weights ws (types, rows ms) with x."""
    n = x.shape[0]
    ys = [np.full((n, m), np.nan, np.float32) for m in ms]
    scratch = np.empty(lib.ember_matmul_scratch_size(int(types[0]), k, n) + 64, np.uint8)
    rc = lib.ember_matmul_multi(
        pool, len(types), ffi.new("int[]", [int(t) for t in types]), [ffi.from_buffer(w) for w in ws],
        ffi.new("int64_t[]", ms), k, ffi.cast("float *", ffi.from_buffer(x)), n,
        [ffi.cast("float *", ffi.from_buffer(y)) for y in ys], ffi.from_buffer(scratch[(-scratch.ctypes.data) % 64:]),
        rounding)
    assert rc == 0
    return ys


@pytest.mark.parametrize("types", [(T.Q4_1, T.Q4_1, T.Q4_1), (T.Q5_0, T.Q5_0, T.Q8_0), (T.Q4_K, T.Q5_K),
                                   (T.Q4_K, T.Q4_K, T.Q6_K), (T.F16, T.F32)], ids=lambda ts: "+".join(t.name for t in ts))
def test_multi_matches_separate_calls(types, pools):
    """One pass for several W sharing x (as q, k, v) gives exactly the separate products."""
    rng = np.random.default_rng(11)
    k, ms = 512, [45, 19, 19][:len(types)]
    ws = [make_weight(t, m, k, rng) for t, m in zip(types, ms)]
    for n in (1, 7, 40):
        x = rng.standard_normal((n, k), dtype=np.float32)
        ys = run_multi(pools[1], types, ws, ms, k, x, EXACT)
        for t, w, m, y in zip(types, ws, ms, ys):
            np.testing.assert_array_equal(y, run_matmul(pools[1], t, w, m, k, x))


@pytest.mark.parametrize("types", [(T.Q4_K,), (T.Q8_0,), (T.Q4_K, T.Q4_K, T.Q6_K)], ids=lambda ts: "+".join(t.name for t in ts))
def test_large_decode_products_agree_over_thread_counts(types):
    """Decode products of a few MB a thread: each share stops short of its neighbours and the units
    between are taken a chunk at a time by whichever neighbour gets there (the caller too, when it
    takes over a descheduled worker's share in an oversubscribed pool). Every row is written once,
    by the kernels of one thread: 2, 3 and 8 threads give the one-thread outputs bit for bit."""
    rng = np.random.default_rng(17)
    k = 4096
    ms = [8001] if types == (T.Q4_K,) else [4103] if types == (T.Q8_0,) else [4096, 1031, 2053]
    ws = [make_weight(t, m, k, rng) for t, m in zip(types, ms)]
    assert sum(w.nbytes for w in ws) > 8 * (2 << 20) * (1 if len(types) == 1 else 0.5)

    xs = [rng.standard_normal((n, k), dtype=np.float32) for n in (1, 3)]
    one = lib.ember_pool_create(1)
    want = [run_multi(one, types, ws, ms, k, x, LLAMA) for x in xs]
    lib.ember_pool_destroy(one)
    assert all(np.isfinite(y).all() for ys in want for y in ys)
    for threads in (2, 3, 8):
        pool = lib.ember_pool_create(threads)
        try:
            for _ in range(3 if threads == 8 else 1):
                for x, ys_want in zip(xs, want):
                    for y, y_want in zip(run_multi(pool, types, ws, ms, k, x, LLAMA), ys_want):
                        np.testing.assert_array_equal(y, y_want)
        finally:
            lib.ember_pool_destroy(pool)


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
                                [ffi.cast("float *", ffi.from_buffer(v)) for v in y], ffi.from_buffer(scratch), EXACT)
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


def test_scratch_and_support():
    assert lib.ember_matmul_scratch_size(int(T.F16), 64, 4) == 0  # float weights read x directly
    assert lib.ember_matmul_scratch_size(int(T.Q4_0), 64, 3) % 64 == 0
    assert lib.ember_matmul_scratch_size(int(T.Q4_K), 96, 1) == -1  # k not a whole super-block
    assert lib.ember_matmul_scratch_size(int(T.NVFP4), 256, 1) == -1
    for t in ALL_TYPES:
        assert lib.ember_type_supported(int(t)) == 1
    assert lib.ember_type_supported(int(T.NVFP4)) == 0
    assert lib.ember_type_supported(999) == 0


def one_hot_weight(qtype: GGMLType, k: int) -> np.ndarray:
    """W (k, k) of `qtype` whose row i is 1 at column i and 0 elsewhere (up to the f16 scale of the
    legacy types), so that y = x^ @ W^T shows the activations exactly as the kernels rounded them."""
    if qtype in LEGACY:
        return gq.quantize(np.eye(k, dtype=np.float32), qtype)
    lay = layout(qtype)
    blocks = np.zeros((k, k // QK_K, lay.type_size), np.uint8)
    one = np.array([1.0], np.float16).view(np.uint8)
    if qtype == T.Q4_K:  # d, dmin, scales (all 1, mins 0), qs: nibble (j & 1) of qs[32 (j / 2) + l]
        blocks[:, :, 0:2] = one
        blocks[:, :, 4:8] = 1
        blocks[:, :, 12:16] = 1
        for i in range(k):
            j, l = divmod(i % QK_K, 32)
            blocks[i, i // QK_K, 16 + 32 * (j // 2) + l] = 1 << (4 * (j & 1))
    else:  # Q2_K: scales 1 with mins 0, d 1, dmin 0; value v is bits 2s of qs[32h + l]
        blocks[:, :, 0:16] = 1
        blocks[:, :, 80:82] = one
        for i in range(k):
            v = i % QK_K
            h, s, l = v >> 7, (v >> 5) & 3, v & 31
            blocks[i, i // QK_K, 16 + 32 * h + l] = 1 << (2 * s)
    return blocks.reshape(k, -1)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q2_K, T.Q4_K], ids=lambda t: t.name)
def test_kernels_see_the_reference_activations(qtype, pools, isa_guard):
    """Through one-hot weights, every activation value on every path (microtiles: n = 1, 2; panels:
    n = 33) is the reference rounding to within float32 noise.
    (Not Q3_K/Q6_K: their SIMD microtiles shed the weight offset only in the sum over lanes, which a
    one-hot row turns into float cancellation of ~1e-4.)"""
    k = 512
    w = one_hot_weight(qtype, k)
    wf = dequant_ref(w, qtype, k).astype(np.float64)
    assert np.count_nonzero(wf) == k and np.all(np.abs(np.diag(wf) - 1) < 1e-3)
    x = np.random.default_rng(9).standard_normal((33, k), dtype=np.float32)
    want = product_ref(w, wf, qtype, x, acts_ref(x, qtype))
    amax = np.abs(x).max(axis=1, keepdims=True)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        for n in (1, 2, 33):
            y = run_matmul(pools[1], qtype, w, k, k, x[:n])
            assert np.all(np.abs(y - want[:n]) <= 1e-6 * amax[:n]), (isa, n)


def test_scratch_size():
    """One row per token: int16 c, then per block of 32 d and s, then from the next 64-byte boundary
    the values again as int8 and their int32 sums per block (Q16); int8 q, per 256 d, then bsums and the
    panels' sums per 16 and 32 (Q8K); each row a multiple of 64 bytes."""
    for t, k in ((T.Q4_0, 576), (T.Q4_K, 1024)):
        assert lib.ember_matmul_scratch_size(int(t), k, 5) == 5 * lib.ember_matmul_scratch_size(int(t), k, 1)
    q16 = -(-(2 * 576 + 8 * 18) // 64) * 64 + 576 + 4 * 18
    assert lib.ember_matmul_scratch_size(int(T.Q4_0), 576, 1) == -(-q16 // 64) * 64
    q8k = 1024 + 4 * 4 + 2 * 64 + 4 * 64 + 4 * 32 + 4 * 64 + 4 * 32
    assert lib.ember_matmul_scratch_size(int(T.Q6_K), 1024, 1) == -(-q8k // 64) * 64


def quantize_c(qtype: GGMLType, x: np.ndarray, rounding: int = EXACT) -> np.ndarray:
    """ember_matmul_quantize of each row of x (n, k) -> (n, row bytes)."""
    n, k = x.shape
    size = lib.ember_matmul_scratch_size(int(qtype), k, 1)
    out = np.zeros((n, size), np.uint8)
    for i in range(n):
        row = np.ascontiguousarray(x[i])
        assert lib.ember_matmul_quantize(int(qtype), ffi.cast("float *", ffi.from_buffer(row)), k,
                                         ffi.from_buffer(out[i]), rounding) == 0
    return out


def activation_inputs(k: int) -> np.ndarray:
    """Rows that exercise the quantizers: normal values, a zero row, a row whose largest magnitude is
    negative, one where +m and -m tie (the first decides Q8_K's sign), and tiny values."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((8, k)).astype(np.float32)
    x[1] = 0
    x[2, 5] = -40.0
    x[3, 7], x[3, 300 % k] = -9.0, 9.0
    x[4] *= 1e-30
    x[5, :64] = 0
    return x


@pytest.mark.parametrize("qtype,rounding", [(T.Q4_0, EXACT), (T.Q4_1, LLAMA), (T.Q4_K, EXACT), (T.Q6_K, LLAMA)],
                         ids=["Q4_0-exact", "Q4_1-llama", "Q4_K", "Q6_K"])
def test_quantizers_write_the_reference_rows(qtype, rounding, isa_guard):
    """The activation rows every path writes: int16 values for the 32-value types, exact or as
    llama.cpp's Q8_0/Q8_1 (its AVX2 code's rounding; then also as int8), and Q8_K byte for byte as ggml's reference
    (ember.quant) whatever the rounding asked, with the sums the kernels read."""
    k = 1536 if qtype in KQUANTS else 576
    x = activation_inputs(k)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        rows = quantize_c(qtype, x, rounding)
        if qtype in KQUANTS:
            nb = k // QK_K
            want = quantize_q8k_ref(x)
            blocks = quantize_q8_K(x.reshape(-1, QK_K)).view(quant_block_q8k()).reshape(len(x), nb)
            np.testing.assert_array_equal(rows[:, :k].view(np.int8), want.q, err_msg=isa)
            np.testing.assert_array_equal(rows[:, k:k + 4 * nb].view(np.float32), want.d, err_msg=isa)
            bsums = rows[:, k + 4 * nb:k + 4 * nb + 2 * (k // 16)].view(np.int16)
            np.testing.assert_array_equal(bsums, blocks["bsums"].reshape(len(x), -1), err_msg=isa)
            off = k + 4 * nb + 2 * (k // 16)
            sum16 = rows[:, off:off + 4 * (k // 16)].view(np.float32)
            sum32 = rows[:, off + 4 * (k // 16):off + 4 * (k // 16) + 4 * (k // 32)].view(np.float32)
            np.testing.assert_array_equal(sum16, bsums.astype(np.float32), err_msg=isa)
            np.testing.assert_array_equal(sum32, bsums.reshape(len(x), -1, 2).sum(-1).astype(np.float32), err_msg=isa)
        else:
            nb = k // 32
            want = quantize_q16_ref(x, rounding)
            np.testing.assert_array_equal(rows[:, :2 * k].view(np.int16), want.q, err_msg=isa)
            np.testing.assert_array_equal(rows[:, 2 * k:2 * k + 4 * nb].view(np.float32), want.d, err_msg=isa)
            np.testing.assert_array_equal(rows[:, 2 * k + 4 * nb:2 * k + 8 * nb].view(np.float32), want.s, err_msg=isa)
            if rounding == LLAMA:  # the same values as int8, for the decode kernels
                q8 = -(-(2 * k + 8 * nb) // 64) * 64
                np.testing.assert_array_equal(rows[:, q8:q8 + k].view(np.int8), want.q, err_msg=isa)


def assert_products_within_float_noise(pool, qtype, w, wf, x, ns, tag):
    """The first n rows of x (for each n in ns) by w on every ISA: the reference's products to within
    float32 noise of the integer sums' magnitude."""
    m, k = wf.shape
    acts = acts_ref(x, qtype)
    want = product_ref(w, wf, qtype, x, acts)
    mag = np.abs(acts.xq) @ np.abs(wf).T
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        for n in ns:
            y = run_matmul(pool, qtype, w, m, k, x[:n])
            assert np.all(np.abs(y - want[:n]) <= FLOAT_SUM_RTOL * mag[:n] + 1e-30), (isa, tag, n)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_exact_q4_decode_tiles_at_the_extremes(qtype, pools, isa_guard):
    """The exact Q4_0 / Q4_1 decode tiles (their nibbles as 16-bit words on x86): values at +-32767,
    every nibble 0 or 15, short rows 4 at a time and a lone long row, the last group of blocks ragged,
    1-4 tokens: the reference's products to within float32 noise."""
    rng = np.random.default_rng(12)
    for k, m in ((576, 9), (1536, 3)):
        w = make_weight(qtype, m, k, rng)
        blocks = w.reshape(m, k // 32, -1)
        blocks[0, :, -16:] = 0xFF  # every nibble 15: the largest products
        blocks[1, :, -16:] = 0x00  # every nibble 0: Q4_0's most negative weight
        wf = dequant_ref(w, qtype, k).astype(np.float64)
        x = rng.standard_normal((4, k), dtype=np.float32)
        x[0, :] = np.tile([1.0, -1.0], k // 2)          # c = +-32767 everywhere
        x[1, :32] = np.linspace(-1, 1, 32, dtype=np.float32)
        x[2, -32:] = -1.0                               # the ragged last group at its largest
        x[3] = 0.0
        assert_products_within_float_noise(pools[1], qtype, w, wf, x, (1, 2, 3, 4), k)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_exact_rows_in_lanes_at_the_extremes(qtype, pools, isa_guard):
    """The exact products of several tokens at their largest integer sums: every weight at its extreme
    (nibbles 15 or 0; Q8_0 -128 and 127) against values of +-32767, rows 1-17 (a lone row, a ragged group,
    a full group and one more), 2-17 tokens: the reference's products to within float32 noise."""
    rng = np.random.default_rng(13)
    k = 576
    for m in (1, 5, 16, 17):
        w = make_weight(qtype, m, k, rng)
        blocks = w.reshape(m, k // 32, -1)
        blocks[0, :, -32 if qtype == T.Q8_0 else -16:] = 0x80 if qtype == T.Q8_0 else 0xFF
        if m > 1:
            blocks[m - 1, :, -32 if qtype == T.Q8_0 else -16:] = 0x7F if qtype == T.Q8_0 else 0x00
        wf = dequant_ref(w, qtype, k).astype(np.float64)
        x = rng.standard_normal((17, k), dtype=np.float32)
        x[0] = 1.0                                       # c = 32767 everywhere
        x[1] = np.tile([1.0, -1.0], k // 2)              # +-32767
        x[2] = -1.0
        x[3] = 0.0
        assert_products_within_float_noise(pools[1], qtype, w, wf, x, (2, 3, 8, 16, 17), m)


@pytest.mark.parametrize("qtype", [T.Q5_1, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
def test_kernels_stay_inside_scratch(qtype, pools, isa_guard):
    """Bytes after the scratch size are never written, on any path (panels too: n = 40)."""
    k, m, n = 512, 19, 40
    rng = np.random.default_rng(3)
    w = make_weight(qtype, m, k, rng)
    x = rng.standard_normal((n, k), dtype=np.float32)
    size = lib.ember_matmul_scratch_size(int(qtype), k, n)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        buf = np.empty(size + 64 + 256, np.uint8)
        start = (-buf.ctypes.data) % 64
        buf[start + size:] = 0xA5
        y = np.empty((n, m), np.float32)
        lib.ember_matmul(pools[1], int(qtype), ffi.from_buffer(w), m, k, ffi.cast("float *", ffi.from_buffer(x)), n,
                         ffi.cast("float *", ffi.from_buffer(y)), ffi.from_buffer(buf[start:]), EXACT)
        assert np.all(buf[start + size:] == 0xA5), isa


def test_backend_refuses_bad_shapes():
    """A K-quant matrix whose rows are not whole super-blocks: an error, not a product."""
    be = Backend(threads=1)
    with pytest.raises(BackendError, match="Q4_K"):
        be._scratch_for(int(T.Q4_K), 96, 1)


def test_rounding_follows_the_weight_types():
    """int8 activations (llama.cpp's rounding) for the 32-value types in models that hold K-quants;
    exact ones otherwise (a cached prompt's continuation stays the uncached one's)."""
    be = Backend(threads=1)
    be._weight_types.update(int(t) for t in (T.Q4_1, T.Q5_0, T.IQ4_NL, T.Q8_0, T.Q4_0))
    assert be.rounding == EXACT
    be._weight_types.add(int(T.Q6_K))
    assert be.rounding == LLAMA


def test_oversubscribed_pool_runs_each_share_once():
    """A pool of more threads than cores: workers are descheduled mid-job, the caller takes their
    shares over, and late workers wake into later jobs. Over many short jobs each share must run
    exactly once: ember_stream_read XORs each share's words into the result, so a share run twice
    cancels itself out; and products stay the one-thread ones."""
    rng = np.random.default_rng(13)
    buf = rng.integers(0, 2**63, 1 << 14, dtype=np.uint64)
    want = int(np.bitwise_xor.reduce(buf))
    many = lib.ember_pool_create(8)
    try:
        for _ in range(20000):
            assert lib.ember_stream_read(many, ffi.from_buffer(buf), buf.nbytes) == want
        k, m = 256, 64
        w = make_weight(T.Q4_K, m, k, rng)
        xs = rng.standard_normal((20, 1, k), dtype=np.float32)
        one = lib.ember_pool_create(1)
        want_y = [run_matmul(one, T.Q4_K, w, m, k, x) for x in xs]
        lib.ember_pool_destroy(one)
        for i in range(2000):
            np.testing.assert_array_equal(run_matmul(many, T.Q4_K, w, m, k, xs[i % 20]), want_y[i % 20])
    finally:
        lib.ember_pool_destroy(many)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_subnormal_scale_products_flush_to_zero_and_python_keeps_its_mode(qtype, pools):
    """Activations near 1e-34 (a saturated silu gives them) make the products of block scales
    subnormal: the kernels flush those to zero rather than compute on them (slowly), so outputs
    stay finite and within |W| |x| of zero; activations that keep the products normal
    scale the output exactly as before. The caller's thread gets its floating-point mode back:
    numpy's subnormal arithmetic after a product is untouched."""
    rng = np.random.default_rng(7)
    m, k = 64, 512
    w = make_weight(qtype, m, k, rng)
    x = rng.standard_normal((1, k), dtype=np.float32)
    size = np.abs(dequant_ref(w, qtype, k)).astype(np.float64) @ np.abs(x[0]).astype(np.float64)  # |W| |x|
    for pool in pools:
        base = run_matmul(pool, qtype, w, m, k, x).astype(np.float64)
        small = run_matmul(pool, qtype, w, m, k, (x * np.float32(1e-20)).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(small - base * 1e-20) <= 1e-6 * size * 1e-20)
        tiny = run_matmul(pool, qtype, w, m, k, (x * np.float32(1e-34)).astype(np.float32)).astype(np.float64)
        assert np.isfinite(tiny).all()
        assert np.all(np.abs(tiny) <= 1.1 * size * 1e-34)
        assert np.float32(1e-38) * np.float32(1e-3) > 0  # subnormal result, not flushed
        assert np.float32(1e-40) > 0  # a subnormal operand still counts
