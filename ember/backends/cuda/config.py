"""The CUDA backend's tunables: one frozen record, read once when the backend is made.

Every field has a default that the H200 measurements in bench/NOTES.md chose; bench/cuda.py
runs variants by passing another CudaConfig (Backend(config=...)). Nothing here is read from
the environment.
"""
from __future__ import annotations

from dataclasses import dataclass

MV_MAX_ROWS = 64  # activation rows up to which products can take the matrix-vector kernels (groups of 8)
# Longest rows a product's own blocks can normalise: mv_n1 holds 8 values a lane (matmul.cu PRO_REG);
# mv_xs's lanes each hold their own slices, so its rows are bounded by its teams (XS_MAX_TEAM).
MV_PROLOGUE_MAX_K = 2048
PROLOGUE_MAX_K = 16384


@dataclass(frozen=True, slots=True)
class CudaConfig:
    # Recorded steps are captured as CUDA graphs (False: a replay launches each kernel from Python).
    graphs: bool = True
    # Neighbouring ops of a recorded step are merged into one kernel where they can be (_fuse.py).
    fuse: bool = True
    # Programmatic dependent launch inside captured steps (Hopper and later; see _launch.py).
    pdl: bool = True
    # Activation rows up to which products of the 32-value block types take the matrix-vector
    # kernels (others: 8); past it, tensor-core tiles.
    mv_rows: int = MV_MAX_ROWS
    # Longest rows (values) that a decode product's blocks normalise and quantize themselves.
    prologue_k: int = PROLOGUE_MAX_K
    # Weight rows per tensor-core tile block: 128, 64, or 0 for the choice by size (Matmul._tile_rows).
    tile_rows: int = 0
    # Products of quantized weights over at least this many activation rows (past the matrix-vector
    # kernels; ahead of mm_split, which takes the rows between) dequantize each weight to f16 and
    # multiply through cuBLAS; 0: the tensor-core tiles always. At 64 rows (64 sequences decoding) the
    # route took the 8B shape's step from 30.5 to 19.4 ms on an H100; from 16 (decode steps of 9-16 and
    # 17-32 sequences: bench/cuda_rows.py) 22.4 -> 18.1 and 24.4 -> 18.1 ms there, Llama-3.2-1B's 4.26 ->
    # 3.73 and 4.68 -> 3.82, a 135M shape's 2.38 -> 2.44 and 2.67 -> 2.48. Below, mm_split's fused epilogues.
    blas_rows: int = 16
    # Bytes of shared memory in which a decode product of 2-8 activation rows (per block) stages
    # chunks of x (matmul.cu mv_stage_chunk); 0: its lanes read x from global memory.
    mv_stage: int = 32768
    # Decode attention splits its key range until there are this many blocks per multiprocessor.
    att_waves: int = 2
    # Steps of up to this many tokens take the grouped expert products' decode kernel (expert_mv:
    # each expert's selections staged together, its rows decoded once for them); more: the sorted
    # tiles (expert_tile). -1: the choice by step and row length measured (takes_mv).
    moe_mv_tokens: int = -1

    def __post_init__(self):
        if not 1 <= self.mv_rows <= MV_MAX_ROWS:
            raise ValueError(f"mv_rows must be 1..{MV_MAX_ROWS}, got {self.mv_rows}")
        if not 0 <= self.prologue_k <= PROLOGUE_MAX_K:
            raise ValueError(f"prologue_k must be 0..{PROLOGUE_MAX_K}, got {self.prologue_k}")
        if self.tile_rows not in (0, 64, 128):
            raise ValueError(f"tile_rows must be 0 (by size), 64 or 128, got {self.tile_rows}")
        if not -1 <= self.moe_mv_tokens <= 64:
            raise ValueError(f"moe_mv_tokens must be -1 (by shape) or 0..64, got {self.moe_mv_tokens}")
        if self.blas_rows < 0:
            raise ValueError(f"blas_rows must be 0 (never) or more, got {self.blas_rows}")
        if self.mv_stage and not 768 <= self.mv_stage <= 40960:
            raise ValueError(f"mv_stage must be 0 or 768..40960 bytes, got {self.mv_stage}")
        if not 1 <= self.att_waves <= 64:
            raise ValueError(f"att_waves must be 1..64, got {self.att_waves}")
