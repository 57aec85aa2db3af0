"""CPU backend: C kernels (SIMD, chosen at load for this CPU) on a persistent thread pool.

Weights stay in the memory-mapped GGUF file in their block format; activations are
float32 numpy arrays; the KV cache is float16.
"""
from __future__ import annotations

import os

import numpy as np

from ...quant.types import GGMLType
from ..base import AttentionBatch, BackendError, RopeParams, Weight
from ._native import ffi, lib

F32 = np.float32


def default_threads() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def isa() -> str:
    """The SIMD path the kernels use ("avx512", "avx2", "neon" or "scalar")."""
    return ffi.string(lib.ember_cpu_isa()).decode()


def cpu_features() -> list[str]:
    return ffi.string(lib.ember_cpu_features()).decode().split()


def set_isa(name: str) -> None:
    """Force a SIMD path (for tests and comparisons); EMBER_CPU_ISA does it at start-up."""
    if lib.ember_cpu_set_isa(name.encode()) != 0:
        raise BackendError(f"SIMD path '{name}' is not available on this CPU (have: {isa()}, {' '.join(cpu_features())})")


def _ptr(a: np.ndarray, ctype: str = "float *"):
    return ffi.cast(ctype, ffi.from_buffer(a))


class Backend:
    name = "cpu"

    def __init__(self, device: str = "cpu", threads: int | None = None):
        self.n_threads = threads or default_threads()
        if self.n_threads < 1:
            raise BackendError(f"threads must be at least 1, got {threads}")
        self._pool = ffi.gc(lib.ember_pool_create(self.n_threads), lib.ember_pool_destroy)
        self._scratch = np.empty(0, np.uint8)

    @property
    def isa(self) -> str:
        return isa()

    def supports(self, qtype: GGMLType) -> bool:
        return bool(lib.ember_type_supported(int(qtype)))

    def weight(self, tensor) -> Weight:
        if tensor.type in (GGMLType.F32,) and len(tensor.shape) == 1:
            return Weight(tensor.name, tensor.type, tuple(tensor.shape), tensor.array())
        if not self.supports(tensor.type):
            raise BackendError(f"tensor '{tensor.name}' has type {tensor.type.name}, which the CPU backend cannot compute with")
        return Weight(tensor.name, tensor.type, tuple(tensor.shape), tensor.data)

    def empty(self, shape, dtype=F32):
        return np.empty(shape, dtype)

    def from_numpy(self, a: np.ndarray):
        return a

    def to_numpy(self, a) -> np.ndarray:
        return a

    def kv_cache(self, n_slots: int, k_dim: int, v_dim: int):
        # float16 bits; zero-filled so that unwritten slots are finite
        return np.zeros((n_slots, k_dim), np.uint16), np.zeros((n_slots, v_dim), np.uint16)

    # ---- ops ----
    def get_rows(self, w: Weight, ids, out) -> None:
        ids = np.ascontiguousarray(ids, np.int32)
        rows, cols = w.shape
        if len(ids) and (ids.min() < 0 or ids.max() >= rows):
            raise BackendError(f"token id out of range for '{w.name}' ({rows} rows)")
        lib.ember_get_rows(self._pool, int(w.type), _ptr(w.data, "void *"), rows, cols,
                           _ptr(ids, "int32_t *"), len(ids), _ptr(out))

    def matmul(self, w: Weight, x, out) -> None:
        rows, cols = w.shape
        n = x.shape[0]
        scratch = self._scratch_for(int(w.type), cols, n)
        lib.ember_matmul(self._pool, int(w.type), _ptr(w.data, "void *"), rows, cols,
                         _ptr(x), n, _ptr(out), _ptr(scratch, "void *"))

    def _scratch_for(self, qtype: int, k: int, n: int) -> np.ndarray:
        need = lib.ember_matmul_scratch_size(qtype, k, n) + 64
        if self._scratch.nbytes < need:
            self._scratch = np.empty(max(need, 2 * self._scratch.nbytes), np.uint8)
        offset = (-self._scratch.ctypes.data) % 64  # the kernels want 64-byte alignment
        return self._scratch[offset:]

    def add_bias(self, x, b: Weight) -> None:
        x += b.data

    def rms_norm(self, x, w, eps, out) -> None:
        d = w.shape[-1] if w is not None else x.shape[-1]
        n = x.size // d
        wp = _ptr(w.data) if w is not None else ffi.NULL
        lib.ember_rms_norm(self._pool, _ptr(x), wp, _ptr(out), n, d, eps)

    def rope(self, x, n_head: int, batch: AttentionBatch, p: RopeParams) -> None:
        n = batch.n_tokens
        head_dim = x.shape[-1] // n_head
        pos = np.ascontiguousarray(batch.positions, np.int32)
        ff = _ptr(p.freq_factors) if p.freq_factors is not None else ffi.NULL
        lib.ember_rope(self._pool, _ptr(x), n, n_head, head_dim, _ptr(pos, "int32_t *"), p.n_rot, int(p.neox),
                       p.freq_base, p.freq_scale, ff, p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow,
                       p.n_ctx_orig)

    def silu_mul(self, gate, up, out) -> None:
        lib.ember_silu_mul(self._pool, _ptr(gate), _ptr(up), _ptr(out), gate.size)

    def gelu_mul(self, gate, up, out) -> None:
        lib.ember_gelu_mul(self._pool, _ptr(gate), _ptr(up), _ptr(out), gate.size)

    def add(self, a, b, out) -> None:
        lib.ember_add(self._pool, _ptr(a), _ptr(b), _ptr(out), a.size)

    def scale(self, x, s: float) -> None:
        lib.ember_scale(self._pool, _ptr(x), s, x.size)

    def kv_store(self, cache, k, v, batch: AttentionBatch) -> None:
        k_cache, v_cache = cache
        slots = np.ascontiguousarray(batch.slots, np.int64)
        lib.ember_kv_store(self._pool, _ptr(k), _ptr(v), _ptr(k_cache, "uint16_t *"), _ptr(v_cache, "uint16_t *"),
                           _ptr(slots, "int64_t *"), batch.n_tokens, k_cache.shape[1], v_cache.shape[1])

    def attention(self, q, cache, out, batch: AttentionBatch, n_head, n_kv_head, window, scale, softcap=0.0):
        k_cache, v_cache = cache
        tables = np.ascontiguousarray(batch.block_tables, np.int32)
        lib.ember_attention(
            self._pool, _ptr(q), _ptr(k_cache, "uint16_t *"), _ptr(v_cache, "uint16_t *"), _ptr(out),
            batch.n_tokens, n_head, n_kv_head, k_cache.shape[1] // n_kv_head, v_cache.shape[1] // n_kv_head,
            _ptr(np.ascontiguousarray(batch.positions, np.int32), "int32_t *"),
            _ptr(np.ascontiguousarray(batch.seq_rows, np.int32), "int32_t *"),
            _ptr(tables, "int32_t *"), tables.shape[1], batch.page_size, window, scale, softcap,
        )
