"""Compute backends. Each backend is a module `ember.backends.<name>` exporting a class `Backend`
that implements the protocol in `base.py`; model code only calls those ops."""
from __future__ import annotations

import importlib
import os
import sys

from .base import AttentionBatch, Backend, BackendError, RopeParams, Weight

__all__ = ["AttentionBatch", "Backend", "BackendError", "RopeParams", "Weight", "get_backend", "available"]

# Modules tried for device="auto", best first.
_AUTO_ORDER = ("cuda", "cpu")


def _gpu_driver_present() -> bool:
    """Whether a GPU driver is loaded (Linux: NVIDIA's or ROCm's device files). Where that cannot be
    told cheaply, True: the backend itself then finds out."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd"))


def get_backend(device: str = "auto", **options) -> Backend:
    """Create the backend for `device` ("auto", "cpu", "reference", ...)."""
    names = _AUTO_ORDER if device == "auto" else (device.split(":", 1)[0],)
    errors = []
    for name in names:
        if device == "auto" and name == "cuda" and not _gpu_driver_present():
            errors.append("cuda: no GPU driver loaded")  # skips importing CuPy (~0.1 s of start-up)
            continue
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(f"{__name__}.{name}"):
                errors.append(f"{name}: no such backend")
                continue
            raise
        try:
            return module.Backend(device=device if device != "auto" else name, **options)
        except BackendError as e:  # e.g. no GPU: auto falls through to the next backend
            if device != "auto":
                raise
            errors.append(f"{name}: {e}")
    raise BackendError(f"no usable backend for device '{device}' ({'; '.join(errors)})")


def available() -> list[str]:
    """Names of the backend modules shipped with this install."""
    from importlib import resources

    return sorted(
        p.name.removesuffix(".py")
        for p in resources.files(__name__).iterdir()
        if not p.name.startswith("_") and p.name not in ("base.py",) and (p.name.endswith(".py") or p.is_dir())
    )
