"""Mixture-of-experts ops on the CUDA backend against the float64 reference backend: routing, the
grouped expert products of every weight type stacked experts can have (read through the real
loader), with a token's input shared by its experts and one input per selection, at decode sizes
(expert_mv) and prompt sizes (expert_group + expert_tile), the weighted sum, and experts nobody
chose left unread. (Whole qwen3moe models, recorded steps and CUDA graphs included:
test_cuda_families.py.) Those tests are skipped, with the reason, where CuPy or a GPU is missing.

The device-free tests below them run the grouped products' algorithm in numpy step by step as the
kernels do (the selections sorted into tiles as expert_group does, x quantized as quant_x does,
each unit's integer dot products and per-half scales as expert_tile sums them, and the K-quants'
super-block sums as expert_tile_sb does) against the same float64 reference, so the arithmetic is checked before any GPU runs it; and the kernels themselves,
compiled from experts.cu as host C++ (bench/cuda_experts_check.py), run on the CPU."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from synth import weight as synth_weight
from test_cuda import REASON, poisoned, rel_err

from ember.backends import get_backend
from ember.backends.cuda.config import CudaConfig
from ember.backends.cuda.ops.experts import (EG_MAX_EXPERTS, ET_ROWS, ET_TOK, EXPERT_TYPES, device_row_bytes, mv_group,
                                             regroup_mxfp4, tile_bound)
from ember.gguf_loader import GGUFFile
from ember.quant import GGMLType, dequantize, quantize

cuda_only = pytest.mark.skipif(REASON is not None, reason=REASON or "")

N_EXPERT, ROWS, COLS = 16, 200, 512  # 200 rows: tiles of 64 and blocks of 16 rows end part-way
TYPES = sorted(EXPERT_TYPES, key=int)
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
TOKENS = [1, 3, 8, 64, 512]  # 1-8: expert_mv; 64, 512: expert_group + expert_tile
MANY = (128, 96, 256)  # a Q4_K stack of Qwen3-30B-A3B's expert count


@pytest.fixture(scope="module")
def backends():
    return get_backend("cuda"), get_backend("reference")


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """A GGUF file of stacked experts (N_EXPERT, ROWS, COLS) of each type (and a second of Q4_K and MXFP4), a
    Q4_K stack of MANY, and one whose unchosen experts (all but 0, 3 and 5) are NaN."""
    import gguf

    path = tmp_path_factory.mktemp("cuda_experts") / "experts.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for qtype in TYPES:
        if qtype in FLOAT_TYPES:
            data = rng.normal(0, 0.05, (N_EXPERT, ROWS, COLS)).astype(np.float32)
            if qtype == GGMLType.F16:
                w.add_tensor(qtype.name, data.astype(np.float16))
            elif qtype == GGMLType.BF16:
                bits = (data.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(N_EXPERT, ROWS, -1)
                w.add_tensor(qtype.name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(qtype.name, data)
            continue
        data = weight(rng, qtype, N_EXPERT * ROWS, COLS, 0.05)
        w.add_tensor(qtype.name, data.reshape(N_EXPERT, ROWS, -1), raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    for qtype in (GGMLType.Q4_K, GGMLType.MXFP4):  # a second stack of the type and shape: pairs of matrices
        data = weight(rng, qtype, N_EXPERT * ROWS, COLS, 0.05)
        w.add_tensor(qtype.name + "_b", data.reshape(N_EXPERT, ROWS, -1), raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    many = weight(rng, GGMLType.Q4_K, MANY[0] * MANY[1], MANY[2], 0.05)
    w.add_tensor("many_experts", many.reshape(MANY[0], MANY[1], -1), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    nan = rng.normal(0, 0.05, (N_EXPERT, ROWS, COLS)).astype(np.float32)
    nan[[e for e in range(N_EXPERT) if e not in (0, 3, 5)]] = np.nan
    w.add_tensor("unchosen_nan", nan)
    w.add_tensor("biases", rng.normal(0, 1, (N_EXPERT, ROWS)).astype(np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    f = GGUFFile(path)
    yield f
    f.close()


def weight(rng, qtype: GGMLType, rows: int, cols: int, std: float) -> np.ndarray:
    """(rows, row_bytes) blocks of random weights of about `std` (MXFP4: quantized normal values)."""
    if qtype == GGMLType.MXFP4:
        return quantize(rng.normal(0, std, (rows, cols)).astype(np.float32), qtype).reshape(rows, -1)
    return synth_weight(rng, qtype, rows, cols, std).reshape(rows, -1)


def routed(n: int, k: int, seed: int = 1, n_expert: int = N_EXPERT) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(n_expert)[:k] for _ in range(n)]).astype(np.int32)


def fused_as_apart(cuda, make):
    """make() -> (ops, arrays to read): the ops run as recorded, then fused into one (_fuse.fuse); every
    array read back bit for bit the same both ways."""
    from ember.backends.cuda._fuse import fuse

    results = []
    for fused in (False, True):
        ops, outs = make()
        ops = fuse(ops, None) if fused else ops
        assert len(ops) == (1 if fused else 2), [type(op).__name__ for op in ops]
        for op in ops:
            for la in op.launches(cuda.kernels):
                la.run()
        results.append([cuda.to_numpy(a) for a in outs])
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)


def limit(qtype) -> float:
    """Relative error allowed: float experts take f32 x; quantized ones int8 x (as the dense decode products)."""
    return 1e-5 if qtype in FLOAT_TYPES else 2e-2


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", TOKENS, ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("k", [4, 8], ids=lambda k: f"top{k}")
@pytest.mark.parametrize("per_row", [False, True], ids=["shared_x", "x_per_selection"])
def test_expert_matmuls(backends, stacks, qtype, n, k, per_row):
    cuda, ref = backends
    t = stacks.tensors[qtype.name]
    ids = routed(n, k)
    x = np.random.default_rng(2).normal(0, 1, (n * k if per_row else n, COLS)).astype(np.float32)
    got = poisoned(cuda, (n * k, ROWS))
    cuda.expert_matmuls([cuda.weight(t)], cuda.from_numpy(x), cuda.from_numpy(ids), [got])
    want = np.empty((n * k, ROWS))
    ref.expert_matmuls([ref.weight(t)], x.astype(np.float64), ids, [want])
    assert rel_err(cuda.to_numpy(got), want) < limit(qtype)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 4], ids=lambda n: f"{n}tok")  # 4 tokens x 4: a slot per expert
def test_two_stacks_of_one_type_share_a_decode_launch(backends, stacks, qtype, n):
    """Gate and up of one type and shape take one expert_mv launch (grid z) at decode sizes: each
    output is its own matrix's product."""
    cuda, ref = backends
    names = [qtype.name, qtype.name + "_b"]
    ids = routed(n, 4, seed=n)
    x = np.random.default_rng(5).normal(0, 1, (n, COLS)).astype(np.float32)
    got = [poisoned(cuda, (n * 4, ROWS)) for _ in names]
    cuda.expert_matmuls([cuda.weight(stacks.tensors[m]) for m in names], cuda.from_numpy(x), cuda.from_numpy(ids), got)
    for name, out in zip(names, got):
        want = np.empty((n * 4, ROWS))
        ref.expert_matmuls([ref.weight(stacks.tensors[name])], x.astype(np.float64), ids, [want])
        assert rel_err(cuda.to_numpy(out), want) < limit(qtype), name


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("n,mv_tokens", [(1, 0), (8, 0), (64, 64), (20, 64)], ids=["1tok_tiles", "8tok_tiles",
                                                                                    "64tok_mv", "20tok_mv"])
def test_either_kernel_at_any_size(stacks, backends, qtype, n, mv_tokens):
    """The decode kernel and the tiles each give the product at sizes the default switch sends to
    the other (moe_mv_tokens), gate and up in one call, one of them F16 (expert_matmul beside them)."""
    from ember.backends.cuda import Backend

    _, ref = backends
    cuda = Backend(config=CudaConfig(moe_mv_tokens=mv_tokens))
    ids = routed(n, 8, seed=n)
    x = np.random.default_rng(3).normal(0, 1, (n, COLS)).astype(np.float32)
    names = [qtype.name, "F16"]
    got = [poisoned(cuda, (n * 8, ROWS)) for _ in names]
    cuda.expert_matmuls([cuda.weight(stacks.tensors[m]) for m in names], cuda.from_numpy(x), cuda.from_numpy(ids), got)
    for name, out in zip(names, got):
        want = np.empty((n * 8, ROWS))
        ref.expert_matmuls([ref.weight(stacks.tensors[name])], x.astype(np.float64), ids, [want])
        assert rel_err(cuda.to_numpy(out), want) < limit(GGMLType[name]), name


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("routing", ["one_expert", "spread", "ids_out_of_range"])
def test_tiles_at_qwen3_moe_counts(backends, stacks, routing):
    """128 experts, 8 a token, 512 tokens (Qwen3-30B-A3B's prompt step): every token on experts
    77..84 (16 tiles each, in a grid bounded for any routing), spread routing, and ids outside the
    stack, whose rows are left unwritten."""
    cuda, _ = backends
    (n_expert, m, kd), n, k = MANY, 512, 8
    t = stacks.tensors["many_experts"]
    ids = routed(n, k, seed=8, n_expert=n_expert)
    if routing == "one_expert":
        ids[:] = (77 + np.arange(k)) % n_expert
    elif routing == "ids_out_of_range":
        ids[5, 2], ids[9, 0] = n_expert, -1
    x = np.random.default_rng(9).normal(0, 1, (n, kd)).astype(np.float32)
    dense = dequantize(np.asarray(t.data).reshape(-1), GGMLType.Q4_K).reshape(n_expert, m, kd).astype(np.float64)
    flat = ids.reshape(-1)
    want = np.einsum("sij,sj->si", dense[np.clip(flat, 0, n_expert - 1)], x[np.arange(n * k) // k])
    got = poisoned(cuda, (n * k, m))
    cuda.expert_matmuls([cuda.weight(t)], cuda.from_numpy(x), cuda.from_numpy(ids), [got])
    out = cuda.to_numpy(got)
    valid = (flat >= 0) & (flat < n_expert)
    assert np.isnan(out[~valid]).all()
    assert rel_err(out[valid], want[valid]) < 2e-2


@pytest.mark.cuda
@cuda_only
def test_experts_nobody_chose_are_not_read(backends, stacks):
    cuda, _ = backends
    ids = np.array([[0, 3], [5, 0], [3, 5]], np.int32)
    out = poisoned(cuda, (6, ROWS))
    w = cuda.weight(stacks.tensors["unchosen_nan"])
    cuda.expert_matmuls([w], cuda.from_numpy(np.ones((3, COLS), np.float32)), cuda.from_numpy(ids), [out])
    assert np.isfinite(cuda.to_numpy(out)).all()


@pytest.mark.cuda
@cuda_only
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


@pytest.mark.cuda
@cuda_only
def test_expert_sum(backends):
    cuda, ref = backends
    n, k, d = 6, 3, 40
    rng = np.random.default_rng(5)
    y, w = rng.normal(0, 1, (n * k, d)).astype(np.float32), rng.uniform(0, 1, (n, k)).astype(np.float32)
    out, want = poisoned(cuda, (n, d)), np.empty((n, d))
    cuda.expert_sum(cuda.from_numpy(y), cuda.from_numpy(w), out)
    ref.expert_sum(y.astype(np.float64), w.astype(np.float64), want)
    np.testing.assert_allclose(cuda.to_numpy(out), want, rtol=1e-5, atol=1e-6)
    # the residual add after it folded in (the fused ExpertSum): out and x bit for bit as the two launches
    from ember.backends.cuda.ops import Add
    from ember.backends.cuda.ops.experts import ExpertSum

    x0 = rng.normal(0, 1, (n, d)).astype(np.float32)

    def ops():
        out, x = poisoned(cuda, (n, d)), cuda.from_numpy(x0)
        return [ExpertSum(cuda.from_numpy(y), cuda.from_numpy(w), out), Add(x, out, x)], [out, x]

    fused_as_apart(cuda, ops)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("n", [1, 40])
def test_routing_beside_the_experts_rounding(backends, stacks, n):
    """route_quant_x_llama (the fused RouteExperts + the gate/up products): ids, weights and the products
    bit for bit those of the separate launches."""
    from ember.backends.cuda.ops.experts import ExpertMatmul, RouteExperts

    cuda, _ = backends
    names = [GGMLType.Q4_K.name, GGMLType.Q4_K.name + "_b"]
    ws = [cuda.weight(stacks.tensors[m]) for m in names]
    rng = np.random.default_rng(n)
    logits0 = rng.normal(0, 2, (n, N_EXPERT)).astype(np.float32)
    x0 = rng.normal(0, 1, (n, COLS)).astype(np.float32)

    def ops():
        logits, x = cuda.from_numpy(logits0), cuda.from_numpy(x0)
        ids, weights = cuda.cp.full((n, 4), -7, np.int32), poisoned(cuda, (n, 4))
        ys = [poisoned(cuda, (n * 4, ROWS)) for _ in ws]
        return [RouteExperts(logits, 4, True, ids, weights),
                ExpertMatmul(ws, x, 4, ids, ys, cuda._expert_scratch(x, n * 4, N_EXPERT), -1)], [ids, weights, *ys]

    fused_as_apart(cuda, ops)


@pytest.mark.cuda
@cuda_only
def test_bad_expert_shapes_are_clear_errors(backends, stacks):
    from ember.backends import BackendError

    cuda, _ = backends
    w = cuda.weight(stacks.tensors["Q4_K"])
    with pytest.raises(BackendError, match="cannot multiply"):
        cuda.expert_matmuls([w], cuda.empty((2, COLS + 32)), cuda.from_numpy(routed(2, 2)), [cuda.empty((4, ROWS))])
    with pytest.raises(BackendError, match="routing needs"):
        cuda.route_experts(cuda.empty((1, 300)), 8, True, cuda.empty((1, 8), np.int32), cuda.empty((1, 8)))


@pytest.mark.cuda
@cuda_only
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


# ---- the grouped products' algorithm in numpy (no GPU) ----

def sb_form(raw: np.ndarray, qtype: GGMLType):
    """Rows of K-quant blocks as expert_tile_sb stages them (quant.cuh unit_sb): q (rows, units, 32) int,
    integer scales and mins (rows, units, 2) per half, d and dmin (rows, super-blocks): value =
    d * sc * q - dmin * mn. Q6_K's codes less 32, no mins."""
    rows = raw.shape[0]
    if qtype == GGMLType.Q4_K:
        sb = raw.reshape(rows, -1, 144)
        d, dmin = (sb[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float32) for o in (0, 2))
        sc12 = sb[..., 4:16].astype(np.int64)
        sc = np.concatenate([sc12[..., 0:4] & 63, (sc12[..., 8:12] & 15) | ((sc12[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([sc12[..., 4:8] & 63, (sc12[..., 8:12] >> 4) | ((sc12[..., 4:8] >> 6) << 4)], -1)
        qs = sb[..., 16:].reshape(rows, -1, 4, 32)  # chunks of 64 values: low nibbles, then high
        q = np.stack([qs & 15, qs >> 4], 3).reshape(rows, -1, 32).astype(np.int64)
        sc, mn = sc.reshape(rows, -1), mn.reshape(rows, -1)
        return q, np.stack([sc, sc], -1), np.stack([mn, mn], -1), d, dmin
    if qtype == GGMLType.Q6_K:
        sb = raw.reshape(rows, -1, 210)
        ql, qh = sb[..., :128].reshape(rows, -1, 2, 2, 32), sb[..., 128:192].reshape(rows, -1, 2, 32)
        d = sb[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
        q = np.empty((rows, sb.shape[1], 2, 4, 32), np.int64)  # (half of 128, k = unit in it)
        for k in range(4):
            q[:, :, :, k] = ((ql[:, :, :, k & 1] >> (4 * (k >> 1))) & 15) | (((qh >> (2 * k)) & 3) << 4)
        sc = sb[..., 192:208].view(np.int8).astype(np.int64).reshape(rows, -1, 2)  # a scale per 16
        return q.reshape(rows, -1, 32) - 32, sc, np.zeros_like(sc), d, np.zeros_like(d)
    raise ValueError(f"no super-block form for {qtype.name}")


def unit_form(raw: np.ndarray, qtype: GGMLType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of GGUF blocks (rows, row_bytes) as unit_q (quant.cuh) decodes them: q (rows, units, 32)
    small integers, a and b (rows, units, 2) f32, value = a[h] * q + b[h] for half h of a unit."""
    rows = raw.shape[0]
    if qtype == GGMLType.Q8_0:
        blk = raw.reshape(rows, -1, 34)
        d = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        return blk[..., 2:].view(np.int8).astype(np.int64), np.stack([d, d], -1), np.zeros(d.shape + (2,), np.float32)
    if qtype == GGMLType.MXFP4:
        blk = raw.reshape(rows, -1, 17)
        levels = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])  # E2M1 doubled
        q = levels[np.concatenate([blk[..., 1:] & 15, blk[..., 1:] >> 4], -1)]
        a = np.ldexp(np.float32(1), blk[..., 0].astype(np.int32) - 128).astype(np.float32)
        return q, np.stack([a, a], -1), np.zeros(a.shape + (2,), np.float32)
    if qtype in (GGMLType.Q4_K, GGMLType.Q6_K):  # the super-block form's integer scales times d (and dmin)
        q, sc, mn, d, dmin = sb_form(raw, qtype)
        d8, dmin8 = (np.repeat(v, 8, axis=1)[..., None] for v in (d, dmin))  # a super-block's 8 units
        a = d8 * sc.astype(np.float32)
        if qtype == GGMLType.Q6_K:  # the codes as stored, their midpoint in b
            return q + 32, a, -32 * a
        return q, a, -(dmin8 * mn.astype(np.float32))
    raise ValueError(f"no unit form for {qtype.name}")


def quant_x(x: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """x (rows, k) as quant_x writes it: q (rows, k/32, 32) and (d, d * sum of each half) (rows, k/32, 3),
    d shared by each group of 32 values (or of 256, as quant_x_llama rounds x for the K-quants)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    dg = (np.abs(x.reshape(x.shape[0], -1, group)).max(-1) / np.float32(127)).astype(np.float32)
    d = np.repeat(dg, group // 32, axis=1)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)
    halves = q.reshape(q.shape[0], q.shape[1], 2, 16).sum(-1).astype(np.float32)
    return q, np.concatenate([d[..., None], d[..., None] * halves], -1)


def group(ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """expert_group: the selections sorted by expert, and the tiles (expert, start, count) -- the
    offsets from its 32 lanes' runs of experts and their inclusive scan."""
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < n_expert)
    cnt = np.bincount(flat[valid], minlength=n_expert)
    per = -(-n_expert // 32)
    off, toff, totals = np.zeros(n_expert, int), np.zeros(n_expert, int), []
    for lane in range(32):
        run = range(lane * per, min(n_expert, lane * per + per))
        totals.append((sum(cnt[e] for e in run), sum(-(-cnt[e] // ET_TOK) for e in run)))
    c_before = np.cumsum([0] + [c for c, _ in totals])
    t_before = np.cumsum([0] + [t for _, t in totals])
    for lane in range(32):
        c, t = c_before[lane], t_before[lane]
        for e in range(lane * per, min(n_expert, lane * per + per)):
            off[e], toff[e] = c, t
            c, t = c + cnt[e], t + -(-cnt[e] // ET_TOK)
    order = np.full(int(valid.sum()), -1)
    fill = np.zeros(n_expert, int)
    for s in np.random.default_rng(0).permutation(flat.size):  # the atomics' order: any
        e = flat[s]
        if 0 <= e < n_expert:
            order[off[e] + fill[e]] = s
            fill[e] += 1
    tiles = np.full((int(t_before[-1]), 3), -1)
    for e in range(n_expert):
        for i in range(-(-cnt[e] // ET_TOK)):
            tiles[toff[e] + i] = (e, off[e] + i * ET_TOK, min(ET_TOK, cnt[e] - i * ET_TOK))
    return order, tiles


def tile_products(raw: np.ndarray, qtype: GGMLType, x: np.ndarray, ids: np.ndarray, x_div: int) -> np.ndarray:
    """y (n_sel, m) as expert_tile computes it: per tile of an expert's selections and ET_ROWS rows,
    unit by unit, a * d * (integer dot) + b * (d * sum of x's values) in f32 -- of the whole unit
    for types of one scale a unit (UNIT_SCALE), else of each half of 16."""
    n_expert, m = raw.shape[:2]
    wq, wa, wb = unit_form(raw.reshape(n_expert * m, -1), qtype)
    units = wq.shape[1]
    wq = wq.reshape(n_expert, m, units, 2, 16).astype(np.float64)  # exact: integer sums stay far below 2^53
    wa, wb = wa.reshape(n_expert, m, units, 2), wb.reshape(n_expert, m, units, 2)
    xq, meta = quant_x(x)
    xq = xq.reshape(x.shape[0], units, 2, 16).astype(np.float64)
    order, tiles = group(ids, n_expert)
    assert len(tiles) <= tile_bound(ids.size, n_expert)
    y = np.full((ids.size, m), np.nan, np.float32)
    for e, start, cnt in tiles:
        sel = order[start:start + cnt]
        xr = sel // x_div
        for r0 in range(0, m, ET_ROWS):
            rows = slice(r0, min(m, r0 + ET_ROWS))
            acc = np.zeros((cnt, rows.stop - r0), np.float32)
            for u in range(units):
                d = meta[xr, u, 0][:, None]
                if qtype in UNIT_SCALE:  # one integer sum of the unit's 32 products
                    dots = (xq[xr, u].reshape(cnt, 32) @ wq[e, rows, u].reshape(-1, 32).T).astype(np.float32)
                    xs = (meta[xr, u, 1] + meta[xr, u, 2])[:, None]
                    acc += d * wa[e, rows, u, 0][None] * dots + wb[e, rows, u, 0][None] * xs
                    continue
                for h in range(2):
                    dots = (xq[xr, u, h] @ wq[e, rows, u, h].T).astype(np.float32)
                    xs = meta[xr, u, 1 + h][:, None]
                    acc += d * wa[e, rows, u, h][None] * dots + wb[e, rows, u, h][None] * xs
            y[sel, rows] = acc
    return y


def sb_tile_products(raw: np.ndarray, qtype: GGMLType, x: np.ndarray, ids: np.ndarray, x_div: int) -> np.ndarray:
    """y (n_sel, m) as expert_tile_sb computes it: x rounded in groups of 256; per tile and super-block an
    integer sum of each unit's (Q6_K: each half's) integer dot product times its integer scale, the mins'
    term as a float sum beside it, then acc += dx * d * sum - dmin * mins in f32."""
    n_expert, m = raw.shape[:2]
    wq, wsc, wmn, wd, wdmin = sb_form(raw.reshape(n_expert * m, -1), qtype)
    units = wq.shape[1]
    wq = wq.reshape(n_expert, m, units, 2, 16)
    wsc, wmn = wsc.reshape(n_expert, m, units, 2), wmn.reshape(n_expert, m, units, 2).astype(np.float32)
    wd, wdmin = wd.reshape(n_expert, m, -1), wdmin.reshape(n_expert, m, -1)
    xq, meta = quant_x(x, 256)
    xq = xq.reshape(x.shape[0], units, 2, 16)
    order, tiles = group(ids, n_expert)
    y = np.full((ids.size, m), np.nan, np.float32)
    for e, start, cnt in tiles:
        sel = order[start:start + cnt]
        xr = sel // x_div
        acc = np.zeros((cnt, m), np.float32)
        for b in range(units // 8):
            isum = np.zeros((cnt, m), np.int64)
            msum = np.zeros((cnt, m), np.float32)
            for u in range(8 * b, 8 * b + 8):
                for h in range(2):
                    isum += (xq[xr, u, h] @ wq[e, :, u, h].T) * wsc[e, :, u, h][None]
                    msum += wmn[e, :, u, h][None] * meta[xr, u, 1 + h][:, None]
            dx = meta[xr, 8 * b, 0][:, None]
            acc += (dx * wd[e, :, b][None]) * isum.astype(np.float32) - wdmin[e, :, b][None] * msum
        y[sel] = acc
    return y


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [3, 64], ids=lambda n: f"{n}tok")
def test_super_block_sums_against_the_float_reference(qtype, n):
    """expert_tile_sb's staged form (unit_sb: d * sc * q - dmin * mn) is the reference dequantizer, its
    integer sums stay inside int32, and its arithmetic (x in groups of 256, a super-block's integer sums times
    integer scales, the float scales once) is within the decode products' error of the float64 product."""
    rng = np.random.default_rng(n)
    raw = weight(rng, qtype, N_EXPERT * ROWS, COLS, 0.05).reshape(N_EXPERT, ROWS, -1)
    q, sc, mn, d, dmin = sb_form(raw.reshape(N_EXPERT * ROWS, -1), qtype)
    rows, units = q.shape[:2]
    d8, dmin8 = (np.repeat(v, 8, axis=1)[..., None, None] for v in (d, dmin))  # a super-block's 8 units
    values = d8 * sc[..., None] * q.reshape(rows, units, 2, 16) - dmin8 * mn[..., None]
    np.testing.assert_allclose(values.reshape(rows, -1), dequantize(raw.reshape(rows, -1), qtype), rtol=1e-5,
                               atol=1e-8)
    bound = 8 * 2 * 16 * np.abs(q).max() * 127 * np.abs(sc).max()  # 8 units, 2 halves of 16 products each
    assert bound < 2 ** 31
    ids = routed(n, 4, seed=n)
    x = rng.normal(0, 1, (n, COLS)).astype(np.float32)
    got = sb_tile_products(raw, qtype, x, ids, 4)
    dense = dequantize(raw.reshape(-1), qtype).reshape(N_EXPERT, ROWS, COLS).astype(np.float64)
    want = np.einsum("sij,sj->si", dense[ids.reshape(-1)], x[np.arange(n * 4) // 4])
    assert rel_err(got, want) < limit(qtype)


EMULATED = [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4]
# experts.cu ET_UNIT_SCALE: types whose units have one scale and offset for both halves
UNIT_SCALE = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K,
              GGMLType.Q5_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4)


@pytest.mark.parametrize("qtype", EMULATED, ids=lambda t: t.name)
def test_unit_form_is_the_reference_dequantizer(qtype):
    raw = weight(np.random.default_rng(11), qtype, 8, COLS, 0.05)
    q, a, b = unit_form(raw, qtype)
    values = a[..., None] * q.reshape(q.shape[0], q.shape[1], 2, 16) + b[..., None]
    np.testing.assert_allclose(values.reshape(8, COLS), dequantize(raw, qtype), rtol=1e-6, atol=1e-9)
    if qtype in UNIT_SCALE:
        assert (a[..., 0] == a[..., 1]).all() and (b[..., 0] == b[..., 1]).all()


@pytest.mark.parametrize("k", [32, 352, 512, 2880])
def test_mxfp4_device_layout_holds_every_unit(k):
    """MXFP4 experts on the device (regroup_mxfp4, as ops.cu mxfp4_regroup makes them): unit u of a row
    is read where unit_q reads it -- scale byte u % 16 of run u // 16 (272 bytes a run), its 16 code
    bytes 16 + 16 (u % 16) into the run -- and gives back the reference values; rows are 16-byte
    multiples no more than 15 bytes longer than GGUF's (a last run of t units: 16 + 16 t bytes)."""
    rows, n = 5, k // 32
    raw = quantize(np.random.default_rng(k).normal(0, 1, (rows, k)).astype(np.float32), GGMLType.MXFP4)
    raw = raw.reshape(rows, -1)
    dev = regroup_mxfp4(raw, k)
    rb = device_row_bytes(GGMLType.MXFP4, k)
    assert dev.shape == (rows, rb) and rb % 16 == 0 and 0 <= rb - n * 17 <= 15
    units = np.empty((rows, n, 17), np.uint8)
    for u in range(n):
        run = (u // 16) * 272
        units[:, u, 0] = dev[:, run + u % 16]
        units[:, u, 1:] = dev[:, run + 16 + 16 * (u % 16):run + 32 + 16 * (u % 16)]
    np.testing.assert_array_equal(dequantize(units.reshape(-1), GGMLType.MXFP4),
                                  dequantize(raw.reshape(-1), GGMLType.MXFP4))


@pytest.mark.parametrize("n_expert,n,k", [(16, 1, 4), (16, 3, 8), (128, 512, 8), (32, 512, 4), (1024, 64, 8),
                                          (7, 40, 7)])
@pytest.mark.parametrize("routing", ["random", "one_expert", "ids_out_of_range"])
def test_group_sorts_every_selection_into_bounded_tiles(n_expert, n, k, routing):
    ids = routed(n, k, seed=n, n_expert=n_expert)
    if routing == "one_expert":
        ids[:] = np.arange(k) % n_expert
    elif routing == "ids_out_of_range":
        ids[0, 0], ids[-1, -1] = n_expert, -3
    assert n_expert <= EG_MAX_EXPERTS
    order, tiles = group(ids, n_expert)
    flat = ids.reshape(-1)
    valid = np.flatnonzero((flat >= 0) & (flat < n_expert))
    assert sorted(order) == list(valid)  # each valid selection once
    assert len(tiles) <= tile_bound(ids.size, n_expert)
    covered = np.concatenate([order[s:s + c] for _, s, c in tiles])
    assert sorted(covered) == list(valid) and (tiles[:, 2] <= ET_TOK).all() and (tiles[:, 2] > 0).all()
    for e, s, c in tiles:
        assert (flat[order[s:s + c]] == e).all()


@pytest.mark.parametrize("qtype", EMULATED, ids=lambda t: t.name)
@pytest.mark.parametrize("n", TOKENS, ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("k", [4, 8], ids=lambda k: f"top{k}")
def test_tile_algorithm_against_the_float_reference(qtype, n, k):
    """The tiles' arithmetic (int8 x per 32 values, integer dot products of 16, per-half scales and
    offsets) within the decode products' error of the float64 product, every output written once."""
    rng = np.random.default_rng(n * k)
    raw = weight(rng, qtype, N_EXPERT * ROWS, COLS, 0.05).reshape(N_EXPERT, ROWS, -1)
    ids = routed(n, k, seed=n)
    per_row = n % 2 == 1  # one x a selection for odd counts, a token's x shared by its experts otherwise
    x = rng.normal(0, 1, (n * k if per_row else n, COLS)).astype(np.float32)
    got = tile_products(raw, qtype, x, ids, 1 if per_row else k)
    dense = dequantize(raw.reshape(-1), qtype).reshape(N_EXPERT, ROWS, COLS).astype(np.float64)
    want = np.einsum("sij,sj->si", dense[ids.reshape(-1)], x[np.arange(n * k) // (1 if per_row else k)])
    assert rel_err(got, want) < limit(qtype)


def test_mv_stages_at_most_what_fits():
    for kd in (256, 512, 2048, 2880, 14336, 32768, 65536):
        g = mv_group(kd)
        assert 1 <= g <= 8 and (g == 1 or g * (kd + kd // 2) <= 40 * 1024)  # with the static list: < 48 KB
    assert mv_group(2048) == mv_group(2880) == 8 and mv_group(14336) == 1


# ---- the kernels themselves on the CPU (bench/cuda_experts_check.py: a fiber per CUDA thread) ----

def experts_check():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "cuda_experts_check.py"
    spec = importlib.util.spec_from_file_location("cuda_experts_check", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not shutil.which("g++"), reason="needs g++")
@pytest.mark.parametrize("qtype,runs", [
    (GGMLType.Q4_K, [(3, "tile", False), (40, "mv", True), (40, "tile_dp4a", False),  # a unit in one sum; slice2_q
                     (40, "tile_sb", True), (3, "tile_sb_dp4a", False)]),  # a super-block in one sum
    (GGMLType.Q6_K, [(40, "tile", True), (3, "mv", False), (3, "tile_dp4a", True),  # half by half
                     (3, "tile_sb", False), (40, "tile_sb_dp4a", True)]),
    (GGMLType.MXFP4, [(40, "tile", False), (40, "mv", True)]),  # 352 values: a last chunk of 3 units
], ids=lambda v: v.name if isinstance(v, GGMLType) else "")
def test_kernels_on_the_cpu(tmp_path, qtype, runs):
    """expert_group, expert_tile (tensor-core path, fragments as the PTX ISA lays them out; and the
    dp4a path of HIP and older GPUs), expert_tile_sb (the K-quants against x in groups of 256, both
    paths) and expert_mv as compiled from experts.cu, run on the CPU: every selection's row written
    and within int8 rounding of the float64 product; the runs with an x per selection also add the
    chosen experts' bias rows as they store (a fused ExpertBias)."""
    check = experts_check()
    dp4a = check.build(tmp_path, qtype, dp4a=True) if any(r[1].endswith("dp4a") for r in runs) else None
    exe = check.build(tmp_path, qtype)
    for n, kernel, per_row in runs:
        top_k = 4 if per_row else 8
        err = check.check(dp4a if kernel.endswith("dp4a") else exe, tmp_path, qtype, n, top_k, per_row,
                          kernel != "mv", np.random.default_rng(n), bias=per_row, sb="_sb" in kernel)
        assert err < 2e-2, f"{kernel} at {n} tokens: relative error {err:.2e} (nan: a row left unwritten)"


@pytest.mark.skipif(not shutil.which("g++"), reason="needs g++")
def test_expert_mv_blocks_take_the_chosen_experts(tmp_path):
    """With fewer selections than experts, expert_mv's grid has a block row per selection and each
    takes the next chosen expert (chosen_expert): one token's 4 of 8 experts; 3 tokens' 4 of 16, where
    experts repeat across tokens and the rows past the chosen ones return; and 2 tokens' 8 of 64 (a
    bitmap word past the first)."""
    check = experts_check()
    exe = check.build(tmp_path, GGMLType.Q4_K)
    for n, top_k, n_expert in ((1, 4, 8), (3, 4, 16), (2, 8, 64)):
        err = check.check(exe, tmp_path, GGMLType.Q4_K, n, top_k, True, False, np.random.default_rng(n),
                          n_expert=n_expert)
        assert err < 2e-2, f"{n} tokens, top-{top_k} of {n_expert}: relative error {err:.2e} (nan: a row left unwritten)"


@pytest.mark.skipif(not shutil.which("g++"), reason="needs g++")
def test_expert_mv_teams_by_row_length(tmp_path):
    """expert_mv's teams: as many lanes as a row's lane steps (4 to 32), a block 2 rows a team; every
    width computes the same products (run on the CPU: Q4_K rows of 512, 8 steps, at teams of 4 to 32)."""
    from ember.backends.cuda.ops.experts import mv_rows, mv_team_log2

    T = GGMLType
    assert [mv_team_log2(t, k) for t, k in ((T.Q4_K, 768), (T.Q4_K, 2048), (T.Q6_K, 768), (T.MXFP4, 2880),
                                            (T.Q4_K, 512), (T.Q8_0, 352), (T.Q8_0, 64))] == [4, 5, 5, 5, 3, 4, 2]
    assert (mv_rows(T.Q4_K, 768), mv_rows(T.Q4_K, 2048), mv_rows(T.Q8_0, 64)) == (32, 16, 128)
    check = experts_check()
    exe = check.build(tmp_path, T.Q4_K)
    for team_log2 in (2, 3, 4, 5):
        err = check.check(exe, tmp_path, T.Q4_K, 2, 4, True, False, np.random.default_rng(7), team_log2=team_log2)
        assert err < 2e-2, f"teams of {1 << team_log2}: relative error {err:.2e} (nan: a row left unwritten)"


# ---- the grouped products' choice of kernel (no device: arrays stand in by shape and address) ----

class FakeArray:
    def __init__(self, shape, addr: int):
        from types import SimpleNamespace

        self.shape, self.data = tuple(shape), SimpleNamespace(ptr=addr)
        self.size = int(np.prod(self.shape))


class FakeKernels:
    def fn(self, module: str, name: str) -> str:
        return f"{module}.{name}"


@pytest.mark.parametrize("k", [768, 2048, 2880])
@pytest.mark.parametrize("n", [1, 4, 5, 8, 16, 48, 49, 512])
def test_grouped_products_choose_their_kernel_by_shape(n, k):
    """By default (moe_mv_tokens -1) steps of up to EMV_TOKENS tokens over rows of at least EMV_MIN_K
    values, and of up to EMV_SHORT_TOKENS over shorter rows, take expert_mv, one launch for both matrices
    after quant_x_llama; others the tiles (one expert_group for all the matrices, then an expert_tile each); a
    fixed moe_mv_tokens overrides the shape."""
    from types import SimpleNamespace

    from ember.backends.cuda.ops import DeviceMatrix
    from ember.backends.cuda.ops.experts import (EMV_MIN_K, EMV_SHORT_TOKENS, EMV_TOKENS, ExpertMatmul,
                                                 ExpertScratch, takes_mv)
    from ember.quant.types import layout

    assert (EMV_TOKENS, EMV_MIN_K, EMV_SHORT_TOKENS) == (48, 1536, 4)
    qt, n_expert, m, top_k = GGMLType.Q4_K, 128, 512, 8
    rb = layout(qt).row_bytes(k)
    ws = [SimpleNamespace(name=f"w{i}", type=qt, shape=(n_expert, m, k),
                          data=DeviceMatrix(FakeArray((n_expert * m * rb,), (1 + i) << 30), rb)) for i in range(2)]
    x, ids = FakeArray((n, k), 3 << 30), FakeArray((n, top_k), 4 << 30)
    ys = [FakeArray((n * top_k, m), (5 + i) << 30) for i in range(2)]
    scratch = ExpertScratch(xq=FakeArray((n * k * 2,), 7 << 30), order=FakeArray((n * top_k,), 8 << 30),
                            tiles=FakeArray((tile_bound(n * top_k, n_expert), 4), 9 << 30),
                            n_tiles=FakeArray((1,), 10 << 30))
    mod = f"experts_{int(qt)}"
    for mv_tokens, want_mv in ((-1, n <= (48 if k >= 1536 else 4)), (0, False), (64, n <= 64)):
        assert takes_mv(n, k, mv_tokens) == want_mv
        fns = [la.fn for la in ExpertMatmul(ws, x, top_k, ids, ys, scratch, mv_tokens).launches(FakeKernels())]
        tile = "expert_tile_sb" if k % 256 == 0 else "expert_tile"  # Q4_K's super-block sums: x in groups of 256
        want = [f"{mod}.expert_mv"] if want_mv else [f"{mod}.expert_group"] + [f"{mod}.{tile}"] * 2
        assert fns == ["ops.quant_x_llama"] + want, (mv_tokens, fns)
        if want_mv:  # both matrices (one type and shape) in one launch: grid z = 2, the second's pointers after
            la = ExpertMatmul(ws, x, top_k, ids, ys, scratch, mv_tokens).launches(FakeKernels())[1]
            assert la.grid[2] == 2 and [int(a) for a in la.args[-4:-2]] == [ws[1].data.buf.data.ptr, 6 << 30]
    with pytest.raises(ValueError, match="moe_mv_tokens"):
        CudaConfig(moe_mv_tokens=-2)


def test_super_block_tiles_only_where_x_rounds_in_groups_of_256():
    """expert_tile_sb takes the K-quants (Q2_K .. Q6_K) when their x was rounded in groups of 256; a stack
    whose x was rounded for another type first (groups of 32) and the other 256-value types take expert_tile."""
    from types import SimpleNamespace

    from ember.backends.cuda.ops import DeviceMatrix
    from ember.backends.cuda.ops.experts import SB_TYPES, ExpertMatmul, ExpertScratch, tile_kernel
    from ember.quant.types import layout

    for qt in SB_TYPES:
        assert (tile_kernel(qt, 256), tile_kernel(qt, 32)) == ("expert_tile_sb", "expert_tile")
    for qt in (GGMLType.IQ4_XS, GGMLType.IQ2_XXS, GGMLType.Q8_0, GGMLType.MXFP4):
        assert tile_kernel(qt, 256) == "expert_tile"
    n, k, m, n_expert, top_k = 64, 2048, 256, 32, 4
    for types, tiles in (((GGMLType.Q8_0, GGMLType.Q4_K), ["experts_8.expert_tile", "experts_12.expert_tile"]),
                         ((GGMLType.Q4_K, GGMLType.Q6_K), ["experts_12.expert_tile_sb", "experts_14.expert_tile_sb"])):
        ws = [SimpleNamespace(name=f"w{i}", type=qt, shape=(n_expert, m, k),
                              data=DeviceMatrix(FakeArray((n_expert * m * layout(qt).row_bytes(k),), (1 + i) << 30),
                                                layout(qt).row_bytes(k)))
              for i, qt in enumerate(types)]
        scratch = ExpertScratch(xq=FakeArray((n * k * 2,), 7 << 30), order=FakeArray((n * top_k,), 8 << 30),
                                tiles=FakeArray((tile_bound(n * top_k, n_expert), 4), 9 << 30),
                                n_tiles=FakeArray((1,), 10 << 30))
        ys = [FakeArray((n * top_k, m), (5 + i) << 30) for i in range(2)]
        launches = ExpertMatmul(ws, FakeArray((n, k), 3 << 30), top_k, FakeArray((n, top_k), 4 << 30), ys, scratch,
                                0).launches(FakeKernels())
        assert [la.fn for la in launches][2:] == tiles
        assert launches[0].args[4] == (32 if types[0] == GGMLType.Q8_0 else 256)  # quant_x_llama's group


def llama_rounded(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x (n, k) f32 as llama.cpp's CPU rounds activations: int8 values and each 32-value block's scale;
    group 256 its Q8_K (the first value of largest magnitude m to -127, iscale = -127 / m), 32 its Q8_0
    (d = max / 127 in f16, values rounded at 127 / max)."""
    n, k = x.shape
    g = x.reshape(n, k // group, group).astype(np.float32)
    amax = np.abs(g).max(axis=2)
    if group == 256:
        m = np.take_along_axis(g, np.abs(g).argmax(axis=2)[..., None], axis=2)[..., 0]  # argmax: the first
        with np.errstate(divide="ignore"):
            mul = np.where(amax > 0, np.float32(-127) / m, 0).astype(np.float32)
            d = np.where(amax > 0, np.float32(1) / mul, 0).astype(np.float32)
    else:
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore"):
            mul = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
    q = np.minimum(127, np.rint((mul[..., None] * g).astype(np.float32))).astype(np.int8)
    return q.reshape(n, k), np.repeat(d, group // 32, axis=1)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("group", [256, 32])
def test_expert_activations_round_as_llama_cpp(group):
    """quant_x_llama: the int8 values and scales of llama.cpp's Q8_K (K-quant weights) or Q8_0 (the
    others) to the bit, in quant_x's layout, with each half block's sum of values beside the scale."""
    from ember.backends.cuda import Backend
    from ember.backends.cuda.ops.base import Launch, f32, i32, ptr

    cuda = Backend()
    n, k = 5, 1280
    rng = np.random.default_rng(group)
    x = (rng.standard_t(3, (n, k)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
    x[1, :256] = 0  # an all-zero group
    x[2, 7], x[2, 9] = -50.0, 50.0  # two values of largest magnitude: the first one decides the sign
    xd = cuda.from_numpy(x)
    xq = cuda.cp.full(n * k + n * (k // 32) * 16, 0xAB, np.uint8)
    fn = cuda.kernels.fn("ops", "quant_x_llama")
    Launch(fn, (n, -(-k // 1024), 1), (128, 1, 1), (ptr(xd), ptr(xq), i32(n), i32(k), i32(group), ptr(None),
                                                     ptr(None), i32(0), f32(0), f32(0))).run()  # 4 warps of 256
    raw = cuda.cp.asnumpy(xq)
    q = raw[:n * k].view(np.int8).reshape(n, k)
    meta = raw[n * k:].view(np.float32).reshape(n, k // 32, 4)
    want_q, want_d = llama_rounded(x, group)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(meta[..., 0], want_d)
    halves = want_q.reshape(n, k // 32, 2, 16).astype(np.int64).sum(axis=3)
    np.testing.assert_allclose(meta[..., 1:3], want_d[..., None] * halves, rtol=1e-6)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("act", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.MXFP4], ids=lambda t: t.name)
def test_gated_activation_rounded_in_one_pass(backends, stacks, act, qtype):
    """A down product whose quant_x_llama computes the gated activation (the fused GatedAct/SwigluOai):
    the activation stored where the elementwise kernel stores it and the products bit for bit those of
    the two launches, at 1 token (expert_mv) and 40 (the tiles), in place on gate as the model runs it."""
    from ember.backends.cuda.ops import GatedAct
    from ember.backends.cuda.ops.experts import ExpertMatmul, SwigluOai

    cuda, _ = backends
    stack = cuda.weight(stacks.tensors[qtype.name])
    for n in (1, 40):
        rng = np.random.default_rng(n)
        gate0 = (rng.standard_normal((n * 4, COLS)) * 3).astype(np.float32)
        up0 = rng.standard_normal((n * 4, COLS)).astype(np.float32)
        ids = cuda.from_numpy(routed(n, 4, seed=n))

        def ops():
            gate, up, y = cuda.from_numpy(gate0), cuda.from_numpy(up0), poisoned(cuda, (n * 4, ROWS))
            act_op = SwigluOai(gate, up, gate, 1.702, 7.0) if act == "swiglu_oai" else GatedAct(act, gate, up, gate)
            down = ExpertMatmul([stack], gate, 1, ids, [y], cuda._expert_scratch(gate, n * 4, N_EXPERT), -1)
            return [act_op, down], [gate, y]

        fused_as_apart(cuda, ops)


@pytest.mark.parametrize("n", [8, 64, 65, 512])
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.F16], ids=lambda t: t.name)
def test_prompt_products_take_the_blas_route_by_size(n, qtype):
    """(Device-free: the launches planned.) Products of quantized weights over blas_rows rows or
    more: x_to_f16, then for each matrix dequant_f16 and one cuBLAS call
    a run of rows (a 40000-row head of 2048 columns: two runs, the second offset into y), then
    unscale_rows; float weights, blas_rows 0 and smaller steps keep the tiles."""
    from types import SimpleNamespace

    from ember.backends.cuda.ops import DeviceMatrix, Matmul
    from ember.backends.cuda.ops.matmul import BLAS_W_VALUES, BlasGemm, BlasScratch
    from ember.quant.types import layout

    k, heads = 2048, (1024, 40000)
    rb = layout(qtype).row_bytes(k)
    ws = [SimpleNamespace(name=f"w{i}", type=qtype, shape=(m, k), data=DeviceMatrix(FakeArray((m * rb,), (1 + i) << 30), rb))
          for i, m in enumerate(heads)]
    x = FakeArray((n, k), 3 << 30)
    ys = [FakeArray((n, m), (5 + i) << 30) for i, m in enumerate(heads)]
    blas = BlasScratch(blas="cublas", wh=FakeArray((BLAS_W_VALUES,), 7 << 30), xh=FakeArray((n * k,), 8 << 30),
                       inv=FakeArray((n,), 9 << 30))
    mod = f"matmul_{int(qtype)}"
    for rows in (64, 0):  # from 64 rows (the default is 65), or never
        op = Matmul(ws, x, ys, mv_rows=4, cfg=CudaConfig(blas_rows=rows), blas_buf=blas)
        launches = op.launches(FakeKernels())
        names = [la.fn if hasattr(la, "fn") else "gemm" for la in launches]
        if rows and n >= 64 and qtype == GGMLType.Q4_K:
            run = BLAS_W_VALUES // k  # 32768 rows
            assert names == ["ops.x_to_f16", f"{mod}.dequant_f16", "gemm", "ops.unscale_rows",
                             f"{mod}.dequant_f16", "gemm", f"{mod}.dequant_f16", "gemm", "ops.unscale_rows"]
            gemms = [la for la in launches if isinstance(la, BlasGemm)]
            assert [g.dims[0] for g in gemms] == [1024, run, 40000 - run]
            assert gemms[2].dims[7] == ys[1].data.ptr + 4 * run and gemms[2].dims[8] == 40000
            assert all(g.dims[1:3] == (n, k) for g in gemms)
            assert launches[4].grid == (-(-(k // 32) // 128), run, 1)
        else:
            assert "gemm" not in names and "ops.x_to_f16" not in names, names
    if n == 64 and qtype == GGMLType.Q4_K:
        # a 64-row step (a batched decode of 64 sequences): the route from blas_rows rows comes
        # before mm_split, which keeps the step below it
        from ember.backends.cuda.ops.matmul import SplitScratch

        split = SplitScratch(FakeArray((1 << 22,), 10 << 30), FakeArray((4096,), 11 << 30))
        one = ws[:1]
        for rows, want in ((64, "gemm"), (65, f"{mod}.mm_split")):
            op = Matmul(one, x, ys[:1], mv_rows=8, cfg=CudaConfig(blas_rows=rows), blas_buf=blas, split_buf=split)
            names = [la.fn if hasattr(la, "fn") else "gemm" for la in op.launches(FakeKernels())]
            assert want in names, (rows, names)
            assert op.split() == (rows == 65)
    with pytest.raises(ValueError, match="blas_rows"):
        CudaConfig(blas_rows=-1)
