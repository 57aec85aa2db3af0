"""Quantized matrix products of the CPU backend (ember_matmul, ember_get_rows, ember_dequantize)
against numpy references, on every SIMD path this CPU can run, with both activation precisions
(16: two int8 levels, the default; 8: one)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from gguf import quants as gq

from ember.backends.base import BackendError
from ember.backends.cpu import Backend
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
ACT_BITS = [16, 8]


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


@pytest.fixture(params=ACT_BITS, ids=lambda b: f"act{b}")
def act_bits(request):
    """Runs the test with each activation precision, then restores the one it found."""
    start = lib.ember_matmul_act_bits()
    assert lib.ember_matmul_set_act_bits(request.param) == 0
    yield request.param
    assert lib.ember_matmul_set_act_bits(start) == 0


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


def round_blocks(xb: np.ndarray) -> np.ndarray:
    """xb (..., block) f32 rounded to int8 with d = amax / 127 per block (float32 steps), as float64."""
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)


def quantize_activations_ref(x: np.ndarray, block: int, bits: int) -> np.ndarray:
    """What the kernels multiply by: x rounded to int8 per block and, for 16 bits, plus the rounding
    of the residual. The residual x - q d is exact in float64, so rounding it to float32 once gives
    the kernels' fma result bit for bit."""
    xb = x.reshape(x.shape[0], -1, block)
    xq = round_blocks(xb)
    if bits == 16:  # the residual in steps of d / 256, at most 127 of them
        amax = np.abs(xb).max(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            inv2 = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32) * np.float32(256)
        r = (xb.astype(np.float64) - xq).astype(np.float32)
        q2 = np.clip(np.rint(r * inv2), -127, 127)
        xq = xq + q2.astype(np.float64) * ((amax / np.float32(127)).astype(np.float32) / np.float32(256)).astype(np.float64)
    return xq.reshape(x.shape)


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
    bound: np.ndarray     # |y - y_exact| allowed by the rounding of x (and float32 sums)


def max_step_error(amax: np.ndarray, bits: int) -> np.ndarray:
    """How far the kernels may move a value of a block with max |x| amax. One rounding to nearest:
    half a step, amax / 254. The residual is then rounded in steps of amax / (127 * 256): half a step,
    or up to one where a residual of nearly half a first-level step is clamped to 127 of them."""
    return amax / (254.0 if bits == 8 else 127.0 * 256.0) * 1.001


@functools.lru_cache(maxsize=None)
def case(qtype: GGMLType, k: int, bits: int = 16, m: int = M, n: int = max(NS)) -> Case:
    rng = np.random.default_rng(int(qtype) * 1000 + k)
    w = make_weight(qtype, m, k, rng)
    wf = dequant_ref(w, qtype, k).astype(np.float64)
    x = rng.standard_normal((n, k), dtype=np.float32)
    block = act_block(qtype)
    xq = x.astype(np.float64) if block is None else quantize_activations_ref(x, block, bits)
    mag = np.abs(xq) @ np.abs(wf).T
    if block is None:
        bound = FLOAT_SUM_RTOL * mag
    else:
        # each x_i moves by at most max_step_error of its block; weighted by |w_i| and summed,
        # that bounds the output error
        amax = np.repeat(np.abs(x.reshape(n, -1, block)).max(-1), block, axis=1).astype(np.float64)
        bound = max_step_error(amax, bits) @ np.abs(wf).T + FLOAT_SUM_RTOL * mag
    return Case(w, x, xq @ wf.T, mag, x.astype(np.float64) @ wf.T, bound)


# float32 accumulation error relative to sum |w x|: observed up to ~2e-7 with k <= 1536
FLOAT_SUM_RTOL = 2e-6


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_reference(qtype, isa, act_bits, pools, isa_guard):
    assert lib.ember_cpu_set_isa(isa.encode()) == 0
    for k in ks_for(qtype):
        c = case(qtype, k, act_bits)
        for n in NS:
            y = run_matmul(pools[1], qtype, c.w, M, k, c.x[:n])
            err = np.abs(y - c.y_rounded[:n])
            assert np.all(err <= FLOAT_SUM_RTOL * c.mag[:n]), (k, n, float((err / c.mag[:n]).max()))
            assert np.all(np.abs(y - c.y_exact[:n]) <= c.bound[:n]), (k, n)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q2_K], ids=lambda t: t.name)
def test_long_rows_are_split_in_k(qtype, act_bits, pools, isa_guard):
    """k above the 2048 values a packed panel holds: the panel kernels sum over k-slices
    (n = 30: above every type's threshold for the panel kernels)."""
    k, n = 4352, 30
    c = case(qtype, k, act_bits, m=21, n=n)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        y = run_matmul(pools[1], qtype, c.w, 21, k, c.x)
        assert np.all(np.abs(y - c.y_rounded) <= FLOAT_SUM_RTOL * c.mag), isa


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_weights_take_any_k(qtype, pools, isa_guard):
    """Float rows have no blocks: k = 37 leaves a tail after the 16-wide vector loop."""
    k = 37
    c = case(qtype, k, m=11, n=5)  # float weights multiply x itself, whatever the activation precision
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        y = run_matmul(pools[1], qtype, c.w, 11, k, c.x)
        assert np.all(np.abs(y - c.y_rounded) <= FLOAT_SUM_RTOL * c.mag), isa


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "scalar"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_simd_agrees_with_scalar(qtype, isa, act_bits, pools, isa_guard):
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
def test_one_and_two_threads_agree_exactly(qtype, act_bits, pools):
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


def test_large_prompt_crosses_token_chunks(act_bits, pools, isa_guard):
    """n large enough that the activations are swept in several L2-sized chunks."""
    k, n = 2048, 300
    c = case(T.Q4_0, k, act_bits, m=45, n=n)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        y = run_matmul(pools[1], T.Q4_0, c.w, 45, k, c.x)
        assert np.all(np.abs(y - c.y_rounded) <= FLOAT_SUM_RTOL * c.mag), isa


@pytest.mark.parametrize("types", [(T.Q4_1, T.Q4_1, T.Q4_1), (T.Q5_0, T.Q5_0, T.Q8_0), (T.Q4_K, T.Q5_K),
                                   (T.F16, T.F32)], ids=lambda ts: "+".join(t.name for t in ts))
def test_multi_matches_separate_calls(types, act_bits, pools):
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
def test_kernels_see_the_reference_activations(qtype, act_bits, pools, isa_guard):
    """Through one-hot weights, every activation value on every path (microtiles: n = 1, 2; panels:
    n = 33) is the reference rounding to within float32 noise, far below one step of the residual.
    (Not Q3_K/Q6_K: their SIMD microtiles shed the weight offset only in the sum over lanes, which a
    one-hot row turns into float cancellation of ~1e-4.)"""
    k = 512
    w = one_hot_weight(qtype, k)
    wf = dequant_ref(w, qtype, k).astype(np.float64)
    assert np.count_nonzero(wf) == k and np.all(np.abs(np.diag(wf) - 1) < 1e-3)
    x = np.random.default_rng(9).standard_normal((33, k), dtype=np.float32)
    block = act_block(qtype)
    want = quantize_activations_ref(x, block, act_bits) @ wf.T
    amax = np.repeat(np.abs(x.reshape(33, -1, block)).max(-1), block, axis=1)
    for isa in ISAS:
        assert lib.ember_cpu_set_isa(isa.encode()) == 0
        for n in (1, 2, 33):
            y = run_matmul(pools[1], qtype, w, k, k, x[:n])
            assert np.all(np.abs(y - want[:n]) <= 1e-6 * amax[:n]), (isa, n)


def test_scratch_serves_both_precisions():
    """One size for both precisions (so switching between calls is safe): two rows per token."""
    for t, k in ((T.Q4_0, 576), (T.Q4_K, 1024)):
        assert lib.ember_matmul_scratch_size(int(t), k, 5) == 5 * lib.ember_matmul_scratch_size(int(t), k, 1)
    # q | d, s, nq per block of 32 | 8 lane sums per block (32-aligned) | c16: both levels as int16 (64-aligned)
    lane_sums_end = -(-(576 + 12 * (576 // 32)) // 32) * 32 + 32 * (576 // 32)
    row_q8 = -(-lane_sums_end // 64) * 64 + 2 * 576
    assert lib.ember_matmul_scratch_size(int(T.Q4_0), 576, 1) == 2 * (-(-row_q8 // 64) * 64)


@pytest.mark.parametrize("qtype", [T.Q5_1, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
def test_kernels_stay_inside_scratch(qtype, act_bits, pools, isa_guard):
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
                         ffi.cast("float *", ffi.from_buffer(y)), ffi.from_buffer(buf[start:]))
        assert np.all(buf[start + size:] == 0xA5), isa


def test_two_levels_are_near_exact(pools):
    """The point of the residual level: on a real-sized row the error against the exact product is
    some 100x below the single int8 rounding's (which llama.cpp also has)."""
    k = 1536
    errors = {}
    start = lib.ember_matmul_act_bits()
    for bits in ACT_BITS:
        assert lib.ember_matmul_set_act_bits(bits) == 0
        c = case(T.Q4_1, k, bits)
        errors[bits] = np.abs(run_matmul(pools[1], T.Q4_1, c.w, M, k, c.x) - c.y_exact).mean()
    assert lib.ember_matmul_set_act_bits(start) == 0
    assert errors[16] * 100 < errors[8], errors


def test_act_bits_setting():
    start = lib.ember_matmul_act_bits()
    assert start in ACT_BITS
    for bad in (0, 4, 12, 32):
        assert lib.ember_matmul_set_act_bits(bad) == -1
        assert lib.ember_matmul_act_bits() == start
    code = "from ember.backends.cpu._native import lib; print(lib.ember_matmul_act_bits())"
    for value, expect in (("8", 8), ("16", 16), ("", 16), ("9", 16), ("8bits", 16)):
        env = {**os.environ, "EMBER_ACT_BITS": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert int(out.stdout) == expect, value
        assert ("EMBER_ACT_BITS" in out.stderr) == (value not in ("", "8", "16")), (value, out.stderr)


def test_backend_refuses_bad_shapes():
    """A K-quant matrix whose rows are not whole super-blocks: an error, not a product."""
    be = Backend(threads=1)
    with pytest.raises(BackendError, match="Q4_K"):
        be._scratch_for(int(T.Q4_K), 96, 1)
