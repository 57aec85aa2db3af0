"""Activation quantizers for the integer dot-product kernels, as ggml's reference C.

Each takes float32 (..., k) and returns raw blocks uint8 (..., row_bytes):
- Q8_0: d = amax/127 stored as f16, q = roundf(x/d) (ties away from zero).
- Q8_1: as Q8_0, plus s = f16(d * sum(q)) with the f32 d.
- Q8_K: f32 d, q = round-to-nearest-even(-127 * x / m) where m is the
  largest-magnitude value (so d = -m/127), bsums = int16 sums of each 16 quants.
"""
from __future__ import annotations

import numpy as np

from .codec import quantize
from .types import GGMLType


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    return quantize(x, GGMLType.Q8_0)


def quantize_q8_1(x: np.ndarray) -> np.ndarray:
    return quantize(x, GGMLType.Q8_1)


def quantize_q8_K(x: np.ndarray) -> np.ndarray:
    return quantize(x, GGMLType.Q8_K)
