"""WebGPU adapters through wgpu-py: which are here, which one a device name picks, what each offers."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import tempfile

from ..base import BackendError

# Adapters ranked for serving: a real GPU before a software rasteriser (lavapipe, llvmpipe), the
# native APIs before OpenGL (whose compute wgpu supports least).
TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
NATIVE_APIS = ("Vulkan", "Metal", "D3D12")
# limits a model's buffers need past WebGPU's defaults, asked of the device up to the adapter's own
LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage",
          "max-compute-workgroup-storage-size", "max-compute-workgroups-per-dimension")
# features asked of the device where the adapter has them (timestamps: per-kernel profiles;
# subgroups: decode products summed across lanes without barriers)
DEVICE_FEATURES = ("timestamp-query", "subgroup")
# features a compute backend may use (of the many about textures and rendering)
COMPUTE_FEATURES = ("shader-", "subgroup", "timestamp-query", "pipeline-cache", "immediates", "cooperative")
SHOWN_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
                "max-compute-invocations-per-workgroup", "max-storage-buffers-per-shader-stage")


def import_wgpu():
    """wgpu, or a BackendError saying how to get it."""
    try:
        import wgpu
    except ImportError as e:
        raise BackendError(f"the WebGPU backend needs wgpu (pip install 'ember[webgpu]'): {e}") from None
    return wgpu


def installed() -> bool:
    return importlib.util.find_spec("wgpu") is not None


def adapters() -> list:
    """This machine's adapters through the native APIs, best first (see TYPE_RANK)."""
    wgpu = import_wgpu()
    _native_apis_only()
    with _without_wsi_noise():
        found = wgpu.gpu.enumerate_adapters_sync()
    return sorted(found, key=rank)


@contextlib.contextmanager
def _without_wsi_noise():
    """Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid" to the process's stderr for every
    adapter of a headless machine (their window-system code, which compute never uses): that line is
    dropped, anything else the drivers write is passed on."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to keep clean
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [ln for ln in caught.read().decode(errors="replace").splitlines(True) if "XDG_RUNTIME_DIR" not in ln]
            if kept:
                sys.stderr.write("".join(kept))


@functools.cache
def _native_apis_only() -> None:
    """Keep wgpu's instance to Vulkan, Metal and D3D12: its OpenGL adapters compute least well, and
    looking for them on a headless Linux machine prints errors about the display."""
    try:
        from wgpu.backends.wgpu_native.extras import set_instance_extras

        set_instance_extras(backends=["Vulkan", "Metal", "DX12"])
    except Exception:  # an instance made already (by another user of wgpu in this process): keep it
        pass


def rank(adapter) -> tuple[int, int]:
    info = adapter.info
    return (TYPE_RANK.get(info.get("adapter_type", ""), 4), 0 if info.get("backend_type") in NATIVE_APIS else 1)


def is_discrete(adapter) -> bool:
    return adapter.info.get("adapter_type") == "DiscreteGPU"


def is_cpu(adapter) -> bool:
    return adapter.info.get("adapter_type") == "CPU"


@functools.cache
def discrete_present() -> bool:
    """Whether device="auto" should try WebGPU: wgpu is installed and sees a discrete GPU (never a
    software adapter, which the CPU backend outruns)."""
    if not installed():
        return False
    try:
        return any(is_discrete(a) for a in adapters())
    except Exception:  # a broken driver stack: the CPU serves
        return False


def pick(i: int):
    """The i-th of adapters()."""
    found = adapters()
    if not found:
        raise BackendError("no WebGPU adapter found (no Vulkan, Metal or D3D12 driver; on Linux without a GPU, "
                           "Mesa's lavapipe gives one: apt-get install mesa-vulkan-drivers)")
    if i >= len(found):
        raise BackendError(f"WebGPU adapter {i} does not exist ({len(found)} found)")
    return found[i]


def open_adapter(device: str):
    """(adapter, device, kernels) that a device name names, opened once a process (see _kernels)."""
    return _opened(adapter_index(device))


def adapter_index(device: str) -> int:
    """Index in adapters() of the adapter "webgpu" (the best) or "webgpu:N" names."""
    _, _, index = device.partition(":")
    if index and not index.isdigit():
        raise BackendError(f"bad WebGPU device '{device}': expected webgpu or webgpu:N")
    return int(index or 0)


@functools.cache
def _opened(index: int):
    from ._kernels import Kernels

    adapter = pick(index)
    device = open_device(adapter)
    return adapter, device, Kernels(device)


def open_device(adapter):
    """A device with the adapter's own limits for what models need (storage bindings above all)."""
    limits = {k: adapter.limits[k] for k in LIMITS if k in adapter.limits}
    features = [f for f in DEVICE_FEATURES if f in adapter.features]
    return adapter.request_device_sync(required_features=features, required_limits=limits)


def describe(adapter) -> dict:
    """An adapter as `ember info --system` lists it."""
    info = adapter.info
    return {"name": info.get("device", ""), "type": info.get("adapter_type", ""),
            "backend": info.get("backend_type", ""), "driver": info.get("description", ""),
            "features": sorted(f for f in adapter.features if f.startswith(COMPUTE_FEATURES)),
            "limits": {k: adapter.limits[k] for k in SHOWN_LIMITS if k in adapter.limits}}
