"""What every op record shares: kernel launches, argument conversion, weight layout, the
weight types the kernels read, and the quantized-activation format."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ....quant.types import GGMLType

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
QUANT_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K,
               GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS,
               GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ1_S,
               GGMLType.IQ1_M, GGMLType.TQ1_0, GGMLType.TQ2_0)
MATRIX_TYPES = frozenset(FLOAT_TYPES + QUANT_TYPES)

u64, i32, i64, f32 = np.uint64, np.int32, np.int64, np.float32


@dataclass(frozen=True)
class DeviceMatrix:
    """A weight matrix on the device in its GGUF block layout (Weight.data of this backend)."""

    buf: Any  # CuPy uint8 (rows * row_bytes + padding,)
    row_bytes: int
    copies: dict = field(default_factory=dict, compare=False, repr=False)  # derived forms (Backend._widened)


@dataclass
class Launch:
    fn: Any
    grid: tuple
    block: tuple
    args: tuple
    smem: int = 0

    def run(self) -> None:
        if min(self.grid) > 0:  # empty work (a step with no rows of logits) launches nothing
            self.fn(self.grid, self.block, self.args, shared_mem=self.smem)


@dataclass(eq=False)
class Copy:
    """A plain copy between device and pinned host memory (recorded steps' inputs and outputs)."""

    dst: int
    src: int
    nbytes: int
    kind: int  # cudaMemcpyHostToDevice / DeviceToHost
    keep: tuple = field(default_factory=tuple)  # the arrays behind dst and src

    def launches(self, kernels) -> list:
        return [self]

    def run(self) -> None:
        import cupy

        cupy.cuda.runtime.memcpyAsync(self.dst, self.src, self.nbytes, self.kind, cupy.cuda.get_current_stream().ptr)


def ptr(a) -> np.uint64:
    """Device address of a CuPy array (or 0 for None), as a kernel argument."""
    return u64(0) if a is None else u64(a.data.ptr)


def pad4(xs: list, fill) -> list:
    return list(xs) + [fill] * (4 - len(xs))


def quantized(qtype: GGMLType) -> bool:
    return qtype not in FLOAT_TYPES


def xq_bytes(n: int, k: int) -> int:
    """Bytes of n activation rows of k values quantized for the decode products: int8 values,
    then a float4 (scale, half-sums) per 32 values."""
    return n * k + n * (k // 32) * 16


def disjoint(a, b) -> bool:
    """Whether two device arrays share no byte."""
    return a.data.ptr + a.nbytes <= b.data.ptr or b.data.ptr + b.nbytes <= a.data.ptr


def allow_smem(fn, nbytes: int) -> None:
    """Let kernel fn take nbytes of dynamic shared memory (past 48 KB it must be asked for)."""
    if nbytes > 48 * 1024 and hasattr(fn, "max_dynamic_shared_size_bytes") and fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes


def elementwise(kernels, name: str, n: int, *args) -> Launch:
    return Launch(kernels.fn("ops", name), (-(-n // 256), 1, 1), (256, 1, 1), args)
