"""Step inputs (host int arrays: token ids, positions, page tables, slots) on their way to the GPU,
and recorded steps.

Direct steps copy each input through a pinned ring buffer with one asynchronous copy, so the
host never waits for the GPU between ops; an input used by several ops (positions, by every
layer) is copied once while its contents stay the same.

A recorded step owns fixed pinned and device buffers for its inputs and outputs. Its ops are
fused and captured, together with the copies, into a CUDA graph; a replay writes the step's new
inputs into the pinned buffers and launches the graph: one launch from Python per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .ops.base import Copy

H2D, D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost
ALIGN = 256


def input_key(a: np.ndarray) -> tuple:
    return (a.__array_interface__["data"][0], a.shape, a.dtype.str)


class InputRing:
    """Direct steps' inputs: pinned host ring -> device ring, one async copy per distinct input."""

    def __init__(self, cp, nbytes: int = 1 << 20):
        self.cp = cp
        self._alloc(nbytes)

    def _alloc(self, nbytes: int) -> None:
        import cupyx

        self.host = cupyx.empty_pinned(nbytes, np.uint8)
        self.dev = self.cp.empty(nbytes, np.uint8)
        self.pos = 0
        self.cache: dict = {}  # input_key -> (snapshot, device view)

    def upload(self, a: np.ndarray):
        key = input_key(a)
        hit = self.cache.get(key)
        if hit is not None and np.array_equal(hit[0], a):
            return hit[1]
        size = -(-max(a.nbytes, 1) // ALIGN) * ALIGN
        if self.pos + size > self.host.nbytes:
            # Wrap: wait until every earlier copy has left the host ring and every kernel that
            # read the device ring has run, then reuse both from the start.
            self.cp.cuda.Stream.null.synchronize()
            if size > self.host.nbytes:
                self._alloc(max(size, 2 * self.host.nbytes))
            self.pos, self.cache = 0, {}
        dev = self.cp.ndarray(a.shape, a.dtype, memptr=self.dev.data + self.pos)
        if a.nbytes:
            self.host[self.pos:self.pos + a.nbytes] = a.reshape(-1).view(np.uint8)
            Copy(dev.data.ptr, self.host.ctypes.data + self.pos, a.nbytes, H2D).run()
        self.cache[key] = (a.copy(), dev)
        self.pos += size
        return dev


@dataclass
class Recording:
    """One recorded forward pass: its ops, its fixed input/output buffers, and its graph."""

    ops: list = field(default_factory=list)
    uploads: list = field(default_factory=list)  # Copy host->device, first in the graph
    downloads: list = field(default_factory=list)  # Copy device->host, last in the graph
    inputs: list = field(default_factory=list)  # (host view read at each replay, its pinned buffer)
    by_key: dict = field(default_factory=dict)
    launches: list = field(default_factory=list)  # what a replay runs, fused
    graph: object = None
    n_ops_fused: int = 0
    run_now: bool = True  # ops, uploads and downloads also run as they are recorded (else: at the first replay)

    def upload(self, cp, a: np.ndarray):
        """The device copy of step input `a`; its host memory is read again at every replay."""
        import cupyx

        key = input_key(a)
        dev = self.by_key.get(key)
        if dev is not None:
            return dev
        pinned = cupyx.empty_pinned(a.shape, a.dtype)
        np.copyto(pinned, a)
        dev = cp.empty(a.shape, a.dtype)
        copy = Copy(dev.data.ptr, pinned.ctypes.data, a.nbytes, H2D, keep=(dev, pinned))
        if a.nbytes:
            if self.run_now:
                copy.run()
            self.uploads.append(copy)
        self.inputs.append((a, pinned))
        self.by_key[key] = dev
        return dev

    def download(self, cp, a) -> np.ndarray:
        """A pinned host array that holds device array `a` after this step and every replay."""
        import cupyx

        pinned = cupyx.empty_pinned(a.shape, a.dtype)
        copy = Copy(pinned.ctypes.data, a.data.ptr, a.nbytes, D2H, keep=(a, pinned))
        if a.nbytes:
            if self.run_now:
                copy.run()
            self.downloads.append(copy)
        if self.run_now:
            cp.cuda.Stream.null.synchronize()
        return pinned

    def stage_inputs(self) -> None:
        for host, pinned in self.inputs:
            np.copyto(pinned, host)
