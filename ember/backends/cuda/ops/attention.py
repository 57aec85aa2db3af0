"""Attention over the paged KV cache: the plan of one step's attention (which kernel, how many
key-range splits, how they merge) and its launches, and the fused qkv_post before it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._kernels import ATT_TILE_DIMS
from .base import Launch, allow_smem, f32, i32, ptr, u64
from .rows import NO_ROPE, RopeArgs

DECODE_TOKENS = 8  # attention of steps up to this many tokens: four threads per key (few keys per split)
ATT_HEADS, ATT_MAX_D = 8, 256
ATT_VPRE = 8  # attn: values a thread loads with the first chunk's keys
ATT_TILE_ROWS = 64  # query rows (token, head) per attn_tile block


def att_min_keys(hd_v: int) -> int:
    """Positions a merged split of a decode step holds at least: as many as one pass takes at
    once, keys (32 at four threads a key) and values (ATT_VPRE per group of threads over the
    value pairs); wide heads have one group of threads, so fewer."""
    groups = max(1, 128 // max(1, hd_v // 2))
    return min(32, groups * ATT_VPRE)


def att_cluster_size(min_keys: int, blocks: int = 1, slots: int = 1 << 30) -> int:
    """Blocks of a decode attention cluster (attn_cluster<8|16>): 8 where they cover 256 positions
    in splits of min_keys, or where 16 splits of each of the step's `blocks` (token, head) pieces
    would be more blocks than `slots` (multiprocessors times waves: Llama-3.1-8B's 32 heads), else
    16."""
    return 8 if 8 * min_keys >= 256 or 16 * blocks > slots else 16


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
    longest possible range. decode: a batched decode step's pieces (one token each) are short
    work over long key ranges: split until the blocks fill every multiprocessor's slots (four of
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


def split_count(n_tok: int, n_kv: int, group: int, max_ctx: int, n_sm: int, waves: int = 2,
                heads_per_block: int = ATT_HEADS) -> int:
    """Key-range splits of decode attention: enough blocks for `waves` per multiprocessor, each
    split covering at least 16 positions of the longest possible sequence, at most 32 (a decode
    step's keys are few: more splits put more blocks to reading them)."""
    blocks = n_tok * n_kv * -(-group // heads_per_block)
    return max(1, min(-(-waves * n_sm // blocks), -(-max_ctx // 16), 32))


@dataclass(frozen=True, slots=True)
class AttentionTarget:
    """What the device offers attention: multiprocessors, tensor-core tiles (compute capability
    8.0+, CUDA), thread-block clusters (9.0+, CUDA), and the configured waves of split blocks."""

    n_sm: int
    tiles: bool
    clusters: bool
    waves: int = 2


@dataclass(frozen=True, slots=True)
class AttentionStep:
    """The shape of one step's attention, as the planner needs it."""

    n: int  # tokens
    n_seq: int
    max_ctx: int  # positions a page table row can hold
    n_head: int
    n_kv: int
    hd_k: int
    hd_v: int
    single: bool  # every token the only one of its sequence (a decode step)
    contiguous: bool  # each sequence's tokens form one run

    @property
    def group(self) -> int:
        return self.n_head // self.n_kv


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    tiles: bool
    n_split: int
    heads_per_block: int
    merge: bool  # attn's last split block merges the splits (counters), else attn_combine
    min_keys: int
    cluster: int  # with merge: blocks of an attn_cluster, 0 for none

    def part_floats(self, s: AttentionStep) -> int:
        return s.n * s.n_head * self.n_split * (s.hd_v + 2) if self.n_split > 1 else 0

    def counters(self, s: AttentionStep) -> int:
        return s.n * s.n_kv * -(-s.group // self.heads_per_block) if self.merge else 0


def plan_attention(t: AttentionTarget, s: AttentionStep) -> AttentionPlan:
    """Tensor-core tiles for steps of many tokens per sequence (and batched decode steps), the
    scalar kernel otherwise: one block per query head for short decode steps, key ranges split
    to fill the GPU, and splits merged by the last split block (in a cluster where one covers
    the range)."""
    min_keys = att_min_keys(s.hd_v)
    if takes_tiles(t, s):
        blocks = tile_pieces(s.n, s.group, s.n_seq) * s.n_kv * -(-s.group // ATT_HEADS)
        n_split = tile_split_count(blocks, s.hd_k, s.max_ctx, t.n_sm, s.single)
        return AttentionPlan(True, n_split, ATT_HEADS, False, min_keys, 0)
    hpb = 1 if s.n <= DECODE_TOKENS else ATT_HEADS
    n_split = split_count(s.n, s.n_kv, s.group, s.max_ctx, t.n_sm, t.waves, hpb)
    merge = n_split > 1
    blocks = s.n * s.n_kv * -(-s.group // hpb)
    cluster = att_cluster_size(min_keys, blocks, t.waves * t.n_sm) if merge and t.clusters and s.hd_v % 32 == 0 else 0
    if cluster:  # whole clusters of splits
        n_split = -(-n_split // cluster) * cluster
    return AttentionPlan(False, n_split, hpb, merge, min_keys, cluster)


def takes_tiles(t: AttentionTarget, s: AttentionStep) -> bool:
    return (t.tiles and (not s.single or s.n > DECODE_TOKENS) and s.hd_k == s.hd_v in ATT_TILE_DIMS
            and s.contiguous)


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
    sinks: Any = None  # device f32 (n_head,) or None: a logit per query head in each softmax's denominator

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
                               ptr(self.xq), ptr(self.sinks))))
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
                ptr(self.counters if merge else None), ptr(self.sinks))
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
                i32(self.n_split), ptr(self.sinks))
        return Launch(fn, (pieces, self.n_kv * n_hc, self.n_split), (128, 1, 1), args, smem=smem)

    def _fold_args(self) -> tuple:
        """attn's arguments for the folded qkv_post: k_new, v_new, q_norm, k_norm, eps, rope, slots
        (all zero: unfolded)."""
        p = self.post
        if p is None:
            return (u64(0), u64(0), u64(0), u64(0), f32(0), *NO_ROPE.kernel_args(), u64(0))
        return (ptr(p.k), ptr(p.v), ptr(p.q_norm), ptr(p.k_norm), f32(p.eps), *p.p.kernel_args(), ptr(p.slots))
