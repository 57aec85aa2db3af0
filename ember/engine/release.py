"""Letting go of a model's memory when the object that owns it is closed, while the caller may keep
the object: an app that closes one model to load another must not hold both."""
from __future__ import annotations

import gc

from .engine import EngineClosed


class ReleasedOnClose:
    """Mixin of LLM and Embeddings: `_release(names)` drops those attributes (the weights, with
    whatever the backend moved them to, the KV cache, the backend) and collects their cycles now;
    reading one afterwards raises EngineClosed."""

    def _release(self, names: tuple[str, ...]) -> None:
        self.__dict__["_released"] = names
        for name in names:
            self.__dict__.pop(name, None)
        gc.collect()  # the model's objects refer to each other: collected now, not at some later allocation

    @property
    def closed(self) -> bool:
        return "_released" in self.__dict__

    def __getattr__(self, name: str):
        if name in self.__dict__.get("_released", ()):
            raise EngineClosed("the model is closed")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
