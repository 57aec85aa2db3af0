"""Mixture-of-experts ops: routing, grouped expert products (experts.cu) and the weighted sum. The
expert ids stay on the device: the products read them there, and each launch's grid is fixed by the
step's size (blocks with no chosen expert or tile return at once), so a step's launches are captured
like the others.

A product of quantized experts quantizes x first (quant_x_llama: the dense decode products' format,
rounded as llama.cpp's CPU rounds activations for the weights' type), then
takes one of two kernels by the step's tokens and row length (takes_mv): expert_mv for a few tokens
(decode: a block row per chosen expert, each selection's x staged once, each weight slice decoded
once for all of an expert's selections), else expert_group (the selections sorted by expert into tiles, on the device)
and expert_tile (a block a tile of an expert's rows and selections, int8 dot products). Float experts take expert_matmul (a warp a row)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ....quant.types import GGMLType, layout
from .base import MATRIX_TYPES, Launch, allow_smem, f32, i32, i64, ptr, quantized

EXP_ROWS = 8  # rows of a block of expert_matmul, one a warp (experts.cu)
EMV_RW, EMV_THREADS, EMV_NMAX = 2, 256, 8  # expert_mv: rows a team, threads of a block, selections staged at most
# Shared memory of expert_mv: its staged x rows take at most EMV_SMEM (unless one row needs more),
# beside its static list of selections, their count, the chosen experts' bitmap and the slot's expert
# (4 KB + 16, 128 + 16 with alignment); past 48 KB in all a launch must ask for it (allow_smem).
EMV_SMEM, EMV_STATIC_SMEM = 40 * 1024, 4 * 1024 + 16 + 128 + 16
ET_ROWS, ET_TOK, ET_THREADS = 64, 32, 128  # expert_tile: weight rows and selections of a tile, threads
# The choice between them by shape (CudaConfig.moe_mv_tokens = -1), from bench/expert_micro.py: expert_mv
# takes steps of up to EMV_TOKENS tokens over rows of at least EMV_MIN_K values (H200: Qwen3's gate and
# up, k 2048: 64 against 107 us at 16 tokens, even at 64; gpt-oss, k 2880: 162 against 265 us at 16), and
# shorter rows up to EMV_SHORT_TOKENS (H100, since its blocks go to the chosen experts only: Qwen3's
# down, k 768: 12.9 against 17.9 us at 1 token, 37.0 against 39.1 at 4; the tiles 90 against 130 at 16).
EMV_TOKENS, EMV_MIN_K, EMV_SHORT_TOKENS = 48, 1536, 4
EG_THREADS = 1024  # expert_group: one block
EG_MAX_EXPERTS = 1024  # experts expert_group sorts into (its shared counters)
ROUTE_MAX_EXPERTS = 256  # route_experts holds 8 experts a lane (ops.cu)
# Types of stacked experts: every matrix type, and MXFP4 (gpt-oss's experts; unit_q in quant.cuh)
EXPERT_TYPES = MATRIX_TYPES | {GGMLType.MXFP4}


MXFP4_RUN, MXFP4_RUN_BYTES = 16, 272  # the device layout of MXFP4 (ops.cu mxfp4_regroup, quant.cuh unit_q)


def device_row_bytes(qtype, k: int) -> int:
    """Bytes of a row of k values of stacked experts on the device: GGUF's, except MXFP4, whose units
    are regrouped in runs of 16 (272 bytes: 16 scale bytes, then 16 aligned code runs), the last run
    of t < 16 units in 16 + 16 t bytes."""
    if qtype == GGMLType.MXFP4:
        n = k // 32
        return n // MXFP4_RUN * MXFP4_RUN_BYTES + (16 + 16 * (n % MXFP4_RUN) if n % MXFP4_RUN else 0)
    return layout(qtype).row_bytes(k)


def regroup_mxfp4(raw: np.ndarray, k: int) -> np.ndarray:
    """What mxfp4_regroup (ops.cu) makes of MXFP4 rows (rows, k / 32 * 17) bytes, in numpy (tests and
    bench/cuda_experts_check.py; the backend regroups on the device)."""
    rows, n = raw.shape[0], k // 32
    units = np.zeros((rows, -(-n // MXFP4_RUN) * MXFP4_RUN, 17), np.uint8)
    units[:, :n] = raw.reshape(rows, n, 17)
    runs = units.reshape(rows, -1, MXFP4_RUN, 17)
    out = np.concatenate([runs[..., 0], runs[..., 1:].reshape(rows, runs.shape[1], 16 * MXFP4_RUN)], axis=2)
    return out.reshape(rows, -1)[:, :device_row_bytes(GGMLType.MXFP4, k)]


# Gated activations quant_x_llama can compute as it rounds x, by a GatedAct's or SwigluOai's act
# (common.cuh ACT_*)
ACT_CODES = {"silu": 1, "gelu": 2, "swiglu_oai": 3}


def experts_module(qtype) -> str:
    return f"experts_{int(qtype)}"


def tile_bound(n_sel: int, n_expert: int) -> int:
    """Tiles of ET_TOK selections that n_sel selections over n_expert experts can make at most: the
    sum over chosen experts of ceil(count / ET_TOK), each ceiling adding under one."""
    return (n_sel + min(n_expert, n_sel) * (ET_TOK - 1)) // ET_TOK


def mv_team_log2(qtype, k: int) -> int:
    """Lanes of an expert_mv team, log2: a lane takes a lane step of a row (a slice, two for Q4_K and
    Q5_K), so rows of fewer than 32 steps take teams as narrow as their steps (at least 4 lanes) and a
    block more rows: Qwen3-30B-A3B's down products (Q4_K rows of 768, 12 steps) teams of 16, 32 rows
    a block instead of 16, half the blocks (fewer waves of blocks, no lane idle in most)."""
    steps = k // 32 // (2 if qtype in (GGMLType.Q4_K, GGMLType.Q5_K) else 1)
    return max(2, min(5, (steps - 1).bit_length()))


def mv_rows(qtype, k: int) -> int:
    """Rows of an expert_mv block: EMV_RW a team."""
    return (EMV_THREADS >> mv_team_log2(qtype, k)) * EMV_RW


def mv_group(k: int) -> int:
    """Selections expert_mv stages at a time for rows of k values (each k int8 and k/32 float4)."""
    return max(1, min(EMV_NMAX, EMV_SMEM // (k + k // 2)))


def llama_group(qtype, k: int) -> int:
    """Values sharing a scale in llama.cpp's rounding of x for weights of qtype: 256 for the K-quants
    (its Q8_K), else 32 (its Q8_0)."""
    return 256 if layout(qtype).block_size == 256 and k % 256 == 0 else 32


# experts.cu IS_KQ: the types expert_tile_sb takes
SB_TYPES = (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def tile_kernel(qtype, x_group: int) -> str:
    """expert_tile_sb for the K-quants against x rounded in groups of 256 (integer sums over a super-block,
    its float scales once), else expert_tile (each unit's sums scaled)."""
    return "expert_tile_sb" if qtype in SB_TYPES and x_group == 256 else "expert_tile"


def takes_mv(n: int, k: int, mv_tokens: int = -1) -> bool:
    """Whether a grouped product of an n-token step over rows of k values takes expert_mv (else
    expert_group + expert_tile): by shape for mv_tokens = -1, else up to mv_tokens tokens."""
    if mv_tokens >= 0:
        return n <= mv_tokens
    return n <= (EMV_TOKENS if k >= EMV_MIN_K else EMV_SHORT_TOKENS)


@dataclass(eq=False)
class RouteExperts:
    """ids (n, k) int32 and weights (n, k) = each row's k most probable experts of softmax(logits)."""

    logits: Any  # (n, n_expert)
    k: int
    norm: bool
    ids: Any
    weights: Any

    def launches(self, kernels) -> list[Launch]:
        n, n_expert = self.logits.shape
        args = (ptr(self.logits), ptr(self.ids), ptr(self.weights), i32(n), i32(n_expert), i32(self.k),
                i32(int(self.norm)))
        return [Launch(kernels.fn("ops", "route_experts"), (-(-n // 4), 1, 1), (128, 1, 1), args)]


@dataclass(frozen=True)
class ExpertScratch:
    """Device buffers of a grouped product: x quantized, and the selections sorted into tiles."""

    xq: Any  # uint8 xq_bytes(x rows, k)
    order: Any  # int32 (n_sel,): selections by expert
    tiles: Any  # int32 (tile_bound, 4): expert, first position in order, count, 0
    n_tiles: Any  # int32 (1,)


@dataclass(eq=False)
class ExpertMatmul:
    """ys[i] (n_sel, m_i): row s = ws[i][ids[s]] @ x[s // x_div] (+ biases[i][ids[s]] where that is not None),
    ws[i] stacked experts (n_expert, m_i, k). The biases come from a following ExpertBias (_fuse.py)."""

    ws: list  # Weights (data: DeviceMatrix of the whole stack), all of k columns
    x: Any  # (x rows, k) f32
    x_div: int
    ids: Any  # device int32 (n, n_used)
    ys: list
    scratch: ExpertScratch
    mv_tokens: int  # CudaConfig.moe_mv_tokens: -1 by shape (takes_mv), else steps up to this many tokens
    biases: list | None = None  # per matrix: stacked biases (n_expert, m_i) f32 (a Weight), or None
    # A GatedAct or SwigluOai whose out is x, done by quant_x_llama as it rounds x (_fuse.py): x is then
    # computed from the activation's gate and up, and also stored to its out
    act: Any = None
    # The RouteExperts that wrote ids, run in the same launch as quant_x_llama (route_quant_x_llama, _fuse.py)
    route: Any = None

    def bias_arg(self, i: int) -> np.uint64:
        b = self.biases[i] if self.biases else None
        return ptr(b.data.buf if b is not None else None)

    def launches(self, kernels) -> list[Launch]:
        out = [self._float(kernels, i) for i, w in enumerate(self.ws) if not quantized(w.type)]
        quant = [i for i, w in enumerate(self.ws) if quantized(w.type)]
        if not quant:
            return out
        out.append(self._quant_x(kernels))
        if takes_mv(self.ids.shape[0], self.x.shape[1], self.mv_tokens):
            return out + [self._mv(kernels, pair) for pair in self._mv_pairs(quant)]
        return out + [self._group(kernels, self.ws[quant[0]])] + [self._tile(kernels, i) for i in quant]

    def _weight_args(self, w) -> tuple:
        _, m, k = w.shape
        return ptr(w.data.buf), i64(w.data.row_bytes), i64(m * w.data.row_bytes), i32(m), i32(k)

    def _float(self, kernels, i: int) -> Launch:
        w, y = self.ws[i], self.ys[i]
        n_expert, m, _ = w.shape
        args = (*self._weight_args(w), ptr(self.x), i32(self.x_div), ptr(self.ids), i32(self.ids.size), ptr(y),
                self.bias_arg(i))
        fn = kernels.fn(experts_module(w.type), "expert_matmul")
        return Launch(fn, (-(-m // EXP_ROWS), n_expert, 1), (32 * EXP_ROWS, 1, 1), args)

    def _quant_x(self, kernels) -> Launch:
        """x quantized as llama.cpp's CPU rounds it for the first quantized matrix's type (quant_x_llama)."""
        rows, k = self.x.shape
        group = self.x_group
        a = self.act  # with a fused activation, x is computed from its gate and up (and stored to its out)
        src, up, out, code = (a.gate, a.up, a.out, ACT_CODES[a.act]) if a is not None else (self.x, None, None, 0)
        args = (ptr(src), ptr(self.scratch.xq), i32(rows), i32(k), i32(group), ptr(up), ptr(out), i32(code),
                f32(getattr(a, "alpha", 0.0)), f32(getattr(a, "limit", 0.0)))
        qy = -(-k // 1024)  # blocks of a row: 4 warps of 256 values
        if self.route is None:
            return Launch(kernels.fn("ops", "quant_x_llama"), (rows, qy, 1), (128, 1, 1), args)
        route = self.route.launches(kernels)[0]
        route_blocks = route.grid[0]
        return Launch(kernels.fn("ops", "route_quant_x_llama"), (route_blocks + rows * qy, 1, 1), (128, 1, 1),
                      (*route.args, i32(route_blocks), *args, i32(qy)))

    def _mv_pairs(self, quant: list[int]) -> list[list[int]]:
        """The quantized matrices in launches of expert_mv: two of one type and shape (gate and up) share one."""
        out: list[list[int]] = []
        for i in quant:
            w = self.ws[i]
            if out and len(out[-1]) == 1 and (self.ws[out[-1][0]].type, self.ws[out[-1][0]].shape) == (w.type, w.shape):
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def _mv(self, kernels, pair: list[int]) -> Launch:
        """expert_mv over one matrix, or two of one type and shape (grid z: which)."""
        w, y = self.ws[pair[0]], self.ys[pair[0]]
        n_expert, m, k = w.shape
        group = mv_group(k)
        smem = group * (k + k // 2)
        fn = kernels.fn(experts_module(w.type), "expert_mv")
        allow_smem(fn, smem + EMV_STATIC_SMEM)
        second = (ptr(self.ws[pair[1]].data.buf), ptr(self.ys[pair[1]]), self.bias_arg(pair[1])) if len(pair) == 2 \
            else (ptr(None), ptr(None), ptr(None))
        args = (*self._weight_args(w), ptr(self.scratch.xq), i32(self.x.shape[0]), i32(self.x_div), ptr(self.ids),
                i32(self.ids.size), i32(n_expert), i32(group), ptr(y), self.bias_arg(pair[0]), *second,
                i32(mv_team_log2(w.type, k)))
        # a block row per expert that can have been chosen: at most one per selection
        grid = (-(-m // mv_rows(w.type, k)), min(n_expert, self.ids.size), len(pair))
        return Launch(fn, grid, (EMV_THREADS, 1, 1), args, smem)

    def _group(self, kernels, w) -> Launch:
        sc = self.scratch
        args = (ptr(self.ids), i32(self.ids.size), i32(w.shape[0]), ptr(sc.order), ptr(sc.tiles), ptr(sc.n_tiles))
        return Launch(kernels.fn(experts_module(w.type), "expert_group"), (1, 1, 1), (EG_THREADS, 1, 1), args)

    def _tile(self, kernels, i: int) -> Launch:
        w, y = self.ws[i], self.ys[i]
        n_expert, m, _ = w.shape
        sc = self.scratch
        args = (*self._weight_args(w), ptr(sc.xq), i32(self.x.shape[0]), i32(self.x_div), ptr(sc.order),
                ptr(sc.tiles), ptr(sc.n_tiles), ptr(y), self.bias_arg(i))
        grid = (-(-m // ET_ROWS), tile_bound(self.ids.size, n_expert), 1)
        return Launch(kernels.fn(experts_module(w.type), tile_kernel(w.type, self.x_group)), grid, (ET_THREADS, 1, 1),
                      args)

    @property
    def x_group(self) -> int:
        """quant_x_llama's group for this product's x: that of its first quantized matrix."""
        return llama_group(next(w.type for w in self.ws if quantized(w.type)), self.x.shape[1])


@dataclass(eq=False)
class ExpertSum:
    """out (n, d) = sum over u of weights[t, u] * y[t * k + u]; and res += out where res is given (the
    residual add after it, _fuse.py)."""

    y: Any
    weights: Any
    out: Any
    res: Any = None

    def launches(self, kernels) -> list[Launch]:
        n, k = self.weights.shape
        d = self.out.shape[1]
        args = (ptr(self.y), ptr(self.weights), ptr(self.out), i32(n), i32(k), i32(d), ptr(self.res))
        return [Launch(kernels.fn("ops", "expert_sum"), (-(-(n * d) // 256), 1, 1), (256, 1, 1), args)]


@dataclass(eq=False)
class ExpertBias:
    """y (n_sel, d) += b[ids[s]] for each row s (b: the stacked biases, (n_expert, d) f32)."""

    y: Any
    b: Any  # Weight (data: DeviceMatrix)
    ids: Any

    def launches(self, kernels) -> list[Launch]:
        rows, d = self.y.shape
        args = (ptr(self.y), ptr(self.b.data.buf), ptr(self.ids), i32(rows), i32(d))
        return [Launch(kernels.fn("ops", "expert_bias"), (-(-(rows * d) // 256), 1, 1), (256, 1, 1), args)]


@dataclass(eq=False)
class SwigluOai:
    """out = g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit)."""

    act = "swiglu_oai"  # not a field: its name in ACT_CODES, as GatedAct's act
    gate: Any
    up: Any
    out: Any
    alpha: float
    limit: float

    def launches(self, kernels) -> list[Launch]:
        n = self.gate.size
        args = (ptr(self.gate), ptr(self.up), ptr(self.out), i64(n), f32(self.alpha), f32(self.limit))
        return [Launch(kernels.fn("ops", "swiglu_oai"), (-(-n // 256), 1, 1), (256, 1, 1), args)]
