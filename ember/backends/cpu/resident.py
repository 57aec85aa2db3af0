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

Moved: stretches that overlap a matrix of at least MIN_BYTES that every token reads, and the
stretches of stacked experts once the kernels have read them. A token reads a few experts of each
stack, so moving whole stacks would make the resident memory the whole file: instead the expert
products mark, in a byte map per stack, each expert they read (experts.c), and the thread looks at
the maps every POLL_S seconds (or when asked: `wait`) and moves the 2 MB stretches of the experts
newly marked. The resident memory stays what the model has read, rounded out to 2 MB. Left mapped:
what a token reads only in part otherwise (an embedding table that is not also the output head), and
everything once the copies would pass half of the memory available at the start, so that a model
larger than RAM still runs from its mapping. Nothing moves where the kernel has no huge pages
(`transparent_hugepage` set to never) or no mremap (Linux only).

The thread holds a mapping only while it moves part of it: the matrices' mapping until they are
moved, and an expert stack's only during a pass (it keeps a weak reference to the stack's view
otherwise). Once a model's weights are dropped its file can unmap, and the thread ends when no
stack of it is left alive with experts still to move.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from dataclasses import dataclass

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


@dataclass(eq=False)
class _Stack:
    """One stacked expert tensor: where its experts lie, which the kernels marked, which are handled."""

    ref: weakref.ref  # the stack's view of the mapping (alive while the model is)
    addr: int  # of expert 0
    expert_bytes: int
    first: int  # the mapping's 2 MB-aligned addresses: [first, end)
    end: int
    used: np.ndarray  # (n_expert,) uint8, set by the kernels
    done: np.ndarray  # (n_expert,) bool: its stretches moved (or found moved)

    def chunks(self, experts) -> set[int]:
        """The 2 MB stretches inside the mapping that hold bytes of these experts."""
        out = set()
        for e in experts:
            lo = self.addr + int(e) * self.expert_bytes
            out.update(_stretches(self.first, self.end, lo, lo + self.expert_bytes))
        return out


class Settler:
    """Collects the file-mapped matrices (`add`) and expert stacks (`add_stack`) a backend hands out,
    then moves the matrices' stretches onto huge pages on a background thread (`start`), which goes on
    to move experts as the kernels mark them used."""

    POLL_S = 0.5  # between looks at the experts' maps

    def __init__(self):
        self._files: dict[int, tuple[int, list[tuple[int, int]]]] = {}  # by mapping address: size, spans
        self._hold: list[np.ndarray] = []  # the mappings of the matrices, until they are moved
        self._stacks: list[_Stack] = []
        self._on_huge: set[int] = set()  # 2 MB stretches moved
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._asked = self._served = 0  # passes over the maps asked for by `wait`, and the last one served
        self.moved = 0  # bytes now on huge pages
        self.moved_experts = 0  # of them, bytes moved for experts
        self.error: str | None = None  # why it stopped early, if it did

    @staticmethod
    def usable() -> bool:
        return sys.platform.startswith("linux") and huge_pages_enabled()

    def add(self, tensor) -> None:
        if tensor.nbytes < MIN_BYTES:
            return
        whole = tensor.mapped_file()
        if whole.ctypes.data not in self._files:
            self._files[whole.ctypes.data] = (whole.nbytes, [])
            self._hold.append(whole)
        self._files[whole.ctypes.data][1].append((tensor.offset, tensor.offset + tensor.nbytes))

    def add_stack(self, tensor, data: np.ndarray) -> np.ndarray:
        """An expert stack (n_expert, rows, cols) whose view `data` the model keeps: returns the byte
        map the expert products mark."""
        whole = tensor.mapped_file()
        base, n_expert = whole.ctypes.data, tensor.shape[0]
        used = np.zeros(n_expert, np.uint8)
        self._stacks.append(_Stack(weakref.ref(data), data.ctypes.data, data.nbytes // n_expert,
                                   *_inside(base, whole.nbytes), used, np.zeros(n_expert, bool)))
        return used

    def runs(self) -> list[tuple[int, int]]:
        """The matrices' address ranges to move: 2 MB-aligned, inside a mapping, overlapping a
        matrix; at most RUN bytes each."""
        chunks = set()
        for base, (size, spans) in self._files.items():
            first, end = _inside(base, size)
            for lo, hi in spans:
                chunks.update(_stretches(first, end, base + lo, base + hi))
        return _runs(chunks)

    def start(self) -> None:
        """Move the collected stretches on a daemon thread (once)."""
        if self._thread is None and (self._files or self._stacks):
            self._thread = threading.Thread(target=self._main, name="ember-settle", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the move has caught up (waiting up to timeout seconds for it): the matrices and
        every expert marked before this call are moved, or the thread has ended."""
        if self._thread is None:
            return True
        with self._cond:
            self._asked += 1
            want = self._asked
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._served >= want, timeout)

    def running(self) -> bool:
        """Whether the thread is still there (watching expert maps, or moving)."""
        return self._thread is not None and self._thread.is_alive()

    def _main(self) -> None:
        try:  # the lowest priority: decoding goes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        budget = memory_available() // 2
        libc = _libc()
        try:
            self._move_runs(libc, self.runs(), budget)  # self._hold keeps the mappings meanwhile
            self._hold.clear()
            while True:
                with self._cond:
                    asked = self._asked
                more = self._move_experts(libc, budget)
                with self._cond:
                    self._served = asked
                    self._cond.notify_all()
                    if not more:
                        return
                    self._cond.wait_for(lambda: self._asked > asked, self.POLL_S)
        except OSError as e:
            self.error = str(e)
        finally:
            self._hold.clear()
            with self._cond:
                self._served = 1 << 62
                self._cond.notify_all()

    def _move_experts(self, libc, budget: int) -> bool:
        """Moves the stretches of the experts marked since the last pass; whether any stack is left
        alive with experts still to move."""
        alive, chunks, more = [], set(), False
        for s in self._stacks:
            data = s.ref()
            if data is None:
                continue
            new = np.flatnonzero(s.used.astype(bool) & ~s.done)
            s.done[new] = True
            chunks |= s.chunks(new)
            alive.append(data)  # the mapping stays while its stretches move
            more = more or not s.done.all()
        before = self.moved
        self._move_runs(libc, _runs(chunks - self._on_huge), budget)
        self.moved_experts += self.moved - before
        return more and self.error is None

    def _move_runs(self, libc, runs: list[tuple[int, int]], budget: int) -> None:
        for lo, hi in runs:
            if self.moved + (hi - lo) > budget:
                self.error = "stopped at half of the available memory"
                return
            self._move(libc, lo, hi - lo)
            self.moved += hi - lo
            self._on_huge.update(range(lo, hi, HUGE))

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


def _inside(base: int, size: int) -> tuple[int, int]:
    """The 2 MB-aligned addresses [first, end) inside a mapping of `size` bytes at `base`."""
    return -(-base // HUGE) * HUGE, (base + size) // HUGE * HUGE


def _stretches(first: int, end: int, lo: int, hi: int) -> range:
    """The 2 MB stretches in [first, end) that hold bytes of the addresses [lo, hi)."""
    return range(max(first, lo // HUGE * HUGE), min(end, hi), HUGE)


def _runs(chunks) -> list[tuple[int, int]]:
    """2 MB stretches joined into address ranges of at most RUN bytes each."""
    out = []
    for c in sorted(chunks):
        if out and out[-1][1] == c and out[-1][1] - out[-1][0] < RUN:
            out[-1] = (out[-1][0], c + HUGE)
        else:
            out.append((c, c + HUGE))
    return out
