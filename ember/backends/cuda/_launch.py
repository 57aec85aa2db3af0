"""Kernel launches through the driver's cuLaunchKernelEx, for programmatic dependent launch.

A decode step is a chain of small kernels, each waiting on the one before it. Launched with the
"programmatic stream serialization" attribute, a kernel may start while its predecessor still
runs: it fetches its weights into L2 and then waits inside the kernel (griddepcontrol.wait, see
common.cuh) until the predecessor's writes are visible. The launch gap and the first trip to
memory then overlap the kernel before. Used only while a step is captured into a CUDA graph
(stream capture turns the attribute into programmatic edges); eager launches stay CuPy's.
Hopper (compute capability 9.0) and later, CUDA only.
"""
from __future__ import annotations

import ctypes

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID

_CTYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
           np.dtype(np.float32): ctypes.c_float}


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)),
                ("n_attrs", ctypes.c_uint)]


class LaunchError(RuntimeError):
    pass


class DriverLauncher:
    """cuLaunchKernelEx from libcuda, with or without the programmatic attribute."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._attr = _Attr(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value.flag = 1

    def launch(self, launch, stream_ptr: int, programmatic: bool) -> None:
        """Run a Launch (see _ops) on the stream; its arguments are numpy scalars."""
        values = [_CTYPES[a.dtype](a.item()) for a in launch.args]  # numpy scalars: their width is the C type's
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        g, b = launch.grid, launch.block
        cfg = _Config(g[0], g[1], g[2], b[0], b[1], b[2], launch.smem, stream_ptr,
                      ctypes.pointer(self._attr) if programmatic else None, 1 if programmatic else 0)
        fn = launch.fn.kernel if hasattr(launch.fn, "kernel") else launch.fn  # RawKernel -> its CUfunction
        rc = self._launch(ctypes.byref(cfg), fn.ptr, params, None)
        if rc != 0:
            raise LaunchError(f"cuLaunchKernelEx failed with CUresult {rc}")


def load_launcher(cp, device) -> tuple[DriverLauncher | None, str | None]:
    """The launcher, or None and why not (ROCm, a GPU older than Hopper, no driver symbol)."""
    if getattr(cp.cuda.runtime, "is_hip", False):
        return None, "ROCm"
    if int(device.compute_capability) < 90:
        return None, f"compute capability {device.compute_capability} < 9.0"
    try:
        return DriverLauncher(), None
    except (OSError, AttributeError) as e:
        return None, f"{type(e).__name__}: {e}"
