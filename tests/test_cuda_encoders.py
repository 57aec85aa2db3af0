"""Encoder ops and models on the CUDA backend against the float64 reference backend: layer norm,
GELU and tanh on random rows, then the synthetic BERT, nomic-bert and bert-reranker files of
tests/encoders.py through the embedder (pooled vectors and rerank scores). Skipped, with the
reason, where CuPy or an NVIDIA GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from encoders import write_bert
from test_cuda import REASON

from ember.backends import get_backend
from ember.backends.base import Weight
from ember.engine.embed import Embeddings
from ember.quant import GGMLType

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France!", "hello world", "a small tree"]


def test_layer_norm_gelu_tanh():
    cuda, ref = get_backend("cuda"), get_backend("reference")
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(9, 384)) * 3 + 1).astype(np.float32)
    w, b = rng.normal(size=384).astype(np.float32), rng.normal(size=384).astype(np.float32)
    weights = [Weight(n, GGMLType.F32, (384,), v) for n, v in (("w", w), ("b", b))]
    got = cuda.from_numpy(x.copy())
    cuda.layer_norm(got, *[Weight(v.name, v.type, v.shape, cuda.from_numpy(v.data)) for v in weights], 1e-12, got)
    want = np.empty((9, 384))
    ref.layer_norm(x.astype(np.float64), *[Weight(v.name, v.type, v.shape, v.data.astype(np.float64)) for v in weights],
                   1e-12, want)
    np.testing.assert_allclose(cuda.to_numpy(got), want, rtol=1e-4, atol=1e-4)
    for op in ("gelu", "tanh"):
        got, want = cuda.from_numpy(x.copy()), x.astype(np.float64)
        (cuda.gelu(got, got), ref.gelu(want, want)) if op == "gelu" else (cuda.tanh(got), ref.tanh(want))
        np.testing.assert_allclose(cuda.to_numpy(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", ["bert", "nomic", "rerank"])
def test_encoders_match_reference(tmp_path, kind):
    path = write_bert(tmp_path / f"{kind}.gguf", nomic=kind == "nomic", reranker=kind == "rerank")
    out = {}
    for device in ("cuda", "reference"):
        with Embeddings(path, device=device) as e:
            out[device] = np.array(e.rank("capital of France", TEXTS)) if kind == "rerank" else np.stack(e.embed(TEXTS))
    if kind == "rerank":
        np.testing.assert_allclose(out["cuda"], out["reference"], atol=0.01 * np.ptp(out["reference"]))
    else:
        cos = (out["cuda"] * out["reference"]).sum(axis=1)  # unit vectors
        assert cos.min() >= 0.9999
