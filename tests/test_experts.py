"""Mixture-of-experts ops: routing, grouped expert products and the weighted sum, on the CPU backend
against the float64 reference backend and against the CPU backend's own dense product of each chosen
expert (the grouped product must give the same bits: same kernels, same rounding)."""
from __future__ import annotations

import numpy as np
import pytest
from synth import random_blocks

from ember.backends import BackendError, Weight, get_backend
from ember.quant import GGMLType, dequantize, quantize

N_EXPERT, COLS, ROWS = 16, 256, 96


@pytest.fixture(scope="module")
def cpu():
    return get_backend("cpu", threads=2)


@pytest.fixture(scope="module")
def ref():
    return get_backend("reference")


def stacked(qtype: GGMLType, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n_expert, rows, row bytes) blocks of qtype and their float values (n_expert, rows, cols)."""
    rng = np.random.default_rng(seed)
    if qtype in (GGMLType.Q4_K, GGMLType.Q6_K):
        data = random_blocks(rng, qtype, N_EXPERT * rows, cols, 0.05)
    elif qtype == GGMLType.F32:
        data = rng.normal(0, 0.05, (N_EXPERT * rows, cols)).astype(np.float32)
    else:
        data = quantize(rng.normal(0, 0.05, (N_EXPERT * rows, cols)).astype(np.float32), qtype)
    values = dequantize(data.reshape(-1), qtype).astype(np.float64).reshape(N_EXPERT, rows, cols)
    return data.reshape(N_EXPERT, rows, -1), values


def weight(qtype, data, rows, cols, e=None) -> Weight:
    if e is None:
        return Weight("exps", qtype, (N_EXPERT, rows, cols), data)
    return Weight(f"exps[{e}]", qtype, (rows, cols), np.ascontiguousarray(data[e]))


def routed(n: int, k: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(N_EXPERT)[:k] for _ in range(n)]).astype(np.int32)


TYPES = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.F16, GGMLType.F32]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 37], ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("per_row", [False, True], ids=["shared_x", "x_per_selection"])
def test_grouped_product_is_each_experts_dense_product(cpu, qtype, n, per_row):
    k = 4
    (a, _), (b, _) = stacked(qtype, ROWS, COLS, 0), stacked(qtype, ROWS + 32, COLS, 5)
    ids = routed(n, k)
    x = np.random.default_rng(2).normal(0, 1, (n * k if per_row else n, COLS)).astype(np.float32)
    outs = [np.full((n * k, ROWS), np.nan, np.float32), np.full((n * k, ROWS + 32), np.nan, np.float32)]
    cpu.expert_matmuls([weight(qtype, a, ROWS, COLS), weight(qtype, b, ROWS + 32, COLS)], x, ids, outs)
    sel = ids.reshape(-1)
    for e in np.unique(sel):  # an expert's selections as one dense product (the same kernel path)
        mine = np.flatnonzero(sel == e)
        rows_x = np.ascontiguousarray(x[mine if per_row else mine // k])
        for data, rows, out in ((a, ROWS, outs[0]), (b, ROWS + 32, outs[1])):
            want = np.empty((len(mine), rows), np.float32)
            cpu.matmul(weight(qtype, data, rows, COLS, e), rows_x, want)
            assert np.array_equal(out[mine], want), f"expert {e}"


def test_grouped_product_against_float64(cpu, ref):
    n, k = 9, 3
    data, values = stacked(GGMLType.F16, ROWS, COLS)
    ids = routed(n, k)
    x = np.random.default_rng(3).normal(0, 1, (n, COLS)).astype(np.float32)
    got = np.empty((n * k, ROWS), np.float32)
    cpu.expert_matmuls([weight(GGMLType.F16, data, ROWS, COLS)], x, ids, [got])
    want = np.empty((n * k, ROWS))
    ref.expert_matmuls([Weight("exps", GGMLType.F16, (N_EXPERT, ROWS, COLS), values)], x.astype(np.float64), ids,
                       [want])
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    for s, e in enumerate(ids.reshape(-1)):
        assert np.allclose(want[s], values[e] @ x[s // k], rtol=1e-12)


def test_grouped_product_reads_only_the_chosen_experts(cpu):
    """Unchosen experts' rows are NaN: nothing of them may reach the outputs."""
    n, k = 5, 2
    data, _ = stacked(GGMLType.F32, ROWS, COLS)
    ids = routed(n, k)
    poisoned = data.copy()
    unused = sorted(set(range(N_EXPERT)) - set(ids.reshape(-1).tolist()))
    poisoned[unused] = np.nan
    x = np.ones((n, COLS), np.float32)
    out = np.empty((n * k, ROWS), np.float32)
    cpu.expert_matmuls([weight(GGMLType.F32, poisoned, ROWS, COLS)], x, ids, [out])
    assert unused and np.isfinite(out).all()


@pytest.mark.parametrize("norm", [True, False])
def test_routing_against_float64(cpu, ref, norm):
    n, k = 33, 4
    logits = np.random.default_rng(4).normal(0, 3, (n, N_EXPERT)).astype(np.float32)
    logits[0, 3] = logits[0, 7] = 20.0  # a tie: the lower id first
    ids, w = np.empty((n, k), np.int32), np.empty((n, k), np.float32)
    cpu.route_experts(logits, k, norm, ids, w)
    rids, rw = np.empty((n, k), np.int32), np.empty((n, k))
    ref.route_experts(logits.astype(np.float64), k, norm, rids, rw)
    assert np.array_equal(ids, rids) and ids[0, :2].tolist() == [3, 7]
    assert np.allclose(w, rw, rtol=1e-5, atol=1e-7)
    if norm:
        assert np.allclose(w.sum(axis=1), 1.0, atol=1e-6)


def test_weighted_sum(cpu, ref):
    n, k, d = 6, 3, 40
    rng = np.random.default_rng(5)
    y, w = rng.normal(0, 1, (n * k, d)).astype(np.float32), rng.uniform(0, 1, (n, k)).astype(np.float32)
    out, want = np.empty((n, d), np.float32), np.empty((n, d))
    cpu.expert_sum(y, w, out)
    ref.expert_sum(y.astype(np.float64), w.astype(np.float64), want)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-6)


def test_bad_expert_products_are_refused(cpu):
    data, _ = stacked(GGMLType.Q4_K, ROWS, COLS)
    x, out = np.ones((2, COLS), np.float32), np.empty((4, ROWS), np.float32)
    with pytest.raises(BackendError, match="refused"):  # an expert id past the stack
        cpu.expert_matmuls([weight(GGMLType.Q4_K, data, ROWS, COLS)], x, np.array([[0, 1], [2, 16]], np.int32), [out])
    with pytest.raises(BackendError, match="routing needs"):
        cpu.route_experts(np.zeros((1, 4), np.float32), 5, True, np.empty((1, 5), np.int32),
                          np.empty((1, 5), np.float32))


def test_clamped_swiglu(cpu, ref):
    """gpt-oss's activation: the gate clamped above at 7, up to [-7, 7], alpha 1.702."""
    rng = np.random.default_rng(6)
    gate, up = (rng.normal(0, 5, 4000).astype(np.float32) for _ in range(2))
    out, want = np.empty(4000, np.float32), np.empty(4000)
    cpu.swiglu_oai(gate, up, out, 1.702, 7.0)
    ref.swiglu_oai(gate.astype(np.float64), up.astype(np.float64), want, 1.702, 7.0)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-5)
    g = np.minimum(gate.astype(np.float64), 7)
    assert np.allclose(want, g / (1 + np.exp(-1.702 * g)) * (np.clip(up, -7, 7) + 1))


def test_expert_biases(cpu, ref):
    n, k, d = 5, 3, 48
    rng = np.random.default_rng(7)
    ids = routed(n, k)
    b = rng.normal(0, 1, (N_EXPERT, d)).astype(np.float32)
    y = rng.normal(0, 1, (n * k, d)).astype(np.float32)
    got, want = y.copy(), y.astype(np.float64)
    cpu.expert_bias(got, Weight("b", GGMLType.F32, b.shape, b), ids)
    ref.expert_bias(want, Weight("b", GGMLType.F32, b.shape, b.astype(np.float64)), ids)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.allclose(want, y + b[ids.reshape(-1)])


def test_mxfp4_experts(cpu):
    """gpt-oss's expert type through the grouped product: the same bits as each expert's dense product."""
    (data, _), ids = stacked(GGMLType.MXFP4, ROWS, COLS), routed(6, 4)
    x = np.random.default_rng(8).normal(0, 1, (6, COLS)).astype(np.float32)
    out = np.empty((24, ROWS), np.float32)
    cpu.expert_matmuls([weight(GGMLType.MXFP4, data, ROWS, COLS)], x, ids, [out])
    for e in np.unique(ids):
        mine = np.flatnonzero(ids.reshape(-1) == e)
        want = np.empty((len(mine), ROWS), np.float32)
        cpu.matmul(weight(GGMLType.MXFP4, data, ROWS, COLS, e), np.ascontiguousarray(x[mine // 4]), want)
        assert np.array_equal(out[mine], want)


def test_products_mark_the_experts_they_read(cpu):
    """The byte map of each stack (which the backend's move onto huge pages reads) gets a 1 for every
    expert a product read, and only for those."""
    (a, _), (b, _) = stacked(GGMLType.Q8_0, ROWS, COLS, 0), stacked(GGMLType.Q8_0, ROWS + 32, COLS, 5)
    maps = [np.zeros(N_EXPERT, np.uint8), np.zeros(N_EXPERT, np.uint8)]
    cpu._expert_maps.update({a.ctypes.data: maps[0], b.ctypes.data: maps[1]})
    try:
        ids = routed(3, 2)
        x = np.ones((3, COLS), np.float32)
        outs = [np.empty((6, ROWS), np.float32), np.empty((6, ROWS + 32), np.float32)]
        cpu.expert_matmuls([weight(GGMLType.Q8_0, a, ROWS, COLS), weight(GGMLType.Q8_0, b, ROWS + 32, COLS)],
                           x, ids, outs)
        want = np.isin(np.arange(N_EXPERT), ids).astype(np.uint8)
        assert 0 < want.sum() < N_EXPERT and np.array_equal(maps[0], want) and np.array_equal(maps[1], want)
    finally:
        cpu._expert_maps.pop(a.ctypes.data), cpu._expert_maps.pop(b.ctypes.data)
