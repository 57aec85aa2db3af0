"""ember: a local inference server for quantized GGUF models."""
__version__ = "0.1.0"


def load(model: str = "smollm2", **kw):
    """Load a model (a GGUF path or a known name) ready to generate: see `ember.engine.LLM`."""
    from .engine import LLM

    return LLM(model, **kw)


def embeddings(model: str, **kw):
    """Open a model for embeddings and rerank scores: see `ember.engine.Embeddings`."""
    from .engine import Embeddings

    return Embeddings(model, **kw)
