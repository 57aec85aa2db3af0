"""Matrix products: the plan of one product over matrices that share x, and its launches.

Decode-sized products (a few activation rows) take matmul.cu's matrix-vector kernels, one pass
over the weights; prompt-sized ones its tensor-core tiles; batched decode steps of quantized
weights (9..64 rows) mm_split. On the matrix-vector path a product may carry fused stages
(recorded steps, see _fuse.py): a norm prologue (its blocks normalise x themselves), a residual
prologue, an epilogue (residual add, or a gated activation, optionally quantized) and a tail.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ....quant.types import GGMLType, layout
from .._kernels import matmul_module
from ..config import MV_MAX_ROWS, MV_PROLOGUE_MAX_K, CudaConfig
from .base import Launch, allow_smem, disjoint, f32, i32, i64, pad4, ptr, quantized, u64, xq_bytes

MODE_STORE, MODE_RESIDUAL, MODE_SILU, MODE_GELU = 0, 1, 2, 3
GATED = (MODE_SILU, MODE_GELU)
MV_THREADS, MVQ_THREADS = 128, 256
PAIRED_SLICES = (GGMLType.Q4_K, GGMLType.Q5_K)  # SPL = 2 in matmul.cu
# Types whose one-row kernels decode a lane's first slices before waiting for x (matmul.cu MV_PRE_OK):
# the 32-value block types on mv_n1 and mv_n1_store; Q4_K and Q5_K on mv_n1_store only (held raw).
PRE_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0)
PRE_RAW_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K)
MV_PRE_STEPS = 2  # lane steps a prologue product holds before the wait (matmul.cu MV_PRE_STEPS)
# Types whose matrix-vector kernels beat the tensor-core tiles up to MV_MAX_ROWS activation rows;
# the others decode too much per slice and take the tiles past 8 rows.
BATCH_MV_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1)

# mv_xs (matmul.cu): gate and up of one activation row over large matrices of these types, a team
# of lanes per row holding its slices of x in registers while it streams rows
XS_TYPES = (GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K)  # those whose slices load apart from their decode
XS_MIN_BYTES = 4 << 20  # weight bytes (gate and up) from which a one-row gated product takes mv_xs
XS_MAX_TEAM = 512  # lanes of a team (one lane step of a row each): longer rows take mv_n1
# Products that only store y take mv_xs where its blocks normalise x themselves (no quant_x launch):
# from these weight bytes, pairs of rows XS_STORE_UNIT a block at least, more where that would make
# over XS_STORE_BLOCKS_PER_SM blocks a multiprocessor (each block repeats the norm)
XS_STORE_MIN_BYTES = 8 << 20
XS_STORE_ALONE_MIN_BYTES = 256 << 20  # without that norm (a quant_x launch before): an 8B-class output head
XS_STORE_UNIT = 4
XS_STORE_BLOCKS_PER_SM = 4

QX_CHUNK = 256  # values of a row a quant_x block writes (it sums the whole row's squares)
STAGE_ALIGN = 512  # a staged chunk of x: whole runs of eight 16-byte units (x_slot) and sixteen blocks (meta_slot)
PROLOGUE_SMEM = 48 * 1024  # dynamic shared memory a product's prologue may take (no opt-in needed)
TARGET_WARPS = 2048  # warps in flight that keep HBM busy (about 16 per multiprocessor of an H100/H200)
MV_FILL_MIN_BYTES = 1 << 20  # one-row products of at least these weight bytes widen teams to fill the GPU
# Weight bytes the resident blocks of a decode product prefetch into L2 at most (before they wait for
# x, and their next rows while they work): a product's rows past that are prefetched only in part
# (whole rows of a 66 MB product would evict each other from the 50 MB L2 before they are read).
L2_PREFETCH_BYTES = 8 << 20

# mm_split (matmul.cu): products of 9..64 activation rows, quantized weights, k split over blocks
MS_ROWS, MS_TOK, MS_CH, MS_THREADS = 64, 64, 8, 256
MS_LD = 32 * MS_CH + 8
MS_MAX_SPLITS = 8
MS_MIN_UNITS = 4  # 32-value units a split takes at least (the K types: a super-block, 8)
MS_PART_FLOATS = 4 << 20  # the shared partial-sum buffer (16 MB); products needing more take mm_tile
MS_COUNTERS = 8192  # tile counters (row tiles x matrices of a launch); products needing more take mm_tile
# The BLAS route's f16 weight scratch holds at most this many values (128 MB): longer matrices (an
# output head over a large vocabulary) are dequantized and multiplied a run of rows at a time.
BLAS_W_VALUES = 64 << 20
BLAS_MAX_RUN_ROWS = 32768  # dequant_f16's grid takes a row a block row (grid.y < 65536)


def matvec_rows(qtype: GGMLType, limit: int = MV_MAX_ROWS) -> int:
    """Activation rows up to which products of this type take the matrix-vector kernels."""
    return limit if qtype in BATCH_MV_TYPES else min(limit, 8)


def float_vec(qtype: GGMLType) -> int:
    """Values of a float row a decode lane reads at a time: one 16-byte load (quant.cuh FLOAT_VEC)."""
    return 4 if qtype == GGMLType.F32 else 8


def team_log2(k: int, teams: int = 1 << 30, wide: bool = True) -> int:
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


def fill_team_log2(tl: int, steps: int, teams: int, threads: int, n_sm: int) -> int:
    """tl, widened up to a warp a team while the product's blocks (threads / 2^tl teams each) are
    fewer than the multiprocessors and half a team's lanes still get a lane step of the `steps` a
    row has: a one-row product of few rows then spreads its weights over the whole GPU. Only for
    products of MV_FILL_MIN_BYTES or more: below that the extra blocks' prologues cost more."""
    while tl < 5 and -(-teams // (threads >> tl)) < n_sm and steps >= 1 << tl:  # half of 2^(tl+1) lanes
        tl += 1
    return tl


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


@dataclass(frozen=True)
class ResidualPrologue:
    """The product's blocks first make r = src + RMS norm of y by post_w (a post-norm, as gemma's
    layers end their halves), then normalise r; the last block through (counter) writes r back,
    and the post-normed y to yout when set. Replaces the tail of the product that wrote y."""

    y: Any
    post_w: Any
    post_eps: float
    counter: Any  # device uint32 (1,), zero between launches
    yout: Any = None


@dataclass(frozen=True)
class SplitScratch:
    """mm_split's partial sums and tile counters, shared by every product of the backend."""

    part: Any  # device f32 (MS_PART_FLOATS,)
    counters: Any  # device uint32 (MS_COUNTERS,), zeros between launches


@dataclass(frozen=True)
class BlasScratch:
    """The BLAS route's buffers, shared by every product of the backend (one stream runs them in
    turn): the handle, an f16 matrix a run of weight rows at a time is dequantized into, x in f16
    and its rows' scales."""

    blas: Any  # _blas.Blas
    wh: Any  # device f16, at most BLAS_W_VALUES values: a run of weight rows
    xh: Any  # device f16 (n * k,)
    inv: Any  # device f32 (n,)


@dataclass(eq=False)
class BlasGemm:
    """One cublasGemmEx call of a recorded step (not a kernel launch: a graph captures the
    library's own kernels, and no programmatic launch follows it)."""

    blas: Any
    dims: tuple  # gemm_f16's (m, n, k, a, lda, b, ldb, c, ldc)

    def run(self) -> None:
        self.blas.gemm_f16(*self.dims)


@dataclass(frozen=True)
class MvGeometry:
    """One matrix-vector launch's shape: row groups of up to nmax, teams of 2^tl lanes."""

    nmax: int
    n_groups: int
    tl: int
    threads: int
    tblocks: int  # blocks of teams per row group
    occ: bool  # mv_n1_occ: too many blocks for mv_n1's registers to hold at once
    n_sm: int

    @property
    def grid(self) -> int:
        """A one-row product of more blocks than fit walks them with a grid that fits (each
        block's prologue done once, its next rows prefetched while it works)."""
        blocks = self.tblocks * self.n_groups
        per_sm = (3 if self.occ else 2) if self.threads > MV_THREADS else (6 if self.occ else 4)
        return min(blocks, per_sm * self.n_sm) if self.nmax == 1 else blocks


@dataclass(eq=False)
class Matmul:
    """outs[j] (n, rows_j) = x (n, k) @ ws[j].T for matrices sharing x.

    Decode path (n <= mv_rows): quantized types read x from xq (xq_bytes(n, k)), which a quant_x
    launch fills first unless a producer already did (quant_in False). Fusions (recorded steps
    only): x = RMS-norm of src (rows idx of src when idx is set) by norm_w; the result added into
    aux (MODE_RESIDUAL), or act(outs[0]) * outs[1] written to aux (gated modes) and quantized into
    act_q; a residual prologue (pro_res); a tail."""

    ws: list  # Weight (data: DeviceMatrix)
    x: Any
    outs: list
    xq: Any = None
    quant_in: bool = True
    src: Any = None
    idx: Any = None  # device int32 (n,)
    norm_w: Any = None
    eps: float = 0.0
    mode: int = MODE_STORE
    aux: Any = None
    act_q: Any = None
    tail: Tail | None = None
    pro_res: ResidualPrologue | None = None
    mv_rows: int = MV_MAX_ROWS  # activation rows up to which this product takes the matrix-vector kernels
    split_buf: SplitScratch | None = None  # mm_split for mv_rows < n <= MS_TOK
    blas_buf: BlasScratch | None = None  # the BLAS route, from cfg.blas_rows rows (takes_blas)
    cfg: CudaConfig = CudaConfig()
    n_sm: int = 132

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

    def matvec(self) -> bool:
        return self.n <= self.mv_rows

    def split(self) -> bool:
        """Whether the product takes mm_split (a batched decode step of quantized weights that the
        BLAS route does not take)."""
        if self.split_buf is None or not self.mv_rows < self.n <= MS_TOK or self.takes_blas():
            return False
        if not all(quantized(w.type) for w in self.ws) or self.norm_w is not None:
            return False
        return all(self._split_fits(g) for g in self.groups())

    def _split_fits(self, group: list[int]) -> bool:
        """Products of many row tiles fill the GPU as mm_tile; the scratch must hold the partials."""
        tiles, _, _, floats = self._split_geometry(group)
        if tiles * len(group) >= 2 * self.n_sm or floats > self.split_buf.part.size:
            return False
        return not floats or tiles * len(group) <= self.split_buf.counters.size

    def _split_geometry(self, group: list[int]) -> tuple[int, int, int, int]:
        """(row tiles, splits, units per split, partial floats) of one launch."""
        ws = [self.ws[j] for j in group]
        tiles = -(-max(w.shape[0] for w in ws) // MS_ROWS)
        upb = layout(ws[0].type).block_size // 32
        n_split, ups = split_plan(self.k // 32, upb, tiles * len(ws), self.n_sm)
        floats = len(ws) * n_split * self.n * tiles * MS_ROWS if n_split > 1 or self.mode in GATED else 0
        return tiles, n_split, ups, floats

    def launches(self, kernels) -> list[Launch]:
        if self.n == 0:
            return []
        if self.matvec():
            return self._matvec_launches(kernels)
        if self.takes_blas():
            return self._blas_launches(kernels)
        groups = self.groups()
        if self.split():
            if self.tail is not None or self.act_q is not None or (self.mode != MODE_STORE and len(groups) > 1):
                raise AssertionError("batched products fuse only a residual add or a gate")
            return [self._split(kernels, g) for g in groups]
        if self.mode != MODE_STORE or self.norm_w is not None or self.tail is not None:
            raise AssertionError("fused products exist only on the decode path")
        return [self._tile(kernels, g) for g in groups]

    # ---- the BLAS route ----
    def takes_blas(self) -> bool:
        """Products of quantized weights over cfg.blas_rows rows or more, past the matrix-vector
        kernels, ahead of mm_split: each weight dequantized to f16, a run of rows at a time, and
        multiplied by cuBLAS (2-7x the tiles at 128-2048 rows of Llama-3.1-8B's matrices on an
        H200; at 64 rows 1.1-1.3x mm_split before dequant_f16 staged its stores;
        bench/prompt_gemm.py). Float weights keep the tiles (their x split into two f16
        parts keeps f32's precision). Products the route takes are not fused with their neighbours
        (plain_or_split sees split() False), so a 64-row step's gate and residual add run apart."""
        return self.blas_buf is not None and self.wants_blas()

    def wants_blas(self) -> bool:
        """takes_blas, given the buffers (the backend makes them only for products that want them)."""
        if not self.cfg.blas_rows or self.n < self.cfg.blas_rows:
            return False
        if self.matvec() or self.mode != MODE_STORE or self.norm_w is not None or self.tail is not None:
            return False
        return self.act_q is None and self.pro_res is None and all(quantized(w.type) for w in self.ws)

    def _blas_launches(self, kernels) -> list:
        buf, n, k = self.blas_buf, self.n, self.k
        out: list = [Launch(kernels.fn("ops", "x_to_f16"), (-(-n // 4), 1, 1), (128, 1, 1),
                            (ptr(self.x), ptr(buf.xh), i32(n), i32(k), ptr(buf.inv)))]
        units = k // 32
        run_rows = max(1, min(BLAS_MAX_RUN_ROWS, buf.wh.size // k))
        for w, y in zip(self.ws, self.outs):
            rows = w.shape[0]
            deq = kernels.fn(matmul_module(w.type), "dequant_f16")
            for r0 in range(0, rows, run_rows):
                m = min(run_rows, rows - r0)
                out.append(Launch(deq, (-(-units // 128), m, 1), (128, 1, 1),
                                  (ptr(w.data.buf), i64(w.data.row_bytes), i32(r0), i32(k), ptr(buf.wh))))
                out.append(BlasGemm(buf.blas, (m, n, k, buf.wh.data.ptr, k, buf.xh.data.ptr, k,
                                               y.data.ptr + 4 * r0, rows)))
            out.append(Launch(kernels.fn("ops", "unscale_rows"), (n, 1, 1), (256, 1, 1),
                              (ptr(y), i32(n), i32(rows), ptr(buf.inv))))
        return out

    # ---- matrix-vector kernels ----
    def _matvec_launches(self, kernels) -> list[Launch]:
        out = []
        xs = self.takes_xs()
        own_norm = self.in_prologue() or (xs and self.xs_prologue())
        if not own_norm and (self.norm_w is not None or (self.quant_in and self.needs_xq)):
            out.append(self._quant_x(kernels))
        groups = self.groups()
        if len(groups) > 1 and (self.mode != MODE_STORE or self.tail is not None or self.act_q is not None):
            raise AssertionError("fused epilogues need one launch")
        if xs:
            return out + [self._xs(kernels)]
        return out + [self._matvec(kernels, g) for g in groups]

    def takes_xs(self) -> bool:
        """Whether the product takes mv_xs (one activation row, a type in XS_TYPES, rows of at most
        XS_MAX_TEAM lane steps): gate and up (rows in whole blocks of 32) of at least XS_MIN_BYTES;
        or up to four matrices that only store y, an even count of rows, of at least
        XS_STORE_MIN_BYTES where the kernel normalises x itself (xs_prologue), of at least
        XS_STORE_ALONE_MIN_BYTES otherwise. Rows short enough for mv_n1's norm prologue keep that."""
        if self.n != 1 or self.tail is not None or self.pro_res is not None:
            return False
        if self.norm_w is not None and self.k <= min(self.cfg.prologue_k, MV_PROLOGUE_MAX_K):
            return False
        qtype = self.ws[0].type if self.ws else None
        if qtype not in XS_TYPES or any(w.type != qtype for w in self.ws):
            return False
        spl = 2 if qtype in PAIRED_SLICES else 1
        if self.k % (32 * spl) or self.k // 32 // spl > XS_MAX_TEAM:
            return False
        nbytes = sum(w.shape[0] * w.data.row_bytes for w in self.ws)
        if self.mode in GATED:
            rows = self.ws[0].shape[0]
            return len(self.ws) == 2 and self.ws[1].shape[0] == rows and rows % 32 == 0 and nbytes >= XS_MIN_BYTES
        if self.mode != MODE_STORE or self.act_q is not None or len(self.ws) > 4 or sum(w.shape[0] for w in self.ws) % 2:
            return False
        return nbytes >= (XS_STORE_MIN_BYTES if self.xs_prologue() else XS_STORE_ALONE_MIN_BYTES)

    def xs_prologue(self) -> bool:
        """Whether mv_xs's blocks normalise x themselves (a norm fused in, rows of at most
        cfg.prologue_k values that fit in PROLOGUE_SMEM as f32, 16-byte aligned): no quant_x launch
        before it."""
        if self.norm_w is None or self.n != 1 or self.idx is not None or self.k > self.cfg.prologue_k:
            return False
        if 4 * self.k > PROLOGUE_SMEM:
            return False
        if any(a.data.ptr % 16 for a in (self.src, self.norm_w, self.x)):
            return False
        return disjoint(self.x, self.src)

    def xs_geometry(self) -> tuple[int, int, int, int]:
        """(team lanes, threads, pairs a block, blocks) of mv_xs: a lane per lane step of a row
        (whole warps), blocks of at least 128 threads where teams are narrower; 32 gate/up pairs a
        block, or XS_STORE_UNIT pairs of stored rows (more for products of many)."""
        spl = 2 if self.ws[0].type in PAIRED_SLICES else 1
        team = -(-(self.k // 32 // spl) // 32) * 32
        threads = MV_THREADS if team < MV_THREADS and MV_THREADS % team == 0 else team
        if self.mode in GATED:
            return team, threads, 32, self.ws[0].shape[0] // 32
        pairs = sum(w.shape[0] for w in self.ws) // 2
        unit = max(XS_STORE_UNIT, -(-pairs // (XS_STORE_BLOCKS_PER_SM * self.n_sm)))
        return team, threads, unit, -(-pairs // unit)

    def _xs(self, kernels) -> Launch:
        team, threads, unit, blocks = self.xs_geometry()
        pro = self.xs_prologue()
        if not pro and self.xq is None:
            raise AssertionError("a decode product of quantized weights needs its xq buffer")
        args = (*self._mats_args(list(range(len(self.ws)))), i32(self.k), ptr(None if pro else self.xq), i32(team),
                i32(unit), i32(self.mode), ptr(self.aux), ptr(self.act_q), ptr(self.src if pro else None),
                ptr(self.norm_w if pro else None), f32(self.eps), ptr(self.x if pro else None))
        fn = kernels.fn(matmul_module(self.ws[0].type, "mv_xs"), "mv_xs")
        return Launch(fn, (blocks, 1, 1), (threads, 1, 1), args, smem=4 * self.k if pro else 0)

    def in_prologue(self) -> bool:
        """Whether the product's blocks normalise and quantize x themselves (into shared memory)
        instead of a quant_x launch before: one launch fewer, but every block repeats the work,
        so only for rows of up to cfg.prologue_k values and one group of at most 8 rows."""
        if self.norm_w is None or not self.matvec() or self.n > 8 or len(self.groups()) != 1 or self.takes_xs():
            return False
        if any(not quantized(w.type) for w in self.ws) or self.k % 32 or self.k > min(self.cfg.prologue_k,
                                                                                       MV_PROLOGUE_MAX_K):
            return False
        if self.pro_res is not None and self.idx is not None:
            return False
        return disjoint(self.x, self.src) and self._prologue_smem() <= PROLOGUE_SMEM

    def _prologue_smem(self) -> int:
        """The quantized rows, and for a residual prologue each row's y, r and x as f32."""
        rows = min(self.n, 8)
        return xq_bytes(rows, self.k) + (12 * rows * self.k if self.pro_res is not None else 0)

    def stores_only(self) -> bool:
        """A product with no fused stage: mv_n1_store, the one-row kernel without the others' paths."""
        return not self.in_prologue() and self.mode == MODE_STORE and self.act_q is None and self.tail is None

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
        ws = [self.ws[j] for j in group]
        geo = self.mv_geometry(ws)
        name = "mv_n1_occ" if geo.occ else "mv_n1_store" if geo.nmax == 1 and self.stores_only() else f"mv_n{geo.nmax}"
        kc = self._stage_chunk(ws[0].type, geo)
        args = (*self._mats_args(group), *self._run_args(geo, self._pre_steps(ws[0].type, geo, name),
                                                          self._prefetch_row(ws, geo), kc),
                *self._epilogue_args(), *self._prologue_args(),
                *(self.tail.kernel_args() if self.tail is not None else NO_TAIL_ARGS))
        fn = kernels.fn(matmul_module(ws[0].type, name), name)
        # both within the 48 KB a launch takes without asking (PROLOGUE_SMEM; mv_stage at most 40 KB)
        smem = self._prologue_smem() if self.in_prologue() else xq_bytes(min(self.n, geo.nmax), kc)
        return Launch(fn, (geo.grid, 1, 1), (geo.threads, 1, 1), args, smem=smem)

    def _stage_chunk(self, qtype, geo: MvGeometry) -> int:
        """Values of x a chunk that a product of several activation rows stages in shared memory
        (matmul.cu mv_stage_chunk), 0 where it reads x where it lies: one row, float weights, a
        prologue's rows (already in shared memory), or cfg.mv_stage 0. As many as the budget of
        cfg.mv_stage bytes holds, whole runs of 512 (the permuted slots' alignment)."""
        if geo.nmax == 1 or not quantized(qtype) or self.in_prologue() or not self.cfg.mv_stage:
            return 0
        rows = min(self.n, geo.nmax)
        fits = self.cfg.mv_stage // xq_bytes(rows, STAGE_ALIGN) * STAGE_ALIGN
        return max(STAGE_ALIGN, min(fits, -(-self.k // STAGE_ALIGN) * STAGE_ALIGN))

    def mv_geometry(self, ws: list) -> MvGeometry:
        n, k = self.n, self.k
        nmax = 1 if n == 1 else 2 if n == 2 else 4 if n <= 4 else 8
        n_groups = -(-n // 8)  # more than 8 rows: groups of 8, each block of teams once per group
        spl = 2 if ws[0].type in PAIRED_SLICES else 1  # K-quant lanes step two slices at a time
        if self.mode in GATED and self.act_q is not None:
            # blocks of 32 output rows, teams of 8 lanes; of 4 where the blocks of 256 threads would
            # not all be resident at once (the walking grid's second round then costs a whole one)
            tblocks = ws[0].shape[0] // 32
            tl = 3 if tblocks <= 3 * self.n_sm else 2
            threads = 32 << tl
        else:
            teams = ws[0].shape[0] if self.mode in GATED else -(-sum(w.shape[0] for w in ws) // 2)
            # lane steps of a row: slices of 32 values (two for the K-quants), 16-byte vectors for floats
            steps = k // 32 // spl if quantized(ws[0].type) else k // float_vec(ws[0].type)
            tl = team_log2(32 * steps, teams * n_groups)
            # a prologue's row lies in registers, 8 values a lane (PRO_REG): longer rows take more warps
            threads = MVQ_THREADS if k > 8 * MV_THREADS and self.in_prologue() else MV_THREADS
            if n == 1 and sum(w.shape[0] * w.data.row_bytes for w in ws) >= MV_FILL_MIN_BYTES:
                tl = fill_team_log2(tl, steps, teams, threads, self.n_sm)
            tblocks = -(-teams // (threads >> tl))
        # mv_n1_occ (80 registers) where mv_n1's blocks (128: two of 256 or four of 128 threads a
        # multiprocessor) would not all fit at once
        occ = nmax == 1 and tblocks * n_groups > self.n_sm * (2 if threads > MV_THREADS else 4)
        return MvGeometry(nmax, n_groups, tl, threads, tblocks, occ, self.n_sm)

    def _pre_steps(self, qtype, geo: MvGeometry, name: str) -> int:
        """Lane steps of weights a one-row product loads before it waits for x (0: none). A product
        whose prologue normalises x after the wait holds up to MV_PRE_STEPS (its later steps would
        otherwise be fetched after that); the others fetch them with x, so one is enough."""
        held = qtype in PRE_TYPES or (qtype in PRE_RAW_TYPES and name == "mv_n1_store")
        if geo.nmax != 1 or geo.occ or not held:
            return 0
        if not self.in_prologue():
            return 1
        steps = self.k // 32 // (2 if qtype in PAIRED_SLICES else 1)
        return max(1, min(MV_PRE_STEPS, -(-steps // (1 << geo.tl))))

    def _mats_args(self, group: list[int]) -> tuple:
        ws, outs = [self.ws[j] for j in group], [self.outs[j] for j in group]
        return (*pad4([ptr(w.data.buf) for w in ws], u64(0)), *pad4([ptr(o) for o in outs], u64(0)),
                *pad4([i32(w.shape[0]) for w in ws], i32(0)), i32(len(ws)), i64(ws[0].data.row_bytes))

    def _run_args(self, geo: MvGeometry, pre_dec: int, pf_row: int, kc: int) -> tuple:
        return (i32(self.k), i32(self.n), ptr(self.x), ptr(self.xq), i32(geo.tl), i32(geo.tblocks), i32(pre_dec),
                i64(pf_row), i32(kc))

    def _prefetch_row(self, ws: list, geo: MvGeometry) -> int:
        """Bytes at the start of each row that a team prefetches into L2: whole rows while the rows
        of the blocks resident at once fit in L2_PREFETCH_BYTES, else that budget shared out
        (whole 128-byte lines)."""
        row_bytes = ws[0].data.row_bytes
        rows = geo.grid * (geo.threads >> geo.tl) * 2  # two rows a team
        share = L2_PREFETCH_BYTES // max(1, rows) // 128 * 128
        return min(row_bytes, share)

    def _epilogue_args(self) -> tuple:
        return (i32(self.mode), ptr(self.aux), ptr(self.act_q))

    def _prologue_args(self) -> tuple:
        if not self.in_prologue():
            return (u64(0), u64(0), u64(0), f32(0), u64(0), u64(0), u64(0), u64(0), f32(0), u64(0))
        r = self.pro_res or ResidualPrologue(None, None, 0.0, None)
        return (ptr(self.src), ptr(self.idx), ptr(self.norm_w), f32(self.eps), ptr(self.x), ptr(r.y), ptr(r.yout),
                ptr(r.post_w), f32(r.post_eps), ptr(r.counter))

    # ---- tensor-core kernels ----
    def _split(self, kernels, group: list[int]) -> Launch:
        ws = [self.ws[j] for j in group]
        if self.mode in GATED and (len(ws) != 2 or ws[0].shape != ws[1].shape):
            raise AssertionError("a gated product multiplies two matrices of one shape")
        tiles, n_split, ups, _ = self._split_geometry(group)
        lay = layout(ws[0].type)
        span, smem = split_smem(ws[0].type)
        mats = self._mats_args(group)
        args = (*mats[:12], mats[13], i32(self.k), i32(self.n), ptr(self.x), ptr(self.split_buf.part),
                ptr(self.split_buf.counters), i32(ups), i32(self.mode), ptr(self.aux), i32(lay.block_size),
                i32(lay.type_size), i32(span))
        fn = kernels.fn(matmul_module(ws[0].type), "mm_split")
        allow_smem(fn, smem)
        return Launch(fn, (tiles, n_split, len(ws)), (MS_THREADS, 1, 1), args, smem=smem)

    def _tile(self, kernels, group: list[int]) -> Launch:
        ws = [self.ws[j] for j in group]
        rows_max = max(w.shape[0] for w in ws)
        tn = self._tile_rows(rows_max, len(ws))
        grid = (-(-rows_max // tn), -(-self.n // 64), len(ws))
        mats = self._mats_args(group)
        args = (*mats[:12], mats[13], i32(self.k), i32(self.n), ptr(self.x))
        name = "mm_tile" if tn == 128 else "mm_tile64"
        return Launch(kernels.fn(matmul_module(ws[0].type), name), grid, (128, 1, 1), args)

    def _tile_rows(self, rows_max: int, n_mat: int) -> int:
        """Weight rows per tile block: 64 (twice the blocks) where 128 would not give two blocks
        per multiprocessor, unless the config fixes it."""
        if self.cfg.tile_rows:
            return self.cfg.tile_rows
        return 64 if -(-rows_max // 128) * -(-self.n // 64) * n_mat < 2 * self.n_sm else 128


def mv_rows_for(ws: list, cfg: CudaConfig, split: bool) -> int:
    """Activation rows up to which a product over ws takes the matrix-vector kernels; with mm_split
    available, quantized products of more than 8 rows take that instead."""
    rows = min(matvec_rows(w.type, cfg.mv_rows) for w in ws) if ws else 8
    return min(rows, 8) if split else rows
