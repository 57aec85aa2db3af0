"""GGUF container format constants (GGUF v2/v3, little-endian).

Layout: magic "GGUF", u32 version, u64 tensor count, u64 key/value count, the key/value
pairs, the tensor infos, zero padding up to `general.alignment`, then the tensor data.
Strings are a u64 byte length followed by UTF-8 bytes (no terminator).
"""
from __future__ import annotations

import enum

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used u32 counts and lengths; nothing current writes it
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
MAX_DIMS = 4  # ggml tensors have at most four dimensions
MAX_KEY_BYTES = 65535  # the spec's limit on metadata key length
MAX_TENSOR_NAME_BYTES = 64  # the spec's limit on tensor name length
MAX_ARRAY_DEPTH = 16  # nesting limit so a crafted file cannot exhaust the Python stack
INT64_MAX = 2**63 - 1  # ggml counts elements and bytes in int64


class ValueType(enum.IntEnum):
    """Metadata value type ids, as stored before every value."""

    U8 = 0
    I8 = 1
    U16 = 2
    I16 = 3
    U32 = 4
    I32 = 5
    F32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    U64 = 10
    I64 = 11
    F64 = 12


# Fixed-size value types: little-endian numpy dtypes (their struct formats follow from them).
FIXED_DTYPES: dict[ValueType, np.dtype] = {
    ValueType.U8: np.dtype("<u1"),
    ValueType.I8: np.dtype("<i1"),
    ValueType.U16: np.dtype("<u2"),
    ValueType.I16: np.dtype("<i2"),
    ValueType.U32: np.dtype("<u4"),
    ValueType.I32: np.dtype("<i4"),
    ValueType.F32: np.dtype("<f4"),
    ValueType.BOOL: np.dtype("?"),
    ValueType.U64: np.dtype("<u8"),
    ValueType.I64: np.dtype("<i8"),
    ValueType.F64: np.dtype("<f8"),
}

# Short names used in `GGUFFile.metadata_types` ("u32", "array[string]", ...).
TYPE_NAMES: dict[ValueType, str] = {
    **{t: t.name.lower() for t in ValueType},
    ValueType.STRING: "string",
}

# Fewest bytes one array element of each type can take; a count is checked against
# the bytes left before anything is allocated for it.
MIN_ELEMENT_BYTES: dict[ValueType, int] = {
    **{t: dt.itemsize for t, dt in FIXED_DTYPES.items()},
    ValueType.STRING: 8,  # u64 length
    ValueType.ARRAY: 12,  # u32 element type + u64 count
}
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
