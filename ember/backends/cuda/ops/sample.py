"""Device reductions for sampling: the k largest logits of each row."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Launch, i32, ptr

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
