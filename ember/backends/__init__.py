"""Compute backends. Each backend is a module or package `ember.backends.<name>` exporting a class
`Backend` that implements the protocol in `base.py` and declares its `Capabilities`; model code
calls only the ops, the engine asks the declaration. `device="<name>"` finds a new backend with
no edit here; AUTO lists those `device="auto"` tries."""
from __future__ import annotations

import glob
import importlib
import os
import sys

from .base import (KV_TYPES, AttentionBatch, Backend, BackendError, Capabilities, KVLayer, RopeParams, Weight, kv_rotation,
                   kv_type)

__all__ = ["AttentionBatch", "Backend", "BackendError", "Capabilities", "KVLayer", "KV_TYPES", "RopeParams", "Weight",
           "get_backend", "available", "kv_rotation", "kv_type"]


def _gpu_driver_present() -> bool:
    """Whether a GPU driver is loaded (Linux: NVIDIA's or ROCm's device files). Where that cannot be
    told cheaply, True: the backend itself then finds out."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd"))


def _discrete_webgpu_present() -> bool:
    """Whether wgpu is installed and sees a discrete GPU (a software adapter such as lavapipe, or an
    integrated GPU sharing the CPU's memory, is left to `--device webgpu`). On Linux the kernel
    tells first: without GPU device files, or when every render node is a GPU that cannot be
    discrete, wgpu is not imported (its import and adapter listing cost 0.3-0.9 s of every start)."""
    if sys.platform.startswith("linux") and not (_linux_gpu_device_files() and _linux_discrete_possible()):
        return False
    from .webgpu import _device

    return _device.discrete_present()


def _linux_gpu_device_files() -> bool:
    """Whether a GPU's device files are here: a DRM render node (Mesa's, AMD's and Intel's drivers,
    NVIDIA's with nvidia-drm) or NVIDIA's own control file."""
    return bool(glob.glob("/dev/dri/renderD*")) or os.path.exists("/dev/nvidiactl")


# Kernel drivers of GPUs that can be discrete. The others behind render nodes are integrated
# (Arm SoCs: msm, panfrost, v3d, asahi, ...), virtual (virtio_gpu, vmwgfx) or a server's display
# chip (ast, mgag200): wgpu would report none of them as a discrete adapter.
_DISCRETE_DRIVERS = frozenset({"nvidia", "nouveau", "amdgpu", "radeon", "i915", "xe"})
_INTEL_INTEGRATED_SLOT = "00:02.0"  # Intel's integrated GPUs sit at PCI device 2 of bus 0


def _linux_discrete_possible() -> bool:
    """Whether this Linux machine may hold a discrete GPU: NVIDIA's control file, or a render node
    that may be one (see _render_nodes_discrete_possible)."""
    return os.path.exists("/dev/nvidiactl") or _render_nodes_discrete_possible("/sys/class/drm")


def _render_nodes_discrete_possible(drm: str) -> bool:
    """Whether a render node under `drm` (sysfs) may be a discrete GPU, from its kernel driver and,
    for Intel's, its PCI slot. Where sysfs does not say: True (wgpu then finds out)."""
    nodes = glob.glob(os.path.join(drm, "renderD*"))
    if not nodes:
        return True
    for node in nodes:
        device = os.path.join(node, "device")
        try:
            driver = os.path.basename(os.readlink(os.path.join(device, "driver")))
        except OSError:
            return True
        if driver not in _DISCRETE_DRIVERS:
            continue
        if driver in ("i915", "xe") and _pci_slot(device).endswith(_INTEL_INTEGRATED_SLOT):
            continue
        return True
    return False


def _pci_slot(device: str) -> str:
    """The PCI slot name ("0000:00:02.0") in a sysfs device's uevent, "" when it has none."""
    try:
        with open(os.path.join(device, "uevent")) as f:
            return next((line.split("=", 1)[1].strip() for line in f if line.startswith("PCI_SLOT_NAME=")), "")
    except OSError:
        return ""


# What device="auto" tries, best first: each backend with a cheap check that its device may be
# here (None: always), so that a machine without one does not import its backend (CuPy: ~0.1 s).
AUTO = (("cuda", _gpu_driver_present), ("webgpu", _discrete_webgpu_present), ("cpu", None))


def get_backend(device: str = "auto", **options) -> Backend:
    """Create the backend for `device` ("auto", "cpu", "cuda:1", "reference", ...)."""
    if device != "auto":
        return _module(device.split(":", 1)[0]).Backend(device=device, **options)
    errors = []
    for name, present in AUTO:
        if present is not None and not present():
            errors.append(f"{name}: no device found")
            continue
        try:
            return _module(name).Backend(device=name, **options)
        except BackendError as e:  # e.g. no GPU: auto falls through to the next backend
            errors.append(f"{name}: {e}")
    raise BackendError(f"no usable backend for device 'auto' ({'; '.join(errors)})")


def _module(name: str):
    """The backend module `name`; the shipped ones are listed (importlib.resources, ~25 ms) only
    when it is not one of them."""
    if not name.isidentifier() or name.startswith("_") or name == "base":
        raise BackendError(f"no backend named '{name}' (have: {', '.join(available())})")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":  # the backend is here; something it imports is not
            raise
        raise BackendError(f"no backend named '{name}' (have: {', '.join(available())})") from None


def available() -> list[str]:
    """Names of the backend modules shipped with this install."""
    from importlib import resources

    return sorted(
        p.name.removesuffix(".py")
        for p in resources.files(__name__).iterdir()
        if not p.name.startswith("_") and p.name not in ("base.py",) and (p.name.endswith(".py") or p.is_dir())
    )
