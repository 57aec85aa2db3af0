"""The low-bit types: i-quants on lattices (IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S) and the
ternary TQ1_0 / TQ2_0. All hold 256-value super-blocks.

An i-quant picks, for each group of 8 (IQ3: 4) values, one entry of a fixed grid of magnitudes
(grids.py) plus 8 sign bits, and scales it per 16 or 32 values. IQ2_XXS and IQ3_XXS store 7 sign
bits per 8 values, the eighth making the count of minus signs even (KSIGNS). The IQ1 types hold
values in {-1, 0, 1} shifted by +-1/8 per group. Arithmetic order is ggml's dequantize_row_*: the
group scale first, then times the grid value, then the sign.
"""
from __future__ import annotations

import numpy as np

from .formats import F16, QuantFormat, field_f32, register, unpack_fields
from .grids import KSIGNS, grid
from .types import QK_K, GGMLType

IQ1_DELTA = np.float32(0.125)


def _sign_bits(masks: np.ndarray) -> np.ndarray:
    """uint8 sign masks (...) -> float32 (..., 8): -1 where bit j is set, else 1."""
    b = (masks[..., None] >> np.arange(8, dtype=np.uint8)) & np.uint8(1)
    return np.where(b == 0, np.float32(1), np.float32(-1))


def _nibbles(a: np.ndarray) -> np.ndarray:
    """uint8 (n, m) -> (n, 2m): low nibble of byte i at 2i, high at 2i + 1."""
    return np.stack([a & np.uint8(15), a >> np.uint8(4)], axis=-1).reshape(len(a), -1)


def _iq2_scale(d: np.ndarray, s: np.ndarray) -> np.ndarray:
    return d * (np.float32(0.5) + s.astype(np.float32)) * np.float32(0.25)


def _put(out: np.ndarray, db: np.ndarray, g: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """out = db * g * signs, with db broadcast over groups of g (n, groups, ..., values)."""
    out[...] = (db * g * signs).reshape(out.shape)
    return out


@register
class IQ2_XXS(QuantFormat):
    """66 bytes: f16 d | u32 qs[8][2]. Per 32 values, qs[i][0] holds 4 grid indices (bytes) and
    qs[i][1] 4 seven-bit sign indices (bits 7l..) and a 4-bit scale s (bits 28..31):
    x = d * (0.5 + s) / 4 * grid * sign."""

    qtype = GGMLType.IQ2_XXS
    block = np.dtype([("d", F16), ("qs", "<u4", (8, 2))])

    def dequantize(self, b, out):
        n = len(b)
        aux = b["qs"][:, :, 1]
        db = _iq2_scale(field_f32(b, "d"), aux >> np.uint32(28)).reshape(n, 8, 1, 1)
        sidx = (aux[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & np.uint32(127)
        g = grid("IQ2_XXS")[np.ascontiguousarray(b["qs"][:, :, 0]).view(np.uint8).reshape(n, 8, 4)]
        return _put(out, db, g, _sign_bits(KSIGNS[sidx]))


@register
class IQ2_XS(QuantFormat):
    """74 bytes: f16 d | u16 qs[32] | u8 scales[8]. qs: 9-bit grid index, 7-bit sign index above it;
    scale nibbles per 16 values (low nibble first): x = d * (0.5 + s) / 4 * grid * sign."""

    qtype = GGMLType.IQ2_XS
    block = np.dtype([("d", F16), ("qs", "<u2", 32), ("scales", "u1", 8)])

    def dequantize(self, b, out):
        n, qs = len(b), b["qs"]
        db = _iq2_scale(field_f32(b, "d"), _nibbles(b["scales"])).reshape(n, 16, 1, 1)
        g = grid("IQ2_XS")[(qs & np.uint16(511)).reshape(n, 16, 2)]
        return _put(out, db, g, _sign_bits(KSIGNS[(qs >> np.uint16(9)).reshape(n, 16, 2)]))


@register
class IQ2_S(QuantFormat):
    """82 bytes: f16 d | u8 qs[32] | u8 signs[32] | u8 qh[8] | u8 scales[8]. Grid index of group
    g (8 values): qs[g] | bits 2(g%4)..+1 of qh[g/4] as bits 8, 9; signs[g] whole; scale nibbles
    per 16 values as IQ2_XS."""

    qtype = GGMLType.IQ2_S
    block = np.dtype([("d", F16), ("qs", "u1", 32), ("signs", "u1", 32), ("qh", "u1", 8), ("scales", "u1", 8)])

    def dequantize(self, b, out):
        n = len(b)
        db = _iq2_scale(field_f32(b, "d"), _nibbles(b["scales"])).reshape(n, 16, 1, 1)
        high = (b["qh"][:, :, None] >> np.array([0, 2, 4, 6], np.uint8)) & np.uint8(3)
        idx = b["qs"].astype(np.uint16) | (high.reshape(n, 32).astype(np.uint16) << np.uint16(8))
        g = grid("IQ2_S")[idx.reshape(n, 16, 2)]
        return _put(out, db, g, _sign_bits(b["signs"].reshape(n, 16, 2)))


@register
class IQ3_XXS(QuantFormat):
    """98 bytes: f16 d | u8 qs[64] | u32 scales_signs[8]. Per 32 values: 8 grid indices (4 values
    each) from qs, and a u32 with 4 seven-bit sign indices and a 4-bit scale s on top:
    x = d * (0.5 + s) / 2 * grid * sign."""

    qtype = GGMLType.IQ3_XXS
    block = np.dtype([("d", F16), ("qs", "u1", 64), ("ss", "<u4", 8)])

    def dequantize(self, b, out):
        n, aux = len(b), b["ss"]
        db = field_f32(b, "d") * (np.float32(0.5) + (aux >> np.uint32(28)).astype(np.float32)) * np.float32(0.5)
        sidx = (aux[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & np.uint32(127)
        g = grid("IQ3_XXS")[b["qs"]].reshape(n, 8, 4, 8)
        return _put(out, db.reshape(n, 8, 1, 1), g, _sign_bits(KSIGNS[sidx]))


@register
class IQ3_S(QuantFormat):
    """110 bytes: f16 d | u8 qs[64] | u8 qh[8] | u8 signs[32] | u8 scales[4]. Grid index i (4 values):
    qs[i] | bit i%8 of qh[i/8] as bit 8; signs per 8 values; scale nibbles per 32 values (low first):
    x = d * (1 + 2 s) * grid * sign."""

    qtype = GGMLType.IQ3_S
    block = np.dtype([("d", F16), ("qs", "u1", 64), ("qh", "u1", 8), ("signs", "u1", 32), ("scales", "u1", 4)])

    def dequantize(self, b, out):
        n = len(b)
        db = field_f32(b, "d") * (np.uint8(1) + np.uint8(2) * _nibbles(b["scales"]))
        high = unpack_fields(b["qh"], 1, 1).reshape(n, 8, 8).astype(np.uint16)
        g = grid("IQ3_S")[b["qs"].astype(np.uint16) | (high.reshape(n, 64) << np.uint16(8))]
        return _put(out, db.reshape(n, 8, 1, 1), g.reshape(n, 8, 4, 8), _sign_bits(b["signs"].reshape(n, 8, 4)))


def _iq1_values(out, dl, idx, neg):
    """out = dl * (grid + delta) for IQ1 grid indices idx (n, groups of 8), delta -1/8 where neg."""
    n = len(out)
    delta = np.where(neg, -IQ1_DELTA, IQ1_DELTA).reshape(n, -1, 1)
    v = grid("IQ1_S")[idx] + delta
    out[...] = (dl * v.reshape(n, dl.shape[1], -1)).reshape(out.shape)
    return out


@register
class IQ1_S(QuantFormat):
    """50 bytes: f16 d | u8 qs[32] | u16 qh[8]. Per 32 values, qh: 4 x 3 high bits of the grid
    indices (bits 3l..), a 3-bit scale s (bits 12..14) and the sign of delta (bit 15):
    x = d * (2 s + 1) * (grid + delta), grid values in {-1, 0, 1}, delta = +-1/8."""

    qtype = GGMLType.IQ1_S
    block = np.dtype([("d", F16), ("qs", "u1", 32), ("qh", "<u2", 8)])

    def dequantize(self, b, out):
        n, qh = len(b), b["qh"]
        dl = field_f32(b, "d") * (np.uint16(2) * ((qh >> np.uint16(12)) & np.uint16(7)) + np.uint16(1))
        high = (qh[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)
        idx = b["qs"].astype(np.uint16) | (high.reshape(n, 32) << np.uint16(8))
        neg = np.repeat((qh & np.uint16(0x8000)) != 0, 4, axis=1)
        return _iq1_values(out, dl[:, :, None], idx, neg)


@register
class IQ1_M(QuantFormat):
    """56 bytes: u8 qs[32] | u8 qh[16] | u16 scales[4]. Per 8 values g, nibble g%2 of qh[g/2]: 3 high
    bits of the grid index and the sign of delta (bit 3). The scales' 16 three-bit fields (bits 0..11
    of each u16) scale 16 values each; their top nibbles together are the f16 d (scales[0] lowest)."""

    qtype = GGMLType.IQ1_M
    block = np.dtype([("qs", "u1", 32), ("qh", "u1", 16), ("scales", "<u2", 4)])

    def dequantize(self, b, out):
        n, sc = len(b), b["scales"]
        top = (sc >> np.uint16(12)) << np.array([0, 4, 8, 12], np.uint16)
        d = np.bitwise_or.reduce(top, axis=1).view(np.float16).astype(np.float32)[:, None]
        s3 = (sc[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)
        dl = d * (np.uint16(2) * s3.reshape(n, 16) + np.uint16(1))
        nib = _nibbles(b["qh"])
        idx = b["qs"].astype(np.uint16) | ((nib & np.uint8(7)).astype(np.uint16) << np.uint16(8))
        return _iq1_values(out, dl[:, :, None], idx, (nib & np.uint8(8)) != 0)


_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def _trits(q: np.ndarray, digits: int) -> np.ndarray:
    """Bytes holding base-3 fixed-point fractions (n, m) -> digit i of every byte, (n, digits, m),
    each 0..2: the top trit of (q * 3^i mod 256) * 3 / 256."""
    shifted = q[:, None, :] * _POW3[:digits, None]  # wraps mod 256, as ggml's uint8 product
    return ((shifted.astype(np.uint16) * np.uint16(3)) >> np.uint16(8)).astype(np.int8)


@register
class TQ1_0(QuantFormat):
    """54 bytes: u8 qs[48] | u8 qh[4] | f16 d. Ternary values, 5 per byte (4 in qh) as base-3
    fractions: trit i of qs[m] (m < 32) is value 32 i + m; of qs[32 + m], 160 + 16 i + m; of qh[m],
    240 + 4 i + m. x = d * (trit - 1)."""

    qtype = GGMLType.TQ1_0
    block = np.dtype([("qs", "u1", 48), ("qh", "u1", 4), ("d", F16)])

    def dequantize(self, b, out):
        n, qs = len(b), b["qs"]
        t = np.concatenate([_trits(qs[:, :32], 5).reshape(n, -1), _trits(qs[:, 32:], 5).reshape(n, -1),
                            _trits(b["qh"], 4).reshape(n, -1)], axis=1)
        out[...] = field_f32(b, "d") * (t - np.int8(1)).astype(np.float32)
        return out


@register
class TQ2_0(QuantFormat):
    """66 bytes: u8 qs[64] | f16 d. Two bits per value: bits 2i of qs[32 h + m] are value
    128 h + 32 i + m. x = d * (q - 1)."""

    qtype = GGMLType.TQ2_0
    block = np.dtype([("qs", "u1", QK_K // 4), ("d", F16)])

    def dequantize(self, b, out):
        q = unpack_fields(b["qs"], 2, 32).reshape(len(b), -1).astype(np.int8) - np.int8(1)
        out[...] = field_f32(b, "d") * q.astype(np.float32)
        return out
