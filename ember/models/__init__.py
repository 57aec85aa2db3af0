"""Model architectures, one module per GGUF `general.architecture` value, each exporting `Model`."""
from __future__ import annotations

import importlib
import re

from .base import KVCache, Model, ModelError, Step

__all__ = ["KVCache", "Model", "ModelError", "Step", "load_model"]


def load_model(gguf, backend) -> Model:
    """Build the model described by an open GGUF file on `backend`."""
    arch = gguf.metadata.get("general.architecture")
    if not isinstance(arch, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", arch):
        raise ModelError(f"general.architecture is missing or invalid: {arch!r}")
    try:  # "nomic-bert" lives in nomic_bert.py, "gpt-oss" in gpt_oss.py
        module = importlib.import_module(f"{__name__}.{arch.replace('-', '_')}")
    except ModuleNotFoundError:
        raise ModelError(f"architecture '{arch}' is not supported (supported: {', '.join(supported())})") from None
    model = module.Model(gguf, backend)
    backend.settle()
    return model


def supported() -> list[str]:
    from importlib import resources

    return sorted(p.name[:-3].replace("_", "-") for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".py") and not p.name.startswith("_") and p.name != "base.py")
