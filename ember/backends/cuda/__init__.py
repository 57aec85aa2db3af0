"""CUDA backend: CUDA C kernels compiled at run time (NVRTC through CuPy), weights on the GPU in
their GGUF block layout, a paged f16 KV cache, and decode steps replayed as CUDA graphs (on
Hopper and later with programmatic dependent launch between their kernels: _launch.py).

Needs CuPy (`pip install ember[cuda]`) and an NVIDIA GPU; under CuPy's ROCm build the same
kernel sources compile with hipRTC (graph capture is then skipped and recorded steps replay their
launches from Python). Importing this module needs neither: `Backend()` says what is missing.

Device memory: the weights take about the file's size (no dequantized copy; 1-D tensors such
as norm weights are kept as f32); activations are f32; the KV cache is f16.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from dataclasses import replace

import numpy as np

from ...quant import dequantize, widen_to_q8_0
from ...quant.legacy import WIDEN_TO_Q8_0
from ...quant.types import GGMLType, layout
from ..base import KV_TYPES, AttentionBatch, BackendError, Capabilities, KVLayer, RopeParams, Weight
from ._kernels import ATT_TILE_DIMS, matmul_module
from .config import CudaConfig
from .ops import (MATRIX_TYPES, Add, AddRow, CopyPages, DeviceMatrix, GatedAct, GatherRows, Gelu, GetRows, KvStore,
                  LayerNorm, Launch, Matmul, PosScale, RmsNorm, Rope, RopeArgs, Scale, Softcap, SplitScratch, Tanh, TopK,
                  quantized, xq_bytes)
from .ops.kvquant import ATTQ_MAX_D, AttentionQ, Hadamard, KvStoreQ
from .ops.attention import ATT_MAX_D, Attention, AttentionStep, AttentionTarget, plan_attention, runs_contiguous
from .ops.base import i32, i64, ptr
from .ops.experts import (EG_MAX_EXPERTS, EXPERT_TYPES, MXFP4_RUN, ROUTE_MAX_EXPERTS, ExpertBias,
                          ExpertMatmul, ExpertScratch, ExpertSum, RouteExperts, SwigluOai, device_row_bytes,
                          experts_module, tile_bound)
from .ops.matmul import BLAS_W_VALUES, MS_COUNTERS, MS_PART_FLOATS, XS_TYPES, BlasGemm, BlasScratch, mv_rows_for
from .ops.sample import TOPK_MAX, TOPS_MAX, tops_k, tops_slices

__all__ = ["Backend", "CudaConfig", "check_attention"]

WEIGHT_PADDING = 64  # bytes past a matrix's end: the block decoders may read one word beyond
WIDEN_MAX_BYTES = 1 << 20  # more bytes a product may read for taking one launch (~0.25 us of HBM)


def widens(ws: list[Weight]) -> bool:
    """Whether a product over ws takes Q8_0 copies (Backend._widened): several types, each one
    that Q8_0 holds exactly, and at most WIDEN_MAX_BYTES more to read."""
    types = {w.type for w in ws}
    if len(types) < 2 or not types <= set(WIDEN_TO_Q8_0):
        return False
    q8 = layout(GGMLType.Q8_0)
    return sum(w.shape[0] * (q8.row_bytes(w.shape[1]) - layout(w.type).row_bytes(w.shape[1])) for w in ws) \
        <= WIDEN_MAX_BYTES


def import_cupy():
    """CuPy, or a BackendError saying how to get it."""
    os.environ.setdefault("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "ember", "kernels", "cupy"))
    try:
        import cupy
    except ImportError as e:
        raise BackendError(f"the CUDA backend needs CuPy (pip install 'ember[cuda]'): {e}") from None
    return cupy


def device_index(device: str) -> int:
    _, _, index = device.partition(":")
    if not index:
        return 0
    if not index.isdigit():
        raise BackendError(f"bad CUDA device '{device}': expected cuda or cuda:N")
    return int(index)


def open_device(cp, device: str):
    """The CUDA device named "cuda" or "cuda:N", made current."""
    index = device_index(device)
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device, or a driver older than CuPy's toolkit
        raise BackendError(f"no usable CUDA GPU: {e}") from None
    if index >= count:
        raise BackendError(f"CUDA device {index} does not exist ({count} visible)")
    dev = cp.cuda.Device(index)
    dev.use()
    return dev


class Backend:
    name = "cuda"
    # top_k, record/replay, copy_pages and get_rows(prev=, bans=) below; prompt-sized steps are
    # captured as graphs too (eager, each op is a Python call); replay(wait=False) returns once the
    # step is queued (mark/wait_mark), so the engine launches greedy decode steps ahead, their
    # tokens taken from the best ids of the step before on the device; decode steps of 9..64
    # sequences cost about the same padded to 16, 32 or 64
    capabilities = Capabilities(top_k=True, record=True, max_recorded_tokens=4096, overlap=True, chain_tokens=True,
                                pad_decode_steps=True, copy_pages=True, kv_types=frozenset(KV_TYPES.values()))

    def __init__(self, device: str = "cuda", threads: int | None = None, config: CudaConfig | None = None):
        from ._kernels import Kernels
        from ._staging import InputRing

        self.cp = import_cupy()
        self.device = open_device(self.cp, device)
        self.config = config or CudaConfig()
        self.kernels = Kernels(self.cp, self.device)
        self.n_threads = 1  # host threads: the GPU does the work
        self.n_sm = int(self.device.attributes["MultiProcessorCount"])
        cc = int(self.device.compute_capability)
        self.tensor_cores = not self.kernels.hip and cc >= 80  # mma.sync tiles: mm_split, attn_tile
        self.attention_target = AttentionTarget(self.n_sm, tiles=self.tensor_cores,
                                                clusters=not self.kernels.hip and cc >= 90,
                                                waves=self.config.att_waves)
        self._prefetch_first_modules()
        self.graph_error: str | None = None
        self._ring = InputRing(self.cp)
        self._recording = None
        self._scratch: dict[str, object] = {}
        self._xq: dict[tuple, object] = {}  # (address, shape) of an activation -> its quantized copy
        self._counters: list = []  # device uint32 pools; tails take one entry each
        self._counter_at = 0
        self._threads_using = {threading.get_ident()}
        self._capture_stream = None
        self._launcher, self.pdl_error = self._load_launcher()
        self._blas = None  # _blas.Blas, made by the first product that takes the BLAS route
        self.blas_error: str | None = None

    @property
    def graphs(self) -> bool:
        return self.config.graphs

    @property
    def fuse(self) -> bool:
        return self.config.fuse

    def _prefetch_first_modules(self) -> None:
        """Start compiling what every model's first token needs (a module per attention tile size:
        the model's own is among them)."""
        for module in ("ops", "attention", "sample"):
            self.kernels.prefetch(module)
        if self.tensor_cores:
            for hd in ATT_TILE_DIMS:
                self.kernels.prefetch(f"attention_tile{hd}")

    def _load_launcher(self):
        """Programmatic dependent launch inside captured steps (Hopper+, see _launch.py): the
        launcher, or None and why not."""
        if not self.config.pdl:
            return None, "switched off"
        from ._launch import load_launcher

        return load_launcher(self.cp, self.device)

    # ---- description ----
    def describe(self) -> dict:
        """What `ember info --system` can show: the GPU, its memory, the toolchain."""
        props = self.cp.cuda.runtime.getDeviceProperties(self.device.id)
        free, total = self.device.mem_info
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return {"backend": self.name, "device": self.device.id, "name": name,
                "compute_capability": self.device.compute_capability, "multiprocessors": self.n_sm,
                "memory_total_gib": round(total / 2**30, 1), "memory_free_gib": round(free / 2**30, 1),
                "cupy": self.cp.__version__, "cuda_runtime": self.cp.cuda.runtime.runtimeGetVersion(),
                "graphs": self.graphs, "fuse": self.fuse, "pdl": self._launcher is not None,
                "blas_error": self.blas_error,
                "kernel_cache": str(_kernel_cache())}

    def supports(self, qtype: GGMLType) -> bool:
        return qtype in MATRIX_TYPES

    # ---- memory ----
    def weight(self, tensor, streamed: bool = True) -> Weight:
        shape = tuple(tensor.shape)
        if len(shape) == 1:  # norm weights, biases, rope factors: small, kept as f32
            values = dequantize(tensor.data, tensor.type).astype(np.float32)
            return Weight(tensor.name, tensor.type, shape, self.cp.asarray(values))
        types = EXPERT_TYPES if len(shape) == 3 else MATRIX_TYPES  # 3: stacked experts (experts.cu)
        if tensor.type not in types or len(shape) not in (2, 3):
            raise BackendError(f"tensor '{tensor.name}' has type {tensor.type.name} and shape {shape}, which the "
                               "CUDA backend cannot compute with")
        if shape[-1] % 32 and not (tensor.type == GGMLType.F32 and len(shape) == 2):  # f32 rows: expert biases
            raise BackendError(f"tensor '{tensor.name}' has rows of {shape[-1]} values; the CUDA kernels need a "
                               "multiple of 32")
        if len(shape) == 3:
            self.kernels.prefetch(experts_module(tensor.type))
        else:
            self._prefetch_matrix_modules(tensor.type, shape[0])
        raw = np.asarray(tensor.data).reshape(-1)  # the bytes, whatever shape the caller's array has
        if tensor.type == GGMLType.MXFP4:  # stacked experts only (EXPERT_TYPES): regrouped on the device
            return Weight(tensor.name, tensor.type, shape, self._mxfp4_stack(raw, shape))
        buf = self.cp.zeros(raw.nbytes + WEIGHT_PADDING, np.uint8)  # a memset: no kernel to compile
        buf[:raw.nbytes].set(raw)
        row_bytes = layout(tensor.type).row_bytes(shape[-1])
        return Weight(tensor.name, tensor.type, shape, DeviceMatrix(buf, row_bytes))

    def _mxfp4_stack(self, raw: np.ndarray, shape: tuple) -> DeviceMatrix:
        """MXFP4 experts in the layout unit_q reads: GGUF's 17-byte units regrouped in runs of 16
        with aligned codes (ops.cu mxfp4_regroup), from a copy of the file's bytes freed after."""
        rows, k = int(np.prod(shape[:-1])), shape[-1]
        row_bytes = device_row_bytes(GGMLType.MXFP4, k)
        src = self.cp.empty(raw.nbytes, np.uint8)
        src.set(raw)
        buf = self.cp.zeros(rows * row_bytes + WEIGHT_PADDING, np.uint8)
        slots = rows * -(-(k // 32) // MXFP4_RUN) * MXFP4_RUN
        Launch(self.kernels.fn("ops", "mxfp4_regroup"), (-(-slots // 256), 1, 1), (256, 1, 1),
               (ptr(src), ptr(buf), i64(rows), i32(k // 32), i64(row_bytes))).run()
        del src  # (the launch is ordered before any later use of the pool's memory)
        return DeviceMatrix(buf, row_bytes)

    def _prefetch_matrix_modules(self, qtype: GGMLType, rows: int) -> None:
        """Compile a weight type's kernels while the weights upload."""
        self.kernels.prefetch(matmul_module(qtype))
        if rows > 4096:  # a one-row product of so many rows likely takes mv_n1_occ (MvGeometry.occ)
            self.kernels.prefetch(matmul_module(qtype, "mv_n1_occ"))
        if rows >= 2048 and qtype in XS_TYPES:  # or mv_xs, on large matrices
            self.kernels.prefetch(matmul_module(qtype, "mv_xs"))
        self.kernels.prefetch(matmul_module(qtype, "mv_n1_store"))  # products storing y alone
        self.kernels.prefetch_later(matmul_module(qtype, "mv_n8"))  # batched decode: after the rest

    def settle(self) -> None:  # the weights were copied to the device as they came
        pass

    def empty(self, shape, dtype=np.float32):
        return self.cp.empty(shape, dtype)

    def from_numpy(self, a: np.ndarray):
        return self.cp.asarray(a)

    def to_numpy(self, a) -> np.ndarray:
        if self._recording is not None:
            return self._recording.download(self.cp, a)
        return self.cp.asnumpy(a)

    def kv_cache(self, n_slots: int, k_dim: int, v_dim: int, k_type=GGMLType.F16, v_type=GGMLType.F16):
        # zero-filled so that unwritten slots are finite; f16 as f16 (the tuned kernels), else rows of bytes
        return KVLayer(self._kv_rows(n_slots, k_dim, k_type), self._kv_rows(n_slots, v_dim, v_type), k_type, v_type)

    def _kv_rows(self, n_slots: int, dim: int, t: GGMLType):
        if t == GGMLType.F16:
            return self.cp.zeros((n_slots, dim), np.float16)
        if dim % layout(t).block_size:
            raise BackendError(f"a {t.name} KV cache needs rows of whole {layout(t).block_size}-value blocks, got {dim}")
        return self.cp.zeros((n_slots, layout(t).row_bytes(dim)), np.uint8)

    def synchronize(self) -> None:
        self.cp.cuda.Stream.null.synchronize()

    # ---- recording ----
    @contextlib.contextmanager
    def record(self):
        """Ops are recorded, not run; when the block ends they are fused, captured as a graph and
        replayed once (nothing in the block may read an op's output: downloads are filled by the
        replay), which also spares a first step running its ops one by one."""
        from ._staging import Recording

        rec = self._recording = Recording(run_now=False)
        try:
            yield rec
        finally:
            self._recording = None
        self._finish(rec)
        self.replay(rec)

    def _finish(self, rec) -> None:
        from ._fuse import fuse

        ops = fuse(rec.ops, self._new_counter) if self.fuse else rec.ops
        rec.n_ops_fused = len(ops)
        rec.launches = [launch for op in (*rec.uploads, *ops, *rec.downloads) for launch in op.launches(self.kernels)]
        # Early launches only for decode-sized steps: in a prompt-sized step the tile products run
        # in several waves of blocks, and successors' blocks waiting on the SMs slow their later
        # waves. mm_split's blocks fit in one wave.
        early = not any(isinstance(op, Matmul) and not op.matvec() and not op.split() for op in ops)
        if self.graphs and self.graph_error is None:
            try:
                rec.graph = self._capture(rec.launches, early)
            except Exception as e:  # e.g. ROCm: replays then run the launches from Python
                if any(isinstance(launch, BlasGemm) for launch in rec.launches) and self.blas_error is None:
                    # a cuBLAS that cannot be captured: this step replays from Python, later
                    # products take the tiles, and graphs stay on for every other step
                    self.blas_error = f"capturing a cuBLAS call failed: {type(e).__name__}: {e}"
                else:
                    self.graph_error = f"{type(e).__name__}: {e}"

    def _capture(self, launches, early: bool = True):
        if self._launcher is not None and early:
            try:
                return self._capture_with(launches, self._launcher)
            except Exception as e:  # an older driver, say: capture the ordinary way from now on
                self.pdl_error = f"{type(e).__name__}: {e}"
                self._launcher = None
        return self._capture_with(launches, None)

    def _capture_with(self, launches, launcher):
        """The launches as one graph; with a launcher, each kernel that follows a kernel may start
        before that one ends (its wait is inside the kernel)."""
        cp = self.cp
        if self._capture_stream is None:
            self._capture_stream = cp.cuda.Stream(non_blocking=True)
        stream = self._capture_stream
        cp.cuda.Stream.null.synchronize()
        with stream:
            stream.begin_capture()
            try:
                after_kernel = False
                for launch in launches:
                    kernel = isinstance(launch, Launch)
                    if kernel and min(launch.grid) == 0:
                        continue  # empty work launches nothing
                    if launcher is not None and kernel:
                        launcher.launch(launch, stream.ptr, programmatic=after_kernel)
                    else:
                        launch.run()
                    after_kernel = kernel
            finally:
                graph = stream.end_capture()
        graph.upload(cp.cuda.Stream.null)
        return graph

    def mark(self):
        """A point in the device's queue (everything queued so far), for wait_mark."""
        self._use_device()
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record(self.cp.cuda.Stream.null)
        return ev

    def wait_mark(self, ev) -> None:
        """Until the work queued before mark() returned `ev` has finished."""
        ev.synchronize()

    def replay(self, rec, wait: bool = True) -> None:
        """Run a recorded step; wait=False returns once it is queued: its outputs hold, and its
        inputs may be written for another step, after synchronize()."""
        self._use_device()
        rec.stage_inputs()
        null = self.cp.cuda.Stream.null
        if rec.graph is not None:
            rec.graph.launch(null)
        else:
            for launch in rec.launches:
                launch.run()
        if wait:
            null.synchronize()

    # ---- helpers ----
    def _use_device(self) -> None:
        ident = threading.get_ident()
        if ident not in self._threads_using:  # the current device is per thread (the engine has its own)
            self.device.use()
            self._threads_using.add(ident)

    def _run(self, op) -> None:
        self._use_device()
        rec = self._recording
        if rec is None or rec.run_now:
            for launch in op.launches(self.kernels):
                launch.run()
        if rec is not None:
            rec.ops.append(op)

    def _input(self, a, dtype):
        """A host int array of the step on the device (uploaded once while its values hold)."""
        if isinstance(a, self.cp.ndarray):
            return a.astype(dtype, copy=False)
        a = np.asarray(a)
        if self._recording is not None:
            if a.dtype != dtype or not a.flags.c_contiguous:
                # a converted copy's memory would not see the values written for later steps
                raise BackendError(f"a recorded step needs contiguous {np.dtype(dtype).name} inputs, got {a.dtype}")
            return self._recording.upload(self.cp, a)
        return self._ring.upload(np.ascontiguousarray(a, dtype))

    def _xq_for(self, x):
        """The buffer holding activation x (n, k) quantized for the decode products: one per
        activation buffer, so that a producer and the product reading x agree on it."""
        key = (x.data.ptr, tuple(x.shape))
        buf = self._xq.get(key)
        if buf is None:
            buf = self._xq[key] = self.cp.empty(xq_bytes(*x.shape), np.uint8)
        return buf

    def _new_counter(self):
        """A zeroed device counter of its own for one fused tail (zero again after each launch)."""
        pool_size = 4096
        if not self._counters or self._counter_at == pool_size:
            self._counters.append(self.cp.zeros(pool_size, np.uint32))
            self._counter_at = 0
        self._counter_at += 1
        return self._counters[-1][self._counter_at - 1:self._counter_at]

    def _zeroed_u32(self, name: str, size: int):
        """Counters that kernels leave at zero after each launch (zeroed once here)."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < size:  # recordings keep the old buffer alive
            buf = self.cp.zeros(max(size, 2 * (buf.size if buf is not None else 0), 64), np.uint32)
            self._scratch[name] = buf
        return buf[:size]

    def _scratch_f32(self, name: str, size: int):
        return self._scratch_typed(name, size, np.float32)

    def _scratch_typed(self, name: str, size: int, dtype):
        buf = self._scratch.get(name)
        if buf is None or buf.size < size:  # recordings keep the old buffer alive
            buf = self.cp.empty(max(size, 2 * (buf.size if buf is not None else 0)), dtype)
            self._scratch[name] = buf
        return buf[:size]

    # ---- ops ----
    def get_rows(self, w: Weight, ids, out, prev=None, bans=None) -> None:
        """prev: (rows, k) int32 on the device, the best ids of the step before (chain_tokens):
        an id -r - 1 takes the first of row r's not in its row of bans (n, k), as the engine's
        greedy choice would."""
        rows = w.shape[0]
        ids_h = np.asarray(ids)
        low = -len(prev) if prev is not None else 0
        if ids_h.size and (int(ids_h.min()) < low or int(ids_h.max()) >= rows):
            raise BackendError(f"token id out of range for '{w.name}' ({rows} rows)")
        if prev is None:
            self._run(GetRows(w, self._input(ids, np.int32), out))
            return
        k = prev.shape[1]
        if tuple(np.shape(bans)) != (len(ids_h), k):
            raise BackendError(f"get_rows of {len(ids_h)} ids after best ids of {k} a row needs "
                               f"({len(ids_h)}, {k}) bans")
        self._run(GetRows(w, self._input(ids, np.int32), out, prev, k, self._input(bans, np.int32)))

    def matmul(self, w: Weight, x, out) -> None:
        self.matmuls([w], x, [out])

    def matmuls(self, ws: list[Weight], x, outs: list) -> None:
        for w, out in zip(ws, outs):
            if len(w.shape) != 2 or w.shape[1] != x.shape[1] or out.shape != (x.shape[0], w.shape[0]):
                raise BackendError(f"cannot multiply {x.shape} by '{w.name}' {w.shape} into {out.shape}")
            if w.shape[1] % 32:
                raise BackendError(f"'{w.name}' has rows of {w.shape[1]} values; the CUDA products need a multiple of 32")
        n = x.shape[0]
        ws = self._widened(ws)
        split = self.tensor_cores and n > 8 and all(quantized(w.type) for w in ws)
        rows = mv_rows_for(ws, self.config, split)
        buf = SplitScratch(self._scratch_f32("mm_split_part", MS_PART_FLOATS),
                           self._zeroed_u32("mm_split_counters", MS_COUNTERS)) if split else None
        op = Matmul(list(ws), x, list(outs), xq=self._xq_for(x) if 0 < n <= rows else None, mv_rows=rows,
                    split_buf=buf, cfg=self.config, n_sm=self.n_sm)
        if op.wants_blas():
            op = replace(op, blas_buf=self._blas_scratch(ws, x))
        self._run(op)

    def _blas_scratch(self, ws: list[Weight], x) -> BlasScratch | None:
        """The BLAS route's buffers for a product over ws (None where cuBLAS cannot be had: ROCm,
        or the library missing; the tiles serve then)."""
        if self._blas is None and self.blas_error is None:
            if self.kernels.hip:
                self.blas_error = "ROCm"
            else:
                from ._blas import Blas

                try:
                    self._blas = Blas(self.cp)
                except Exception as e:
                    self.blas_error = f"{type(e).__name__}: {e}"
        if self._blas is None:
            return None
        n, k = x.shape
        w_values = min(BLAS_W_VALUES, max(w.shape[0] for w in ws) * k)
        return BlasScratch(self._blas, self._scratch_typed("blas_w", w_values, np.float16),
                           self._scratch_typed("blas_x", n * k, np.float16), self._scratch_typed("blas_inv", n, np.float32))

    def _widened(self, ws: list[Weight]) -> list[Weight]:
        """ws, or Q8_0 copies of them (made once, kept beside the originals) where they are of
        several types that Q8_0 holds exactly and the copies add at most WIDEN_MAX_BYTES to what
        the product reads: one launch instead of one per type (Gemma 3's Q5_0 queries and keys
        beside Q8_0 values)."""
        if not widens(ws):
            return ws
        return [self._wide_copy(w) if w.type != GGMLType.Q8_0 else w for w in ws]

    def _wide_copy(self, w: Weight) -> Weight:
        """w as Q8_0, made once and kept with w's device matrix (and freed with it)."""
        copy = w.data.copies.get(GGMLType.Q8_0)
        if copy is None:
            rows, row_bytes = w.shape[0], layout(GGMLType.Q8_0).row_bytes(w.shape[1])
            raw = self.cp.asnumpy(w.data.buf[:rows * w.data.row_bytes]).reshape(rows, w.data.row_bytes)
            wide = widen_to_q8_0(raw, w.type)
            buf = self.cp.zeros(wide.nbytes + WEIGHT_PADDING, np.uint8)
            buf[:wide.nbytes].set(wide.reshape(-1))
            copy = w.data.copies[GGMLType.Q8_0] = Weight(w.name, GGMLType.Q8_0, w.shape, DeviceMatrix(buf, row_bytes))
        return copy

    # ---- mixture of experts (ops/experts.py) ----
    def route_experts(self, logits, k: int, norm: bool, ids, weights) -> None:
        n, n_expert = logits.shape
        if not 1 <= k <= n_expert <= ROUTE_MAX_EXPERTS:
            raise BackendError(f"routing needs 1 <= k <= experts <= {ROUTE_MAX_EXPERTS}, got k={k} of {n_expert}")
        self._run(RouteExperts(logits, k, bool(norm), ids, weights))

    def expert_matmuls(self, ws: list[Weight], x, ids, outs: list) -> None:
        n, k = ids.shape
        for w, out in zip(ws, outs):
            if len(w.shape) != 3 or w.shape[2] != x.shape[1] or x.shape[0] not in (n, n * k) \
                    or out.shape != (n * k, w.shape[1]):
                raise BackendError(f"cannot multiply {x.shape} by experts '{w.name}' {w.shape} into {out.shape}")
        n_expert = ws[0].shape[0]
        if any(w.shape[0] != n_expert for w in ws) or n_expert > EG_MAX_EXPERTS:
            raise BackendError(f"grouped expert products need one expert count of at most {EG_MAX_EXPERTS}, "
                               f"got {[w.shape[0] for w in ws]}")
        x_div = 1 if x.shape[0] == n * k else k
        self._run(ExpertMatmul(list(ws), x, x_div, ids, list(outs), self._expert_scratch(x, ids.size, n_expert),
                               self.config.moe_mv_tokens))

    def _expert_scratch(self, x, n_sel: int, n_expert: int) -> ExpertScratch:
        """The grouped products' buffers, shared by every product (each fills them before reading)."""
        def words(name: str, size: int):
            return self._scratch_f32(name, max(size, 1)).view(np.int32)

        return ExpertScratch(xq=self._scratch_f32("experts_xq", -(-xq_bytes(*x.shape) // 4)).view(np.uint8),
                             order=words("experts_order", n_sel),
                             tiles=words("experts_tiles", 4 * tile_bound(n_sel, n_expert)).reshape(-1, 4),
                             n_tiles=words("experts_n_tiles", 1))

    def expert_sum(self, y, weights, out) -> None:
        self._run(ExpertSum(y, weights, out))

    def expert_bias(self, y, b: Weight, ids) -> None:
        if tuple(y.shape) != (ids.size, b.shape[1]):
            raise BackendError(f"expert biases '{b.name}' {b.shape} do not fit rows {y.shape} of {ids.size} selections")
        self._run(ExpertBias(y, b, ids))

    def swiglu_oai(self, gate, up, out, alpha: float, limit: float) -> None:
        self._run(SwigluOai(gate, up, out, float(alpha), float(limit)))

    def gather_rows(self, x, rows, out) -> None:
        self._run(GatherRows(x, self._input(rows, np.int32), out))

    def add_bias(self, x, b: Weight) -> None:
        self._run(AddRow(x, b.data))

    def rms_norm(self, x, w, eps, out) -> None:
        d = w.shape[-1] if w is not None else x.shape[-1]
        self._run(RmsNorm(x, w.data if w is not None else None, float(eps), out, d))

    def rope(self, x, n_head: int, batch: AttentionBatch, p: RopeParams) -> None:
        if p.n_rot % 2 or p.n_rot > min(512, x.shape[-1] // n_head):
            raise BackendError(f"rotary dimension {p.n_rot} does not fit heads of {x.shape[-1] // n_head}")
        self._run(Rope(x, n_head, self._input(batch.positions, np.int32), rope_args(p)))

    def silu_mul(self, gate, up, out) -> None:
        self._run(GatedAct("silu", gate, up, out))

    def gelu_mul(self, gate, up, out) -> None:
        self._run(GatedAct("gelu", gate, up, out))

    def add(self, a, b, out) -> None:
        self._run(Add(a, b, out))

    def layer_norm(self, x, w, b, eps, out) -> None:
        self._run(LayerNorm(x, w.data if w is not None else None, b.data if b is not None else None, float(eps), out))

    def gelu(self, x, out) -> None:
        self._run(Gelu(x, out))

    def tanh(self, x) -> None:
        self._run(Tanh(x))

    def scale(self, x, s: float) -> None:
        self._run(Scale(x, float(s)))

    def softcap(self, x, cap: float) -> None:
        self._run(Softcap(x, float(cap)))

    def pos_scale(self, x, batch: AttentionBatch, length: int, scale: float, offset: float = 0.0) -> None:
        if length < 1:
            raise BackendError(f"pos_scale needs a length of at least 1, got {length}")
        self._run(PosScale(x, self._input(batch.positions, np.int32), int(length), float(scale), float(offset)))

    def copy_pages(self, layers, pairs, page_size: int) -> None:
        """Page dst of every layer's caches = page src, for each (src, dst) of pairs, in one launch
        per layer (CuPy's own indexing would compile a kernel on first use: a stall mid-serving).
        Pairs run together, so no destination may be another pair's source (KVCache.copy_pages
        runs those one at a time)."""
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        n_pages = layers[0][0].shape[0] // page_size if layers else 0
        if pairs.size and (int(pairs.min()) < 0 or int(pairs.max()) >= n_pages):
            raise BackendError(f"page out of range (cache has {n_pages} pages)")
        if pairs.size and layers:
            self._run(CopyPages(list(layers), self._input(pairs, np.int32), page_size))

    def kv_store(self, cache, k, v, batch: AttentionBatch) -> None:
        k_cache, v_cache = cache
        slots = np.asarray(batch.slots)
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= k_cache.shape[0]):
            raise BackendError(f"KV slot out of range (cache has {k_cache.shape[0]} slots)")
        if _quantized_kv(cache):
            k, v = self._rotation("rot_k", k, cache.k_rot), self._rotation("rot_v", v, cache.v_rot)
            self._run(KvStoreQ(k, v, k_cache, v_cache, self._input(batch.slots, np.int64), cache.k_type, cache.v_type))
            return
        self._run(KvStore(k, v, k_cache, v_cache, self._input(batch.slots, np.int64)))

    def attention(self, q, cache, out, batch: AttentionBatch, n_head, n_kv_head, window, scale, softcap=0.0,
                  sinks=None):
        k_cache, v_cache = cache
        sinks = self._sinks(sinks, n_head)
        if _quantized_kv(cache):
            self._attention_q(q, cache, out, batch, n_head, n_kv_head, window, scale, softcap, sinks)
            return
        check_attention(q, k_cache, v_cache, batch, n_head, n_kv_head)
        step = attention_step(q, k_cache, v_cache, batch, n_head, n_kv_head)
        plan = plan_attention(self.attention_target, step)
        part = self._scratch_f32("attn_part", plan.part_floats(step)) if plan.n_split > 1 else None
        counters = self._zeroed_u32("attn_counters", plan.counters(step)) if plan.merge else None
        self._run(Attention(q, k_cache, v_cache, out, part, self._input(batch.positions, np.int32),
                            self._input(batch.seq_rows, np.int32), self._input(batch.block_tables, np.int32),
                            batch.page_size, n_head, n_kv_head, int(window), float(scale), float(softcap),
                            plan.n_split, one_token_per_seq=step.single, tiles=plan.tiles,
                            heads_per_block=plan.heads_per_block, counters=counters, cluster=plan.cluster,
                            min_keys=plan.min_keys, sinks=sinks))

    @staticmethod
    def _sinks(sinks: Weight | None, n_head: int):
        """The attention sinks' device vector (n_head,), or None."""
        if sinks is None:
            return None
        if tuple(sinks.shape) != (n_head,):
            raise BackendError(f"attention sinks must be {n_head} values (one per query head), got shape "
                               f"{tuple(sinks.shape)}")
        return sinks.data  # 1-D weights are held as f32 on the device

    def _attention_q(self, q, cache: KVLayer, out, batch: AttentionBatch, n_head, n_kv_head, window, scale, softcap,
                     sinks=None):
        """Attention over caches of other types than f16: one kernel reading the rows in place."""
        if n_kv_head < 1 or n_head % n_kv_head or max(q.shape[1], out.shape[1]) // n_head > ATTQ_MAX_D:
            raise BackendError(f"attention over a {cache.k_type.name}/{cache.v_type.name} KV cache takes grouped "
                               f"heads of at most {ATTQ_MAX_D} values")
        q = self._rotation("rot_q", q, cache.k_rot)
        self._run(AttentionQ(q, cache.k, cache.v, out, self._input(batch.positions, np.int32),
                             self._input(batch.seq_rows, np.int32), self._input(batch.block_tables, np.int32),
                             batch.page_size, n_head, n_kv_head, int(window), float(scale), float(softcap),
                             cache.k_type, cache.v_type, sinks))
        if cache.v_rot:
            self._run(Hadamard(out, out, cache.v_rot))  # back from the values' rotation

    def _rotation(self, name: str, x, block: int):
        """x rotated in blocks of `block` values into a scratch buffer (x itself where block is 0)."""
        if not block:
            return x
        out = self._scratch_f32(name, x.size).reshape(x.shape)
        self._run(Hadamard(x, out, block))
        return out

    # ---- sampling reductions (capabilities.top_k) ----
    def top_k(self, logits, k: int, ids, vals) -> None:
        """ids (n, k) int32 and vals (n, k) f32 = the k largest logits of each row of logits (n, vocab),
        best first, computed on the device (k = 1: the argmax, lowest id among equal values).
        k <= TOPK_MAX; which of several values equal to the k-th largest are kept is unspecified."""
        n, vocab = logits.shape
        if not 1 <= k <= min(TOPK_MAX, vocab):
            raise BackendError(f"top_k needs 1 <= k <= {min(TOPK_MAX, vocab)}, got {k}")
        if tuple(ids.shape) != (n, k) or tuple(vals.shape) != (n, k) or ids.dtype != np.int32:
            raise BackendError(f"top_k of ({n}, {vocab}) logits needs ({n}, {k}) int32 ids and f32 values")
        if not n:
            return
        self.kernels.prefetch("sample")
        if k <= TOPS_MAX:
            size = n * tops_slices(vocab) * tops_k(k)
            self._run(TopK(logits, k, ids, vals, self._scratch_f32("tops_v", size),
                           self._scratch_f32("tops_i", size).view(np.int32), self._zeroed_u32("tops_count", n)))
        else:
            self._run(TopK(logits, k, ids, vals))


def _quantized_kv(cache) -> bool:
    return isinstance(cache, KVLayer) and (cache.k_type != GGMLType.F16 or cache.v_type != GGMLType.F16)


def check_attention(q, k_cache, v_cache, batch: AttentionBatch, n_head: int, n_kv: int) -> None:
    """The kernel's contract, checked on the host (positions only on direct runs' values)."""
    if n_kv < 1 or n_head % n_kv:
        raise BackendError(f"{n_head} query heads do not group into {n_kv} kv heads")
    hd_k, hd_v = k_cache.shape[1] // n_kv, v_cache.shape[1] // n_kv
    if hd_k % 8 or hd_v % 2 or hd_k > ATT_MAX_D or hd_v > ATT_MAX_D:
        raise BackendError(f"head sizes {hd_k}/{hd_v} are not supported by the CUDA attention kernel "
                           f"(multiples of 8 and 2, at most {ATT_MAX_D})")
    pos = np.asarray(batch.positions)
    tables = batch.block_tables
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= tables.shape[1] * batch.page_size):
        raise BackendError("a position lies beyond its sequence's page table")


def attention_step(q, k_cache, v_cache, batch: AttentionBatch, n_head: int, n_kv: int) -> AttentionStep:
    """A step's attention shape. Decode steps (every token the only one of its sequence) may fold
    the KV-cache write into the attention in a recording (the engine replays such a recording
    only for steps of one token per sequence)."""
    n, (n_seq, max_pages) = q.shape[0], batch.block_tables.shape
    rows = np.asarray(batch.seq_rows)
    single = bool(0 < n <= n_seq and np.unique(rows).size == n)
    return AttentionStep(n, n_seq, max_pages * batch.page_size, n_head, n_kv, k_cache.shape[1] // n_kv,
                         v_cache.shape[1] // n_kv, single, bool(runs_contiguous(rows)))


def rope_args(p: RopeParams) -> RopeArgs:
    """ggml's rope parameters resolved: YaRN's ramp bounds and the magnitude scale."""
    from ..reference import yarn_corr_dims

    mscale, low, high = p.attn_factor, 0.0, 0.0
    if p.ext_factor != 0.0:
        low, high = yarn_corr_dims(p)
        mscale *= 1.0 + 0.1 * math.log(1.0 / p.freq_scale)
    return RopeArgs(p.n_rot, p.neox, p.freq_base, p.freq_scale, p.ext_factor, mscale, float(low), float(high),
                    p.freq_factors)


def _kernel_cache():
    from ._kernels import cache_dir

    return cache_dir()
