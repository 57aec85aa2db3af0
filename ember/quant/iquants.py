"""Non-linear 4-bit types: each 4-bit code indexes a fixed table of 16 int8 levels."""
from __future__ import annotations

import numpy as np

from .formats import F16, QuantFormat, field_f32, register, scale_groups, unpack_fields
from .types import QK_K, GGMLType

# ggml's kvalues_iq4nl: levels denser near zero, where weights cluster.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


@register
class IQ4_NL(QuantFormat):
    """18 bytes: f16 d | u8 qs[16]. Codes packed as Q4_0 (low nibbles: values 0..15).
    x = d * IQ4_LEVELS[code]."""

    qtype = GGMLType.IQ4_NL
    block = np.dtype([("d", F16), ("qs", "u1", 16)])

    def dequantize(self, b, out):
        np.take(IQ4_LEVELS, unpack_fields(b["qs"], 4, 16).reshape(out.shape), out=out, mode="clip")
        return scale_groups(out, None, field_f32(b, "d"))


@register
class IQ4_XS(QuantFormat):
    """136 bytes: f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128].

    8 sub-blocks of 32 values, each packed like one IQ4_NL block (16 bytes).
    Sub-block i has a 6-bit scale biased by 32: low 4 bits = nibble i % 2 of
    scales_l[i // 2], high 2 bits = bits 2i..2i+1 of scales_h.
    x = d * (ls - 32) * IQ4_LEVELS[code].
    """

    qtype = GGMLType.IQ4_XS
    block = np.dtype([("d", F16), ("scales_h", "<u2"), ("scales_l", "u1", 4), ("qs", "u1", QK_K // 2)])

    def dequantize(self, b, out):
        n = len(b)
        low = unpack_fields(b["scales_l"], 4, 1).reshape(n, 8)
        shifts = np.arange(0, 16, 2, dtype=np.uint16)
        high = ((b["scales_h"][:, None] >> shifts) & np.uint16(3)).astype(np.uint8)
        ls = (low | (high << np.uint8(4))).view(np.int8) - np.int8(32)
        dl = field_f32(b, "d") * ls
        np.take(IQ4_LEVELS, unpack_fields(b["qs"], 4, 16).reshape(out.shape), out=out, mode="clip")
        return scale_groups(out, None, dl)


# MXFP4's E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) doubled to integers; the
# block's scale is then half its E8M0 power of two.
MXFP4_LEVELS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
MXFP4_CHUNK = 1 << 15  # blocks quantized at a time


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) as float32 (e = 0 and 1 are subnormals, exact)."""
    return np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)


@register
class MXFP4(QuantFormat):
    """17 bytes: u8 e (E8M0 scale) | u8 qs[16]. Codes packed as Q4_0 (low nibbles: values 0..15);
    bit 3 of a code is the sign. x = 2^(e - 128) * MXFP4_LEVELS[code] (gpt-oss's expert weights)."""

    qtype = GGMLType.MXFP4
    block = np.dtype([("e", "u1"), ("qs", "u1", 16)])
    can_quantize = True

    def dequantize(self, b, out):
        np.take(MXFP4_LEVELS, unpack_fields(b["qs"], 4, 16).reshape(out.shape), out=out, mode="clip")
        return scale_groups(out, None, e8m0_half(b["e"])[:, None])

    def quantize(self, x):
        """The scale from the block's largest magnitude (2^(floor(log2 amax) - 2)), then each value's
        nearest level (the first of equal ones), as ggml's reference quantizer does."""
        amax = np.abs(x).max(axis=1)
        with np.errstate(divide="ignore"):
            e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
        d = e8m0_half(e)
        codes = np.empty(x.shape, np.uint8)
        for lo in range(0, len(x), MXFP4_CHUNK):  # the errors to all 16 levels: 2 KiB a block
            hi = lo + MXFP4_CHUNK
            err = np.abs(d[lo:hi, None, None] * MXFP4_LEVELS - x[lo:hi, :, None])
            codes[lo:hi] = np.argmin(err, axis=2)
        out = np.zeros(len(x), self.block)
        out["e"], out["qs"] = e, codes[:, :16] | (codes[:, 16:] << np.uint8(4))
        return out
