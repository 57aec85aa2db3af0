"""The KV cache in BF16, Q8_0 or Q4_0 (kernels/kv_quant.cu): the write quantizing each row, and
the attention reading the rows in place. Caches of these types are u8 (n_slots, row bytes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....quant.types import GGMLType
from .base import Launch, f32, i32, ptr

ATTQ_MAX_D = 512


@dataclass(eq=False)
class Hadamard:
    """out (n, d) = x rotated in blocks of `block` values (a power of two <= 1024); out may be x."""

    x: Any
    out: Any
    block: int

    def launches(self, kernels) -> list[Launch]:
        n, d = self.x.shape
        return [Launch(kernels.fn("kv_quant", "hadamard"), (n, d // self.block, 1), (self.block, 1, 1),
                       (ptr(self.x), ptr(self.out), i32(d), i32(self.block)))]


@dataclass(eq=False)
class KvStoreQ:
    """k_cache row slots[t] = k[t] as k_type, v likewise."""

    k: Any
    v: Any
    k_cache: Any
    v_cache: Any
    slots: Any  # device int64 (n,)
    k_type: GGMLType
    v_type: GGMLType

    def launches(self, kernels) -> list[Launch]:
        args = (ptr(self.k), ptr(self.v), ptr(self.k_cache), ptr(self.v_cache), ptr(self.slots),
                i32(self.k.shape[1]), i32(self.v.shape[1]), i32(int(self.k_type)), i32(int(self.v_type)))
        return [Launch(kernels.fn("kv_quant", "kv_store_q"), (self.k.shape[0], 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class AttentionQ:
    """Causal attention of q (n, n_head * hd_k) over caches of k_type and v_type; out (n, n_head * hd_v)."""

    q: Any
    k_cache: Any
    v_cache: Any
    out: Any
    pos: Any  # device int32 (n,)
    seq_rows: Any  # device int32 (n,)
    tables: Any  # device int32 (n_seq, max_pages)
    page_size: int
    n_head: int
    n_kv: int
    window: int
    scale: float
    softcap: float
    k_type: GGMLType
    v_type: GGMLType
    sinks: Any = None  # device f32 (n_head,) or None: a logit per query head in each softmax's denominator

    def launches(self, kernels) -> list[Launch]:
        n = self.q.shape[0]
        hd_k, hd_v = self.q.shape[1] // self.n_head, self.out.shape[1] // self.n_head
        args = (ptr(self.q), ptr(self.k_cache), ptr(self.v_cache), ptr(self.out), ptr(self.pos), ptr(self.seq_rows),
                ptr(self.tables), i32(self.tables.shape[1]), i32(self.page_size), i32(self.n_head), i32(self.n_kv),
                i32(hd_k), i32(hd_v), i32(self.window), f32(self.scale), f32(self.softcap), i32(int(self.k_type)),
                i32(int(self.v_type)), ptr(self.sinks))
        return [Launch(kernels.fn("kv_quant", "attn_q"), (n, self.n_head, 1), (128, 1, 1), args)]
