"""Plain float types: one value per "block"."""
from __future__ import annotations

import numpy as np

from .formats import QuantFormat, register
from .types import GGMLType


@register
class F32(QuantFormat):
    """Little-endian IEEE binary32."""

    qtype = GGMLType.F32
    block = np.dtype("<f4")
    can_quantize = True

    def dequantize(self, blocks, out):
        out[:, 0] = blocks
        return out

    def quantize(self, x):
        return x.astype("<f4").reshape(-1)


@register
class F16(QuantFormat):
    """Little-endian IEEE binary16."""

    qtype = GGMLType.F16
    block = np.dtype("<f2")
    can_quantize = True

    def dequantize(self, blocks, out):
        out[:, 0] = blocks
        return out

    def quantize(self, x):
        return x.astype("<f2").reshape(-1)  # round to nearest even, as ggml


@register
class BF16(QuantFormat):
    """bfloat16: the high 16 bits of a binary32, stored as little-endian u16."""

    qtype = GGMLType.BF16
    block = np.dtype("<u2")
    can_quantize = True

    def dequantize(self, blocks, out):
        as_bits = out.view(np.uint32)
        as_bits[:, 0] = blocks
        as_bits <<= np.uint32(16)
        return out

    def quantize(self, x):
        # ggml rounds to nearest even, and keeps NaNs NaN by setting the quiet bit
        # (plain rounding could carry a NaN's payload into infinity).
        u = np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint32)
        rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
        quiet_nan = (u >> np.uint32(16)) | np.uint32(0x40)
        is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        return np.where(is_nan, quiet_nan, rounded).astype("<u2")
