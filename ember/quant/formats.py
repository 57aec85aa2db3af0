"""The per-type interface and the registry that maps a ggml type id to its format.

A format describes one block as a numpy structured dtype (fields in file order,
so the dtype *is* the documented layout) and converts whole arrays of blocks at
once: `dequantize` takes a structured array of shape (n_blocks,) and fills a
caller-owned float32 (n_blocks, block_size); `quantize` does the reverse where
supported. Writing into the caller's buffer matters for speed: fresh large
temporaries cost page faults on every chunk of a big tensor.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from .types import LAYOUTS, BlockLayout, GGMLType

F16 = np.dtype("<f2")


class QuantFormat:
    qtype: ClassVar[GGMLType]
    block: ClassVar[np.dtype]  # one block, fields in file order
    can_quantize: ClassVar[bool] = False

    @property
    def layout(self) -> BlockLayout:
        return LAYOUTS[self.qtype]

    def dequantize(self, blocks: np.ndarray, out: np.ndarray) -> np.ndarray:
        """blocks: structured (n,) of `self.block`; fills and returns out: float32 (n, block_size)."""
        raise NotImplementedError

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """x: float32 (n, block_size) -> structured (n,) of `self.block`."""
        raise ValueError(f"quantizing to {self.qtype.name} is not supported")


FORMATS: dict[GGMLType, QuantFormat] = {}


def register(cls: type[QuantFormat]) -> type[QuantFormat]:
    """Class decorator: make `cls` the format for its type id."""
    expected = LAYOUTS[cls.qtype].type_size
    if cls.block.itemsize != expected:  # a layout typo must fail at import, not corrupt data
        raise TypeError(f"{cls.__name__}: block is {cls.block.itemsize} bytes, layout says {expected}")
    FORMATS[cls.qtype] = cls()
    return cls


def format_for(qtype: int) -> QuantFormat:
    """The registered format of `qtype`; ValueError naming the type when there is none."""
    try:
        t = GGMLType(qtype)
    except ValueError:
        raise ValueError(f"unknown ggml type id {qtype}") from None
    fmt = FORMATS.get(t)
    if fmt is None:
        raise ValueError(f"ggml type {t.name} is not supported by ember.quant")
    return fmt


# ---------------------------------------------------------------------------
# Bit unpacking shared by several layouts.

def unpack_fields(a: np.ndarray, width: int, group: int) -> np.ndarray:
    """Split each byte of `a` (n, m) into 8/width unsigned fields of `width` bits.

    Bytes are taken in runs of `group`: for each run, field 0 (lowest bits) of
    every byte comes first, then field 1, and so on. Returns uint8
    (n, m // group, 8 // width, group); callers reshape it to their value order.
    ggml packs most layouts exactly this way (e.g. Q4_0: low nibbles are values
    0..15, high nibbles values 16..31, i.e. width 4, group 16).
    """
    n, m = a.shape
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(1, 1, -1, 1)
    fields = a.reshape(n, m // group, 1, group) >> shifts
    fields &= np.uint8((1 << width) - 1)
    return fields


def scale_groups(out: np.ndarray, q: np.ndarray | None, scale: np.ndarray,
                 offset: np.ndarray | None = None) -> np.ndarray:
    """out = scale * q (- offset) over equal groups of each row; returns out.

    out: float32 (n, values); q: numbers holding n * values, or None when out
    already holds q; scale, offset: float32 (n, groups). Casting q into out and
    working in place is ~4x faster than numpy's mixed-type broadcasting, and
    rounds identically (one float32 rounding per operation).
    """
    n, groups = scale.shape
    y = out.reshape(n, groups, -1)
    if q is not None:
        y[...] = q.reshape(y.shape)
    y *= scale[:, :, None]
    if offset is not None:
        y -= offset[:, :, None]
    return out


def field_f32(b: np.ndarray, name: str) -> np.ndarray:
    """A per-block scalar field (f16 or f32) as float32 (n, 1), ready to broadcast."""
    return b[name].astype(np.float32)[:, None]


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf (ties away from zero) on float32, exact (no v + 0.5 rounding error)."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= np.float32(0.5), np.sign(v), np.float32(0))


def safe_reciprocal(d: np.ndarray) -> np.ndarray:
    """1/d in float32, 0 where d == 0 (ggml's `d ? 1.0f/d : 0.0f`)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per row of x (n, k), the value with the largest magnitude, sign kept; first one on ties."""
    i = np.abs(x).argmax(axis=-1)
    return np.take_along_axis(x, i[:, None], axis=-1)[:, 0]
