"""The CUDA backend's ops as small records, each turning itself into kernel launches.

The backend builds one record per op call and runs its launches at once; while a step is
recorded it also keeps the records, so that `_fuse` can merge neighbours and the merged list can
be captured into a CUDA graph. Records refer to device arrays (CuPy), never to host data: step
inputs were uploaded before the record was made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...quant.types import GGMLType, layout
from ._kernels import ATT_TILE_DIMS, matmul_module

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
QUANT_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K,
               GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS)
MATRIX_TYPES = frozenset(FLOAT_TYPES + QUANT_TYPES)
PAIRED_SLICES = (GGMLType.Q4_K, GGMLType.Q5_K)  # SPL = 2 in matmul.cu
PRE_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0)  # see Matmul._pre
PRE_SPEC_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K)  # on mv_n1_spec only (raw bytes held: see Matmul._pre)

MV_MAX_ROWS = 64  # activation rows up to which products take the matrix-vector kernels (in groups of 8)
DECODE_TOKENS = 8  # attention of steps up to this many tokens: four threads per key (few keys per split)
MV_THREADS, MVQ_THREADS = 128, 256
MODE_STORE, MODE_RESIDUAL, MODE_SILU, MODE_GELU = 0, 1, 2, 3
# mv_n1_spec's paths (matmul.cu SPEC_*)
SPEC_PRO, SPEC_PRO_RES, SPEC_GATED, SPEC_ACT_Q, SPEC_RES, SPEC_TAIL = 1, 2, 4, 8, 16, 32
ATT_HEADS, ATT_MAX_D = 8, 256
ATT_VPRE = 8  # attn: values a thread loads with the first chunk's keys


def att_min_keys(hd_v: int) -> int:
    """Positions a merged split of a decode step holds at least: as many as one pass takes at
    once, keys (32 at four threads a key) and values (ATT_VPRE per group of threads over the
    value pairs). H200, a decode step at a context of ~130: SmolLM2 (head 64: 32) 0.855 ->
    0.818 ms; Gemma 3 (head 256) with 32 went 1.013 -> 1.116 ms (its single group of threads
    then loads a split's values in four rounds), hence 8 there."""
    groups = max(1, 128 // max(1, hd_v // 2))
    return min(32, groups * ATT_VPRE)


def att_cluster_size(setting, min_keys: int) -> int:
    """Blocks of a decode attention cluster (attn_cluster<8|16>; 0: none) for EMBER_CUDA_ATT_CLUSTER's
    setting ("0", "8", "16", "auto"; an int is taken as it is). auto: 8 where they cover 256
    positions in splits of min_keys, else 16. H200, decode step at a context of ~130 (against
    the global merge, 0.746 / 0.885 ms): SmolLM2 (head 64, 32 keys) 8: 0.674 ms, 16: 0.697;
    Gemma 3 (head 256, 8 keys) 8: 0.810, 16: 0.776."""
    if setting == "auto":
        return 8 if 8 * min_keys >= 256 else 16
    return int(setting)


u64, i32, i64, f32 = np.uint64, np.int32, np.int64, np.float32


@dataclass(frozen=True)
class DeviceMatrix:
    """A weight matrix on the device in its GGUF block layout (Weight.data of this backend)."""

    buf: Any  # CuPy uint8 (rows * row_bytes + padding,)
    row_bytes: int
    copies: dict = field(default_factory=dict, compare=False, repr=False)  # derived forms (Backend._widened)


def ptr(a) -> np.uint64:
    """Device address of a CuPy array (or 0 for None), as a kernel argument."""
    return u64(0) if a is None else u64(a.data.ptr)


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


# Types whose matrix-vector kernels beat the tensor-core tiles up to MV_MAX_ROWS activation rows
# (a batched decode step: the tiles' few blocks wait on memory). Measured on an H200 at 64 rows:
# Q4_1 18 vs 29 us, Q5_0 22 vs 27 us per product; the K-quants and Q8_0 decode too much per slice
# (Q4_K 286 vs 54 us), so they take the tiles past 8 rows.
BATCH_MV_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1)


def matvec_rows(qtype: GGMLType, limit: int = MV_MAX_ROWS) -> int:
    """Activation rows up to which products of this type take the matrix-vector kernels."""
    return limit if qtype in BATCH_MV_TYPES else min(limit, 8)


# mm_split (matmul.cu): products of 9..64 activation rows, quantized weights, k split over blocks
MS_ROWS, MS_TOK, MS_CH, MS_THREADS = 64, 64, 8, 256
MS_LD = 32 * MS_CH + 8
MS_MAX_SPLITS = 8
MS_MIN_UNITS = 4  # 32-value units a split takes at least (the K types: a super-block, 8)
MS_PART_FLOATS = 4 << 20  # the shared partial-sum buffer (16 MB); products needing more take mm_tile
MS_COUNTERS = 8192  # tile counters (row tiles x matrices of a launch); products needing more take mm_tile


def split_plan(units: int, upb: int, tiles: int, n_sm: int) -> tuple[int, int]:
    """(splits, units per split) of a mm_split launch with `tiles` row tiles over all its matrices:
    enough blocks for two per multiprocessor where k allows, each split at least MS_MIN_UNITS
    units (whole GGUF blocks of upb units), at most MS_MAX_SPLITS."""
    step = max(upb, MS_MIN_UNITS)
    most = max(1, min(MS_MAX_SPLITS, units // step))
    want = 2 * n_sm // max(1, tiles)
    if want > 1:  # splitting anyway: a split of one chunk (MS_CH units) walks no chunk after another
        want = max(want, -(-units // MS_CH))
    want = max(1, min(most, want))
    ups = -(-units // want)
    ups = -(-ups // upb) * upb  # whole blocks
    return -(-units // ups), ups


def split_smem(qtype: GGMLType) -> tuple[int, int]:
    """(span, dynamic shared memory) of mm_split for a type: span = one chunk of a row's raw
    bytes plus 15 of alignment, in 16s; 16 bytes of slack past the last row (word reads)."""
    lay = layout(qtype)
    upb = lay.block_size // 32
    chunk = -(-MS_CH // upb) * lay.type_size
    span = 16 * -(-(chunk + 15) // 16)
    return span, 2 * MS_TOK * MS_LD * 2 + MS_ROWS * span + 16


def disjoint(a, b) -> bool:
    """Whether two device arrays share no byte."""
    return a.data.ptr + a.nbytes <= b.data.ptr or b.data.ptr + b.nbytes <= a.data.ptr


def quantized(qtype: GGMLType) -> bool:
    return qtype not in FLOAT_TYPES


def xq_bytes(n: int, k: int) -> int:
    """Bytes of n activation rows of k values quantized for the decode products: int8 values,
    then a float4 (scale, half-sums) per 32 values."""
    return n * k + n * (k // 32) * 16


QX_CHUNK = 256  # values of a row a quant_x block writes (it sums the whole row's squares)
PROLOGUE_SMEM = 48 * 1024  # dynamic shared memory a product's prologue may take (no opt-in needed)
PROLOGUE_K = 2048  # longest rows a product's blocks normalise themselves by default (see Matmul.in_prologue)
PROLOGUE_MAX_K = 2048  # and at most: 8 values a lane in registers (matmul.cu PRO_REG) at 256 threads a block

TARGET_WARPS = 2048  # warps in flight that keep HBM busy (about 16 per multiprocessor of an H100/H200)


def team_log2(k: int, teams: int = 1 << 30, wide: bool = False) -> int:
    """Lanes per pair of output rows: about four 32-value slices per lane, 4 to 32 lanes; for long
    rows of few teams, up to a block of 128 lanes while that keeps two slices per lane, so that
    enough warps stream the matrix. wide: products of fewer warps than that also widen teams of
    under a warp while every lane keeps a slice (shorter chains, more blocks)."""
    slices = k // 32
    tl = min(5, max(2, (max(1, math.ceil(slices / 4)) - 1).bit_length()))
    while wide and tl < 5 and teams * (1 << tl) // 32 < TARGET_WARPS and slices >= 2 << tl:
        tl += 1
    while tl == 5 or 5 < tl < 7:
        if teams * (1 << tl) // 32 >= TARGET_WARPS or slices < 2 * (2 << tl):
            break
        tl += 1
    return tl


MV_FILL_MIN_BYTES = 1 << 20  # one-row products of at least these weight bytes widen their teams to fill the GPU


def fill_team_log2(tl: int, steps: int, teams: int, threads: int, n_sm: int) -> int:
    """tl, widened up to a warp a team while the product's blocks (threads / 2^tl teams each) are
    fewer than the multiprocessors and half a team's lanes still get a lane step of the `steps` a
    row has: a one-row product of few rows then spreads over the whole GPU, every multiprocessor
    reading its share of the weights, instead of some reading twice as much and others idle.
    Taken by products of at least MV_FILL_MIN_BYTES: H200, the 1.5 B model's q/k/v and o products
    (1.8 and 1.3 MB in Q4_K) 472 -> 429 us a step, its step 1.176 -> 1.134 ms; SmolLM2's and
    Gemma 3's (under 0.5 MB, where the more blocks' own prologues and the wider sums cost more
    than the spread saves) made their steps slower, 0.679 -> 0.699 and 0.675 -> 0.697 ms."""
    while tl < 5 and -(-teams // (threads >> tl)) < n_sm and steps >= 1 << tl:  # half of 2^(tl+1) lanes
        tl += 1
    return tl


def _pad4(xs: list, fill) -> list:
    return list(xs) + [fill] * (4 - len(xs))


# ---- matrix products ----

@dataclass(frozen=True)
class Tail:
    """Row-wide work done by the last block of a single-matrix decode product (rows of d = its
    output width): res += y (y normalised by post_w first and overwritten, when add), then res
    normalised by pre_w into pre_h (f32) and pre_q (quantized, or None) for the next product."""

    counter: Any  # device uint32 (1,), zero between launches
    res: Any
    add: bool = False
    post_w: Any = None
    post_eps: float = 0.0
    pre_w: Any = None
    pre_eps: float = 0.0
    pre_h: Any = None
    pre_q: Any = None

    def kernel_args(self) -> tuple:
        return (ptr(self.counter), ptr(self.res), i32(int(self.add)), ptr(self.post_w), f32(self.post_eps),
                ptr(self.pre_w), f32(self.pre_eps), ptr(self.pre_h), ptr(self.pre_q))


NO_TAIL_ARGS = (u64(0), u64(0), i32(0), u64(0), f32(0), u64(0), f32(0), u64(0), u64(0))


@dataclass(eq=False)
class Matmul:
    """outs[j] (n, rows_j) = x (n, k) @ ws[j].T for matrices sharing x.

    Decode path (n <= 8): quantized types read x from xq (n, k quantized: xq_bytes), which a
    quant_x launch fills first unless a producer already did (quant_in False). Fusions (recorded
    steps only): x = RMS-norm of src (rows idx of src when idx is set) by norm_w, done by that
    quant_x launch; the result added into aux (MODE_RESIDUAL), or act(outs[0]) * outs[1]
    written to aux (gated modes) and quantized into act_q; a Tail."""

    ws: list  # Weight (data: DeviceMatrix)
    x: Any
    outs: list
    xq: Any = None  # device uint8 (xq_bytes(n, k),); needed on the decode path by quantized types
    quant_in: bool = True
    src: Any = None
    idx: Any = None  # device int32 (n,)
    norm_w: Any = None
    eps: float = 0.0
    mode: int = MODE_STORE
    aux: Any = None
    act_q: Any = None
    tail: Tail | None = None
    # residual prologue (see MvArgs in matmul.cu): src is the residual r, first made r + RMS norm of
    # pro_y by pro_post_w; the last block through its prologue writes r back (pro_counter)
    pro_y: Any = None
    pro_post_w: Any = None
    pro_post_eps: float = 0.0
    pro_counter: Any = None
    pro_yout: Any = None  # where the post-normed y goes, or None (nothing reads it)
    mv_rows: int = MV_MAX_ROWS  # the backend's limit for the matrix-vector path
    prologue: bool = True  # a norm may be done by the product's own blocks (see in_prologue)
    prologue_k: int = PROLOGUE_K  # the longest rows they normalise (past 1024: blocks of 256 threads)
    mv_wide: bool = True  # team_log2's wide rule (see there)
    mv_fill: bool = True  # one activation row: teams widened until the blocks cover the GPU (fill_team_log2)
    mv_occ: str = "auto"  # one activation row: mv_n1_occ "1" always, "0" never, "auto" (see _occ)
    mv_persist: bool = True  # one activation row: a grid that fits the GPU walks more blocks of teams (_matvec)
    mv_store: bool = True  # one activation row that only stores y: mv_n1_spec of no paths (see _spec)
    mv_spec: bool = False  # one activation row otherwise on mv_n1: mv_n1_spec for its paths (see _spec)
    # one activation row: a lane's first slices decoded before the kernel waits for x ("1", "0",
    # or "auto": see _pre); with a norm prologue, up to mv_pre_steps lane steps so (see _pre_steps)
    mv_pre: str = "auto"
    mv_pre_steps: int = 2
    tile_rows: str = "auto"  # weight rows per tile block: "128", "64", or "auto" (see _tile)
    n_sm: int = 132
    # mm_split for mv_rows < n <= split_rows (0: never); its partial sums and tile counters
    split_rows: int = 0
    part: Any = None  # device f32 (MS_PART_FLOATS,), shared by every product of the backend
    counters: Any = None  # device uint32, zeros between launches

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def k(self) -> int:
        return self.x.shape[1]

    @property
    def needs_xq(self) -> bool:
        return any(quantized(w.type) for w in self.ws)

    def groups(self) -> list[list[int]]:
        """Indices of ws grouped by type, at most four to a launch."""
        by_type: dict = {}
        for j, w in enumerate(self.ws):
            by_type.setdefault(w.type, []).append(j)
        return [idx[i:i + 4] for idx in by_type.values() for i in range(0, len(idx), 4)]

    def matvec(self, kernels=None) -> bool:
        return self.n <= self.mv_rows

    def split(self) -> bool:
        """Whether the product takes mm_split (a batched decode step of quantized weights)."""
        if not (self.mv_rows < self.n <= min(self.split_rows, MS_TOK)) or self.part is None:
            return False
        if not all(quantized(w.type) for w in self.ws) or self.norm_w is not None:
            return False
        for g in self.groups():
            tiles, n_split, _, floats = self._split_geometry(g)
            # products of many row tiles fill the GPU as mm_tile (H200, 64 rows: the SmolLM2 head
            # 44 us as mm_tile, 68 as mm_split)
            if tiles * len(g) >= 2 * self.n_sm or floats > self.part.size:
                return False
            if floats and tiles * len(g) > self.counters.size:
                return False
        return True

    def _split_geometry(self, group: list[int]) -> tuple[int, int, int, int]:
        """(row tiles, splits, units per split, partial floats) of one launch."""
        ws = [self.ws[j] for j in group]
        tiles = -(-max(w.shape[0] for w in ws) // MS_ROWS)
        upb = layout(ws[0].type).block_size // 32
        n_split, ups = split_plan(self.k // 32, upb, tiles * len(ws), self.n_sm)
        gated = self.mode in (MODE_SILU, MODE_GELU)
        floats = len(ws) * n_split * self.n * tiles * MS_ROWS if n_split > 1 or gated else 0
        return tiles, n_split, ups, floats

    def launches(self, kernels) -> list[Launch]:
        if self.n == 0:
            return []
        if self.matvec():
            out = []
            if not self.in_prologue() and (self.norm_w is not None or (self.quant_in and self.needs_xq)):
                out.append(self._quant_x(kernels))
            groups = self.groups()
            if len(groups) > 1 and (self.mode != MODE_STORE or self.tail is not None or self.act_q is not None):
                raise AssertionError("fused epilogues need one launch")
            return out + [self._matvec(kernels, g) for g in groups]
        if self.split():
            groups = self.groups()
            if self.tail is not None or self.act_q is not None or (self.mode != MODE_STORE and len(groups) > 1):
                raise AssertionError("batched products fuse only a residual add or a gate")
            return [self._split(kernels, g) for g in groups]
        if self.mode != MODE_STORE or self.norm_w is not None or self.tail is not None:
            raise AssertionError("fused products exist only on the decode path")
        return [self._tile(kernels, g) for g in self.groups()]

    def in_prologue(self) -> bool:
        """Whether the product's blocks normalise and quantize x themselves (into shared memory),
        instead of a quant_x launch before: one launch of quantized types, and h (written by the
        first blocks) is not read by others. Every block repeats the work, so only for rows of up
        to prologue_k values and one group of rows: on an H200, a decode step of SmolLM2 (k 576)
        1.23 -> 1.09 ms, Gemma 3 (k 640) 1.45 -> 1.38 ms; 64-row steps (eight groups) were slower by
        half. Rows past 1024 take blocks of 256 threads (the row in registers): a 1.5 B model (k
        1536) 1.537 -> 1.473 ms a step in Q4_K, 1.835 -> 1.820 ms in Q8_0 (it was slower, 1.92 ->
        2.01 ms, when the prologue read its row in strided loops)."""
        if not (self.prologue and self.norm_w is not None and self.matvec() and len(self.groups()) == 1):
            return False
        if any(not quantized(w.type) for w in self.ws) or self.k % 32 or self.k > min(self.prologue_k, PROLOGUE_MAX_K):
            return False
        if self.n > 8:
            return False
        if self.pro_y is not None and self.idx is not None:
            return False
        return disjoint(self.x, self.src) and self._prologue_smem() <= PROLOGUE_SMEM

    def _prologue_smem(self) -> int:
        """The quantized rows, and for a residual prologue each row's y, r and x as f32."""
        rows = min(self.n, 8)
        return xq_bytes(rows, self.k) + (12 * rows * self.k if self.pro_y is not None else 0)

    def _quant_x(self, kernels) -> Launch:
        if self.needs_xq and self.xq is None:
            raise AssertionError("a decode product of quantized weights needs its xq buffer")
        normed = self.norm_w is not None
        src = self.src if normed else self.x
        args = (ptr(src), ptr(self.idx if normed else None), ptr(self.norm_w), f32(self.eps),
                ptr(self.x if normed else None), ptr(self.xq), i32(self.n), i32(self.k))
        # chunks of QX_CHUNK values in blocks of their own, unless h overwrites src in place
        chunks = -(-self.k // QX_CHUNK) if not normed or disjoint(self.x, src) else 1
        return Launch(kernels.fn("ops", "quant_x"), (self.n, chunks, 1), (128, 1, 1), args)

    def _matvec(self, kernels, group: list[int]) -> Launch:
        ws, outs = [self.ws[j] for j in group], [self.outs[j] for j in group]
        qtype, n, k = ws[0].type, self.n, self.k
        nmax = 1 if n == 1 else 2 if n == 2 else 4 if n <= 4 else 8
        n_groups = -(-n // 8)  # more than 8 rows: groups of 8, each block of teams once per group
        gated = self.mode in (MODE_SILU, MODE_GELU)
        spl = 2 if qtype in PAIRED_SLICES else 1  # K-quant lanes step two slices at a time
        if gated and self.act_q is not None:  # blocks of 32 output rows, teams of 8 lanes
            tl, threads = 3, MVQ_THREADS
            grid = ws[0].shape[0] // 32 * n_groups
        else:
            teams = ws[0].shape[0] if gated else -(-sum(w.shape[0] for w in ws) // 2)
            tl = team_log2(k // spl, teams * n_groups, self.mv_wide)
            # a prologue's row lies in registers, 8 values a lane (PRO_REG): longer rows take more warps
            threads = MVQ_THREADS if k > 8 * MV_THREADS and self.in_prologue() else MV_THREADS
            if n == 1 and self.mv_fill and sum(w.shape[0] * w.data.row_bytes for w in ws) >= MV_FILL_MIN_BYTES:
                tl = fill_team_log2(tl, k // 32 // spl, teams, threads, self.n_sm)
            grid = -(-teams // (threads >> tl)) * n_groups
        occ = nmax == 1 and self._occ(grid, threads)
        spec = self._spec()
        name = ("mv_n1_occ" if occ else "mv_n1_spec" if nmax == 1 and (self.mv_spec or self.mv_store and spec == 0)
                else f"mv_n{nmax}")
        tblocks = grid // n_groups
        # One row, more blocks than fit at once: a grid that fits walks them (each block's prologue
        # done once, its next rows prefetched while it works on the current ones) instead of waves
        # of blocks that each normalise x again.
        per_sm = (3 if occ else 2) if threads > MV_THREADS else (6 if occ else 4)  # registers: 80 / 128
        if nmax == 1 and self.mv_persist and tblocks > per_sm * self.n_sm:
            grid = per_sm * self.n_sm
        args = (*_pad4([ptr(w.data.buf) for w in ws], u64(0)), *_pad4([ptr(o) for o in outs], u64(0)),
                *_pad4([i32(w.shape[0]) for w in ws], i32(0)), i32(len(ws)), i64(ws[0].data.row_bytes),
                i32(k), i32(n), ptr(self.x), ptr(self.xq), i32(self.mode), ptr(self.aux), i32(tl), i32(tblocks),
                i32(self._pre_steps(k // 32 // spl, 1 << tl) if nmax == 1 and self._pre(qtype, occ, name) else 0),
                ptr(self.act_q),
                *self._prologue_args(), *(self.tail.kernel_args() if self.tail is not None else NO_TAIL_ARGS))
        fn = kernels.fn(matmul_module(qtype, name, spec), name)
        return Launch(fn, (grid, 1, 1), (threads, 1, 1), args, smem=self._prologue_smem() if self.in_prologue() else 0)

    def _spec(self) -> int:
        """The mask of paths mv_n1_spec is compiled with for this product: its prologue, its
        epilogue (gated, with the activation quantized or not, or residual) and its tail. A
        one-row product of none (it only stores y) takes that kernel by default (mv_store); the
        others only with mv_spec (EMBER_CUDA_MV_SPEC=1, an experiment, off by default): where the
        store-only kernel's leaner code paid (a step of several weight types), whether the other
        products' own kernels do too."""
        m = 0
        if self.in_prologue():
            m |= SPEC_PRO_RES if self.pro_y is not None else SPEC_PRO
        if self.mode in (MODE_SILU, MODE_GELU):
            m |= SPEC_GATED
        elif self.mode == MODE_RESIDUAL:
            m |= SPEC_RES
        return m | (SPEC_ACT_Q if self.act_q is not None else 0) | (SPEC_TAIL if self.tail is not None else 0)

    def _pre(self, qtype, occ: bool, name: str) -> bool:
        """Whether a one-row product on kernel `name` loads a lane's first slices before it waits
        for x. H200,
        SmolLM2-shaped Q4_1 products in chains: qkv with its norm prologue 4.86 -> 4.40 us, gate+up
        5.27 -> 4.48, down 2.68 -> 2.32 (Q5_0 alike); SmolLM2's step 0.874 -> 0.815 ms, Gemma 3's
        1.033 -> 0.968. The K-quants' two slices a step and mv_n1_occ's 80 registers spill: the
        1.5 B model's Q4_K step 1.437 -> 1.536 ms, its Q8_0 mv_n1_occ products 813 -> 860 us a step.
        So mv_n1 holds it for the types of 32-value blocks only (PRE_TYPES; the others ignore
        pre_dec), and "auto" takes it there. Q4_K and Q5_K hold one step as its raw bytes (12 or
        20 registers, decoded after the wait) in mv_n1_spec only (PRE_SPEC_TYPES; in mv_n1 it
        spilled): Gemma 3's store-only Q4_K products 84 -> 78 us a step, its step 0.670 -> 0.655
        ms across runs (tg128 1530 -> 1553-1560)."""
        if self.mv_pre in ("0", "1"):
            return self.mv_pre == "1"
        return not occ and (qtype in PRE_TYPES or qtype in PRE_SPEC_TYPES and name == "mv_n1_spec")

    def _pre_steps(self, steps: int, lanes: int) -> int:
        """Lane steps decoded before the wait: a product whose prologue normalises x after it would
        otherwise fetch its later steps' weights after that (a second trip to L2); the others fetch
        them with x's quantized values, so one step is enough there."""
        if self.in_prologue():
            return max(1, min(self.mv_pre_steps, -(-steps // lanes)))
        return 1

    def _occ(self, grid: int, threads: int) -> bool:
        """Whether mv_n1_occ (80 registers) takes a one-row product: where mv_n1's blocks (128
        registers: two of 256 threads or four of 128 a multiprocessor) would not all fit at once.
        H200, 1.5 B model in Q8_0 (gate+up 280 blocks of 256, down 768 of 128): a decode step
        1.901 -> 1.726 ms; small products stay on mv_n1, whose few blocks all fit (Gemma 3 with
        every product on mv_n1_occ: 1.089 -> 1.215 ms, its spills cost more than it gains)."""
        if self.mv_occ in ("0", "1"):
            return self.mv_occ == "1"
        return grid > self.n_sm * (2 if threads > MV_THREADS else 4)

    def _prologue_args(self) -> tuple:
        if not self.in_prologue():
            return (u64(0), u64(0), u64(0), f32(0), u64(0), u64(0), u64(0), u64(0), f32(0), u64(0))
        return (ptr(self.src), ptr(self.idx), ptr(self.norm_w), f32(self.eps), ptr(self.x), ptr(self.pro_y),
                ptr(self.pro_yout), ptr(self.pro_post_w), f32(self.pro_post_eps), ptr(self.pro_counter))

    def _split(self, kernels, group: list[int]) -> Launch:
        ws, outs = [self.ws[j] for j in group], [self.outs[j] for j in group]
        gated = self.mode in (MODE_SILU, MODE_GELU)
        if gated and (len(ws) != 2 or ws[0].shape != ws[1].shape):
            raise AssertionError("a gated product multiplies two matrices of one shape")
        tiles, n_split, ups, _ = self._split_geometry(group)
        lay = layout(ws[0].type)
        span, smem = split_smem(ws[0].type)
        args = (*_pad4([ptr(w.data.buf) for w in ws], u64(0)), *_pad4([ptr(o) for o in outs], u64(0)),
                *_pad4([i32(w.shape[0]) for w in ws], i32(0)), i64(ws[0].data.row_bytes), i32(self.k), i32(self.n),
                ptr(self.x), ptr(self.part), ptr(self.counters), i32(ups), i32(self.mode), ptr(self.aux),
                i32(lay.block_size), i32(lay.type_size), i32(span))
        fn = kernels.fn(matmul_module(ws[0].type), "mm_split")
        allow_smem(fn, smem)
        return Launch(fn, (tiles, n_split, len(ws)), (MS_THREADS, 1, 1), args, smem=smem)

    def _tile(self, kernels, group: list[int]) -> Launch:
        ws, outs = [self.ws[j] for j in group], [self.outs[j] for j in group]
        n, k = self.n, self.k
        rows_max = max(w.shape[0] for w in ws)
        tn = 128
        if self.tile_rows == "64" or (self.tile_rows == "auto" and
                                      -(-rows_max // 128) * -(-n // 64) * len(ws) < 2 * self.n_sm):
            tn = 64  # twice the blocks of half the rows: products too small to fill the GPU
        grid = (-(-rows_max // tn), -(-n // 64), len(ws))
        args = (*_pad4([ptr(w.data.buf) for w in ws], u64(0)), *_pad4([ptr(o) for o in outs], u64(0)),
                *_pad4([i32(w.shape[0]) for w in ws], i32(0)), i64(ws[0].data.row_bytes), i32(k), i32(n),
                ptr(self.x))
        name = "mm_tile" if tn == 128 else "mm_tile64"
        return Launch(kernels.fn(matmul_module(ws[0].type), name), grid, (128, 1, 1), args)


@dataclass(eq=False)
class GetRows:
    """out (n, cols) = rows ids (n,) of w. With prev: ids -r - 1 name the first id of row r of prev
    (device int32 (rows, prev_k), best first) that row t of bans (device int32 (n, prev_k), -1
    padded) does not hold (see get_rows)."""

    w: Any
    ids: Any  # device int32 (n,)
    out: Any
    prev: Any = None
    prev_k: int = 0
    bans: Any = None

    def launches(self, kernels) -> list[Launch]:
        rows, cols = self.w.shape
        n = self.out.shape[0]
        grid = (-(-(cols // 32) // 128), n, 1)
        args = (ptr(self.w.data.buf), i64(self.w.data.row_bytes), i32(rows), i32(cols), ptr(self.ids), ptr(self.out),
                ptr(self.prev), i32(self.prev_k), ptr(self.bans))
        return [Launch(kernels.fn(matmul_module(self.w.type), "get_rows"), grid, (128, 1, 1), args)]


# ---- row and elementwise ops ----

def _elementwise(kernels, name: str, n: int, *args) -> Launch:
    return Launch(kernels.fn("ops", name), (-(-n // 256), 1, 1), (256, 1, 1), args)


@dataclass(eq=False)
class RmsNorm:
    """out (rows, d) = x / rms(x) * w over rows of d = w's length; out may be x."""

    x: Any
    w: Any  # device f32 (d,) or None
    eps: float
    out: Any
    d: int

    @property
    def rows(self) -> int:
        return self.x.size // self.d

    def launches(self, kernels) -> list[Launch]:
        args = (ptr(self.x), ptr(self.w), ptr(self.out), i32(self.rows), i32(self.d), f32(self.eps))
        return [Launch(kernels.fn("ops", "rms_norm"), (-(-self.rows // 4), 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class NormAdd:
    """Fused: h = rms_norm(h) * w, then x += h (rows of d)."""

    h: Any
    w: Any
    x: Any
    eps: float
    d: int

    def launches(self, kernels) -> list[Launch]:
        rows = self.h.size // self.d
        args = (ptr(self.h), ptr(self.w), ptr(self.x), i32(rows), i32(self.d), f32(self.eps))
        return [Launch(kernels.fn("ops", "norm_add"), (-(-rows // 4), 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class GatedAct:
    """out = act(gate) * up, act "silu" or "gelu" (tanh form)."""

    act: str
    gate: Any
    up: Any
    out: Any

    def launches(self, kernels) -> list[Launch]:
        n = self.gate.size
        return [_elementwise(kernels, f"{self.act}_mul", n, ptr(self.gate), ptr(self.up), ptr(self.out), i64(n))]


@dataclass(eq=False)
class Add:
    a: Any
    b: Any
    out: Any

    def launches(self, kernels) -> list[Launch]:
        n = self.a.size
        return [_elementwise(kernels, "add", n, ptr(self.a), ptr(self.b), ptr(self.out), i64(n))]


@dataclass(eq=False)
class Scale:
    x: Any
    s: float

    def launches(self, kernels) -> list[Launch]:
        n = self.x.size
        return [_elementwise(kernels, "scale", n, ptr(self.x), f32(self.s), i64(n))]


@dataclass(eq=False)
class AddRow:
    """x (rows, d) += b (d,)"""

    x: Any
    b: Any

    def launches(self, kernels) -> list[Launch]:
        rows, d = self.x.shape
        return [_elementwise(kernels, "add_row", rows * d, ptr(self.x), ptr(self.b), i32(rows), i32(d))]


@dataclass(eq=False)
class GatherRows:
    """out[r] = x[idx[r]]"""

    x: Any
    idx: Any  # device int32 (n,)
    out: Any

    def launches(self, kernels) -> list[Launch]:
        n, d = self.out.shape
        return [_elementwise(kernels, "gather_rows", n * d, ptr(self.x), ptr(self.idx), ptr(self.out), i32(n), i32(d))]


# ---- attention inputs and attention ----

@dataclass(frozen=True)
class RopeArgs:
    """RopeParams resolved for the kernels (YaRN ramp bounds and magnitude scale computed here)."""

    n_rot: int
    neox: bool
    base: float
    freq_scale: float
    ext_factor: float
    mscale: float
    corr_low: float
    corr_high: float
    freq_factors: Any  # device f32 (n_rot/2,) or None

    def kernel_args(self) -> tuple:
        return (i32(self.n_rot), i32(int(self.neox)), f32(self.base), f32(self.freq_scale), f32(self.ext_factor),
                f32(self.mscale), f32(self.corr_low), f32(self.corr_high), ptr(self.freq_factors))


@dataclass(eq=False)
class Rope:
    """x (n, n_head * head_dim) rotated in place at positions pos."""

    x: Any
    n_head: int
    pos: Any  # device int32 (n,)
    p: RopeArgs

    def launches(self, kernels) -> list[Launch]:
        n, width = self.x.shape
        args = (ptr(self.x), ptr(self.pos), i32(self.n_head), i32(width // self.n_head), *self.p.kernel_args())
        return [Launch(kernels.fn("ops", "rope"), (n, 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class KvStore:
    k: Any
    v: Any
    k_cache: Any
    v_cache: Any
    slots: Any  # device int64 (n,)

    def launches(self, kernels) -> list[Launch]:
        n = self.k.shape[0]
        args = (ptr(self.k), ptr(self.v), ptr(self.k_cache), ptr(self.v_cache), ptr(self.slots),
                i32(self.k_cache.shape[1]), i32(self.v_cache.shape[1]))
        return [Launch(kernels.fn("ops", "kv_store"), (n, 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class CopyPages:
    """For each (src, dst) row of pairs: page dst of every layer's keys and values = page src."""

    layers: list  # [(k_cache, v_cache)], f16 (n_slots, dim)
    pairs: Any  # device int32 (n, 2)
    page: int  # slots per page

    def launches(self, kernels) -> list[Launch]:
        n = self.pairs.shape[0]
        out = []
        for k, v in self.layers:
            chunks = max(1, min(64, -(-self.page * max(k.shape[1], v.shape[1]) // (8 * 256))))
            out.append(Launch(kernels.fn("ops", "copy_pages"), (chunks, n, 1), (256, 1, 1),
                              (ptr(k), ptr(v), ptr(self.pairs), i32(self.page), i32(k.shape[1]), i32(v.shape[1]))))
        return out


@dataclass(eq=False)
class QkvPost:
    """Fused: per-head norms of q and k (optional), rope of both, k and v into the cache."""

    q: Any
    k: Any
    v: Any
    q_norm: Any
    k_norm: Any
    eps: float
    pos: Any
    p: RopeArgs
    n_head: int
    n_kv: int
    k_cache: Any
    v_cache: Any
    slots: Any

    def launches(self, kernels) -> list[Launch]:
        n, q_width = self.q.shape
        hd = q_width // self.n_head
        args = (ptr(self.q), ptr(self.k), ptr(self.v), ptr(self.q_norm), ptr(self.k_norm), f32(self.eps),
                ptr(self.pos), *self.p.kernel_args(), i32(self.n_head), i32(self.n_kv), i32(hd),
                i32(self.v.shape[1]), ptr(self.k_cache), ptr(self.v_cache), ptr(self.slots))
        return [Launch(kernels.fn("ops", "qkv_post"), (n, 1, 1), (128, 1, 1), args)]


NO_ROPE = RopeArgs(0, False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, None)


@dataclass(eq=False)
class Attention:
    """out (n, n_head * hd_v) = attention of q over the paged cache (see attention.cu).

    With post (a QkvPost on q, the caches and pos; recorded decode steps only, see
    _fuse.fold_qkv_post) the attention launch does that op's work itself: q and post.k are read as
    the product wrote them, the new keys and values go into the cache, and q and k keep their
    values. one_token_per_seq: every token of the step is the only one of its sequence (no token
    reads a key another token's blocks write), which the folded form needs."""

    q: Any
    k_cache: Any
    v_cache: Any
    out: Any
    part: Any  # scratch f32 (n, n_head, n_split, hd_v + 2), used when n_split > 1
    pos: Any
    seq_rows: Any
    tables: Any  # device int32 (n_seq, max_pages)
    page_size: int
    n_head: int
    n_kv: int
    window: int
    scale: float
    softcap: float
    n_split: int
    xq: Any = None  # device uint8 (xq_bytes(n, n_head * hd_v),) or None: out also quantized (hd_v % 32 == 0)
    one_token_per_seq: bool = False
    post: QkvPost | None = None
    tiles: bool = False  # tensor-core tiles (attn_tile<hd>): hd_k == hd_v in ATT_TILE_DIMS, no xq or post
    heads_per_block: int = ATT_HEADS  # attn: query heads of one kv head a block takes (1..8; grid y = kv x chunks)
    counters: Any = None  # attn with n_split > 1: device uint32 (n * grid y,), zero between launches; the
    # last split block of each (token, head chunk) merges the splits (no attn_combine launch)
    min_keys: int = 0  # with counters: positions a split holds at least (fewer splits, see attn)
    cluster: int = 0  # with counters: attn_cluster<8|16>, clusters of that many splits (n_split a multiple)

    def launches(self, kernels) -> list[Launch]:
        n = self.q.shape[0]
        hd_k, hd_v = self.k_cache.shape[1] // self.n_kv, self.v_cache.shape[1] // self.n_kv
        group = self.n_head // self.n_kv
        if self.tiles:
            out = [self._tile_launch(kernels, n, hd_k, -(-group // ATT_HEADS))]
        else:  # attn derives its heads per block from the grid: ceil(group / chunks)
            if not 1 <= self.heads_per_block <= ATT_HEADS:
                raise AssertionError("attn takes 1 to 8 query heads per block")
            out = [self._launch(kernels, n, hd_k, hd_v, -(-group // self.heads_per_block))]
        if self.n_split > 1 and (self.tiles or self.counters is None):
            name = "attn_combine32" if self.n_split > 8 else "attn_combine"  # splits loaded at once
            out.append(Launch(kernels.fn("attention", name), (self.n_head, n, 1), (128, 1, 1),
                              (ptr(self.part), ptr(self.out), i32(self.n_head), i32(hd_v), i32(self.n_split),
                               ptr(self.xq))))
        return out

    def _launch(self, kernels, n: int, hd_k: int, hd_v: int, n_hc: int) -> Launch:
        merge = self.n_split > 1 and self.counters is not None
        if merge and self.counters.size < n * self.n_kv * n_hc:
            raise AssertionError("attn's merge needs a counter per (token, kv head, head chunk)")
        args = (ptr(self.q), ptr(self.k_cache), ptr(self.v_cache), ptr(self.out), ptr(self.part), ptr(self.pos),
                ptr(self.seq_rows), ptr(self.tables), i32(self.tables.shape[1]), i32(self.page_size),
                i32(self.n_head), i32(self.n_kv), i32(hd_k), i32(hd_v), i32(self.window), f32(self.scale),
                f32(self.softcap), i32(self.n_split), ptr(self.xq if self.n_split == 1 or merge else None),
                i32(2 if n <= DECODE_TOKENS else 0), i32(self.min_keys if merge else 0), *self._fold_args(),
                ptr(self.counters if merge else None))
        name = "attn"
        if merge and self.cluster:
            if self.cluster not in (8, 16) or self.n_split % self.cluster or hd_v % 32:
                raise AssertionError("attn_cluster takes whole clusters of 8 or 16 splits and hd_v % 32 == 0")
            name = f"attn_cluster{self.cluster}"
        return Launch(kernels.fn("attention", name), (self.n_split, self.n_kv * n_hc, n), (128, 1, 1), args)

    def _tile_launch(self, kernels, n: int, hd: int, n_hc: int) -> Launch:
        """attn_tile: one block per (piece of the step, kv head and head chunk, split of the keys)."""
        fn = kernels.fn(f"attention_tile{hd}", f"attn_tile{hd}")
        smem = attn_tile_smem(hd)
        allow_smem(fn, smem)
        pieces = tile_pieces(n, self.n_head // self.n_kv, self.tables.shape[0])
        args = (ptr(self.q), ptr(self.k_cache), ptr(self.v_cache), ptr(self.out), ptr(self.pos), ptr(self.seq_rows),
                ptr(self.tables), i32(self.tables.shape[1]), i32(self.page_size), i32(n), i32(self.n_head),
                i32(self.n_kv), i32(self.window), f32(self.scale), f32(self.softcap), ptr(self.part),
                i32(self.n_split))
        return Launch(fn, (pieces, self.n_kv * n_hc, self.n_split), (128, 1, 1), args, smem=smem)

    def _fold_args(self) -> tuple:
        """attn's arguments for the folded qkv_post: k_new, v_new, q_norm, k_norm, eps, rope, slots
        (all zero: unfolded)."""
        p = self.post
        if p is None:
            return (u64(0), u64(0), u64(0), u64(0), f32(0), *NO_ROPE.kernel_args(), u64(0))
        return (ptr(p.k), ptr(p.v), ptr(p.q_norm), ptr(p.k_norm), f32(p.eps), *p.p.kernel_args(), ptr(p.slots))


ATT_TILE_ROWS = 64  # query rows (token, head) per attn_tile block


def attn_tile_smem(hd: int) -> int:
    """attn_tile's dynamic shared memory: q rows (high and low f16 parts) and two stages of key and
    value chunks (64 keys, 32 at head dim 256), rows padded by 8 halves."""
    chunk = 32 if hd == 256 else 64
    return (2 * ATT_TILE_ROWS + 4 * chunk) * (hd + 8) * 2


def tile_pieces(n: int, group: int, n_seq: int) -> int:
    """Blocks (per kv head, head chunk and split) that attn_tile's pieces may need: tokens are cut
    at multiples of the piece length and where the sequence changes, once per sequence at most."""
    return -(-n // (ATT_TILE_ROWS // min(group, ATT_HEADS))) + min(n, n_seq)


def tile_split_count(blocks: int, hd: int, max_ctx: int, n_sm: int, decode: bool = False) -> int:
    """Key-range splits of attn_tile where its pieces fill less than half the multiprocessors:
    enough blocks for two per multiprocessor, at most 8 and at most one per key chunk of the
    longest possible range. On an H200, pp512: Gemma 3 (33 blocks) attention 1076 -> 670 us a step,
    with the merge (attn_combine); SmolLM2 (78 blocks) gained nothing (618 -> 428 + 196 us).
    decode: a batched decode step's pieces (one token each, a few query rows) are short work
    with long key ranges: split until the blocks fill every multiprocessor's slots (four of
    attn_tile64/128 fit one, one of attn_tile256)."""
    chunk = 32 if hd == 256 else 64
    if decode:
        slots = (1 if hd == 256 else 4) * n_sm
        return max(1, min(-(-slots // blocks), -(-max_ctx // chunk), 8))
    if 2 * blocks >= n_sm:
        return 1
    return max(1, min(-(-2 * n_sm // blocks), -(-max_ctx // chunk), 8))


def runs_contiguous(seq_rows) -> bool:
    """Whether each sequence's tokens form one run in the step (attn_tile's pieces need it)."""
    rows = np.asarray(seq_rows)
    starts = rows[np.r_[True, rows[1:] != rows[:-1]]] if rows.size else rows
    return np.unique(starts).size == starts.size


def allow_smem(fn, nbytes: int) -> None:
    """Let kernel fn take nbytes of dynamic shared memory (past 48 KB it must be asked for)."""
    if nbytes > 48 * 1024 and hasattr(fn, "max_dynamic_shared_size_bytes") and fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes


def split_count(n_tok: int, n_kv: int, group: int, max_ctx: int, n_sm: int, waves: int = 2,
                heads_per_block: int = ATT_HEADS) -> int:
    """Key-range splits of decode attention: enough blocks for `waves` per multiprocessor, each
    split covering at least 16 positions of the longest possible sequence, at most 32 (a decode
    step's keys are few: more splits put more blocks to reading them)."""
    blocks = n_tok * n_kv * -(-group // heads_per_block)
    return max(1, min(-(-waves * n_sm // blocks), -(-max_ctx // 16), 32))


# ---- sampling reductions ----

TOPK_MAX = 256
TOPS_MAX = 8  # k up to which rows are cut into slices, one block each (row_top{1,2,4,8})
TOPS_SLICE = 256 * 8  # values per slice (TOPS_THREADS * TOPS_PER_THREAD in sample.cu)


def tops_k(k: int) -> int:
    """The sliced kernel's list length for k <= TOPS_MAX."""
    return 1 if k == 1 else 2 if k == 2 else 4 if k <= 4 else 8


def tops_slices(vocab: int) -> int:
    return -(-vocab // TOPS_SLICE)


@dataclass(eq=False)
class TopK:
    """ids, vals (n, k) = the k largest values of each row of x (n, vocab), best first.

    k <= TOPS_MAX with scratch (cand_v, cand_i: (n, tops_slices(vocab), tops_k(k)); counter: n
    zeroed uint32): many blocks per row. Otherwise one block per row."""

    x: Any
    k: int
    ids: Any  # device int32 (n, k)
    vals: Any  # device f32 (n, k)
    cand_v: Any = None
    cand_i: Any = None
    counter: Any = None

    def launches(self, kernels) -> list[Launch]:
        n, vocab = self.x.shape
        if self.counter is not None and self.k <= TOPS_MAX:
            args = (ptr(self.x), i32(vocab), i32(self.k), ptr(self.ids), ptr(self.vals), ptr(self.cand_v),
                    ptr(self.cand_i), ptr(self.counter))
            return [Launch(kernels.fn("sample", f"row_top{tops_k(self.k)}"), (tops_slices(vocab), n, 1), (256, 1, 1),
                           args)]
        name = "row_argmax" if self.k == 1 else "row_topk"
        args = (ptr(self.x), i32(vocab), i32(self.k), ptr(self.ids), ptr(self.vals))
        return [Launch(kernels.fn("sample", name), (n, 1, 1), (1024, 1, 1), args)]


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
