"""The KV page pool's bookkeeping: which pages are free and who references each.

A page holds the keys and values of `page_size` consecutive positions of one sequence,
in every layer. Pages are shared by reference count: the prefix tree and any number of
running sequences may point at the same page; it returns to the free list when the
last reference goes. A page with more than one reference is never written: a writer
copies it first (copy on write).
"""
from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs pages and slots (got {n_pages} pages of {page_size})")
        self.n_pages, self.page_size = n_pages, page_size
        self.refs = [0] * n_pages
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: low ids first

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A fresh page with one reference (the caller's)."""
        if not self._free:
            raise OutOfPages("no free KV page")
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def retain(self, pages) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.refs[p] += 1

    def release(self, pages) -> int:
        """Drop one reference to each page; returns how many pages became free."""
        freed = 0
        for p in pages:
            if self.refs[p] <= 0:
                raise ValueError(f"page {p} released more often than retained")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def shared(self, page: int) -> bool:
        return self.refs[page] > 1

    def pages_for(self, n_tokens: int) -> int:
        """Pages needed to hold positions 0..n_tokens-1."""
        return -(-n_tokens // self.page_size)
