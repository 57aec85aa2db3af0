"""CPU backend: C kernels (SIMD, chosen at load for this CPU) on a persistent thread pool.

Weights stay in the memory-mapped GGUF file in their block format; activations are
float32 numpy arrays; the KV cache holds rows of bytes in its storage type (f16 by default, or
bf16, q8_0, q4_0: quantized as written, read in place by the attention kernel).

Every op is an `ember_op` record run by the C side. A forward pass can be recorded
(`record()`, which runs it in one native call at the end of the block) and replayed later
(`replay()`): Python then costs one call per step instead of one per op. A recording holds
references to every array it points into, so its addresses stay valid.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np

from ...quant.types import GGMLType, layout
from ..base import KV_TYPES, AttentionBatch, BackendError, Capabilities, KVLayer, RopeParams, Weight
from ._native import ffi, lib
from .resident import Settler

F32 = np.float32
MAX_MULTI = 8  # matrices one ember_matmul_multi call takes


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


def read_bandwidth(threads: int, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes per second that `threads` threads of a pool read from memory: the best of `reps` passes
    over a buffer of nbytes (far beyond the caches), each thread a contiguous share, after one pass
    that faults the pages in. The ceiling of a decode step, which reads every weight once."""
    import time

    buf = np.ones(nbytes // 64 * 64, np.uint8)
    pool = ffi.gc(lib.ember_pool_create(threads), lib.ember_pool_destroy)
    ptr = ffi.from_buffer(buf)
    lib.ember_stream_read(pool, ptr, buf.nbytes)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        lib.ember_stream_read(pool, ptr, buf.nbytes)
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best


def set_isa(name: str) -> None:
    """Force a SIMD path (for tests and comparisons); EMBER_CPU_ISA does it at start-up."""
    if lib.ember_cpu_set_isa(name.encode()) != 0:
        raise BackendError(f"SIMD path '{name}' is not available on this CPU (have: {isa()}, {' '.join(cpu_features())})")


_OP_NAMES = {
    lib.EMBER_OP_MATMUL: "matmul", lib.EMBER_OP_MATMUL_MULTI: "matmul (shared input)", lib.EMBER_OP_GET_ROWS: "get_rows",
    lib.EMBER_OP_RMS_NORM: "rms_norm", lib.EMBER_OP_ROPE: "rope", lib.EMBER_OP_SILU_MUL: "silu_mul",
    lib.EMBER_OP_GELU_MUL: "gelu_mul", lib.EMBER_OP_ADD: "add", lib.EMBER_OP_SCALE: "scale",
    lib.EMBER_OP_KV_STORE: "kv_store", lib.EMBER_OP_ATTENTION: "attention", lib.EMBER_OP_GATHER_ROWS: "gather_rows",
    lib.EMBER_OP_ADD_ROW: "add_row", lib.EMBER_OP_TOP_K: "top_k", lib.EMBER_OP_SOFTCAP: "softcap",
    lib.EMBER_OP_POS_SCALE: "pos_scale", lib.EMBER_OP_LAYER_NORM: "layer_norm", lib.EMBER_OP_GELU: "gelu",
    lib.EMBER_OP_TANH: "tanh", lib.EMBER_OP_HADAMARD: "hadamard", lib.EMBER_OP_EXPERTS_MATMUL: "experts matmul",
    lib.EMBER_OP_EXPERTS_ROUTE: "experts route", lib.EMBER_OP_EXPERTS_SUM: "experts sum",
    lib.EMBER_OP_EXPERTS_BIAS: "experts bias", lib.EMBER_OP_SWIGLU_OAI: "swiglu_oai",
}


def _type_name(t: int) -> str:
    return GGMLType(t).name if t in GGMLType._value2member_map_ else str(t)


def op_label(op) -> str:
    """A profile line's name: the op, and for products the matrix type and shape."""
    name = _OP_NAMES.get(op.kind, f"op {op.kind}")
    if op.kind == lib.EMBER_OP_MATMUL:
        return f"{name} {_type_name(op.type)} {op.i[0]}x{op.i[1]}"
    if op.kind == lib.EMBER_OP_MATMUL_MULTI:
        count = int(op.i[0])
        types = ffi.cast("int *", op.p[0])
        ms = ffi.cast("int64_t *", op.p[2])
        parts = "+".join(f"{_type_name(types[j])} {ms[j]}" for j in range(count))
        return f"{name} {parts} x{op.i[1]}"
    return name


def op_weight_bytes(op) -> int:
    """Bytes of weights a product reads (0 for other ops)."""
    if op.kind == lib.EMBER_OP_MATMUL:
        return int(op.i[0]) * _row_bytes(op.type, int(op.i[1]))
    if op.kind == lib.EMBER_OP_MATMUL_MULTI:
        types, ms = ffi.cast("int *", op.p[0]), ffi.cast("int64_t *", op.p[2])
        return sum(int(ms[j]) * _row_bytes(types[j], int(op.i[1])) for j in range(int(op.i[0])))
    return 0


def _row_bytes(t: int, k: int) -> int:
    lay = layout(GGMLType(t))
    return k // lay.block_size * lay.type_size


@dataclass
class Profile:
    """Native time per op label, summed over the steps run while it was attached, and the bytes of
    weights each product reads (for its rate)."""

    ns: dict = field(default_factory=dict)  # label -> total nanoseconds
    calls: dict = field(default_factory=dict)  # label -> times run
    weight_bytes: dict = field(default_factory=dict)  # label -> bytes of weights one call reads

    def add(self, labels: list[str], ns, weight_bytes: list[int] | None = None) -> None:
        for i, (label, t) in enumerate(zip(labels, ns)):
            self.ns[label] = self.ns.get(label, 0) + int(t)
            self.calls[label] = self.calls.get(label, 0) + 1
            if weight_bytes is not None:
                self.weight_bytes[label] = weight_bytes[i]

    def rates(self) -> dict[str, float]:
        """Bytes of weights per second for each product label (what a decode step is bound by)."""
        return {label: self.weight_bytes[label] * self.calls[label] / (self.ns[label] * 1e-9)
                for label in self.ns if self.weight_bytes.get(label) and self.ns[label] > 0}

    @property
    def total_s(self) -> float:
        return sum(self.ns.values()) / 1e9

    def by_kind(self) -> dict[str, float]:
        """Seconds per op kind (matrix products grouped by type)."""
        out: dict[str, float] = {}
        for label, t in self.ns.items():
            words = label.replace(" (shared input)", "").split()  # "matmul Q4_1 ..." -> "matmul Q4_1"
            key = " ".join(words[:2]) if words[0] == "matmul" else words[0]
            out[key] = out.get(key, 0.0) + t / 1e9
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclass
class Recording:
    """Ops of one recorded forward pass and the arrays they point into."""

    ops: list = field(default_factory=list)  # ember_op records
    keep: list = field(default_factory=list)  # arrays and cffi objects the ops reference
    array: object = None  # the packed ember_op[] once finished
    labels: list | None = None  # op labels, made on the first profiled replay
    weight_bytes: list | None = None  # bytes of weights each op reads, with the labels

    def finish(self) -> None:
        self.ops = fuse_rope_pairs(self.ops)
        self.array = ffi.new("ember_op[]", len(self.ops))
        for i, op in enumerate(self.ops):
            self.array[i] = op[0]


def fuse_rope_pairs(ops: list) -> list:
    """A recorded step's ops with each rope followed by another of the same positions and parameters
    (queries, then keys) made one op over both tensors: a token's angles are computed once, and the
    step has one op less to run."""
    out: list = []
    for op in ops:
        prev = out[-1] if out else None
        if prev is not None and _rope_pairs_with(prev[0], op[0]):
            prev.p[3], prev.i[6] = op.p[0], op.i[1]
            continue
        out.append(op)
    return out


def _rope_pairs_with(a, b) -> bool:
    """Whether rope b can join rope a (a not yet fused): same positions, shape of a head, parameters,
    and tensors apart (each is rotated in place)."""
    rope = lib.EMBER_OP_ROPE
    if a.kind != rope or b.kind != rope or a.p[3] != ffi.NULL:
        return False
    same = a.p[1] == b.p[1] and a.p[2] == b.p[2] and all(a.i[j] == b.i[j] for j in (0, 2, 3, 4, 5)) \
        and all(a.f[j] == b.f[j] for j in range(6))
    return same and _apart(a, b)


def _apart(a, b) -> bool:
    """Whether two ropes' tensors (n_tok, n_head, head_dim) floats share no byte."""
    def span(op):
        start = int(ffi.cast("uintptr_t", op.p[0]))
        return start, start + op.i[0] * op.i[1] * op.i[2] * 4

    (a0, a1), (b0, b1) = span(a), span(b)
    return a1 <= b0 or b1 <= a0


def rounding_for(types) -> int:
    """How a model whose matrices have these ggml types rounds its 32-value types' activations
    (Backend.rounding): as llama.cpp where a type rounds as llama.cpp's Q8_K (the K-quants), else exactly."""
    k_quants = any(lib.ember_matmul_act_kind(int(t)) == lib.EMBER_ACT_KIND_Q8K for t in types)
    return lib.EMBER_ROUND_LLAMA if k_quants else lib.EMBER_ROUND_EXACT


class Backend:
    name = "cpu"
    capabilities = Capabilities(top_k=True, record=True, kv_types=frozenset(KV_TYPES.values()), kv_head_parts=True)

    def __init__(self, device: str = "cpu", threads: int | None = None):
        self.n_threads = threads or default_threads()
        if self.n_threads < 1:
            raise BackendError(f"threads must be at least 1, got {threads}")
        self._pool = ffi.gc(lib.ember_pool_create(self.n_threads), lib.ember_pool_destroy)
        self._scratch = np.empty(0, np.uint8)  # 64-byte aligned view of a larger allocation
        self._recording: Recording | None = None
        self.profile: Profile | None = None  # set to a Profile to time every op
        self._weight_types: set[int] = set()  # of every weight handed to this backend (one model's)
        self._rotated: dict[str, np.ndarray] = {}  # rotated queries, keys, values of a quantized KV cache
        self._settler = Settler() if Settler.usable() else None  # moves weight matrices onto huge pages
        self._expert_maps: dict[int, np.ndarray] = {}  # by a stack's address: its experts the kernels used

    @property
    def isa(self) -> str:
        return isa()

    def supports(self, qtype: GGMLType) -> bool:
        return bool(lib.ember_type_supported(int(qtype)))

    def weight(self, tensor, streamed: bool = True) -> Weight:
        self._weight_types.add(int(tensor.type))
        if tensor.type == GGMLType.F32 and len(tensor.shape) == 1:
            return Weight(tensor.name, tensor.type, tuple(tensor.shape), tensor.array())
        if not self.supports(tensor.type):
            raise BackendError(f"tensor '{tensor.name}' has type {tensor.type.name}, which the CPU backend cannot compute with")
        data = tensor.data
        if self._settler is not None and streamed and len(tensor.shape) == 2:
            self._settler.add(tensor)
        elif self._settler is not None and len(tensor.shape) == 3:  # stacked experts: moved as they are used
            self._expert_maps[data.ctypes.data] = self._settler.add_stack(tensor, data)
        return Weight(tensor.name, tensor.type, tuple(tensor.shape), data)

    def settle(self) -> None:
        """The matrices every token reads move onto huge pages, in place, in the background, and
        stacked experts follow as the kernels first use them (resident.py)."""
        if self._settler is not None:
            self._settler.start()

    def settled(self, timeout: float | None = None) -> bool:
        """Whether settle()'s move has caught up: the matrices and every expert used so far are
        on huge pages (waiting up to timeout seconds; benchmarks wait so that they time the steady
        state)."""
        return self._settler is None or self._settler.wait(timeout)

    def empty(self, shape, dtype=F32):
        return np.empty(shape, dtype)

    def from_numpy(self, a: np.ndarray):
        return a

    def to_numpy(self, a) -> np.ndarray:
        return a

    def kv_cache(self, n_slots: int, k_dim: int, v_dim: int, k_type=GGMLType.F16, v_type=GGMLType.F16):
        # rows of bytes; zero-filled (lazily committed by the OS) so unwritten slots are finite
        return KVLayer(np.zeros((n_slots, _kv_row_bytes(k_type, k_dim)), np.uint8),
                       np.zeros((n_slots, _kv_row_bytes(v_type, v_dim)), np.uint8), k_type, v_type)

    # ---- recording ----
    @contextlib.contextmanager
    def record(self):
        """Ops are recorded and run together, in one native call, when the block ends; yields the
        Recording. Nothing in the block may read an op's output (a replay could not either)."""
        rec = self._recording = Recording()
        try:
            yield rec
        finally:
            self._recording = None
        rec.finish()
        self.replay(rec)

    def replay(self, rec: Recording) -> None:
        if self.profile is not None:
            if rec.labels is None:
                rec.labels = [op_label(rec.array[k]) for k in range(len(rec.ops))]
                rec.weight_bytes = [op_weight_bytes(rec.array[k]) for k in range(len(rec.ops))]
            failed = self._timed(rec.array, len(rec.ops), rec.labels, rec.weight_bytes)
        else:
            failed = lib.ember_run_ops(self._pool, rec.array, len(rec.ops))
        if failed >= 0:
            raise BackendError(f"op {failed} of a recorded step could not run")

    def _run(self, kind: int, ptrs=(), ints=(), floats=(), qtype: int = 0, keep=()) -> None:
        op = ffi.new("ember_op *")
        op.kind, op.type = kind, qtype
        for j, p in enumerate(ptrs):
            op.p[j] = p
        for j, v in enumerate(ints):
            op.i[j] = v
        for j, v in enumerate(floats):
            op.f[j] = v
        if self._recording is not None:
            self._recording.ops.append(op)
            self._recording.keep.append((ptrs, keep))
            return
        if self.profile is not None:
            failed = self._timed(op, 1, [op_label(op[0])], [op_weight_bytes(op[0])])
        else:
            failed = lib.ember_run_ops(self._pool, op, 1)
        if failed >= 0:
            raise BackendError(f"the CPU kernels refused op kind {kind}")

    def _timed(self, ops, n: int, labels: list[str], weight_bytes: list[int]) -> int:
        ns = np.zeros(n, np.int64)
        failed = lib.ember_run_ops_timed(self._pool, ops, n, ffi.cast("int64_t *", ns.ctypes.data))
        self.profile.add(labels, ns, weight_bytes)
        return failed

    def _p(self, a: np.ndarray):
        """Address of an array (kept alive by the recording, if any)."""
        if self._recording is not None:
            self._recording.keep.append(a)
        return ffi.cast("void *", ffi.from_buffer(a))

    def _ints(self, a, dtype) -> np.ndarray:
        """a as a contiguous int array; while recording it must already be one (a copy's address
        would not see the values written for later steps)."""
        a = np.asarray(a)
        if a.dtype == dtype and a.flags.c_contiguous:
            return a
        if self._recording is not None:
            raise BackendError(f"a recorded step needs contiguous {np.dtype(dtype).name} inputs, got {a.dtype}")
        return np.ascontiguousarray(a, dtype)

    # ---- ops ----
    def get_rows(self, w: Weight, ids, out) -> None:
        rows, cols = w.shape
        if self._recording is None and len(ids) and (int(np.min(ids)) < 0 or int(np.max(ids)) >= rows):
            raise BackendError(f"token id out of range for '{w.name}' ({rows} rows)")
        self._run(lib.EMBER_OP_GET_ROWS, (self._p(w.data), self._p(self._ints(ids, np.int32)), self._p(out)),
                  (rows, cols, len(ids)), qtype=int(w.type))

    @property
    def rounding(self) -> int:
        """How the products round the activations of the 32-value block types (api_quant.h): as
        llama.cpp does (int8, the fast decode kernels) when the model also has K-quant matrices,
        whose products always round as llama.cpp's (measured against llama.cpp's outputs, mixing
        exact and llama.cpp-rounded products drifts furthest); else exactly (int16). Exact
        activations keep a cached prompt's continuation equal to the uncached one's: int8 rounding
        turns the last-bit differences between a prompt chunk and a decode step into whole steps of
        1/127 where a value sits at a rounding boundary, and on SmolLM2 that parted a repeated
        greedy request from the first within 16 tokens; the int8 kernels were within 3% of the
        exact ones there (bench/NOTES.md)."""
        return rounding_for(self._weight_types)

    def matmul(self, w: Weight, x, out) -> None:
        rows, cols = w.shape
        scratch = self._scratch_for(int(w.type), cols, x.shape[0])
        self._run(lib.EMBER_OP_MATMUL, (self._p(w.data), self._p(x), self._p(out), self._p(scratch)),
                  (rows, cols, x.shape[0], self.rounding), qtype=int(w.type))

    def matmuls(self, ws: list[Weight], x, outs: list) -> None:
        """outs[j] = x @ ws[j].T for matrices that share x: x is quantized once when their types allow."""
        kinds = {lib.ember_matmul_act_kind(int(w.type)) for w in ws}
        if len(ws) == 1 or len(ws) > MAX_MULTI or len(kinds) != 1 or -1 in kinds:
            for w, out in zip(ws, outs):
                self.matmul(w, x, out)
            return
        n, k = x.shape
        types = ffi.new("int[]", [int(w.type) for w in ws])
        mats = ffi.new("void *[]", [self._p(w.data) for w in ws])
        ms = ffi.new("int64_t[]", [w.shape[0] for w in ws])
        ys = ffi.new("float *[]", [ffi.cast("float *", self._p(o)) for o in outs])
        scratch = self._scratch_for(int(ws[0].type), k, n)
        self._run(lib.EMBER_OP_MATMUL_MULTI, (types, mats, ms, self._p(x), ys, self._p(scratch)),
                  (len(ws), k, n, self.rounding), keep=(types, mats, ms, ys))

    def _scratch_for(self, qtype: int, k: int, n: int) -> np.ndarray:
        size = lib.ember_matmul_scratch_size(qtype, k, n)
        if size < 0:  # the kernels would not compute; say why rather than return garbage
            name = GGMLType(qtype).name if qtype in GGMLType._value2member_map_ else str(qtype)
            raise BackendError(f"cannot multiply by a {name} matrix with {k} columns (unsupported type, "
                               "or rows that are not whole blocks)")
        return self._scratch_bytes(size)

    def _scratch_bytes(self, size: int) -> np.ndarray:
        """The shared scratch buffer, grown to at least `size` bytes."""
        if self._scratch.nbytes < max(size, 64):  # recordings keep the old buffer alive
            raw = np.empty(max(size, 2 * self._scratch.nbytes, 64) + 64, np.uint8)
            offset = (-raw.ctypes.data) % 64  # the kernels want 64-byte alignment
            self._scratch = raw[offset:]  # aligned once here: .ctypes costs 10-20 us, per matmul it added up
        return self._scratch

    def add_bias(self, x, b: Weight) -> None:
        self._run(lib.EMBER_OP_ADD_ROW, (self._p(x), self._p(b.data)), (x.shape[0], x.shape[1]))

    def top_k(self, logits, k: int, ids, vals) -> None:
        """ids (n, k) int32 and vals (n, k) f32 = each row's k largest logits, best first (lowest id
        among equal values), so that greedy steps hand Python only token ids."""
        n, vocab = logits.shape
        if not 1 <= k <= min(lib.EMBER_TOPK_MAX, vocab):
            raise BackendError(f"top_k needs 1 <= k <= {min(lib.EMBER_TOPK_MAX, vocab)}, got {k}")
        if ids.shape != (n, k) or vals.shape != (n, k) or ids.dtype != np.int32 or vals.dtype != F32:
            raise BackendError(f"top_k of ({n}, {vocab}) logits needs ({n}, {k}) int32 ids and f32 values")
        self._run(lib.EMBER_OP_TOP_K, (self._p(logits), self._p(ids), self._p(vals)), (n, vocab, k))

    def gather_rows(self, x, rows, out) -> None:
        """out[r] = x[rows[r]]"""
        self._run(lib.EMBER_OP_GATHER_ROWS, (self._p(x), self._p(self._ints(rows, np.int32)), self._p(out)),
                  (len(rows), x.shape[1]))

    def rms_norm(self, x, w, eps, out) -> None:
        d = w.shape[-1] if w is not None else x.shape[-1]
        wp = self._p(w.data) if w is not None else ffi.NULL
        self._run(lib.EMBER_OP_RMS_NORM, (self._p(x), wp, self._p(out)), (x.size // d, d), (eps,))

    def rope(self, x, n_head: int, batch: AttentionBatch, p: RopeParams) -> None:
        ff = self._p(p.freq_factors) if p.freq_factors is not None else ffi.NULL
        self._run(lib.EMBER_OP_ROPE, (self._p(x), self._p(self._ints(batch.positions, np.int32)), ff),
                  (batch.n_tokens, n_head, x.shape[-1] // n_head, p.n_rot, int(p.neox), p.n_ctx_orig),
                  (p.freq_base, p.freq_scale, p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow))

    def silu_mul(self, gate, up, out) -> None:
        self._run(lib.EMBER_OP_SILU_MUL, (self._p(gate), self._p(up), self._p(out)), (gate.size,))

    def gelu_mul(self, gate, up, out) -> None:
        self._run(lib.EMBER_OP_GELU_MUL, (self._p(gate), self._p(up), self._p(out)), (gate.size,))

    def add(self, a, b, out) -> None:
        self._run(lib.EMBER_OP_ADD, (self._p(a), self._p(b), self._p(out)), (a.size,))

    def layer_norm(self, x, w, b, eps, out) -> None:
        wp = self._p(w.data) if w is not None else ffi.NULL
        bp = self._p(b.data) if b is not None else ffi.NULL
        self._run(lib.EMBER_OP_LAYER_NORM, (self._p(x), wp, bp, self._p(out)), (x.shape[0], x.shape[1]), (eps,))

    def gelu(self, x, out) -> None:
        self._run(lib.EMBER_OP_GELU, (self._p(x), self._p(out)), (x.size,))

    def tanh(self, x) -> None:
        self._run(lib.EMBER_OP_TANH, (self._p(x),), (x.size,))

    def scale(self, x, s: float) -> None:
        self._run(lib.EMBER_OP_SCALE, (self._p(x),), (x.size,), (s,))

    def softcap(self, x, cap: float) -> None:
        self._run(lib.EMBER_OP_SOFTCAP, (self._p(x),), (x.size,), (cap,))

    def pos_scale(self, x, batch: AttentionBatch, length: int, scale: float, offset: float = 0.0) -> None:
        if length < 1:
            raise BackendError(f"pos_scale needs a length of at least 1, got {length}")
        self._run(lib.EMBER_OP_POS_SCALE, (self._p(x), self._p(self._ints(batch.positions, np.int32))),
                  (batch.n_tokens, x.shape[-1], length), (scale, offset))

    def hadamard(self, x, out, block: int) -> None:
        """out (n, d) = x rotated in blocks of `block` values (see api_ops.h); out may be x."""
        self._run(lib.EMBER_OP_HADAMARD, (self._p(x), self._p(out)), (x.shape[0], x.shape[1], block))

    def _rotation(self, name: str, x, block: int):
        """x rotated in blocks of `block` into a buffer of this backend's (x itself where block is 0)."""
        if not block:
            return x
        buf = self._rotated.get(name)
        if buf is None or buf.shape[0] < x.shape[0] or buf.shape[1] != x.shape[1]:
            buf = self._rotated[name] = np.empty((max(x.shape[0], 64), x.shape[1]), F32)  # recordings keep old ones
        out = buf[:x.shape[0]]
        self.hadamard(x, out, block)
        return out

    def kv_store(self, cache: KVLayer, k, v, batch: AttentionBatch) -> None:
        k, v = self._rotation("k", k, cache.k_rot), self._rotation("v", v, cache.v_rot)
        self._run(lib.EMBER_OP_KV_STORE, (self._p(k), self._p(v), self._p(cache.k), self._p(cache.v),
                                          self._p(self._ints(batch.slots, np.int64))),
                  (batch.n_tokens, k.shape[1], v.shape[1], int(cache.k_type), int(cache.v_type), batch.page_size,
                   cache.parts))

    def attention(self, q, cache: KVLayer, out, batch: AttentionBatch, n_head, n_kv_head, window, scale, softcap=0.0,
                  sinks: Weight | None = None):
        q = self._rotation("q", q, cache.k_rot)
        if n_kv_head % cache.parts:
            raise BackendError(f"a cache in {cache.parts} parts a row cannot hold {n_kv_head} kv heads")
        tables = self._ints(batch.block_tables, np.int32)
        self._run(lib.EMBER_OP_ATTENTION,
                  (self._p(q), self._p(cache.k), self._p(cache.v), self._p(out), self._p(self._ints(batch.positions, np.int32)),
                   self._p(self._ints(batch.seq_rows, np.int32)), self._p(tables),
                   self._p(sinks.data) if sinks is not None else ffi.NULL),
                  (batch.n_tokens, n_head, n_kv_head, q.shape[1] // n_head, out.shape[1] // n_head, tables.shape[1],
                   batch.page_size, window, int(cache.k_type), int(cache.v_type), cache.parts),
                  (scale, softcap))
        if cache.v_rot:
            self.hadamard(out, out, cache.v_rot)  # back from the values' rotation


    # ---- mixture of experts ----
    def route_experts(self, logits, k: int, norm: bool, ids, weights) -> None:
        n, n_expert = logits.shape
        if not 1 <= k <= n_expert <= lib.EMBER_EXPERTS_MAX:
            raise BackendError(f"routing needs 1 <= k <= experts <= {lib.EMBER_EXPERTS_MAX}, got k={k} of {n_expert}")
        self._run(lib.EMBER_OP_EXPERTS_ROUTE, (self._p(logits), self._p(ids), self._p(weights)),
                  (n, n_expert, k, int(norm)))

    def expert_matmuls(self, ws: list[Weight], x, ids, outs: list) -> None:
        """Grouped by expert in the kernels (experts.c): each chosen expert's rows read once."""
        n, k = ids.shape
        n_expert, _, cols = ws[0].shape
        if len(ws) > lib.EMBER_EXPERTS_MAX_MATS or any(w.shape[0] != n_expert or w.shape[2] != cols for w in ws):
            raise BackendError(f"expert products of {[w.shape for w in ws]}: at most {lib.EMBER_EXPERTS_MAX_MATS} "
                               "stacks of as many experts with as many columns")
        for w, out in zip(ws, outs):
            if x.shape[1] != cols or x.shape[0] not in (n, n * k) or out.shape != (n * k, w.shape[1]):
                raise BackendError(f"cannot multiply {x.shape} by experts '{w.name}' {w.shape} into {out.shape}")
        size = lib.ember_experts_scratch_size(int(ws[0].type), cols, n * k, sum(w.shape[1] for w in ws), len(ws),
                                              n_expert)
        if size < 0:
            raise BackendError(f"cannot multiply by '{ws[0].name}' ({ws[0].type.name}, {n_expert} experts of "
                               f"{cols} columns)")
        types = ffi.new("int[]", [int(w.type) for w in ws])
        mats = ffi.new("void *[]", [self._p(w.data) for w in ws])
        ms = ffi.new("int64_t[]", [w.shape[1] for w in ws])
        ys = ffi.new("float *[]", [ffi.cast("float *", self._p(o)) for o in outs])
        maps = [self._expert_maps.get(w.data.ctypes.data) for w in ws]
        used = ffi.new("uint8_t *[]", [ffi.NULL if m is None else ffi.cast("uint8_t *", self._p(m)) for m in maps])
        scratch = self._scratch_bytes(size)
        self._run(lib.EMBER_OP_EXPERTS_MATMUL,
                  (types, mats, ms, self._p(x), self._p(ids), ys, self._p(scratch), used),
                  (len(ws), n_expert, cols, n, k, int(x.shape[0] == n * k and k > 1), self.rounding),
                  keep=(types, mats, ms, ys, used))

    def expert_sum(self, y, weights, out) -> None:
        n, k = weights.shape
        self._run(lib.EMBER_OP_EXPERTS_SUM, (self._p(y), self._p(weights), self._p(out)), (n, k, out.shape[1]))

    def expert_bias(self, y, b: Weight, ids) -> None:
        n_expert, d = b.shape
        if y.shape != (ids.size, d):
            raise BackendError(f"expert biases '{b.name}' {b.shape} do not fit rows {y.shape} of {ids.size} selections")
        self._run(lib.EMBER_OP_EXPERTS_BIAS, (self._p(y), self._p(b.data), self._p(ids)), (ids.size, d))

    def swiglu_oai(self, gate, up, out, alpha: float, limit: float) -> None:
        self._run(lib.EMBER_OP_SWIGLU_OAI, (self._p(gate), self._p(up), self._p(out)), (gate.size,), (alpha, limit))


def _kv_row_bytes(t: GGMLType, dim: int) -> int:
    n = lib.ember_kv_row_bytes(int(t), dim)
    if n < 0:
        raise BackendError(f"a KV cache of type {t.name} cannot hold rows of {dim} values "
                           f"(types: {', '.join(KV_TYPES)}; the block types need heads of a multiple of 32)")
    return n
