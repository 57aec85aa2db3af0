"""Mixture-of-experts ops on the CUDA backend against the float64 reference backend: routing, the
grouped expert products of every weight type the qwen3moe files use (stacked experts read through
the real loader), with a token's input shared by its experts and one input per selection, the
weighted sum, and experts nobody chose left unread. (Whole qwen3moe models, recorded steps and CUDA
graphs included: test_cuda_families.py.) Skipped, with the reason, where CuPy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest
from synth import random_blocks
from test_cuda import REASON, poisoned, rel_err

from ember.backends import get_backend
from ember.gguf_loader import GGUFFile
from ember.quant import GGMLType, quantize

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

N_EXPERT, ROWS, COLS = 16, 200, 512
TYPES = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4, GGMLType.F16, GGMLType.F32]


@pytest.fixture(scope="module")
def backends():
    return get_backend("cuda"), get_backend("reference")


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """A GGUF file of stacked experts (N_EXPERT, ROWS, COLS) of each type, and one whose unchosen
    experts (all but 0, 3 and 5) are NaN."""
    import gguf

    path = tmp_path_factory.mktemp("cuda_experts") / "experts.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for qtype in TYPES:
        if qtype in (GGMLType.Q4_K, GGMLType.Q6_K):
            data = random_blocks(rng, qtype, N_EXPERT * ROWS, COLS, 0.05).reshape(N_EXPERT, ROWS, -1)
            w.add_tensor(qtype.name, data, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
        elif qtype in (GGMLType.Q8_0, GGMLType.MXFP4):
            data = quantize(rng.normal(0, 0.05, (N_EXPERT * ROWS, COLS)).astype(np.float32), qtype)
            w.add_tensor(qtype.name, data.reshape(N_EXPERT, ROWS, -1), raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
        else:
            dtype = np.float16 if qtype == GGMLType.F16 else np.float32
            w.add_tensor(qtype.name, rng.normal(0, 0.05, (N_EXPERT, ROWS, COLS)).astype(dtype))
    nan = rng.normal(0, 0.05, (N_EXPERT, ROWS, COLS)).astype(np.float32)
    nan[[e for e in range(N_EXPERT) if e not in (0, 3, 5)]] = np.nan
    w.add_tensor("unchosen_nan", nan)
    w.add_tensor("biases", rng.normal(0, 1, (N_EXPERT, ROWS)).astype(np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    f = GGUFFile(path)
    yield f
    f.close()


def routed(n: int, k: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(N_EXPERT)[:k] for _ in range(n)]).astype(np.int32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 37], ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("per_row", [False, True], ids=["shared_x", "x_per_selection"])
def test_expert_matmuls(backends, stacks, qtype, n, per_row):
    cuda, ref = backends
    k = 4
    t = stacks.tensors[qtype.name]
    ids = routed(n, k)
    x = np.random.default_rng(2).normal(0, 1, (n * k if per_row else n, COLS)).astype(np.float32)
    got = poisoned(cuda, (n * k, ROWS))
    cuda.expert_matmuls([cuda.weight(t)], cuda.from_numpy(x), cuda.from_numpy(ids), [got])
    want = np.empty((n * k, ROWS))
    ref.expert_matmuls([ref.weight(t)], x.astype(np.float64), ids, [want])
    assert rel_err(cuda.to_numpy(got), want) < 1e-5


def test_experts_nobody_chose_are_not_read(backends, stacks):
    cuda, _ = backends
    ids = np.array([[0, 3], [5, 0], [3, 5]], np.int32)
    out = poisoned(cuda, (6, ROWS))
    w = cuda.weight(stacks.tensors["unchosen_nan"])
    cuda.expert_matmuls([w], cuda.from_numpy(np.ones((3, COLS), np.float32)), cuda.from_numpy(ids), [out])
    assert np.isfinite(cuda.to_numpy(out)).all()


@pytest.mark.parametrize("n_expert,k", [(16, 4), (128, 8), (256, 8), (32, 32)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_experts(backends, n_expert, k, norm):
    cuda, ref = backends
    n = 37
    logits = np.random.default_rng(4).normal(0, 3, (n, n_expert)).astype(np.float32)
    logits[0, 3] = logits[0, 7] = 20.0  # a tie: the lower id first
    ids, w = cuda.empty((n, k), np.int32), cuda.empty((n, k))
    cuda.route_experts(cuda.from_numpy(logits), k, norm, ids, w)
    rids, rw = np.empty((n, k), np.int32), np.empty((n, k))
    ref.route_experts(logits.astype(np.float64), k, norm, rids, rw)
    assert np.array_equal(cuda.to_numpy(ids), rids)
    np.testing.assert_allclose(cuda.to_numpy(w), rw, rtol=1e-5, atol=1e-7)


def test_expert_sum(backends):
    cuda, ref = backends
    n, k, d = 6, 3, 40
    rng = np.random.default_rng(5)
    y, w = rng.normal(0, 1, (n * k, d)).astype(np.float32), rng.uniform(0, 1, (n, k)).astype(np.float32)
    out, want = poisoned(cuda, (n, d)), np.empty((n, d))
    cuda.expert_sum(cuda.from_numpy(y), cuda.from_numpy(w), out)
    ref.expert_sum(y.astype(np.float64), w.astype(np.float64), want)
    np.testing.assert_allclose(cuda.to_numpy(out), want, rtol=1e-5, atol=1e-6)


def test_bad_expert_shapes_are_clear_errors(backends, stacks):
    from ember.backends import BackendError

    cuda, _ = backends
    w = cuda.weight(stacks.tensors["Q4_K"])
    with pytest.raises(BackendError, match="cannot multiply"):
        cuda.expert_matmuls([w], cuda.empty((2, COLS + 32)), cuda.from_numpy(routed(2, 2)), [cuda.empty((4, ROWS))])
    with pytest.raises(BackendError, match="routing needs"):
        cuda.route_experts(cuda.empty((1, 300)), 8, True, cuda.empty((1, 8), np.int32), cuda.empty((1, 8)))


def test_expert_bias_and_clamped_swiglu(backends, stacks):
    cuda, ref = backends
    rng = np.random.default_rng(6)
    ids = routed(5, 3)
    y = rng.normal(0, 1, (15, ROWS)).astype(np.float32)
    got, want = cuda.from_numpy(y), y.astype(np.float64)
    cuda.expert_bias(got, cuda.weight(stacks.tensors["biases"]), cuda.from_numpy(ids))
    ref.expert_bias(want, ref.weight(stacks.tensors["biases"]), ids)
    np.testing.assert_allclose(cuda.to_numpy(got), want, rtol=1e-6, atol=1e-6)
    gate, up = (rng.normal(0, 5, 4000).astype(np.float32) for _ in range(2))
    out, want = poisoned(cuda, (4000,)), np.empty(4000)
    cuda.swiglu_oai(cuda.from_numpy(gate), cuda.from_numpy(up), out, 1.702, 7.0)
    ref.swiglu_oai(gate.astype(np.float64), up.astype(np.float64), want, 1.702, 7.0)
    np.testing.assert_allclose(cuda.to_numpy(out), want, rtol=1e-5, atol=1e-5)
