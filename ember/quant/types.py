"""ggml tensor types: ids as stored in GGUF files and their block layouts.

Every quantized type stores a row as a sequence of fixed-size blocks; a block
holds `block_size` values in `type_size` bytes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


QK_K = 256  # super-block size of the K-quants


@dataclass(frozen=True, slots=True)
class BlockLayout:
    block_size: int  # values per block
    type_size: int  # bytes per block

    def row_bytes(self, n: int) -> int:
        """Bytes used by a row of `n` values (n must be a multiple of block_size)."""
        return n // self.block_size * self.type_size


# Layouts of every type a GGUF file may hold (whether or not ember computes with it):
# the loader needs them to place tensors.
LAYOUTS: dict[GGMLType, BlockLayout] = {
    GGMLType.F32: BlockLayout(1, 4),
    GGMLType.F16: BlockLayout(1, 2),
    GGMLType.Q4_0: BlockLayout(32, 2 + 16),
    GGMLType.Q4_1: BlockLayout(32, 2 + 2 + 16),
    GGMLType.Q5_0: BlockLayout(32, 2 + 4 + 16),
    GGMLType.Q5_1: BlockLayout(32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: BlockLayout(32, 2 + 32),
    # ggml's block_q8_1 is {f16 d, f16 s, i8 qs[32]} = 36 bytes; gguf-py's table still says 40.
    GGMLType.Q8_1: BlockLayout(32, 2 + 2 + 32),
    GGMLType.Q2_K: BlockLayout(256, 2 + 2 + QK_K // 16 + QK_K // 4),
    GGMLType.Q3_K: BlockLayout(256, 2 + QK_K // 4 + QK_K // 8 + 12),
    GGMLType.Q4_K: BlockLayout(256, 2 + 2 + QK_K // 2 + 12),
    GGMLType.Q5_K: BlockLayout(256, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    GGMLType.Q6_K: BlockLayout(256, 2 + QK_K // 16 + 3 * QK_K // 4),
    GGMLType.Q8_K: BlockLayout(256, 4 + QK_K + QK_K // 8),
    GGMLType.IQ2_XXS: BlockLayout(256, 2 + QK_K // 4),
    GGMLType.IQ2_XS: BlockLayout(256, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: BlockLayout(256, 2 + QK_K // 4 + QK_K // 8),
    GGMLType.IQ1_S: BlockLayout(256, 2 + QK_K // 8 + QK_K // 16),
    GGMLType.IQ4_NL: BlockLayout(32, 2 + 16),
    GGMLType.IQ3_S: BlockLayout(256, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType.IQ2_S: BlockLayout(256, 2 + QK_K // 4 + QK_K // 16),
    GGMLType.IQ4_XS: BlockLayout(256, 2 + 2 + QK_K // 2 + QK_K // 64),
    GGMLType.I8: BlockLayout(1, 1),
    GGMLType.I16: BlockLayout(1, 2),
    GGMLType.I32: BlockLayout(1, 4),
    GGMLType.I64: BlockLayout(1, 8),
    GGMLType.F64: BlockLayout(1, 8),
    GGMLType.IQ1_M: BlockLayout(256, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType.BF16: BlockLayout(1, 2),
    GGMLType.TQ1_0: BlockLayout(256, 2 + 4 * 13),
    GGMLType.TQ2_0: BlockLayout(256, 2 + 64),
    GGMLType.MXFP4: BlockLayout(32, 1 + 16),
    GGMLType.NVFP4: BlockLayout(64, 4 + 32),
    GGMLType.Q1_0: BlockLayout(128, 2 + 16),
}


def layout(t: int) -> BlockLayout:
    """Block layout of ggml type id `t`; ValueError for an id no GGUF writer uses."""
    return LAYOUTS[GGMLType(t)]
