"""WebGPU backend: one set of WGSL kernels through wgpu-py, on Vulkan, Metal or D3D12 (on a machine
without a GPU, Mesa's software Vulkan driver lavapipe runs them).

Weights stay in their GGUF block layout on the device, packed back to back into buffers of up to
the adapter's largest storage binding (a matrix larger than that is split by rows): the products
of several matrices of one buffer and type on the same activations (queries, keys and values; gate
and up) run as one dispatch. 1-D tensors are kept as f32; activations
are f32; the paged KV cache is f16 (pairs of halves a 32-bit word, which every WGSL implementation
has). A step's ops are collected and submitted as one command buffer; a recorded step keeps its
pipelines, bind groups and parameters and is encoded again from them on each replay.

Needs wgpu (`pip install 'ember[webgpu]'`); importing this module does not.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import numpy as np

from ...quant import dequantize
from ...quant.types import GGMLType, layout
from ..base import AttentionBatch, BackendError, Capabilities, KVLayer, RopeParams, Weight
from . import _device, _kernels
from ._step import INPUTS, PARAM_WORDS, Dispatch, GpuArray, Step

__all__ = ["Backend", "GpuArray", "MATRIX_TYPES"]

# weight type -> its block decoder in kernels/dequant.wgsl
MATRIX_TYPES = {GGMLType.Q4_0: "deq_q4_0", GGMLType.Q4_1: "deq_q4_1", GGMLType.Q5_0: "deq_q5_0",
                GGMLType.Q5_1: "deq_q5_1", GGMLType.Q8_0: "deq_q8_0", GGMLType.Q4_K: "deq_q4_k",
                GGMLType.Q5_K: "deq_q5_k", GGMLType.Q6_K: "deq_q6_k", GGMLType.F16: "deq_f16",
                GGMLType.BF16: "deq_bf16", GGMLType.F32: "deq_f32"}
MV_MAX_ROWS = 8  # activation rows up to which products take a matrix-vector kernel (mvp, mv_row)
MV_ROWS = 2  # weight rows a workgroup of mvp (matvec.wgsl's NR)
# one activation row against fewer weight rows than this: mvp with 128 lanes a workgroup (more warps
# in flight for the few workgroups of a layer's product: 8.5 -> 7.4 us at 576 x 576, 14.1 -> 9.5 at
# 640 x 2048 Q6_K on an H100); the heads, with workgroups to spare, keep 32 (41.9 us against 60.4 at
# 49,152 x 576 Q8_0); bench/webgpu.py --lanes
MV_WIDE_BELOW = 16384
# Q4_K's and Q6_K's own decode entries (32 weights a lane's item): mvq on int8 blocks of x (rows
# from INT8_MIN_K; 64 lanes for one activation row under MV_WIDE_BELOW weight rows, else 32: on an
# H100 the 8B's o 11.2 us at 64 lanes vs 13.5 at 32, down 23.3 vs 31.0, gate 25.6 at 32 vs 27.0), mvk
# on f32 x (shorter rows, the 32-lane builds; it beat mvp there on each of the 8B's products, one
# row: q 26.4 vs 33.6 us, gate 66.7 vs 76.4; at 128 lanes mvp is the faster): bench/webgpu.py --lanes
#
# The row length from which decode products take int8 x (Backend.int8_min_k). On an H100 the 8B's
# products (k 4096 and 14336) ran 1.4-2.8x faster alone than the f32 entries served before and its
# decode step went 9.65 -> 5.81 ms (tg128 101 -> 159 tok/s); SmolLM2's (k 576, 1536) took 1.15 ms
# a step against 1.07 and its step went 1.52 -> 2.42 ms, the roundings' dispatches (about 10 us
# each) and the norms' slower int8 stores on top: bench/webgpu.py --lanes
INT8_MIN_K = 4096
# teams of lanes a decode workgroup, by the lanes of a team (Backend.mv_teams; matvec.wgsl's MV_TEAMS:
# each team on rows of its own, so a workgroup puts several warps on a multiprocessor, which holds
# at most 32 workgroups). On an H100 the 8B's decode step 3.71 -> 3.53 ms (tg128 251 -> 262 tok/s),
# gate-and-up 19.0 -> 16.6 us at 4 teams, o 9.4 -> 9.0 at 2; the small models' steps 0.5-1% shorter
# (SmolLM2 1.260 -> 1.247 ms): bench/webgpu.py --lanes, bench/NOTES.md
MV_TEAMS = {32: 4, 64: 2, 128: 2}
MM_TILE = 64  # weight rows and activation rows of an mm workgroup's output tile (matmul.wgsl)
MMQ_ROWS = 128  # weight rows of an mmq workgroup's tile (matmul_q8.wgsl; 9 KiB of workgroup memory)
# tiles below which mmq splits k (each split at least MMQ_MIN_RUNS runs of 32), mmq_sum adding the
# splits' sums: the small models' products are 16-192 tiles for an H100's 132 multiprocessors
MMQ_MIN_GROUPS = 256
MMQ_MIN_RUNS = 4
MM2_STORAGE = 24576  # bytes of workgroup memory mm2's tiles (128 weight rows by 64) take
# a CPU adapter's mm costs 0.7-0.85 of mv_row's time an activation row on lavapipe (the two
# models' layers, 64 and 128 rows): it takes mm where the tiles' rows are at most this many
# times the activation rows (64 rows and more, bar the last tile's waste), mv_row below
CPU_TILE_SLACK = 1.2
TOPK_MAX = 256
TOPK_CHUNK = 4096  # values a workgroup of top_k's first stage takes (GPUs, rows of 4 chunks and more: two stages)
ATT_MAX_D = 256  # longest head the attention kernel holds (4 value dimensions a thread)
# a GPU's attention of fewer (head, token) rows than this (decode) splits each row's keys into
# chunks of a workgroup each (attn_part, attn_merge), where the page table reaches past one chunk:
# chunks of ATT_CHUNK_MIN keys and more, at most ATT_MAX_CHUNKS a row
ATT_SPLIT_BELOW = 256
ATT_CHUNK_MIN = 32
# decode steps of more rows (many sequences a token each) split too, into fewer chunks: about this
# many workgroups in all (rows below ATT_SPLIT_BELOW keep ATT_MAX_CHUNKS). Without the split a
# workgroup walks a row's keys alone, 64 at a time, a few hundred workgroups for the step
ATT_SPLIT_GROUPS = 16384
# rows of a prompt's attention workgroup (attn_tile: query heads of one kv head x tokens, each key and
# value loaded once for all of them; at most 8, the kernel's capacity)
ATT_TILE_ROWS = 8
FL_ROWS = 32  # query rows of an attn_flash tile (attn_flash.wgsl): tokens times a kv head's query heads
FL_STORAGE = 26368  # bytes of workgroup memory attn_flash takes
FL_KEYS = 64  # keys of an attn_flash tile
# workgroups below which attn_flash splits its rows' keys into chunks (an H100 has 132 multiprocessors,
# each with room for two of its workgroups)
FL_MIN_GROUPS = 256
ATT_MAX_CHUNKS = 64
WEIGHT_PADDING = 16  # bytes past a part's end: the block readers may read one word beyond
MAX_GROUPS = 65535  # workgroups a dispatch dimension may have (WebGPU's default limit)
MAX_FUSED = 3  # matrices one product dispatch may run (matmul.wgsl's Y, Y2, Y3)
# storage buffers a decode product that ropes and stores binds (matvec_kv.wgsl: weights, x's int8
# blocks and scales, three outputs, the step's inputs, frequency factors, two caches)
KV_PRODUCT_BUFFERS = 10
F32 = np.float32
SPARE_OUTPUTS = (5, 9)  # ops.wgsl's H and Z, outputs some entry points may leave unused
# bindings each entry point of kernels/ops.wgsl reads (all must be bound: an input that is the
# output itself, or absent, is bound to a placeholder)
OPS_BINDINGS = {"binary": (1, 2, 3), "unary": (1,), "add_row": (1, 2), "gather_rows": (1, 2, 4), "pos_scale": (1, 4),
                "rms_norm": (1, 2, 3, 9), "add_rms_norm": (1, 2, 3, 5, 9), "norm_add_rms_norm": (1, 2, 3, 5, 9),
                "rope": (1, 3, 4, 9), "rope_store": (1, 2, 3, 4, 5, 6, 7, 9, 10), "kv_store": (2, 3, 4, 5, 10),
                "copy_pages": (4, 5), "attention": (1, 2, 4, 6, 7), "attn_tile": (1, 2, 4, 6, 7), "attn_flash": (1, 2, 4, 6, 7, 9), "attn_part": (2, 4, 6, 7, 9), "attn_merge": (1, 4, 5, 9), "top_k": (1, 2, 4, 8), "chain_ids": (4, 8),
                "quant_q8": (2, 5)}


def _groups(count: int) -> tuple[int, int, int]:
    """`count` workgroups as a 2-D grid (flat_group in common.wgsl folds them back)."""
    if count <= MAX_GROUPS:
        return max(count, 1), 1, 1
    y = -(-count // MAX_GROUPS)
    return -(-count // y), y, 1


def _params(*values) -> np.ndarray:
    """Kernel parameters as the 32 words the kernels read (floats by their bits)."""
    words = np.zeros(PARAM_WORDS, np.uint32)
    for i, v in enumerate(values):
        if isinstance(v, float):
            words[i] = np.array(v, F32).view(np.uint32)
        else:
            words[i] = np.array(int(v), np.int64).astype(np.uint32)
    return words


@dataclass(frozen=True, slots=True)
class MatrixData:
    """A matrix in GGUF blocks: parts of whole rows, each within one buffer (settle places them)."""

    parts: list  # (first row, rows, GPUBuffer, byte offset in it)
    row_bytes: int


class Backend:
    name = "webgpu"
    # top_k, record/replay (prompt-sized steps too: each op eagerly costs a bind group), copy_pages;
    # overlap (a replay queued while the host goes on: mark, wait_mark) and chain_tokens (get_rows
    # of the step before's best ids: the engine's decode-ahead)
    capabilities = Capabilities(top_k=True, record=True, max_recorded_tokens=4096, overlap=True, chain_tokens=True,
                                copy_pages=True)

    def __init__(self, device: str = "webgpu", threads: int | None = None):
        self.wgpu = _device.import_wgpu()
        self.adapter, self.device, self.kernels = _device.open_adapter(device)
        self.n_threads = 1  # host threads: the adapter does the work
        self.max_binding = int(self.device.limits["max-storage-buffer-binding-size"])
        # a CPU adapter (lavapipe: invocations are SIMD lanes of host cores) runs products of a few
        # rows fastest a weight row a thread with no shared memory or barriers (mv_row: each
        # block decoded once for 8 activation rows), one row with lanes splitting blocks (mvp), and
        # whole tiles (mm) from 64 rows (CPU_TILE_SLACK); a GPU wants lanes sharing a row's blocks
        # (mvp) and tiles shared by a workgroup (mm)
        self.row_products = _device.is_cpu(self.adapter)
        # on a GPU, decode steps of 9 to 64 sequences padded to 16, 32 or 64 (the runner's
        # decode_bucket): a replayed step costs about the same with a few more rows, and recording
        # each count as streams end one by one cost ~50 ms a step on an H100 (bench/NOTES.md); a CPU
        # adapter's rows are computed one by one, so it runs each count as it is
        if not self.row_products:
            self.capabilities = replace(self.capabilities, pad_decode_steps=True)
        # prompt-sized attention in tiles of rows sharing each key's loads (attn_tile: 2-5x the
        # row kernel on lavapipe) on CPU adapters; on GPUs attn_flash (below), else a workgroup a
        # (head, token) row: attn_tile's few workgroups (256 for Gemma 3's 512-token prompt) ran at
        # half the row kernel's speed on an H100 (bench/NOTES.md)
        self.tile_attention = self.row_products
        # prompts' attention in tiles of query rows against tiles of keys (attn_flash) on GPUs with the
        # workgroup memory for them
        storage = int(self.device.limits["max-compute-workgroup-storage-size"])
        self.flash_attention = not self.row_products and storage >= FL_STORAGE
        self.subgroups = "subgroup" in self.device.features  # mvp summed by subgroupAdd
        # decode products of the 32-value block types, Q4_K and Q6_K on x rounded to int8 blocks
        # (put_q8 in the norm before or quant_q8, then mvq's packed 4 x 8-bit dot products): a
        # quarter of the f32 activations' reads, as the CPU's products; off: the f32 entries
        self.int8_products = True
        # ... from this row length (INT8_MIN_K)
        self.int8_min_k = INT8_MIN_K
        self.mv_teams: dict[int, int] = MV_TEAMS.copy()
        # prompt tiles of 128 weight rows (mm2) where the adapter has the workgroup memory for them
        self.mm_rows = 128 if storage >= MM2_STORAGE else 64
        # decode products of queries, keys and values that rotate and store them into the KV cache
        # (matvec_kv.wgsl: one dispatch fewer a layer) where the adapter binds their buffers
        self.kv_products = int(self.device.limits["max-storage-buffers-per-shader-stage"]) >= KV_PRODUCT_BUFFERS
        self._recording: Step | None = None
        self._pending: Step | None = None
        self._residual = None  # (step, dispatch index, h, x) of the last `x += h`, for _fuses_residual
        self._rope_last = None  # (step, dispatch index, positions, (hd, params), x, n_head) of the last rope
        self._keys_roped = None  # (step, dispatch index, keys, hd, positions) of the last queries' and keys' rope
        self._normed = None  # (step, dispatch index, x, eps) of the last norm in place, for _pairs_norm
        self._gate_up = None  # (step, dispatch index, gate, up) of the last two-matrix mvp product, for _gates
        self._mv_made = None  # (step, {dispatch index: (dispatch, module, entry)}) of its decode products, for _products_store
        self._norm_out = None  # (step, dispatch index, output buffer, (rows, d), flags) of the last add(-)norm or attention merge, for _q8_for
        self._q8_of = None  # (step, x's buffer, (n, k), blocks' buffer) of the int8 blocks made last
        self._topk_buffers: dict = {}  # size -> (values, ids) of top_k's candidates
        self._scratches: dict = {}  # name -> a growing buffer (_scratch)
        self._dummy = self._buffer(16)  # placeholder of unused inputs
        # of unused outputs (a writable binding aliases nothing)
        self._spares = {b: self._buffer(16) for b in SPARE_OUTPUTS}
        self._spare_outputs = {5: self._buffer(16), 6: self._buffer(16)}  # of a product's Y2, Y3 (one matrix)
        self._unplaced: list = []  # (MatrixData, part index, bytes) not on the device yet (settle)
        self.last_step: Step | None = None  # the last step run (its host encode and wait times)

    # ---- description ----
    def describe(self) -> dict:
        return {"backend": self.name, "wgpu": self.wgpu.__version__, **_device.describe(self.adapter)}

    def supports(self, qtype: GGMLType) -> bool:
        return qtype in MATRIX_TYPES

    # ---- memory ----
    def _buffer(self, nbytes: int, data: np.ndarray | None = None):
        usage = self.wgpu.BufferUsage
        size = max(16, -(-nbytes // 16) * 16)
        buf = self.device.create_buffer(size=size, usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST)
        if data is not None and data.nbytes:
            self._write(buf, 0, data)
        return buf

    def _write(self, buf, at: int, data: np.ndarray) -> None:
        """data's bytes into buf from byte `at` (a multiple of 4), the last word zero-padded."""
        self._q8_of = None
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        whole = raw.size // 4 * 4
        if whole:
            self.device.queue.write_buffer(buf, at, raw[:whole])
        if whole < raw.size:
            self.device.queue.write_buffer(buf, at + whole, np.pad(raw[whole:], (0, 4 - raw.size + whole)))

    def weight(self, tensor, streamed: bool = True) -> Weight:
        shape = tuple(tensor.shape)
        if len(shape) == 1:  # norm weights, biases, rope factors: small, kept as f32
            values = dequantize(tensor.data, tensor.type).astype(F32)
            return Weight(tensor.name, tensor.type, shape, self.from_numpy(values))
        if tensor.type not in MATRIX_TYPES or len(shape) != 2:
            raise BackendError(f"tensor '{tensor.name}' has type {tensor.type.name} and shape {shape}, which the "
                               "WebGPU backend cannot compute with")
        if shape[1] % 32 or shape[1] % layout(tensor.type).block_size:
            raise BackendError(f"tensor '{tensor.name}' has rows of {shape[1]} values, not whole blocks of 32")
        return Weight(tensor.name, tensor.type, shape, self._matrix(np.asarray(tensor.data), shape, tensor.type))

    def _matrix(self, raw: np.ndarray, shape: tuple, qtype: GGMLType) -> MatrixData:
        """The matrix's parts, placed on the device by the next settle (held as the host's bytes
        until then: a file's mapping, not a copy)."""
        row_bytes = layout(qtype).row_bytes(shape[1])
        raw = raw.reshape(-1).view(np.uint8)
        per_part = max(1, (self.max_binding - WEIGHT_PADDING) // row_bytes)
        data = MatrixData([], row_bytes)
        for row0 in range(0, shape[0], per_part):
            rows = min(per_part, shape[0] - row0)
            self._unplaced.append((data, len(data.parts), raw[row0 * row_bytes:(row0 + rows) * row_bytes]))
            data.parts.append((row0, rows, None, 0))
        return data

    def settle(self) -> None:
        """The matrices made since the last settle packed back to back (16-byte aligned, in the order
        they came) into buffers of up to the largest binding, and copied there."""
        todo, self._unplaced = self._unplaced, []
        limit = min(self.max_binding, int(self.device.limits["max-buffer-size"])) - WEIGHT_PADDING
        start = 0
        while start < len(todo):
            end, size = start, 0
            while end < len(todo) and (end == start or _align(size) + todo[end][2].nbytes <= limit):
                size = _align(size) + todo[end][2].nbytes
                end += 1
            buf = self._buffer(size + WEIGHT_PADDING)
            at = 0
            for data, i, chunk in todo[start:end]:
                at = _align(at)
                self._write(buf, at, chunk)
                row0, rows, _, _ = data.parts[i]
                data.parts[i] = (row0, rows, buf, at)
                at += chunk.nbytes
            start = end

    def empty(self, shape, dtype=F32):
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        return GpuArray(self._buffer(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize), shape, dtype)

    def from_numpy(self, a: np.ndarray):
        a = np.ascontiguousarray(a)
        return GpuArray(self._buffer(a.nbytes, a), a.shape, a.dtype)

    def to_numpy(self, a: GpuArray) -> np.ndarray:
        """The array on the host. In a recording: an array that each replay fills."""
        host = np.empty(a.shape, a.dtype)
        step = self._step()
        step.downloads.append((a, host))
        if self._recording is None:
            self._flush()
        return host

    def kv_cache(self, n_slots: int, k_dim: int, v_dim: int, k_type=GGMLType.F16, v_type=GGMLType.F16) -> KVLayer:
        if k_type != GGMLType.F16 or v_type != GGMLType.F16:
            raise BackendError(f"the WebGPU KV cache is f16 only, not {k_type.name}/{v_type.name}")
        if k_dim % 2 or v_dim % 2:
            raise BackendError(f"the WebGPU KV cache holds pairs of values; rows of {k_dim} and {v_dim} are not")
        return KVLayer(self.empty((n_slots, k_dim), np.float16), self.empty((n_slots, v_dim), np.float16))  # zeros

    def synchronize(self) -> None:
        self._flush()
        if self.last_step is not None:
            self.last_step.finish()

    # ---- steps ----
    @contextlib.contextmanager
    def record(self):
        """Ops are recorded, then run once when the block ends (nothing in the block may read an
        op's output: downloads are filled by each replay)."""
        self._flush()
        rec = self._recording = Step(record=True)
        try:
            yield rec
        finally:
            self._recording = None
        rec.build(self.device, self.wgpu)
        self.replay(rec)

    def replay(self, rec: Step, wait: bool = True) -> None:
        """Run a recorded step; wait=False returns once it is queued: its downloads are filled by
        wait_mark of a mark() taken after it."""
        rec.run(self.device, self.wgpu, wait)
        self.last_step = rec

    def mark(self):
        """The point in the device's queue after the last step queued (for wait_mark)."""
        return self.last_step

    def wait_mark(self, mark) -> None:
        """Until the step `mark` names has run, its downloads filled."""
        if mark is not None:
            mark.finish()

    def _step(self) -> Step:
        if self._recording is not None:
            return self._recording
        if self._pending is None:
            self._pending = Step(record=False)
        return self._pending

    def _flush(self) -> None:
        step, self._pending = self._pending, None
        if step is not None and (step.dispatches or step.downloads):
            step.build(self.device, self.wgpu)
            step.run(self.device, self.wgpu)
            self.last_step = step

    def _dispatch(self, module: str, entry: str, bindings: dict, params: np.ndarray, groups) -> None:
        if self._unplaced:  # weights made outside a model's load (which settles them)
            self.settle()
        for arr in bindings.values():
            if isinstance(arr, GpuArray) and arr.offset:
                raise BackendError("the WebGPU kernels take whole arrays or their first rows, not later rows")
        self._residual = self._rope_last = self._gate_up = self._normed = self._keys_roped = self._norm_out = None
        if module.startswith("ops"):
            bindings = {b: bindings.get(b, self._spares.get(b, self._dummy))
                        for b in OPS_BINDINGS[entry]}
        bound = tuple((b, a.buf if isinstance(a, GpuArray) else a) for b, a in sorted(bindings.items()))
        q8 = self._q8_of  # int8 blocks of x stay x's until an op runs or a product writes x
        if q8 is not None and (module.startswith("ops") or any(b in (3, 5, 6) and a is q8[1] for b, a in bound)):
            self._q8_of = None
        self._step().dispatches.append(Dispatch(self.kernels.pipeline(module, entry), bound, params, tuple(groups)))

    def _input(self, a) -> int:
        """Word offset of host ints a in the step's inputs (int32 on the device)."""
        a = np.asarray(a)
        if self._recording is not None and not a.flags.c_contiguous:
            raise BackendError(f"a recorded step needs contiguous int inputs, got {a.dtype}")
        if a.dtype == np.int64 and a.size and int(np.abs(a).max(initial=0)) >= 2**31 and self._recording is None:
            raise BackendError("an index beyond 2**31 cannot reach the WebGPU kernels")
        return self._step().add_input(a)

    def _elementwise(self, entry: str, bindings: dict, size: int, *params) -> None:
        self._dispatch("ops", entry, bindings, _params(size, *params), _groups(-(-size // 256)))

    # ---- ops ----
    def get_rows(self, w: Weight, ids, out, prev=None, bans=None) -> None:
        """out = rows ids of w. prev: (rows, k) int32 on the device, the best ids of the step before
        (chain_tokens): an id -r - 1 takes the first of row r's that its row of bans (n, k) lacks, as
        the engine's greedy choice would (none: the row is left as it was)."""
        rows, cols = w.shape
        ids = np.asarray(ids)
        low = -len(prev) if prev is not None else 0
        if self._recording is None and len(ids) and (int(np.min(ids)) < low or int(np.max(ids)) >= rows):
            raise BackendError(f"token id out of range for '{w.name}' ({rows} rows)")
        off = self._input(ids)
        if prev is not None:
            k = prev.shape[1]
            if tuple(np.shape(bans)) != (len(ids), k) or prev.offset or prev.dtype != np.int32:
                raise BackendError(f"get_rows of {len(ids)} ids after best ids of {k} a row needs "
                                   f"({len(ids)}, {k}) bans and a whole int32 array of best ids")
            # the ids rewritten in the step's inputs on the device, where get_rows reads them
            self._dispatch("ops", "chain_ids", {4: prev, 8: INPUTS},
                           _params(len(ids), k, off, self._input(bans), len(prev)), _groups(-(-len(ids) // 64)))
        if self._unplaced:
            self.settle()
        for row0, n_rows, buf, base in w.data.parts:
            self._dispatch(MATRIX_TYPES[w.type], "get_rows", {1: buf, 3: out, 4: INPUTS},
                           _params(n_rows, cols, len(ids), w.data.row_bytes, row0, off, base),
                           (-(-cols // 32 // 64), max(len(ids), 1), 1))

    def matmul(self, w: Weight, x, out) -> None:
        """out (n, rows) = x (n, cols) @ w.T, a dispatch for each part of w."""
        rows, cols = w.shape
        if not x.shape[0]:
            return
        if self._unplaced:
            self.settle()
        q8 = None  # x's int8 blocks, once for all parts
        for row0, n_rows, buf, base in w.data.parts:
            params = _params(n_rows, cols, x.shape[0], w.data.row_bytes, rows, row0, base, n_rows, n_rows)
            q8 = self._product(w.type, buf, x, {3: out}, params, n_rows, q8)

    def _mvp(self, n: int) -> bool:
        """Whether products of n activation rows take mvp (matvec.wgsl)."""
        return n == 1 or (n <= MV_MAX_ROWS and not self.row_products)

    def _product(self, qtype: GGMLType, buf, x, outs: dict, params: np.ndarray, rows: int, q8=None):
        """A product dispatch of `rows` (virtual) rows of matmul.wgsl's kernels, the plan's; returns
        the buffer of x's int8 blocks where mvq took them (q8: already made)."""
        n = x.shape[0]
        bindings = {1: buf, 2: x, **self._spare_outputs, **outs}
        if self._mvp(n):  # built for 1, 2, 4 or 8 activation rows (no idle sums)
            module = f"{MATRIX_TYPES[qtype]}+mv{1 << (n - 1).bit_length()}+{'sg' if self.subgroups else 'wg'}"
            entry, own = "mvp", _kernels.MV_OWN.get(MATRIX_TYPES[qtype])
            if (self.int8_products and x.shape[-1] >= self.int8_min_k
                    and (own is not None or MATRIX_TYPES[qtype] in _kernels.MV_INT)):
                entry = "mvq"  # on x as int8 blocks, made first
                q8 = bindings[8] = bindings[9] = q8 or self._q8_for(x)
                del bindings[2]
            lanes = 32
            if own is not None and entry == "mvq":  # Q4_K's and Q6_K's own mvq: 64 lanes for a layer's one row
                bindings[own[1]] = bindings.pop(1)
                if n == 1 and rows < MV_WIDE_BELOW and not self.row_products:
                    lanes = 64
            elif n == 1 and rows < MV_WIDE_BELOW and not self.row_products:
                lanes = 128
            elif own is not None:  # mvk at 32 lanes only (above)
                entry = "mvk"
                bindings[own[1]] = bindings.pop(1)
            teams = self.mv_teams.get(lanes, 1) if not self.row_products else 1
            module += _kernels.mv_build(lanes, teams)
            self._dispatch(module, entry, bindings, params, _groups(-(-rows // (MV_ROWS * teams))))
            step = self._step()
            if self._mv_made is None or self._mv_made[0] is not step:
                self._mv_made = (step, {})
            self._mv_made[1][len(step.dispatches) - 1] = (step.dispatches[-1], module, entry)
            return q8
        elif self.row_products and MM_TILE * -(-n // MM_TILE) > CPU_TILE_SLACK * n:
            self._dispatch(MATRIX_TYPES[qtype], "mv_row", bindings, params, (-(-rows // 64), -(-n // 8), 1))
        elif (self.int8_products and not self.row_products
              and MATRIX_TYPES[qtype] in _kernels.MM_INT):  # the tiles on x as int8 blocks (mmq), at every k
            q8 = bindings[8] = bindings[9] = q8 or self._q8_for(x)
            del bindings[2]
            module, grid = f"{MATRIX_TYPES[qtype]}+mmq", (-(-rows // MMQ_ROWS), -(-n // MM_TILE))
            runs, splits = _mmq_splits(grid[0] * grid[1], x.shape[-1] // 32)
            if splits > 1:  # too few tiles to fill the GPU: k split, each split's sums into a scratch, then added up
                params[13], params[14] = runs, splits
                bindings[10] = self._scratch("mmq", splits * n * rows)
            else:
                bindings[10] = self._dummy
            self._dispatch(module, "mmq", bindings, params, (*grid, splits))
            if splits > 1:
                self._dispatch(module, "mmq_sum", {b: a for b, a in bindings.items() if b in (3, 5, 6, 10)},
                               params, _groups(-(-rows * n // 256)))
            return q8
        else:  # mm2's tiles of 128 weight rows where the adapter has room for them, else mm's 64
            self._dispatch(MATRIX_TYPES[qtype], "mm2" if self.mm_rows == 128 else "mm", bindings, params,
                           (-(-rows // self.mm_rows), -(-n // MM_TILE), 1))

    def _q8_for(self, x):
        """x (n, k) as int8 blocks of 32 and their scales (ops.wgsl's put_q8) in a scratch buffer for
        the integer decode products (mvq): those made last where x is unchanged since; else made
        by the (add and) norm or the attention merge that wrote x as the step's last dispatch; else
        by quant_q8."""
        n, k = x.shape[0], x.shape[-1]
        step, blocks = self._step(), n * (k // 32)
        got = self._q8_of
        if got is not None and got[0] is step and got[1] is x.buf and got[2] == (n, k):
            return got[3]
        buf = self._scratch("q8", 12 * blocks)  # 8 words of int8 and 4 of scale and sums a block
        norm = self._norm_out
        if (norm is not None and norm[0] is step and norm[1] == len(step.dispatches) - 1 and norm[2] is x.buf
                and norm[3] == (n, k) and not x.offset):
            last = step.dispatches[-1]
            params = last.params.copy()
            on, at = norm[4]
            params[on], params[at] = 1, 8 * blocks
            bindings = dict(last.bindings)
            bindings[5] = buf
            step.dispatches[-1] = Dispatch(last.pipeline, tuple(sorted(bindings.items())), params, last.groups)
        else:
            self._dispatch("ops", "quant_q8", {2: x, 5: buf}, _params(k, n, 8 * blocks), _groups(-(-blocks // 32)))
        self._q8_of = (step, x.buf, (n, k), buf)
        return buf

    def matmuls(self, ws: list[Weight], x, outs: list) -> None:
        """outs[i] = x @ ws[i].T: the matrices of one type and width, whole in one buffer, one
        dispatch together (where their outputs are distinct whole arrays); the others one each."""
        if self._unplaced:
            self.settle()
        groups: dict = {}
        for w, out in zip(ws, outs):
            key = (w.type, w.shape[1], id(w.data.parts[0][2])) if len(w.data.parts) == 1 else id(w)
            groups.setdefault(key, []).append((w, out))
        for group in groups.values():
            if len(group) > 1 and self._fusable(group, x):
                self._fused_product(group, x)
            else:
                for w, out in group:
                    self.matmul(w, x, out)

    def _fused_product(self, group: list, x) -> None:
        """One product dispatch for two or three matrices of a buffer (matmul.wgsl's rows r1 ..,
        r2 .. and outputs Y2, Y3)."""
        if not x.shape[0]:
            return
        (w0, _), (w1, _), *rest = group
        bases = [w.data.parts[0][3] for w, _ in group] + [0]
        r1 = w0.shape[0]
        r2 = r1 + w1.shape[0]
        r3 = rest[0][0].shape[0] if rest else 0
        params = _params(r2 + r3, w0.shape[1], x.shape[0], w0.data.row_bytes, r1, 0, bases[0], r1, r2,
                         bases[1], bases[2], w1.shape[0], r3)
        outs = dict(zip((3, 5, 6), (out for _, out in group)))
        self._product(w0.type, w0.data.parts[0][2], x, outs, params, r2 + r3)
        step = self._step()
        if not rest and r1 == w1.shape[0] and step.dispatches[-1].params is params and self._mvp(x.shape[0]):
            self._gate_up = (step, len(step.dispatches) - 1, group[0][1], group[1][1])

    @staticmethod
    def _fusable(group: list, x) -> bool:
        bufs = [out.buf for _, out in group]
        return (len(group) <= MAX_FUSED and len(set(map(id, bufs))) == len(bufs) and x.buf not in bufs
                and all(o.offset == 0 and tuple(o.shape) == (x.shape[0], w.shape[0]) for w, o in group))

    def gather_rows(self, x, rows, out) -> None:
        rows = np.asarray(rows)
        d = x.shape[1]
        self._elementwise("gather_rows", {1: out, 2: x, 4: INPUTS}, len(rows) * d, d, self._input(rows))

    def add_bias(self, x, b: Weight) -> None:
        self._elementwise("add_row", {1: x, 2: b.data}, x.size, x.shape[-1])

    def top_k(self, logits, k: int, ids, vals) -> None:
        """ids (n, k) int32 and vals (n, k) f32 = each row's k largest logits, best first (lowest id
        among equal values), computed on the device."""
        n, vocab = logits.shape
        if not 1 <= k <= min(TOPK_MAX, vocab):
            raise BackendError(f"top_k needs 1 <= k <= {min(TOPK_MAX, vocab)}, got {k}")
        if tuple(ids.shape) != (n, k) or tuple(vals.shape) != (n, k) or ids.dtype != np.int32:
            raise BackendError(f"top_k of ({n}, {vocab}) logits needs ({n}, {k}) int32 ids and f32 values")
        if not n:
            return
        chunks = -(-vocab // TOPK_CHUNK)
        if chunks < 4 or self.row_products:  # a CPU adapter: its few cores gain nothing from a second stage
            self._dispatch("ops", "top_k", {1: vals, 2: logits, 8: ids}, _params(vocab, k, 0, 0), (1, n, 1))
            return
        cand_v, cand_i = self._topk_scratch(n * chunks * k)
        self._dispatch("ops", "top_k", {1: cand_v, 2: logits, 8: cand_i}, _params(vocab, k, TOPK_CHUNK, 0),
                       (chunks, n, 1))
        self._dispatch("ops", "top_k", {1: vals, 2: cand_v, 4: cand_i, 8: ids}, _params(chunks * k, k, 0, 1),
                       (1, n, 1))

    def _topk_scratch(self, size: int) -> tuple:
        """The candidates' values and ids of a two-stage top_k (kept: recordings bind them)."""
        got = self._topk_buffers.get(size)
        if got is None:
            got = self._topk_buffers[size] = (self._buffer(4 * size), self._buffer(4 * size))
        return got

    def _scratch(self, name: str, floats: int):
        """A buffer of at least `floats` f32 for an op's intermediate results, grown by doubling (a
        recording keeps the buffer it bound alive)."""
        buf = self._scratches.get(name)
        if buf is None or buf.size < 4 * floats:
            buf = self._scratches[name] = self._buffer(4 * max(floats, 2 * (buf.size // 4 if buf is not None else 0)))
        return buf

    def rms_norm(self, x, w, eps, out) -> None:
        d = w.shape[-1] if w is not None else x.shape[-1]
        rows = x.size // d
        if self._fuses_residual(x, d, out):
            self._add_rms_norm(x, w, eps, out)
            return
        if self._pairs_norm(x, w, eps, out, d):
            return
        bindings = {1: out}
        if x.buf is not out.buf:
            bindings[2] = x
        if w is not None:
            bindings[3] = w.data
        params = _params(d, rows, int(x.buf is out.buf), int(w is not None), float(eps))
        self._dispatch("ops", "rms_norm", bindings, params, _groups(rows))
        if x.buf is out.buf and not x.offset and x.size == rows * d:
            step = self._step()
            self._normed = (step, len(step.dispatches) - 1, x, float(eps))

    def _pairs_norm(self, x, w, eps, out, d: int) -> bool:
        """A norm in place right after another of the same width and eps (queries' then keys'):
        that dispatch takes this array's rows too (rms_norm's rows past `rows`, array Z)."""
        if self._normed is None or x.buf is not out.buf or x.offset or x.size % d:
            return False
        n, step = self._normed, self._step()
        last = step.dispatches[-1]
        if (n[0] is not step or n[1] != len(step.dispatches) - 1 or n[2].buf is x.buf or n[3] != float(eps)
                or last.params[0] != d or last.params[5]):
            return False
        params = last.params.copy()
        params[5], params[6] = x.size // d, int(w is not None)
        bindings = dict(last.bindings)
        bindings[9] = x.buf
        if w is not None:
            bindings[2] = w.data.buf
        step.dispatches[-1] = Dispatch(last.pipeline, tuple(sorted(bindings.items())), params,
                                       _groups(int(params[1]) + x.size // d))
        self._normed = None
        return True

    def _fuses_residual(self, x, d: int, out) -> bool:
        """Whether this norm of x follows the add into x (x += h) as the step's last dispatch, so
        that one pass over the rows does both (the residual stream's add and the next block's norm)."""
        r, step = self._residual, self._step()
        return (r is not None and r[0] is step and r[1] == len(step.dispatches) - 1 and x.buf is r[3].buf
                and x.size == r[3].size and d == x.shape[-1] and out.buf is not x.buf)

    def _add_rms_norm(self, x, w, eps, out) -> None:
        h, normed = self._residual[2], self._residual[4]
        step = self._step()
        step.dispatches.pop()
        if (normed is not None and normed[0] is step and normed[1] == len(step.dispatches) - 1
                and normed[2].buf is h.buf and out.buf is h.buf and normed[3] == float(eps)):
            self._norm_add_rms_norm(x, h, w, eps)
            return
        bindings = {1: x, 9: out}
        if h.buf is not out.buf:
            bindings[2] = h
        if w is not None:
            bindings[3] = w.data
        rows = x.size // x.shape[-1]
        self._dispatch("ops", "add_rms_norm", bindings,
                       _params(x.shape[-1], rows, int(h.buf is out.buf), int(w is not None), float(eps)), _groups(rows))
        self._note_norm_out(out, rows, x.shape[-1])

    def _note_norm_out(self, out, rows: int, d: int, flags: tuple[int, int] = (5, 6)) -> None:
        """The step's last dispatch (add_rms_norm, norm_add_rms_norm, attn_merge) wrote out (rows, d):
        a product of it may have it write out's int8 blocks too (_q8_for; the params that turn them
        on and place their scales: 5 and 6 of the norms, 14 and 15 of attn_merge)."""
        if out.size == rows * d and d % 32 == 0 and not out.offset:
            step = self._step()
            self._norm_out = (step, len(step.dispatches) - 1, out.buf, (rows, d), flags)

    def rope(self, x, n_head: int, batch: AttentionBatch, p: RopeParams) -> None:
        """Rotate x in place; keys rotated right after their queries (same positions and parameters)
        join the queries' dispatch."""
        n = batch.n_tokens
        hd = x.shape[-1] // n_head
        last, step = self._rope_last, self._step()
        if (last is not None and last[0] is step and last[1] == len(step.dispatches) - 1 and last[2] is batch.positions
                and last[3] == (hd, p) and last[4].buf is not x.buf and last[4].shape[0] == x.shape[0]):
            step.dispatches.pop()
            self._rope_dispatch(last[4], x, last[5], n_head, hd, batch, p)
            if not x.offset and x.shape[-1] == n_head * hd:
                self._keys_roped = (step, len(step.dispatches) - 1, x, hd, batch.positions)
            return
        self._rope_dispatch(x, None, n_head, 0, hd, batch, p)
        self._rope_last = (step, len(step.dispatches) - 1, batch.positions, (hd, p), x, n_head)

    def _norm_add_rms_norm(self, x, h, w, eps) -> None:
        """h normed in place (the step's last dispatch), x += h, h = the norm of x: one pass over
        the rows (ops.wgsl's norm_add_rms_norm)."""
        post = self._step().dispatches.pop()
        post_w = dict(post.bindings).get(3)
        bindings = {1: x, 9: h}
        if post.params[3]:
            bindings[3] = post_w
        if w is not None:
            bindings[2] = w.data
        rows = x.size // x.shape[-1]
        self._dispatch("ops", "norm_add_rms_norm", bindings,
                       _params(x.shape[-1], rows, int(post.params[3]), int(w is not None), float(eps)), _groups(rows))
        self._note_norm_out(h, rows, x.shape[-1])

    def _rope_dispatch(self, x, z, n_head: int, n_head_z: int, hd: int, batch: AttentionBatch, p: RopeParams) -> None:
        mscale, low, high = rope_scales(p)
        bindings = {1: x, 4: INPUTS}
        if z is not None:
            bindings[9] = z
        if p.freq_factors is not None:
            bindings[3] = p.freq_factors
        params = _params(batch.n_tokens, n_head, hd, p.n_rot, int(p.neox), self._input(batch.positions),
                         float(p.freq_base), float(p.freq_scale), float(p.ext_factor), float(mscale), float(low),
                         float(high), int(p.freq_factors is not None), n_head_z)
        groups = -(-((n_head + n_head_z) * p.n_rot // 2) // 64)
        self._dispatch("ops", "rope", bindings, params, (groups, max(batch.n_tokens, 1), 1))

    def _binary(self, a, b, out, mode: int) -> None:
        bindings = {1: out}
        if a.buf is not out.buf:
            bindings[2] = a
        if b.buf is not out.buf:
            bindings[3] = b
        self._elementwise("binary", bindings, out.size, int(a.buf is out.buf), int(b.buf is out.buf), mode)

    def add(self, a, b, out) -> None:
        normed = self._normed  # of h, just before: a norm of x may take it in too
        self._binary(a, b, out, 0)
        if a.buf is out.buf and b.buf is not out.buf and a.size == b.size:  # x += h: a norm of x may follow
            step = self._step()
            self._residual = (step, len(step.dispatches) - 1, b, out, normed)

    def silu_mul(self, gate, up, out) -> None:
        if not self._gates(gate, up, out, 1):
            self._binary(gate, up, out, 1)

    def gelu_mul(self, gate, up, out) -> None:
        if not self._gates(gate, up, out, 2):
            self._binary(gate, up, out, 2)

    def _gates(self, gate, up, out, mode: int) -> bool:
        """Where gate and up are the outputs of the step's last dispatch, an mvp product of two
        matrices of as many rows, and the gated product goes over one of them: that dispatch
        made to pair gate row r with up row r in a workgroup and write act(gate) * up itself
        (matvec.wgsl's gated mode: the same values in both outputs, one dispatch fewer)."""
        g, step = self._gate_up, self._step()
        if (g is None or g[0] is not step or g[1] != len(step.dispatches) - 1 or gate.buf is not g[2].buf
                or up.buf is not g[3].buf or out.buf not in (gate.buf, up.buf)
                or any(a.offset or tuple(a.shape) != tuple(g[2].shape) for a in (gate, up, out))):
            return False
        d = step.dispatches[-1]
        params = d.params.copy()
        params[13], params[14] = mode, int(out.buf is up.buf)
        # as many workgroups: a team's two rows are now gate row r and up row r
        step.dispatches[-1] = Dispatch(d.pipeline, d.bindings, params, d.groups)
        self._gate_up = None
        return True

    def scale(self, x, s: float) -> None:
        self._elementwise("unary", {1: x}, x.size, 0, float(s))

    def softcap(self, x, cap: float) -> None:
        self._elementwise("unary", {1: x}, x.size, 1, float(cap))

    def pos_scale(self, x, batch: AttentionBatch, length: int, scale: float, offset: float = 0.0) -> None:
        if length < 1:
            raise BackendError(f"pos_scale needs a length of at least 1, got {length}")
        self._elementwise("pos_scale", {1: x, 4: INPUTS}, x.size, x.shape[-1], self._input(batch.positions),
                          int(length), float(scale), float(offset))

    def kv_store(self, cache, k, v, batch: AttentionBatch) -> None:
        slots = np.asarray(batch.slots)
        n_slots = cache[0].shape[0]
        if self._recording is None and slots.size and (int(slots.min()) < 0 or int(slots.max()) >= n_slots):
            raise BackendError(f"KV slot out of range (cache has {n_slots} slots)")
        kd, vd = cache[0].shape[1], cache[1].shape[1]
        if self._stores_roped(cache, k, v, batch, slots):
            return
        self._dispatch("ops", "kv_store", {2: k, 3: v, 4: INPUTS, 5: cache[0], 10: cache[1]},
                       _params(len(slots), kd, self._input(slots), vd),
                       (-(-max(kd, vd) // 2 // 64), max(len(slots), 1), 1))

    def _stores_roped(self, cache, k, v, batch: AttentionBatch, slots: np.ndarray) -> bool:
        """Keys stored right after their rope (with the queries'): that dispatch stores them and
        the values too (ops.wgsl's rope_store: a workgroup a head, so that pairs of halves are
        whole in a thread)."""
        r, step = self._keys_roped, self._step()
        if (r is None or r[0] is not step or r[1] != len(step.dispatches) - 1 or r[2].buf is not k.buf
                or r[2].shape != k.shape or k.shape[0] != len(slots) or r[4] is not batch.positions
                or r[3] > ATT_MAX_D or r[3] % 2
                or k.shape[1] != cache[0].shape[1] or v.offset or tuple(v.shape) != (k.shape[0], cache[1].shape[1])
                or v.buf in (k.buf, cache[0].buf, cache[1].buf, dict(step.dispatches[-1].bindings)[1])):
            return False
        if self._products_store(cache, v, slots):
            return True
        d = step.dispatches.pop()
        params = d.params.copy()
        params[14], params[15] = self._input(slots), cache[1].shape[1]
        bindings = {**dict(d.bindings), 2: v.buf, 5: cache[0].buf, 10: cache[1].buf}
        norm = step.dispatches[-1] if step.dispatches else None
        if norm is not None and self._norms_heads(norm, d, k):  # the heads' norms taken in too
            step.dispatches.pop()
            nb = dict(norm.bindings)
            params[16:20] = 1, norm.params[3], norm.params[6], norm.params[4]
            bindings[6], bindings[7] = nb[3], nb[2]
        heads = int(params[1]) + int(params[13])
        self._dispatch("ops", "rope_store", bindings, params,
                       (heads + -(-cache[1].shape[1] // 2 // 64), max(batch.n_tokens, 1), 1))
        return True

    def _products_store(self, cache, v, slots: np.ndarray) -> bool:
        """Where the decode products that wrote the queries, keys and values are the dispatches right
        before their rope (the step's last), rope pairs are adjacent (not neox) and whole in a
        team's two rows: those products rotate the queries and keys and store the keys and values
        into the caches themselves (their "+kv" builds, matvec_kv.wgsl), the rope's dispatch gone.
        The queries and keys may share a product with the values or not (Q4_K_M's Q6_K values)."""
        step = self._step()
        made = self._mv_made[1] if self._mv_made is not None and self._mv_made[0] is step else None
        rope = step.dispatches[-1]
        rp = rope.params
        hd, n_rot, n = int(rp[2]), int(rp[3]), len(slots)
        if not self.kv_products or made is None or rp[4] or hd % 2 or n_rot % 2:
            return False
        rb = dict(rope.bindings)
        roles = {rb[1]: 0, rb[9]: 1, v.buf: 2}  # queries, keys, values
        widths = (int(rp[1]) * hd, int(rp[13]) * hd, cache[1].shape[1])
        if widths[1] != cache[0].shape[1] or widths[2] % 2:
            return False
        ends, seen, i = {}, set(), len(step.dispatches) - 2
        while len(seen) < 3:
            d, module, entry = made.get(i, (None, "", ""))
            if d is None or step.dispatches[i] is not d or d.params[13] or d.params[5] or int(d.params[2]) != n:
                return False
            p, b = d.params, dict(d.bindings)
            r1, r2, rows = int(p[7]), int(p[8]), int(p[0])
            spans, last = {}, -1  # role -> its rows (lo, hi) in this product, the roles in order
            for bind, lo, hi, stride in ((3, 0, r1, p[4]), (5, r1, r2, p[11]), (6, r2, rows, p[12])):
                if hi == lo:
                    continue
                role = roles.get(b.get(bind), -1)
                if role <= last or role in seen or hi - lo != widths[role] or int(stride) != widths[role] or lo % 2:
                    return False
                seen.add(role)
                spans[role] = lo, hi
                last = role
            # queries end where their rows end (0 without them: the rows start at 0); keys where theirs
            # end, else where the values start, else at the last row
            q_end = spans[0][1] if 0 in spans else 0
            k_end = spans[1][1] if 1 in spans else spans.get(2, (rows,))[0]
            ends[i] = (d, module, entry, q_end, k_end)
            i -= 1
        step.dispatches.pop()
        factors = rb[3] if rp[12] else self._dummy
        slot_off = self._input(slots)
        for i, (d, module, entry, q_end, k_end) in ends.items():
            params = d.params.copy()
            params[16:31] = (hd, n_rot, rp[5], slot_off, rp[6], rp[7], rp[8], rp[9], rp[10], rp[11], rp[12], q_end,
                             k_end, widths[1], widths[2])
            bindings = {**dict(d.bindings), 4: INPUTS, 11: factors, 12: cache[0].buf, 13: cache[1].buf}
            step.dispatches[i] = Dispatch(self.kernels.pipeline(module + _kernels.KV_BUILD, entry),
                                          tuple(sorted(bindings.items())), params, d.groups)
        return True

    def _norms_heads(self, norm: Dispatch, rope: Dispatch, k) -> bool:
        """Whether `norm` is the queries' and keys' per-head norms in place (rms_norm with rows past
        `rows`) of exactly the arrays the paired `rope` rotates."""
        nb, rb = dict(norm.bindings), dict(rope.bindings)
        hd, nq, nk = int(rope.params[2]), int(rope.params[1]), int(rope.params[13])
        return (norm.pipeline is self.kernels.pipeline("ops", "rms_norm") and bool(norm.params[2])
                and int(norm.params[0]) == hd and nb[1] is rb[1] and nb[9] is rb[9]
                and int(norm.params[1]) == k.shape[0] * nq and int(norm.params[5]) == k.shape[0] * nk)

    def copy_pages(self, layers, pairs, page_size: int) -> None:
        """Page dst of every layer's caches = page src, for each (src, dst) of pairs (no destination
        is another pair's source: KVCache.copy_pages runs those one at a time)."""
        pairs = np.ascontiguousarray(np.asarray(pairs, np.int32).reshape(-1, 2))
        n_pages = layers[0][0].shape[0] // page_size if layers else 0
        if pairs.size and (int(pairs.min()) < 0 or int(pairs.max()) >= n_pages):
            raise BackendError(f"page out of range (cache has {n_pages} pages)")
        if not pairs.size or not layers:
            return
        off = self._input(pairs)
        for cache in layers:
            for c in cache:
                words = page_size * c.shape[1] // 2
                self._dispatch("ops", "copy_pages", {4: INPUTS, 5: c}, _params(words, len(pairs), off),
                               (-(-words // 64), len(pairs), 1))
        if self._recording is None:
            self._flush()

    def _attn_flash(self, q, k_cache, v_cache, out, params, n, n_head, n_kv, hd_v, reach, batch) -> None:
        """attn_flash's tiles of query rows, each within a sequence (_flash_tiles: the grid has room
        for a tile more for each sequence); where they are few, each row's keys in chunks (a
        workgroup each, their partial softmaxes combined by attn_merge as decode's are)."""
        tp = FL_ROWS // (n_head // n_kv)
        tiles = -(-n // tp) + len(batch.block_tables)
        seq_rows = batch.seq_rows
        at = self._step().add_derived(("flash_tiles", seq_rows.__array_interface__["data"][0], n, tp, tiles),
                                      lambda: _flash_tiles(seq_rows, n, tp, tiles))
        chunk, chunks = _flash_chunks(n_kv * tiles, reach)
        fp = params.copy()
        fp[12], fp[13], fp[14], fp[15], fp[16] = tp, n, chunk, chunks, at
        bindings = {1: out, 2: q, 4: INPUTS, 6: k_cache, 7: v_cache}
        if chunk:
            bindings[9] = parts = self._attn_parts(params, chunk, chunks, n, n_head, hd_v)
        self._dispatch(f"ops+fl{-(-hd_v // 64)}", "attn_flash", bindings, fp, (n_kv, tiles, chunks))
        if chunk:
            self._attn_merge(out, parts, params, n, n_head, hd_v)

    def _attn_parts(self, params, chunk: int, chunks: int, n: int, n_head: int, hd_v: int):
        """The scratch of the (token, head, chunk) partial softmaxes (attn_part's layout: max, sum,
        then hd_v weighted values), the chunking set in attn_merge's params (12, 13)."""
        params[12], params[13] = chunk, chunks
        return self._scratch("attention", n * n_head * chunks * (hd_v + 2))

    def _attn_merge(self, out, parts, params, n: int, n_head: int, hd_v: int) -> None:
        """attn_merge: the chunks' partial softmaxes into out (and, for the next product, its int8
        blocks where a head is whole blocks)."""
        self._dispatch("ops", "attn_merge", {1: out, 4: INPUTS, 9: parts}, params, (n_head, n, 1))
        if hd_v % 32 == 0:
            self._note_norm_out(out, n, n_head * hd_v, (14, 15))

    def attention(self, q, cache, out, batch: AttentionBatch, n_head, n_kv_head, window, scale, softcap=0.0,
                  sinks: Weight | None = None):
        if sinks is not None:
            raise BackendError("the WebGPU backend has no attention sinks (gpt-oss): use the CPU backend")
        k_cache, v_cache = cache
        check_attention(k_cache, v_cache, batch, n_head, n_kv_head, self._recording is None)
        n = batch.n_tokens
        if not n:
            return
        tables = batch.block_tables
        hd_v = v_cache.shape[1] // n_kv_head
        params = _params(n_head, n_kv_head, k_cache.shape[1] // n_kv_head, hd_v,
                         tables.shape[1], batch.page_size, int(window), float(scale), float(softcap),
                         self._input(batch.positions), self._input(batch.seq_rows), self._input(tables))
        reach = tables.shape[1] * batch.page_size
        decode = n < 2 * len(tables)  # about a token a sequence: few keys' tiles shared by a query tile
        if self.row_products or (n * n_head >= ATT_SPLIT_BELOW and not decode) or reach <= ATT_CHUNK_MIN:
            group = n_head // n_kv_head
            if self.flash_attention and group <= FL_ROWS and not decode:
                self._attn_flash(q, k_cache, v_cache, out, params, n, n_head, n_kv_head, hd_v, reach, batch)
                return
            if not self.tile_attention:
                self._dispatch("ops", "attention", {1: out, 2: q, 4: INPUTS, 6: k_cache, 7: v_cache}, params,
                               (n_head, n, 1))
                return
            hp, tp = _attention_tile(n_head // n_kv_head, n, len(tables))
            params[12], params[13], params[14] = hp, tp, n
            self._dispatch("ops", "attn_tile", {1: out, 2: q, 4: INPUTS, 6: k_cache, 7: v_cache}, params,
                           (n_head // hp, -(-n // tp), 1))
            return
        # few (head, token) rows, or decode rows: their keys split into chunks, each a workgroup, merged after
        chunk, chunks = _split_chunks(n * n_head, reach)
        parts = self._attn_parts(params, chunk, chunks, n, n_head, hd_v)
        self._dispatch("ops", "attn_part", {2: q, 4: INPUTS, 6: k_cache, 7: v_cache, 9: parts}, params,
                       (n_head, n, chunks))
        self._attn_merge(out, parts, params, n, n_head, hd_v)


def _mmq_splits(tiles: int, runs: int) -> tuple[int, int]:
    """mmq's runs of 32 a split and splits where its `tiles` are under MMQ_MIN_GROUPS workgroups:
    enough splits of at least MMQ_MIN_RUNS runs to make MMQ_MIN_GROUPS; (runs, 1): no split."""
    want = min(-(-MMQ_MIN_GROUPS // tiles), runs // MMQ_MIN_RUNS)
    if want <= 1:
        return runs, 1
    per = -(-runs // want)
    return per, -(-runs // per)


def _split_chunks(rows: int, reach: int) -> tuple[int, int]:
    """attn_part's keys a chunk (whole multiples of ATT_CHUNK_MIN) and chunks covering the page
    table's reach for `rows` (head, token) rows: up to ATT_MAX_CHUNKS a row, fewer where the rows
    are many (about ATT_SPLIT_GROUPS workgroups in all)."""
    want = max(1, min(ATT_MAX_CHUNKS, -(-ATT_SPLIT_GROUPS // max(rows, 1))))
    chunk = ATT_CHUNK_MIN * -(-reach // (ATT_CHUNK_MIN * want))
    return chunk, -(-reach // chunk)


def _flash_tiles(seq_rows, n: int, tp: int, tiles: int) -> np.ndarray:
    """attn_flash's tile list, (tiles, 2) int32 (first token, tokens; (0, 0) past the last): each run
    of a sequence's consecutive tokens cut into tiles of tp. Runs that would need more tiles than
    the grid has (a sequence's tokens not together): tiles of tp tokens from 0, their sequences
    taking turns in the kernel."""
    rows = np.asarray(seq_rows)[:n]
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if n else np.zeros(0, np.int64)
    lengths = np.diff(np.r_[starts, n])
    counts = -(-lengths // tp)
    out = np.zeros((tiles, 2), np.int32)
    if counts.sum() > tiles:
        starts, lengths, counts = np.zeros(1, np.int64), np.array([n]), np.array([-(-n // tp)])
    first = np.repeat(starts, counts) + tp * (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    out[:len(first), 0] = first
    out[:len(first), 1] = np.minimum(tp, np.repeat(starts + lengths, counts) - first)
    return out


def _flash_chunks(groups: int, reach: int) -> tuple[int, int]:
    """attn_flash's keys a chunk and chunks where its grid of `groups` tiles is under FL_MIN_GROUPS:
    the page table's reach split into enough chunks of whole key tiles (at most ATT_MAX_CHUNKS, what
    attn_merge takes) to make FL_MIN_GROUPS workgroups; (0, 1): one pass a row."""
    want = min(ATT_MAX_CHUNKS, -(-FL_MIN_GROUPS // groups), -(-reach // FL_KEYS))
    if want <= 1:
        return 0, 1
    chunk = FL_KEYS * -(-reach // (FL_KEYS * want))
    return chunk, -(-reach // chunk)


def _attention_tile(group: int, n: int, n_seqs: int) -> tuple[int, int]:
    """attn_tile's rows: hp query heads of a kv group (the largest divisor of the group up to
    ATT_TILE_ROWS) times tp consecutive tokens; one token a tile where the step's sequences (its
    page tables' rows) have fewer than two tokens each (decode rows: a tile's tokens of different
    sequences take turns)."""
    hp = max(d for d in range(1, min(group, ATT_TILE_ROWS) + 1) if group % d == 0)
    tp = max(1, ATT_TILE_ROWS // hp)
    if tp > 1 and n < 2 * n_seqs:
        tp = 1
    return hp, tp


def _align(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def check_attention(k_cache, v_cache, batch: AttentionBatch, n_head: int, n_kv: int, positions: bool) -> None:
    """The kernel's contract, checked on the host (positions only where they are this step's)."""
    if n_kv < 1 or n_head % n_kv:
        raise BackendError(f"{n_head} query heads do not group into {n_kv} kv heads")
    hd_k, hd_v = k_cache.shape[1] // n_kv, v_cache.shape[1] // n_kv
    if hd_k % 2 or hd_v % 2 or hd_k > ATT_MAX_D or hd_v > ATT_MAX_D:
        raise BackendError(f"head sizes {hd_k}/{hd_v} are not supported by the WebGPU attention kernel "
                           f"(even, at most {ATT_MAX_D})")
    pos = np.asarray(batch.positions)
    reach = batch.block_tables.shape[1] * batch.page_size
    if positions and pos.size and (int(pos.min()) < 0 or int(pos.max()) >= reach):
        raise BackendError("a position lies beyond its sequence's page table")


def rope_scales(p: RopeParams) -> tuple[float, float, float]:
    """YaRN's magnitude scale and ramp bounds (ggml's), resolved on the host."""
    from ..reference import yarn_corr_dims

    mscale, low, high = p.attn_factor, 0.0, 0.0
    if p.ext_factor != 0.0:
        low, high = yarn_corr_dims(p)
        mscale *= 1.0 + 0.1 * math.log(1.0 / p.freq_scale)
    return mscale, float(low), float(high)
