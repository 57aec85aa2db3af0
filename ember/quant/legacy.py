"""The original 32-value block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and Q8_1.

Packing shared by the 4/5-bit types: byte j of `qs` (j < 16) holds value j in its
low nibble and value j + 16 in its high nibble. The 5-bit types keep the fifth
bit of value j in bit j of the little-endian u32 `qh`.

The quantizers follow ggml's reference C (and so gguf-py, which mirrors it):
scales are computed in float32, stored as f16, and the f32 reciprocal of the
*unrounded* scale is what the values are multiplied by.
"""
from __future__ import annotations

import numpy as np

from .formats import (
    F16,
    QuantFormat,
    field_f32,
    register,
    round_half_away,
    safe_reciprocal,
    scale_groups,
    signed_absmax,
    unpack_fields,
)
from .types import GGMLType

QK = 32


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs (n, 16) -> uint8 (n, 32): low nibbles are values 0..15, high ones 16..31."""
    return unpack_fields(qs, 4, 16).reshape(-1, QK)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q uint8 (n, 32) of values < 16 -> (n, 16), the inverse of _nibbles."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """qh u32 (n,) -> uint8 (n, 32): bit j of qh, shifted to the value's bit 4."""
    bytes_le = qh.astype("<u4").view(np.uint8).reshape(-1, 4)
    bits = np.unpackbits(bytes_le, axis=-1, bitorder="little")
    bits <<= np.uint8(4)
    return bits


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """q uint8 (n, 32) of values < 32 -> u32 (n,) with bit j = bit 4 of value j."""
    bits = np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=-1, bitorder="little")
    return np.ascontiguousarray(bits).view("<u4")[:, 0]


def _scale_plus_min(out: np.ndarray, q: np.ndarray, b: np.ndarray) -> np.ndarray:
    """out = d * q + m for the offset types; out: float32 (n, 32)."""
    out[...] = q
    out *= field_f32(b, "d")
    out += field_f32(b, "m")
    return out


def _truncate_levels(v: np.ndarray, top: int) -> np.ndarray:
    """C's `(uint8_t)v` (truncation) then MIN(top, .), for v >= 0 in float32."""
    return np.minimum(np.trunc(v), np.float32(top)).astype(np.uint8)


def _offset_scale(x: np.ndarray, levels: int):
    """Scale d = (max - min) / levels, its reciprocal, and min, per row, in float32."""
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    d = (hi - lo) / np.float32(levels)
    return d, safe_reciprocal(d), lo


@register
class Q4_0(QuantFormat):
    """18 bytes: f16 d | u8 qs[16] (nibbles). x = d * (q - 8)."""

    qtype = GGMLType.Q4_0
    block = np.dtype([("d", F16), ("qs", "u1", 16)])
    can_quantize = True

    def dequantize(self, b, out):
        q = _nibbles(b["qs"]).view(np.int8) - np.int8(8)
        return scale_groups(out, q, field_f32(b, "d"))

    def quantize(self, x):
        # The largest-magnitude value maps to -8 exactly, giving one extra level.
        d = signed_absmax(x) / np.float32(-8)
        q = _truncate_levels(x * safe_reciprocal(d)[:, None] + np.float32(8.5), 15)
        out = np.zeros(len(x), self.block)
        out["d"], out["qs"] = d, _pack_nibbles(q)
        return out


@register
class Q4_1(QuantFormat):
    """20 bytes: f16 d | f16 m | u8 qs[16] (nibbles). x = d * q + m."""

    qtype = GGMLType.Q4_1
    block = np.dtype([("d", F16), ("m", F16), ("qs", "u1", 16)])
    can_quantize = True

    def dequantize(self, b, out):
        q = _nibbles(b["qs"])
        return _scale_plus_min(out, q, b)

    def quantize(self, x):
        d, inv, lo = _offset_scale(x, 15)
        q = _truncate_levels((x - lo[:, None]) * inv[:, None] + np.float32(0.5), 15)
        out = np.zeros(len(x), self.block)
        out["d"], out["m"], out["qs"] = d, lo, _pack_nibbles(q)
        return out


@register
class Q5_0(QuantFormat):
    """22 bytes: f16 d | u32 qh (bit j = bit 4 of value j) | u8 qs[16]. x = d * (q - 16)."""

    qtype = GGMLType.Q5_0
    block = np.dtype([("d", F16), ("qh", "<u4"), ("qs", "u1", 16)])
    can_quantize = True

    def dequantize(self, b, out):
        q = (_nibbles(b["qs"]) | _high_bits(b["qh"])).view(np.int8) - np.int8(16)
        return scale_groups(out, q, field_f32(b, "d"))

    def quantize(self, x):
        d = signed_absmax(x) / np.float32(-16)
        q = _truncate_levels(x * safe_reciprocal(d)[:, None] + np.float32(16.5), 31)
        out = np.zeros(len(x), self.block)
        out["d"], out["qh"], out["qs"] = d, _pack_high_bits(q), _pack_nibbles(q & np.uint8(15))
        return out


@register
class Q5_1(QuantFormat):
    """24 bytes: f16 d | f16 m | u32 qh | u8 qs[16]. x = d * q + m."""

    qtype = GGMLType.Q5_1
    block = np.dtype([("d", F16), ("m", F16), ("qh", "<u4"), ("qs", "u1", 16)])
    can_quantize = True

    def dequantize(self, b, out):
        q = _nibbles(b["qs"]) | _high_bits(b["qh"])
        return _scale_plus_min(out, q, b)

    def quantize(self, x):
        d, inv, lo = _offset_scale(x, 31)
        q = _truncate_levels((x - lo[:, None]) * inv[:, None] + np.float32(0.5), 31)
        out = np.zeros(len(x), self.block)
        out["d"], out["m"] = d, lo
        out["qh"], out["qs"] = _pack_high_bits(q), _pack_nibbles(q & np.uint8(15))
        return out


def _q8_levels(x: np.ndarray):
    """ggml's 8-bit block rounding: d = amax / 127, q = roundf(x / d) (ties away from 0)."""
    d = np.abs(x).max(axis=-1) / np.float32(127)
    q = round_half_away(x * safe_reciprocal(d)[:, None])
    return d, q.astype(np.int8)


@register
class Q8_0(QuantFormat):
    """34 bytes: f16 d | i8 qs[32]. x = d * q."""

    qtype = GGMLType.Q8_0
    block = np.dtype([("d", F16), ("qs", "i1", QK)])
    can_quantize = True

    def dequantize(self, b, out):
        return scale_groups(out, b["qs"], field_f32(b, "d"))

    def quantize(self, x):
        out = np.zeros(len(x), self.block)
        out["d"], out["qs"] = _q8_levels(x)
        return out


@register
class Q8_1(QuantFormat):
    """36 bytes: f16 d | f16 s | i8 qs[32]. x = d * q; s = d * sum(q), for the kernels'
    offset terms (the f32 d times the integer sum, then rounded to f16)."""

    qtype = GGMLType.Q8_1
    block = np.dtype([("d", F16), ("s", F16), ("qs", "i1", QK)])
    can_quantize = True

    def dequantize(self, b, out):
        return scale_groups(out, b["qs"], field_f32(b, "d"))

    def quantize(self, x):
        d, q = _q8_levels(x)
        out = np.zeros(len(x), self.block)
        out["d"], out["qs"] = d, q
        out["s"] = q.sum(axis=-1, dtype=np.int32).astype(np.float32) * d
        return out


# Types whose blocks Q8_0 holds exactly: one f16 scale and integer levels within int8.
WIDEN_TO_Q8_0 = (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0)


def widen_to_q8_0(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """Q4_0, Q5_0 (or Q8_0) blocks, structured (n,), as Q8_0 blocks of the same values: the
    scale's f16 bits kept, the levels (q - 8, q - 16) stored as int8. Nothing is rounded."""
    out = np.zeros(len(blocks), Q8_0.block)
    out["d"] = blocks["d"]
    if qtype == GGMLType.Q8_0:
        out["qs"] = blocks["qs"]
    elif qtype == GGMLType.Q4_0:
        out["qs"] = _nibbles(blocks["qs"]).view(np.int8) - np.int8(8)
    elif qtype == GGMLType.Q5_0:
        out["qs"] = (_nibbles(blocks["qs"]) | _high_bits(blocks["qh"])).view(np.int8) - np.int8(16)
    else:
        raise ValueError(f"{GGMLType(qtype).name} blocks do not widen to Q8_0 exactly")
    return out
