"""Array-level dequantize/quantize over raw GGUF tensor bytes, dispatching on the type id."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from . import floats, iquants, kquants, legacy, lowbit  # noqa: F401  (importing registers the formats)
from .formats import FORMATS, QuantFormat, format_for
from .types import GGMLType

# Values per dequantization chunk: keeps the temporaries of a big tensor
# (an embedding matrix is ~10^8 values) in cache instead of several GB of RAM.
CHUNK_VALUES = 1 << 18


def dequantize(data: np.ndarray, qtype: int, shape: Sequence[int] | None = None) -> np.ndarray:
    """Raw blocks -> float32 values.

    data: uint8, 1-D or (..., row_bytes); plain types may also come typed
    (F32 as float32, F16 as float16, BF16 as uint16 bits). The result has shape
    `shape` when given, else (..., values_per_row) for shaped input, else 1-D.
    """
    fmt = format_for(qtype)
    raw = _as_bytes(data, fmt)
    out_shape = _values_shape(raw, fmt, shape)
    if raw.size == 0:
        return np.zeros(out_shape, np.float32)
    blocks = np.ascontiguousarray(raw).reshape(-1).view(fmt.block)
    with np.errstate(invalid="ignore"):  # inf * 0 in garbage blocks: let the NaN through quietly
        return _dequantize_chunked(fmt, blocks).reshape(out_shape)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """float32 (..., k) -> uint8 (..., row_bytes); k must be a multiple of the block size."""
    fmt = format_for(qtype)
    if not fmt.can_quantize:
        raise ValueError(f"quantizing to {fmt.qtype.name} is not supported")
    x = np.asarray(x, dtype=np.float32)
    lay = fmt.layout
    if x.ndim == 0 or x.shape[-1] % lay.block_size:
        raise ValueError(
            f"{fmt.qtype.name} rows must be a multiple of {lay.block_size} values, got shape {x.shape}")
    blocks = fmt.quantize(x.reshape(-1, lay.block_size))
    return blocks.view(np.uint8).reshape(*x.shape[:-1], lay.row_bytes(x.shape[-1]))


def widen_to_q8_0(data: np.ndarray, qtype: int) -> np.ndarray:
    """Raw Q4_0 / Q5_0 / Q8_0 bytes (..., row_bytes) -> the same values as raw Q8_0 bytes
    (..., row_bytes of Q8_0): exact (see legacy.widen_to_q8_0), so a product of mixed types
    can take one kernel of one type. ValueError for other types."""
    fmt = format_for(qtype)
    if fmt.qtype not in legacy.WIDEN_TO_Q8_0:
        raise ValueError(f"{fmt.qtype.name} blocks do not widen to Q8_0 exactly")
    raw = _as_bytes(data, fmt)
    if raw.shape[-1] % fmt.layout.type_size:
        raise ValueError(f"{fmt.qtype.name} rows: expected a multiple of {fmt.layout.type_size} bytes")
    blocks = np.ascontiguousarray(raw).reshape(-1).view(fmt.block)
    wide = legacy.widen_to_q8_0(blocks, fmt.qtype).view(np.uint8)
    per_row = raw.shape[-1] // fmt.layout.type_size * format_for(GGMLType.Q8_0).layout.type_size
    return wide.reshape(*raw.shape[:-1], per_row)


def _as_bytes(data: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """data as uint8 with blocks along the last axis. Arrays of the format's own
    block dtype are accepted too: the loader hands out F32/F16/BF16 tensors typed."""
    data = np.asarray(data)
    if data.dtype == fmt.block and data.dtype != np.uint8:
        data = np.ascontiguousarray(data.reshape(-1) if data.ndim == 0 else data).view(np.uint8)
    if data.dtype != np.uint8:
        raise TypeError(f"{fmt.qtype.name} data must be raw uint8 block bytes, got {data.dtype}")
    if data.ndim == 0:
        raise ValueError(f"{fmt.qtype.name} data must be an array of block bytes, got a scalar")
    return data


def _values_shape(raw: np.ndarray, fmt: QuantFormat, shape: Sequence[int] | None) -> tuple[int, ...]:
    """Shape of the dequantized result, after checking the byte count against it."""
    lay, name = fmt.layout, fmt.qtype.name
    if shape is not None:
        shape = tuple(int(s) for s in shape)
        if not shape or shape[-1] % lay.block_size:
            raise ValueError(f"{name} rows must be a multiple of {lay.block_size} values, got shape {shape}")
        expected = math.prod(shape[:-1]) * lay.row_bytes(shape[-1])
        if raw.size != expected:
            raise ValueError(f"{name} tensor of shape {shape}: expected {expected} bytes, got {raw.size}")
        return shape
    row_bytes = raw.shape[-1]
    if row_bytes % lay.type_size:
        what = "row" if raw.ndim > 1 else "data"
        raise ValueError(
            f"{name} {what}: expected a multiple of {lay.type_size} bytes (one block), got {row_bytes}")
    return (*raw.shape[:-1], row_bytes // lay.type_size * lay.block_size)


def _dequantize_chunked(fmt: QuantFormat, blocks: np.ndarray) -> np.ndarray:
    """fmt.dequantize over `blocks` in cache-sized chunks, into one float32 (n, block_size)."""
    n, per_block = len(blocks), fmt.layout.block_size
    step = max(1, CHUNK_VALUES // per_block)
    out = np.empty((n, per_block), np.float32)
    for start in range(0, n, step):
        fmt.dequantize(blocks[start:start + step], out[start:start + step])
    return out


DEQUANTIZABLE: frozenset[GGMLType] = frozenset(FORMATS)
QUANTIZABLE: frozenset[GGMLType] = frozenset(t for t, f in FORMATS.items() if f.can_quantize)
