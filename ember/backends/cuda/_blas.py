"""cuBLAS's GEMM for the prompt products, called through ctypes on a handle of the backend's own.

CuPy's wrapper refuses cuBLAS calls while a stream is being captured (it resets the handle's stream
on every call), and the backend captures whole steps as CUDA graphs; cuBLAS itself captures fine
once the handle has a workspace of its own. The library is the one CuPy already loaded.
"""
from __future__ import annotations

import ctypes
import ctypes.util

CUDA_R_32F, CUDA_R_16F = 0, 2
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20


class BlasError(RuntimeError):
    pass


def _library(cp):
    """libcublas as CuPy loaded it (the same soname gives the loaded copy), else by name."""
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads the library)
    except Exception:
        pass
    major = cp.cuda.runtime.runtimeGetVersion() // 1000
    names = [f"libcublas.so.{major}", "libcublas.so", ctypes.util.find_library("cublas")]
    errors = []
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise BlasError("cuBLAS not found: " + "; ".join(errors))


class Blas:
    """One cuBLAS handle with its workspace, kept for the process's life (as CuPy keeps its own);
    gemm_f16 queues on the current CuPy stream."""

    def __init__(self, cp):
        self.cp = cp
        lib = self.lib = _library(cp)
        lib.cublasGemmEx.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self.workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)
        self._check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(self.workspace.data.ptr), WORKSPACE_BYTES),
                    "cublasSetWorkspace")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._stream = None

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise BlasError(f"{what} failed with cuBLAS status {status}")

    def gemm_f16(self, m: int, n: int, k: int, a: int, lda: int, b: int, ldb: int, c: int, ldc: int) -> None:
        """Column-major C (m, n) f32 = A^T B: A (k, m) f16 with leading dimension lda, B (k, n) f16,
        f32 accumulation. For row-major y (n, m) = x (n, k) @ W (m, k)^T: a = W, b = x, lda = ldb
        = k, ldc = m (or the row length of a wider y)."""
        stream = self.cp.cuda.get_current_stream().ptr
        if stream != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
            self._stream = stream
        self._check(self.lib.cublasGemmEx(self.handle, OP_T, OP_N, m, n, k, ctypes.byref(self._one), a, CUDA_R_16F,
                                          lda, b, CUDA_R_16F, ldb, ctypes.byref(self._zero), c, CUDA_R_32F, ldc,
                                          CUBLAS_COMPUTE_32F, GEMM_DEFAULT), "cublasGemmEx")

