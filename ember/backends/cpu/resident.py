"""Weight matrices moved, in place, from the file's mapping onto anonymous 2 MB pages.

A decode step streams every weight matrix from DRAM once. Through the file's mapping that is one
4 KB page-cache page after another, scattered in physical memory: hundreds of thousands of page
walks per token (an 800 MB model), each a DRAM read of its own once the page tables have left the
caches, and the hardware prefetchers stop at every page boundary. The same bytes on transparent
huge pages decode 1.6x as fast (llama-1b Q4_K_M, 2 threads: 19 -> 30 tok/s, bench/NOTES.md).
Linux maps files with 4 KB pages, so the bytes are copied.

They are copied in place: for each 2 MB-aligned stretch of the mapping's addresses that holds
matrix bytes, anonymous memory advised for huge pages is filled with the same bytes and then moved
over the stretch (mremap), so every view, pointer and recorded step that points there keeps
working and from then on reads huge pages. A kernel reading the stretch meanwhile sees the old
page or the new one, which hold the same bytes. It runs on a thread of its own at the lowest
priority, after the model is loaded, so start-up does not wait for it (faulting fresh huge pages
can cost seconds a gigabyte on a virtual machine) and decoding runs from the mapping until it is
done. The page cache keeps the file's pages, which the kernel reclaims as it needs.

Moved: stretches that overlap a matrix of at least MIN_BYTES that every token reads. Left mapped:
what a token reads only in part (an embedding table that is not also the output head, stacked
experts), and everything once the copies would pass half of the memory available at the start,
so that a model larger than RAM still runs from its mapping. Nothing moves where the kernel has
no huge pages (`transparent_hugepage` set to never) or no mremap (Linux only).
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np

HUGE = 2 << 20
RUN = 64 << 20  # bytes moved by one mremap at most: the move is spread over the time it takes
MIN_BYTES = 256 << 10

_PROT_READ, _PROT_WRITE = 1, 2
_MAP_PRIVATE, _MAP_ANONYMOUS = 0x02, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MADV_HUGEPAGE = 14


def huge_pages_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def memory_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    libc.mmap.restype, libc.mmap.argtypes = vp, [vp, sz, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [vp, sz]
    libc.mprotect.argtypes = [vp, sz, ctypes.c_int]
    libc.madvise.argtypes = [vp, sz, ctypes.c_int]
    libc.mremap.restype, libc.mremap.argtypes = vp, [vp, sz, sz, ctypes.c_int, vp]
    libc.memcpy.restype, libc.memcpy.argtypes = vp, [vp, vp, sz]
    return libc


class Settler:
    """Collects the file-mapped matrices a backend hands out (`add`), then moves the stretches
    that hold them onto huge pages on a background thread (`start`)."""

    def __init__(self):
        self._files: dict[int, tuple[np.ndarray, list[tuple[int, int]]]] = {}  # by mapping address
        self._thread: threading.Thread | None = None
        self.moved = 0  # bytes now on huge pages
        self.error: str | None = None  # why it stopped early, if it did

    @staticmethod
    def usable() -> bool:
        return sys.platform.startswith("linux") and huge_pages_enabled()

    def add(self, tensor) -> None:
        if tensor.nbytes < MIN_BYTES:
            return
        whole = tensor.mapped_file()
        entry = self._files.setdefault(whole.ctypes.data, (whole, []))
        entry[1].append((tensor.offset, tensor.offset + tensor.nbytes))

    def runs(self) -> list[tuple[int, int]]:
        """Address ranges to move: 2 MB-aligned, inside a mapping, overlapping a matrix; at most RUN
        bytes each."""
        out = []
        for base, (whole, spans) in self._files.items():
            first, end = -(-base // HUGE) * HUGE, (base + whole.nbytes) // HUGE * HUGE
            chunks = sorted({c for lo, hi in spans
                             for c in range(max(first, (base + lo) // HUGE * HUGE), min(end, base + hi), HUGE)})
            for c in chunks:
                if out and out[-1][1] == c and out[-1][1] - out[-1][0] < RUN:
                    out[-1] = (out[-1][0], c + HUGE)
                else:
                    out.append((c, c + HUGE))
        return out

    def start(self) -> None:
        """Move the collected stretches on a daemon thread (once)."""
        if self._thread is None and self._files:
            self._thread = threading.Thread(target=self._move_all, name="ember-settle", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the move has finished (waiting up to timeout seconds for it)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def _move_all(self) -> None:
        try:  # the lowest priority: decoding goes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        budget = memory_available() // 2
        libc = _libc()
        try:  # self._files holds a view of each mapping: none can close meanwhile
            for lo, hi in self.runs():
                if self.moved + (hi - lo) > budget:
                    self.error = "stopped at half of the available memory"
                    return
                self._move(libc, lo, hi - lo)
                self.moved += hi - lo
        except OSError as e:
            self.error = str(e)

    @staticmethod
    def _move(libc, addr: int, n: int) -> None:
        raw = libc.mmap(None, n + HUGE, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if raw in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of anonymous memory failed")
        start = -(-raw // HUGE) * HUGE  # its own 2 MB-aligned mapping: the slack around it is returned
        if start > raw:
            libc.munmap(raw, start - raw)
        if raw + n + HUGE > start + n:
            libc.munmap(start + n, raw + n + HUGE - (start + n))
        libc.madvise(start, n, _MADV_HUGEPAGE)
        libc.memcpy(start, addr, n)
        libc.mprotect(start, n, _PROT_READ)
        if libc.mremap(start, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, addr) != addr:
            err = ctypes.get_errno()
            libc.munmap(start, n)
            raise OSError(err, f"mremap onto the mapping failed: {os.strerror(err)}")
