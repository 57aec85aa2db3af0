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

import numpy as np

from ...quant import dequantize, widen_to_q8_0
from ...quant.legacy import WIDEN_TO_Q8_0
from ...quant.types import GGMLType, layout
from ..base import AttentionBatch, BackendError, RopeParams, Weight
from ._kernels import matmul_module
from ._ops import (
    ATT_HEADS,
    ATT_MAX_D,
    ATT_TILE_DIMS,
    MATRIX_TYPES,
    MV_MAX_ROWS,
    PROLOGUE_K,
    TOPK_MAX,
    TOPS_MAX,
    Add,
    CopyPages,
    AddRow,
    Attention,
    DeviceMatrix,
    GatedAct,
    GatherRows,
    GetRows,
    KvStore,
    Launch,
    Matmul,
    RmsNorm,
    Rope,
    RopeArgs,
    Scale,
    TopK,
    DECODE_TOKENS,
    MS_COUNTERS,
    MS_PART_FLOATS,
    MS_TOK,
    att_cluster_size,
    att_min_keys,
    matvec_rows,
    quantized,
    runs_contiguous,
    split_count,
    tile_pieces,
    tile_split_count,
    tops_k,
    tops_slices,
    xq_bytes,
)

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


class Backend:
    name = "cuda"
    max_recorded_tokens = 4096  # prompt-sized steps are captured as graphs too: eager, each op is a Python call
    pads_decode_steps = True  # decode steps of 9..64 sequences cost about the same padded to 16, 32 or 64

    def __init__(self, device: str = "cuda", threads: int | None = None, graphs: bool | None = None,
                 fuse: bool | None = None, tails: bool | None = None, pdl: bool | None = None):
        cp = self.cp = import_cupy()
        index = device_index(device)
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, no device, or a driver older than CuPy's toolkit
            raise BackendError(f"no usable CUDA GPU: {e}") from None
        if index >= count:
            raise BackendError(f"CUDA device {index} does not exist ({count} visible)")
        self.device = cp.cuda.Device(index)
        self.device.use()
        from ._kernels import Kernels
        from ._staging import InputRing

        self.kernels = Kernels(cp, self.device)
        for module in ("ops", "attention", "sample"):  # every model's first token needs them
            self.kernels.prefetch(module)
        self.n_threads = 1  # host threads: the GPU does the work
        self.n_sm = int(self.device.attributes["MultiProcessorCount"])
        self.graphs = os.environ.get("EMBER_CUDA_GRAPHS", "1") != "0" if graphs is None else graphs
        self.fuse = os.environ.get("EMBER_CUDA_FUSE", "1") != "0" if fuse is None else fuse
        # Fused products' tails (their last block does the layer's row-wide norms): "post" (default)
        # where they take over a post-norm and residual add, "all" also for plain residual products,
        # "0" never (norms as quant_x launches). tails=True/False mean "all"/"0".
        mode = os.environ.get("EMBER_CUDA_TAILS", "post") if tails is None else ("all" if tails else "0")
        if mode not in ("post", "all", "0"):
            raise BackendError(f"EMBER_CUDA_TAILS must be post, all or 0, not '{mode}'")
        self.tails = mode
        # a decode product's blocks normalise and quantize x themselves; "0": a quant_x launch first
        self.prologue = os.environ.get("EMBER_CUDA_PROLOGUE", "1") != "0"
        self.prologue_k = int(os.environ.get("EMBER_CUDA_PROLOGUE_K", PROLOGUE_K))
        self.mv_occ = os.environ.get("EMBER_CUDA_MV_OCC", "auto")
        self.mv_wide = os.environ.get("EMBER_CUDA_MV_WIDE", "1") != "0"
        self.mv_persist = os.environ.get("EMBER_CUDA_MV_PERSIST", "1") != "0"
        # one-row products of 1 MiB or more but fewer blocks than multiprocessors widen their teams
        # (fill_team_log2); "0": they keep them
        self.mv_fill = os.environ.get("EMBER_CUDA_MV_FILL", "1") != "0"
        # one-row products that only store y: a kernel of their own, the generic one's other paths left out
        self.mv_store = os.environ.get("EMBER_CUDA_MV_STORE", "1") != "0"
        # the other one-row products on kernels compiled for their own paths (an experiment; off:
        # H200 decode steps SmolLM2 0.754 -> 0.832 ms, Gemma 3 0.828 -> 0.850 with it)
        self.mv_spec = os.environ.get("EMBER_CUDA_MV_SPEC", "0") == "1"
        # products over matrices of several types that Q8_0 holds exactly (Q4_0, Q5_0, Q8_0) take
        # Q8_0 copies of them, one launch instead of one per type (see _widened); "0": never
        self.widen = os.environ.get("EMBER_CUDA_WIDEN", "1") != "0"
        # one-row products: a lane's first weight slices decoded before the kernel waits for x;
        # "auto": types of 32-value blocks on mv_n1 (see Matmul._pre)
        self.mv_pre = os.environ.get("EMBER_CUDA_MV_PRE", "auto")
        if self.mv_pre not in ("0", "1", "auto"):
            raise BackendError(f"EMBER_CUDA_MV_PRE must be 0, 1 or auto, not '{self.mv_pre}'")
        # products normalising x themselves: up to this many lane steps so (1 or 2)
        steps = os.environ.get("EMBER_CUDA_MV_PRE_STEPS", "2")
        if steps not in ("1", "2"):
            raise BackendError(f"EMBER_CUDA_MV_PRE_STEPS must be 1 or 2, not '{steps}'")
        self.mv_pre_steps = int(steps)
        # weight rows per block of the tensor-core products: 128, 64, or auto (64 where 128 would
        # not give two blocks per multiprocessor; H200, pp512: SmolLM2 64.8k -> 68.7k tokens/s,
        # Gemma 3 270M 56.6k -> 59.7-62.7k)
        self.tile_rows = os.environ.get("EMBER_CUDA_TILE_ROWS", "auto")
        if self.tile_rows not in ("128", "64", "auto"):
            raise BackendError(f"EMBER_CUDA_TILE_ROWS must be 128, 64 or auto, not '{self.tile_rows}'")
        # activation rows up to which products take the matrix-vector kernels (8 or 64)
        rows = os.environ.get("EMBER_CUDA_MV_ROWS", str(MV_MAX_ROWS))
        if not rows.isdigit() or not 1 <= int(rows) <= MV_MAX_ROWS:
            raise BackendError(f"EMBER_CUDA_MV_ROWS must be a number of rows from 1 to {MV_MAX_ROWS}, not '{rows}'")
        self.mv_rows = int(rows)
        # products of 9..64 activation rows of quantized weights (batched decode) split k over
        # blocks of tensor-core tiles (mm_split: compute capability 8.0+, CUDA); "0": the
        # matrix-vector kernels in groups of 8 rows and mm_tile take them
        self.mm_split = (os.environ.get("EMBER_CUDA_MM_SPLIT", "1") != "0" and not self.kernels.hip
                         and int(self.device.compute_capability) >= 80)
        # decode attention's key-range splits: blocks for this many per multiprocessor
        waves = os.environ.get("EMBER_CUDA_ATT_WAVES", "2")
        if not waves.isdigit() or not 1 <= int(waves) <= 64:
            raise BackendError(f"EMBER_CUDA_ATT_WAVES must be a number from 1 to 64, not '{waves}'")
        self.att_waves = int(waves)
        # steps with many tokens per sequence (prompts) take tensor-core attention tiles (compute
        # capability 8.0+, CUDA, head dims 64/128/256); "0": the scalar kernel for every step
        self.att_tiles = (os.environ.get("EMBER_CUDA_ATT_TILES", "1") != "0" and not self.kernels.hip
                          and int(self.device.compute_capability) >= 80)
        if self.att_tiles:  # a module per head size: the model's own is among them (small modules)
            for hd in ATT_TILE_DIMS:
                self.kernels.prefetch(f"attention_tile{hd}")
        # their key ranges split over several blocks where the pieces alone would leave the GPU
        # idle (merged by attn_combine); "0": one block per piece
        self.att_tile_splits = os.environ.get("EMBER_CUDA_ATT_TILE_SPLITS", "1") != "0"
        # batched decode steps (more than DECODE_TOKENS sequences of one token each) take the tiles
        # too, one piece per token; "0": the split-K kernel with the folded qkv_post
        self.att_tiles_decode = os.environ.get("EMBER_CUDA_ATT_TILES_DECODE", "1") != "0"
        # decode steps of up to DECODE_TOKENS tokens on the split-K kernel: one block per query head
        # (and split), each with a share of the work a block of the kv head's whole group did;
        # "0": a block per kv head and group of up to 8 query heads
        self.att_head_blocks = os.environ.get("EMBER_CUDA_ATT_HEAD_BLOCKS", "1") != "0"
        # decode attention's last split block merges the splits (else an attn_combine launch)
        self.att_merge = os.environ.get("EMBER_CUDA_ATT_MERGE", "1") != "0"
        # merged splits hold at least this many positions: a short key range takes fewer blocks,
        # and a split alone needs no merge; "auto": what one pass of a block takes (att_min_keys)
        min_keys = os.environ.get("EMBER_CUDA_ATT_MIN_KEYS", "auto")
        if not (min_keys.isdigit() or min_keys == "auto"):
            raise BackendError(f"EMBER_CUDA_ATT_MIN_KEYS must be a number of positions or auto, not '{min_keys}'")
        self.att_min_keys = None if min_keys == "auto" else int(min_keys)
        # merged decode splits of a short key range form a thread-block cluster of this many blocks
        # and merge through distributed shared memory (compute capability 9.0+, CUDA); "auto": 8
        # where that covers 256 positions in splits of the minimum size, else 16 (heads of 128 and
        # 256 values); "0": the last split block merges through global memory for every range
        cluster = os.environ.get("EMBER_CUDA_ATT_CLUSTER", "auto")
        if cluster not in ("0", "8", "16", "auto"):
            raise BackendError(f"EMBER_CUDA_ATT_CLUSTER must be 0, 8, 16 (blocks) or auto, not '{cluster}'")
        self.att_cluster = (cluster if not self.kernels.hip and int(self.device.compute_capability) >= 90
                            else "0")
        # greedy rows reduced by many blocks per row (k <= 8); "0": one block per row
        self.sliced_top_k = os.environ.get("EMBER_CUDA_SLICED_TOPK", "1") != "0"
        self.graph_error: str | None = None
        self._ring = InputRing(cp)
        self._recording = None
        self._scratch: dict[str, object] = {}
        self._xq: dict[tuple, object] = {}  # (address, shape) of an activation -> its quantized copy
        self._counters: list = []  # device uint32 pools; tails take one entry each
        self._counter_at = 0
        self._threads_using = {threading.get_ident()}
        self._capture_stream = None
        # Programmatic dependent launch inside captured steps (Hopper+, see _launch.py)
        self.pdl_error: str | None = None
        self._launcher = None
        if (os.environ.get("EMBER_CUDA_PDL", "1") != "0") if pdl is None else pdl:
            from ._launch import load_launcher

            self._launcher, self.pdl_error = load_launcher(cp, self.device)
        else:
            self.pdl_error = "switched off"

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
                "graphs": self.graphs, "tails": self.tails, "pdl": self._launcher is not None,
                "kernel_cache": str(_kernel_cache())}

    def supports(self, qtype: GGMLType) -> bool:
        return qtype in MATRIX_TYPES

    # ---- memory ----
    def weight(self, tensor) -> Weight:
        shape = tuple(tensor.shape)
        if len(shape) == 1:  # norm weights, biases, rope factors: small, kept as f32
            values = dequantize(tensor.data, tensor.type).astype(np.float32)
            return Weight(tensor.name, tensor.type, shape, self.cp.asarray(values))
        if tensor.type not in MATRIX_TYPES or len(shape) != 2:
            raise BackendError(f"tensor '{tensor.name}' has type {tensor.type.name} and shape {shape}, which the "
                               "CUDA backend cannot compute with")
        if shape[1] % 32:
            raise BackendError(f"tensor '{tensor.name}' has rows of {shape[1]} values; the CUDA kernels need a "
                               "multiple of 32")
        self.kernels.prefetch(matmul_module(tensor.type))  # compiles while the weights upload
        if shape[0] > 4096:  # a one-row product of so many rows likely takes mv_n1_occ (Matmul._occ)
            self.kernels.prefetch(matmul_module(tensor.type, "mv_n1_occ"))
        if self.mv_store:  # products storing y alone (Matmul._spec): decode steps' second kernel of the type
            self.kernels.prefetch(matmul_module(tensor.type, "mv_n1_spec", 0))
        self.kernels.prefetch_later(matmul_module(tensor.type, "mv_n8"))  # batched decode: after the rest
        raw = np.asarray(tensor.data)
        buf = self.cp.zeros(raw.nbytes + WEIGHT_PADDING, np.uint8)  # a memset: no kernel to compile
        buf[:raw.nbytes].set(raw)
        row_bytes = layout(tensor.type).row_bytes(shape[1])
        return Weight(tensor.name, tensor.type, shape, DeviceMatrix(buf, row_bytes))

    def empty(self, shape, dtype=np.float32):
        return self.cp.empty(shape, dtype)

    def from_numpy(self, a: np.ndarray):
        return self.cp.asarray(a)

    def to_numpy(self, a) -> np.ndarray:
        if self._recording is not None:
            return self._recording.download(self.cp, a)
        return self.cp.asnumpy(a)

    def kv_cache(self, n_slots: int, k_dim: int, v_dim: int):
        # zero-filled so that unwritten slots are finite
        return self.cp.zeros((n_slots, k_dim), np.float16), self.cp.zeros((n_slots, v_dim), np.float16)

    def synchronize(self) -> None:
        self.cp.cuda.Stream.null.synchronize()

    # ---- recording ----
    @contextlib.contextmanager
    def record(self):
        """Ops are recorded, not run; when the block ends they are fused, captured as a graph and
        replayed once (nothing in the block may read an op's output: downloads are filled by the
        replay). Running them as they come as well cost a first step half its recording time
        again (H200: 30-50 ms to record a step of SmolLM2, ~20 of it running the ops one by one)."""
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

        if self.fuse:
            counter = self._new_counter if self.tails != "0" else None
            ops = fuse(rec.ops, counter, residual_tails=self.tails == "all")
        else:
            ops = rec.ops
        rec.n_ops_fused = len(ops)
        rec.launches = [launch for op in (*rec.uploads, *ops, *rec.downloads) for launch in op.launches(self.kernels)]
        # Early launches only for decode-sized steps: in a prompt-sized step the tile products run
        # in several waves of blocks, and successors' blocks waiting on the SMs slow their later
        # waves (H200: pp512 66.6k -> 55.3k tokens/s with them). mm_split's blocks fit in one wave.
        early = not any(isinstance(op, Matmul) and not op.matvec() and not op.split() for op in ops)
        if self.graphs and self.graph_error is None:
            try:
                rec.graph = self._capture(rec.launches, early)
            except Exception as e:  # e.g. ROCm: replays then run the launches from Python
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

    async_replay = True  # replay(wait=False) returns once the step is queued on the device
    # get_rows takes ids from the best ids of the step before, on the device: a decode step may be
    # launched before the host has read the one before it (the engine's ahead steps)
    chains_tokens = True

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
        buf = self._scratch.get(name)
        if buf is None or buf.size < size:  # recordings keep the old buffer alive
            buf = self.cp.empty(max(size, 2 * (buf.size if buf is not None else 0)), np.float32)
            self._scratch[name] = buf
        return buf[:size]

    # ---- ops ----
    def get_rows(self, w: Weight, ids, out, prev=None, bans=None) -> None:
        """prev: (rows, k) int32 on the device, the best ids of the step before (chains_tokens):
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
        n, k = x.shape
        ws = self._widened(ws)
        rows = min(matvec_rows(w.type, self.mv_rows) for w in ws) if ws else 8
        split = {}
        if self.mm_split and n > 8 and all(quantized(w.type) for w in ws):
            rows = min(rows, 8)
            split = dict(split_rows=MS_TOK, part=self._scratch_f32("mm_split_part", MS_PART_FLOATS),
                         counters=self._zeroed_u32("mm_split_counters", MS_COUNTERS))
        decode = 0 < n <= rows
        self._run(Matmul(list(ws), x, list(outs), xq=self._xq_for(x) if decode else None, mv_rows=rows,
                         prologue=self.prologue, prologue_k=self.prologue_k, mv_occ=self.mv_occ,
                         mv_wide=self.mv_wide, mv_fill=self.mv_fill, mv_persist=self.mv_persist,
                         mv_store=self.mv_store, mv_spec=self.mv_spec, mv_pre=self.mv_pre,
                         mv_pre_steps=self.mv_pre_steps,
                         tile_rows=self.tile_rows, n_sm=self.n_sm, **split))

    def _widened(self, ws: list[Weight]) -> list[Weight]:
        """ws, or Q8_0 copies of them (made once, kept beside the originals) where they are of
        several types that Q8_0 holds exactly and the copies add at most WIDEN_MAX_BYTES to what
        the product reads: one launch instead of one per type. Gemma 3 270M's layers with Q8_0
        values beside Q5_0 queries and keys: on an H200 its decode step 0.795 -> 0.670 ms (112
        -> 102 launches), tg128 1310 -> 1533 tok/s."""
        if not self.widen or not widens(ws):
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

    def scale(self, x, s: float) -> None:
        self._run(Scale(x, float(s)))

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
        self._run(KvStore(k, v, k_cache, v_cache, self._input(batch.slots, np.int64)))

    def attention(self, q, cache, out, batch: AttentionBatch, n_head, n_kv_head, window, scale, softcap=0.0):
        k_cache, v_cache = cache
        check_attention(q, k_cache, v_cache, batch, n_head, n_kv_head)
        n, (n_seq, max_pages) = q.shape[0], batch.block_tables.shape
        hd_k, hd_v = k_cache.shape[1] // n_kv_head, v_cache.shape[1] // n_kv_head
        rows = np.asarray(batch.seq_rows)
        # decode steps: a recording's fusion may then fold the KV-cache write into the attention
        # (the engine replays such a recording only for steps of one token per sequence)
        single = 0 < n <= n_seq and np.unique(rows).size == n
        tiles = (self.att_tiles and (not single or (self.att_tiles_decode and n > DECODE_TOKENS))
                 and hd_k == hd_v in ATT_TILE_DIMS and runs_contiguous(rows))
        group, max_ctx = n_head // n_kv_head, max_pages * batch.page_size
        if tiles:
            blocks = tile_pieces(n, group, n_seq) * n_kv_head * -(-group // ATT_HEADS)
            n_split = tile_split_count(blocks, hd_k, max_ctx, self.n_sm, single) if self.att_tile_splits else 1
        hpb = 1 if self.att_head_blocks and not tiles and n <= DECODE_TOKENS else ATT_HEADS
        if not tiles:
            n_split = split_count(n, n_kv_head, group, max_ctx, self.n_sm, self.att_waves, hpb)
        merge = not tiles and n_split > 1 and self.att_merge
        min_keys = att_min_keys(hd_v) if self.att_min_keys is None else self.att_min_keys
        cluster = att_cluster_size(self.att_cluster, min_keys) if merge and hd_v % 32 == 0 else 0
        if cluster:  # whole clusters of splits
            n_split = -(-n_split // cluster) * cluster
        part = self._scratch_f32("attn_part", n * n_head * n_split * (hd_v + 2)) if n_split > 1 else None
        counters = self._zeroed_u32("attn_counters", n * n_kv_head * -(-group // hpb)) if merge else None
        self._run(Attention(q, k_cache, v_cache, out, part, self._input(batch.positions, np.int32),
                            self._input(batch.seq_rows, np.int32), self._input(batch.block_tables, np.int32),
                            batch.page_size, n_head, n_kv_head, int(window), float(scale), float(softcap), n_split,
                            one_token_per_seq=bool(single), tiles=bool(tiles), heads_per_block=hpb,
                            counters=counters, cluster=cluster, min_keys=min_keys))

    # ---- sampling reductions (not yet part of the Backend protocol) ----
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
        if k <= TOPS_MAX and self.sliced_top_k:
            size = n * tops_slices(vocab) * tops_k(k)
            self._run(TopK(logits, k, ids, vals, self._scratch_f32("tops_v", size),
                           self._scratch_f32("tops_i", size).view(np.int32), self._zeroed_u32("tops_count", n)))
        else:
            self._run(TopK(logits, k, ids, vals))


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
