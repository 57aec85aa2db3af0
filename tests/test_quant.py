"""ember.quant against gguf-py's numpy reference (the oracle) and ggml's C semantics."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as oracle

from ember.quant import (
    DEQUANTIZABLE,
    FORMATS,
    QK_K,
    QUANTIZABLE,
    GGMLType,
    dequantize,
    layout,
    quantize,
    quantize_q8_0,
    quantize_q8_1,
    quantize_q8_K,
)

LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
SUPER_BLOCK = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
LOW_BIT = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"]
FLOATS = ["F32", "F16", "BF16"]
MX = ["MXFP4"]  # E8M0 scale bytes: any byte is a valid scale
SEEDS = [0, 1, 2]
ROWS = [1, 3, 17]


def bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns, so -0.0 != 0.0 and NaNs compare by payload."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def oracle_dequantize(raw: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # random scales include inf and NaN
        return oracle.dequantize(raw, GGMLQuantizationType[name])


def oracle_quantize(x: np.ndarray, name: str) -> np.ndarray:
    out = oracle.quantize(x, GGMLQuantizationType[name])
    return np.ascontiguousarray(out).view(np.uint8).reshape(*x.shape[:-1], -1)


def weights(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Weight-like rows with the awkward cases: a zero block, a constant block, mixed scales."""
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.01, 3, (rows, 1)).astype(np.float32)
    x[0, :32] = 0.0
    if k >= 64:
        x[0, 32:64] = np.float32(0.25)
    return x


def random_blocks(rng: np.random.Generator, name: str, rows: int, blocks_per_row: int) -> np.ndarray:
    """Random raw rows whose f16 scale fields hold small finite values (some negative, zero, subnormal)."""
    fmt = FORMATS[GGMLType[name]]
    raw = rng.integers(0, 256, (rows, blocks_per_row * fmt.block.itemsize), dtype=np.uint8)
    blocks = raw.reshape(-1).view(fmt.block)
    for field in ("d", "dmin"):
        if field in blocks.dtype.names:
            scale = rng.uniform(-2, 2, len(blocks)) * 10.0 ** rng.integers(-7, 1, len(blocks))
            scale[:2] = [0.0, -0.0][: len(scale[:2])]
            blocks[field] = scale.astype(np.float16)
    return raw


# --- dequantization, bit-exact with the oracle -----------------------------------------------------


@pytest.mark.parametrize("name", LEGACY + MX)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", ROWS)
def test_legacy_dequantize_of_quantized_weights(name, seed, rows):
    x = weights(np.random.default_rng(seed), rows, 32 * 4)
    raw = oracle_quantize(x, name)
    np.testing.assert_array_equal(bits(dequantize(raw, GGMLType[name])), bits(oracle_dequantize(raw, name)))


@pytest.mark.parametrize("name", LEGACY + LOW_BIT + MX + ["F16", "BF16", "F32"])
@pytest.mark.parametrize("seed", SEEDS)
def test_dequantize_random_raw_bytes(name, seed):
    # Fully random bytes: scales may be inf or NaN, and the results must still agree bit for bit.
    rng = np.random.default_rng(seed)
    lay = layout(GGMLType[name])
    raw = rng.integers(0, 256, (11, lay.type_size * 5), dtype=np.uint8)
    ours = dequantize(raw, GGMLType[name])
    assert ours.dtype == np.float32 and ours.shape == (11, lay.block_size * 5)
    np.testing.assert_array_equal(bits(ours), bits(oracle_dequantize(raw, name)))


@pytest.mark.parametrize("name", SUPER_BLOCK + LOW_BIT)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", ROWS)
def test_super_block_dequantize_random_blocks(name, seed, rows):
    raw = random_blocks(np.random.default_rng(seed), name, rows, blocks_per_row=2)
    ours = dequantize(raw, GGMLType[name])
    assert ours.shape == (rows, 2 * layout(GGMLType[name]).block_size)
    np.testing.assert_array_equal(bits(ours), bits(oracle_dequantize(raw, name)))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ2_XS", "IQ1_M", "TQ1_0"])
def test_dequantize_large_tensor_spanning_chunks(name):
    # Big enough that the dequantizer works in several chunks, with a ragged last one.
    block_size = layout(GGMLType[name]).block_size
    raw = random_blocks(np.random.default_rng(7), name, rows=1, blocks_per_row=(1 << 18) // block_size + 3)
    np.testing.assert_array_equal(bits(dequantize(raw, GGMLType[name])), bits(oracle_dequantize(raw, name)))


def test_dequantizable_covers_every_type_in_use():
    wanted = LEGACY + SUPER_BLOCK + LOW_BIT + FLOATS + MX + ["Q8_1", "Q8_K"]
    assert {GGMLType[n] for n in wanted} <= DEQUANTIZABLE
    assert GGMLType.NVFP4 not in DEQUANTIZABLE


# --- quantization, bit-exact with the oracle -------------------------------------------------------


@pytest.mark.parametrize("name", LEGACY + FLOATS + MX)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", ROWS)
def test_quantize_matches_oracle(name, seed, rows):
    x = weights(np.random.default_rng(seed), rows, 32 * 3)
    ours = quantize(x, GGMLType[name])
    assert ours.dtype == np.uint8 and ours.shape == (rows, layout(GGMLType[name]).row_bytes(96))
    np.testing.assert_array_equal(ours, oracle_quantize(x, name))


@pytest.mark.parametrize("name", LEGACY + ["Q8_1"])
def test_quantize_round_trip_error_is_bounded(name):
    blocks = weights(np.random.default_rng(3), 8, 256).reshape(-1, 32)
    amax, spread = np.abs(blocks).max(axis=1), blocks.max(axis=1) - blocks.min(axis=1)
    bound = {  # the symmetric 4/5-bit types clip the far side by up to one step
        "Q4_0": amax / 8, "Q5_0": amax / 16, "Q4_1": spread / 30, "Q5_1": spread / 62,
        "Q8_0": amax / 254, "Q8_1": amax / 254,
    }[name]
    y = dequantize(quantize(blocks, GGMLType[name]), GGMLType[name])
    err = np.abs(y - blocks).max(axis=1)
    assert np.all(err <= bound + 2e-3 * amax + 1e-6)  # slack: f16 rounding of the scale and min
    assert np.count_nonzero(err) >= len(err) - 2  # lossy, except the zero and constant blocks


def test_bf16_quantize_keeps_nan_and_rounds_to_even():
    x = np.array([np.nan, -np.inf, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.0e38], np.float32)
    got = quantize(x, GGMLType.BF16).view(np.uint16)
    assert np.isnan(dequantize(got.view(np.uint8), GGMLType.BF16)[0])
    np.testing.assert_array_equal(got[1:4], [0xFF80, 0x3F80, 0x3F82])  # ties go to the even mantissa
    np.testing.assert_array_equal(got, oracle_quantize(x, "BF16").view(np.uint16))


# --- activation quantizers vs a scalar transcription of ggml's reference C -------------------------


def roundf(v: float) -> int:
    return int(np.trunc(v) + (np.sign(v) if abs(v - np.trunc(v)) >= 0.5 else 0))


def scalar_q8_1(block: np.ndarray) -> tuple[np.float16, np.float16, list[int]]:
    d = np.float32(np.abs(block).max()) / np.float32(127)
    inv = np.float32(1) / d if d else np.float32(0)
    q = [roundf(np.float32(v) * inv) for v in block]
    return np.float16(d), np.float16(np.float32(sum(q)) * d), q


def scalar_q8_K(block: np.ndarray) -> tuple[np.float32, list[int], list[int]]:
    peak = np.float32(0)
    for v in block:  # the first value of largest magnitude wins
        if abs(v) > abs(peak):
            peak = np.float32(v)
    if peak == 0:
        return np.float32(0), [0] * QK_K, [0] * 16
    iscale = np.float32(-127) / peak
    q = [min(127, int(np.rint(iscale * np.float32(v)))) for v in block]
    return np.float32(1) / iscale, q, [sum(q[i:i + 16]) for i in range(0, QK_K, 16)]


def activations(seed: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, k)) * rng.uniform(0.1, 20, (2, 1))).astype(np.float32)
    x[1, :32] = 0.0
    return x


@pytest.mark.parametrize("seed", SEEDS)
def test_quantize_q8_0_is_ggml_reference(seed):
    x = activations(seed, 128)
    raw = quantize_q8_0(x)
    np.testing.assert_array_equal(raw, oracle_quantize(x, "Q8_0"))
    blocks = raw.reshape(-1).view(FORMATS[GGMLType.Q8_0].block)
    for blk, want in zip(blocks, map(scalar_q8_1, x.reshape(-1, 32)), strict=True):
        assert blk["d"].tobytes() == want[0].tobytes() and list(blk["qs"]) == want[2]


@pytest.mark.parametrize("seed", SEEDS)
def test_quantize_q8_1_is_ggml_reference(seed):
    x = activations(seed, 128)
    raw = quantize_q8_1(x)
    assert raw.shape == (2, 4 * 36)
    blocks = raw.reshape(-1).view(FORMATS[GGMLType.Q8_1].block)
    for blk, (d, s, q) in zip(blocks, map(scalar_q8_1, x.reshape(-1, 32)), strict=True):
        assert (blk["d"].tobytes(), blk["s"].tobytes(), list(blk["qs"])) == (d.tobytes(), s.tobytes(), q)
    # its values are exactly Q8_0's
    as_q8_0 = dequantize(quantize_q8_0(x), GGMLType.Q8_0)
    np.testing.assert_array_equal(bits(dequantize(raw, GGMLType.Q8_1)), bits(as_q8_0))


@pytest.mark.parametrize("seed", SEEDS)
def test_quantize_q8_K_is_ggml_reference(seed):
    x = activations(seed, 2 * QK_K)
    x[0, 5] = -np.abs(x[0]).max() * 1.5  # a negative peak: d comes out positive
    raw = quantize_q8_K(x)
    assert raw.shape == (2, 2 * 292)
    blocks = raw.reshape(-1).view(FORMATS[GGMLType.Q8_K].block)
    for blk, (d, q, sums) in zip(blocks, map(scalar_q8_K, x.reshape(-1, QK_K)), strict=True):
        assert blk["d"].tobytes() == d.tobytes()
        assert list(blk["qs"]) == q and list(blk["bsums"]) == sums
    y = dequantize(raw, GGMLType.Q8_K).reshape(-1, QK_K)
    d = np.abs(blocks["d"])[:, None]
    assert np.all(np.abs(y - x.reshape(-1, QK_K)) <= 0.5001 * d)


def test_activation_rounding_modes_on_exact_ties():
    # amax 127 makes d = 1, so quants are the inputs rounded: Q8_0/Q8_1 round ties away from zero,
    # Q8_K (scale -127/peak = 1 for peak -127) rounds ties to even.
    ties = np.array([2.5, -2.5, 3.5, 0.5, -0.5, 126.5], np.float32)
    x = np.zeros(QK_K, np.float32)
    x[0], x[1:7] = -127, ties
    q8_0 = quantize_q8_0(x[:32]).view(np.int8)[2:]
    np.testing.assert_array_equal(q8_0[1:7], [3, -3, 4, 1, -1, 127])
    q8_k = quantize_q8_K(x)[4:4 + QK_K].view(np.int8)
    np.testing.assert_array_equal(q8_k[:7], [-127, 2, -2, 4, 0, 0, 126])


def test_q8_K_zero_block_and_positive_peak():
    x = np.zeros((2, QK_K), np.float32)
    x[1, 3] = 2.0
    blocks = quantize_q8_K(x).reshape(-1).view(FORMATS[GGMLType.Q8_K].block)
    assert blocks[0]["d"] == 0 and not blocks[0]["qs"].any() and not blocks[0]["bsums"].any()
    assert blocks[1]["d"] == np.float32(1) / (np.float32(-127) / np.float32(2)) and blocks[1]["qs"][3] == -127
    assert blocks[1]["bsums"][0] == -127
    np.testing.assert_array_equal(dequantize(quantize_q8_K(x), GGMLType.Q8_K)[1, 3], np.float32(2.0))


# --- shapes and errors ----------------------------------------------------------------------------


def test_shapes_follow_input_or_explicit_shape():
    x = weights(np.random.default_rng(5), 6, 64).reshape(2, 3, 64)
    raw = quantize(x, GGMLType.Q8_0)
    assert raw.shape == (2, 3, 68)
    assert dequantize(raw, GGMLType.Q8_0).shape == (2, 3, 64)
    flat = dequantize(raw.reshape(-1), GGMLType.Q8_0)
    assert flat.shape == (384,)
    np.testing.assert_array_equal(dequantize(raw.reshape(-1), GGMLType.Q8_0, shape=(6, 64)), flat.reshape(6, 64))
    assert quantize(x[0, 0], GGMLType.Q4_0).shape == (18 * 2,)
    assert dequantize(np.zeros((0, 34), np.uint8), GGMLType.Q8_0).shape == (0, 32)


def test_plain_types_accept_typed_arrays():
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    bf16_bits = quantize(x, GGMLType.BF16).view("<u2")
    assert bf16_bits.shape == (3, 4)
    np.testing.assert_allclose(dequantize(bf16_bits, GGMLType.BF16), x, rtol=2**-8)
    halves = x.astype(np.float16)
    np.testing.assert_array_equal(dequantize(halves, GGMLType.F16), halves.astype(np.float32))
    np.testing.assert_array_equal(dequantize(x, GGMLType.F32), x)
    with pytest.raises(TypeError, match="F16.*float32"):
        dequantize(x, GGMLType.F16)


def test_f32_dequantize_copies():
    raw = quantize(np.arange(8, dtype=np.float32), GGMLType.F32)
    y = dequantize(raw, GGMLType.F32)
    raw[:] = 0
    np.testing.assert_array_equal(y, np.arange(8, dtype=np.float32))


def test_unsupported_types_are_named():
    with pytest.raises(ValueError, match="NVFP4"):
        dequantize(np.zeros(36, np.uint8), GGMLType.NVFP4)
    with pytest.raises(ValueError, match="Q4_K"):
        quantize(np.zeros(256, np.float32), GGMLType.Q4_K)
    with pytest.raises(ValueError, match="99"):
        dequantize(np.zeros(4, np.uint8), 99)
    assert GGMLType.Q4_K not in QUANTIZABLE


def test_wrong_byte_counts_say_expected_and_got():
    with pytest.raises(ValueError, match=r"34 bytes.*got 35"):
        dequantize(np.zeros(35, np.uint8), GGMLType.Q8_0)
    with pytest.raises(ValueError, match=r"expected 136 bytes, got 135"):
        dequantize(np.zeros(135, np.uint8), GGMLType.Q8_0, shape=(2, 64))
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(np.zeros(144, np.uint8), GGMLType.Q4_K, shape=(100,))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 40), np.float32), GGMLType.Q8_0)
    with pytest.raises(TypeError, match="uint8"):
        dequantize(np.zeros(8, np.float32), GGMLType.Q8_0)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0])
def test_widening_to_q8_0_keeps_every_value(qtype):
    """Blocks of random bytes (every level, both ends included) with finite scales: the Q8_0
    bytes dequantize to the very same values, rows keep their shape."""
    from ember.quant import layout, widen_to_q8_0

    rng = np.random.default_rng(9)
    size = layout(qtype).type_size
    raw = rng.integers(0, 256, (5, 20 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    blocks[:, :2] = np.frombuffer(rng.uniform(-2, 2, len(blocks)).astype(np.float16).tobytes(), np.uint8).reshape(-1, 2)
    wide = widen_to_q8_0(raw, qtype)
    assert wide.shape == (5, 20 * 34) and wide.dtype == np.uint8
    np.testing.assert_array_equal(dequantize(wide, GGMLType.Q8_0), dequantize(raw, qtype))


def test_widening_refuses_types_q8_0_cannot_hold():
    from ember.quant import widen_to_q8_0

    for qtype in (GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.F16):
        with pytest.raises(ValueError, match=f"{qtype.name} blocks do not widen"):
            widen_to_q8_0(np.zeros(256, np.uint8), qtype)
