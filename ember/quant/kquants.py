"""K-quants: 256-value super-blocks split into sub-blocks with their own quantized scales.

Value order in every K-quant: the super-block is walked in chunks of 128 (Q2_K,
Q3_K, Q6_K) or 64 (Q4_K, Q5_K) values, and within a chunk the low bit-fields of
a run of bytes come first, then the next bit-fields of the same bytes (see
`unpack_fields`). Arithmetic order matches ggml's dequantize_row_* exactly:
the sub-block scale is formed first (d * sc), then multiplied by the quant.
"""
from __future__ import annotations

import numpy as np

from .formats import F16, QuantFormat, field_f32, register, scale_groups, signed_absmax, unpack_fields
from .types import QK_K, GGMLType


@register
class Q2_K(QuantFormat):
    """84 bytes: u8 scales[16] | u8 qs[64] | f16 d | f16 dmin.

    16 sub-blocks of 16 values. scales[i]: low nibble = scale, high nibble = min.
    qs: two 128-value chunks of 32 bytes; value 32*j + l of a chunk is bits
    2j..2j+1 of byte l. x = d * sc * q - dmin * m.
    """

    qtype = GGMLType.Q2_K
    block = np.dtype([("scales", "u1", 16), ("qs", "u1", QK_K // 4), ("d", F16), ("dmin", F16)])

    def dequantize(self, b, out):
        sc = b["scales"]
        q = unpack_fields(b["qs"], 2, 32)
        scale = field_f32(b, "d") * (sc & np.uint8(15))
        return scale_groups(out, q, scale, field_f32(b, "dmin") * (sc >> np.uint8(4)))


def _q3_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes -> int8 (n, 16) signed 6-bit scales.

    Scale i: low 4 bits are nibble i // 8 of byte i % 8; high 2 bits are bits
    2*(i // 4)..+1 of byte 8 + i % 4; stored with a +32 bias.
    """
    low = unpack_fields(s[:, :8], 4, 8).reshape(-1, 16)
    high = unpack_fields(s[:, 8:], 2, 4).reshape(-1, 16)
    return (low | (high << np.uint8(4))).view(np.int8) - np.int8(32)


@register
class Q3_K(QuantFormat):
    """110 bytes: u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d.

    16 sub-blocks of 16 values with 6-bit signed scales (see _q3_scales).
    Low 2 bits of value 32*k + l (k = 0..7 over the block) come from qs as in
    Q2_K; its third bit is bit k of hmask[l], and a *clear* bit subtracts 4.
    x = d * sc * (q - (hbit ? 0 : 4)).
    """

    qtype = GGMLType.Q3_K
    block = np.dtype([("hmask", "u1", 32), ("qs", "u1", QK_K // 4), ("scales", "u1", 12), ("d", F16)])

    def dequantize(self, b, out):
        low = unpack_fields(b["qs"], 2, 32).reshape(-1, QK_K).view(np.int8)
        hbit = unpack_fields(b["hmask"], 1, 32).reshape(-1, QK_K).view(np.int8)
        q = low - np.int8(4) + (hbit << np.int8(2))
        return scale_groups(out, q, field_f32(b, "d") * _q3_scales(b["scales"]))


def _k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> uint8 (n, 8) 6-bit scales and (n, 8) 6-bit mins.

    Sub-blocks 0..3: scale = s[j] & 63, min = s[j+4] & 63. Sub-blocks 4..7:
    low 4 bits from s[j+4] (scale: low nibble, min: high nibble), high 2 bits
    from the top bits of s[j-4] (scale) and s[j] (min).
    """
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    top = np.uint8(6)
    scales = np.concatenate([a & np.uint8(63), (c & np.uint8(15)) | ((a >> top) << np.uint8(4))], axis=1)
    mins = np.concatenate([b & np.uint8(63), (c >> np.uint8(4)) | ((b >> top) << np.uint8(4))], axis=1)
    return scales, mins


@register
class Q4_K(QuantFormat):
    """144 bytes: f16 d | f16 dmin | u8 scales[12] | u8 qs[128].

    8 sub-blocks of 32 values, 6-bit scales and mins (see _k4_scales_mins).
    qs: four 64-value chunks of 32 bytes; low nibbles are the chunk's first 32
    values, high nibbles the next 32. x = d * sc * q - dmin * m.
    """

    qtype = GGMLType.Q4_K
    block = np.dtype([("d", F16), ("dmin", F16), ("scales", "u1", 12), ("qs", "u1", QK_K // 2)])

    def dequantize(self, b, out):
        sc, m = _k4_scales_mins(b["scales"])
        q = unpack_fields(b["qs"], 4, 32)
        return scale_groups(out, q, field_f32(b, "d") * sc, field_f32(b, "dmin") * m)


@register
class Q5_K(QuantFormat):
    """176 bytes: f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128].

    As Q4_K, plus a fifth bit: value 32*k + l (k = sub-block 0..7) has bit 4 = bit k of qh[l].
    """

    qtype = GGMLType.Q5_K
    block = np.dtype([
        ("d", F16), ("dmin", F16), ("scales", "u1", 12), ("qh", "u1", QK_K // 8), ("qs", "u1", QK_K // 2),
    ])

    def dequantize(self, b, out):
        sc, m = _k4_scales_mins(b["scales"])
        low = unpack_fields(b["qs"], 4, 32).reshape(-1, QK_K)
        high = unpack_fields(b["qh"], 1, 32).reshape(-1, QK_K)
        return scale_groups(out, low | (high << np.uint8(4)), field_f32(b, "d") * sc, field_f32(b, "dmin") * m)


@register
class Q6_K(QuantFormat):
    """210 bytes: u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d.

    16 sub-blocks of 16 values with int8 scales. Two 128-value chunks, each using
    64 bytes of ql and 32 of qh: value 32*k + l (k = 0..3) takes its low 4 bits
    from nibble k // 2 of ql[l + 32 * (k % 2)] and its high 2 bits from bits
    2k..2k+1 of qh[l]. x = d * sc * (q - 32).
    """

    qtype = GGMLType.Q6_K
    block = np.dtype([("ql", "u1", QK_K // 2), ("qh", "u1", QK_K // 4), ("scales", "i1", 16), ("d", F16)])

    def dequantize(self, b, out):
        low = unpack_fields(b["ql"], 4, 64).reshape(-1, QK_K)
        high = unpack_fields(b["qh"], 2, 32).reshape(-1, QK_K)
        q = (low | (high << np.uint8(4))).view(np.int8) - np.int8(32)
        return scale_groups(out, q, field_f32(b, "d") * b["scales"])


@register
class Q8_K(QuantFormat):
    """292 bytes: f32 d | i8 qs[256] | i16 bsums[16] (sum of each 16 quants).

    Only an activation format: the K-quant dot kernels pair it with weights and
    use bsums for the min terms. x = d * q. Quantized as ggml's
    quantize_row_q8_K_ref: the largest-magnitude value m maps to -127
    (d = -m / 127, so d takes the opposite sign of m), rounding to nearest even.
    """

    qtype = GGMLType.Q8_K
    block = np.dtype([("d", "<f4"), ("qs", "i1", QK_K), ("bsums", "<i2", QK_K // 16)])
    can_quantize = True

    def dequantize(self, b, out):
        return scale_groups(out, b["qs"], field_f32(b, "d"))

    def quantize(self, x):
        peak = signed_absmax(x)
        live = peak != 0  # an all-zero block keeps d = 0 and q = 0
        with np.errstate(divide="ignore"):
            iscale = np.where(live, np.float32(-127) / peak, np.float32(0)).astype(np.float32)
        q = np.clip(np.rint(x * iscale[:, None]), -128, 127).astype(np.int8)
        out = np.zeros(len(x), self.block)
        out["qs"] = q
        out["bsums"] = q.reshape(len(x), 16, 16).sum(axis=-1, dtype=np.int16)
        with np.errstate(divide="ignore"):
            out["d"] = np.where(live, np.float32(1) / iscale, np.float32(0))
        return out
