"""CUDA backend against the float64 reference backend: every op and quant type on random inputs,
whole-model logits (prefill and decode, batch 1 and 64), recorded steps replayed as CUDA graphs
against direct execution, and engine runs against the CPU backend.

Skipped, with the reason, where CuPy or an NVIDIA GPU is missing (CI has none: these run on the
GPU machine through bench/cuda_device_run.sh).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from synth import ALL_TYPES, Shape, weight, write_model

from ember.backends import AttentionBatch, RopeParams, get_backend
from ember.gguf_loader import GGUFFile
from ember.models import Step, load_model
from ember.quant import GGMLType, dequantize


def gpu_missing() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'ember[cuda]')"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, or no device
        return f"no usable CUDA GPU ({type(e).__name__}: {e})"
    return None if n else "no CUDA GPU visible"


REASON = gpu_missing()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

FLOAT_TYPES = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
ROWS, COLS = 301, 768  # odd rows: partial tiles and unpaired rows; three 256-value super-blocks


@pytest.fixture(scope="module")
def cuda():
    return get_backend("cuda")


@pytest.fixture(scope="module")
def ref():
    return get_backend("reference")


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "non-finite output (an element left unwritten?)"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def poisoned(cuda, shape):
    """An output buffer full of NaN: an element the kernel forgets to write fails the check."""
    out = cuda.empty(shape)
    out.fill(np.nan)
    return out


@pytest.fixture(scope="module")
def matrices(tmp_path_factory):
    """One GGUF file holding a (ROWS, COLS) matrix of every type, read through the real loader."""
    import gguf

    path = tmp_path_factory.mktemp("cuda") / "matrices.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for qtype in ALL_TYPES:
        data = weight(rng, qtype, ROWS, COLS, 0.05)
        if qtype == GGMLType.F32:
            w.add_tensor(qtype.name, data.view(np.float32).reshape(ROWS, COLS))
        elif qtype == GGMLType.F16:
            w.add_tensor(qtype.name, data.view(np.float16).reshape(ROWS, COLS))
        else:
            w.add_tensor(qtype.name, data, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    w.add_tensor("norm", rng.uniform(0.5, 1.5, COLS).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    yield f
    f.close()


def dense(f: GGUFFile, name: str) -> np.ndarray:
    t = f.tensors[name]
    return dequantize(t.data, t.type).reshape(t.shape).astype(np.float64)


# ---- matrices ----

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_get_rows(cuda, matrices, qtype):
    w = cuda.weight(matrices.tensors[qtype.name])
    ids = np.array([0, 5, ROWS - 1, 17, 5], np.int32)
    out = poisoned(cuda, (len(ids), COLS))
    cuda.get_rows(w, ids, out)
    np.testing.assert_allclose(cuda.to_numpy(out), dense(matrices, qtype.name)[ids], rtol=1e-6, atol=1e-7)


def test_get_rows_after_a_step_of_best_ids(cuda, matrices):
    """An ahead step's embedding: ids -r - 1 take the first of row r's best ids (of the step before,
    on the device) that the token's row of bans lacks; other ids are read as they are."""
    from ember.backends import BackendError

    w = cuda.weight(matrices.tensors["Q8_0"])
    best = np.array([[7, 3, 9], [2, 11, 4], [5, 6, 8], [1, 0, 12]], np.int32)
    prev = cuda.from_numpy(best)
    ids = np.array([-1, -2, 17, -4, -3], np.int32)
    bans = np.array([[-1, -1, -1], [2, 11, -1], [-1, -1, -1], [1, -1, 0], [5, -1, -1]], np.int32)
    out = poisoned(cuda, (len(ids), COLS))
    cuda.get_rows(w, ids, out, prev=prev, bans=bans)
    want = [7, 4, 17, 12, 6]
    np.testing.assert_allclose(cuda.to_numpy(out), dense(matrices, "Q8_0")[want], rtol=1e-6, atol=1e-7)
    with pytest.raises(BackendError, match="out of range"):
        cuda.get_rows(w, np.array([-5], np.int32), out[:1], prev=prev, bans=bans[:1])


@pytest.mark.parametrize("n", [1, 3, 20, 64, 200])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul(cuda, matrices, qtype, n):
    w = cuda.weight(matrices.tensors[qtype.name])
    x = np.random.default_rng(n).normal(0, 1, (n, COLS)).astype(np.float32)
    out = poisoned(cuda, (n, ROWS))
    cuda.matmul(w, cuda.from_numpy(x), out)
    err = rel_err(cuda.to_numpy(out), x.astype(np.float64) @ dense(matrices, qtype.name).T)
    # Matrix-vector kernels (n <= 8; up to 64 for some types, in groups of 8 rows): f32 (float
    # weights) or int8 activations. Larger n: tensor-core tiles of f16 weights (exact for F16 and
    # BF16) and of x split into two f16 parts for float weights.
    from ember.backends.cuda.ops.matmul import matvec_rows

    matvec = n <= matvec_rows(qtype, 8 if cuda.tensor_cores else cuda.config.mv_rows)
    if qtype in FLOAT_TYPES:
        limit = 3e-4 if qtype == GGMLType.F32 and not matvec else 1e-5
    else:
        limit = 2e-2 if matvec else 3e-3
    assert err < limit, f"relative error {err:.2e}"


@pytest.mark.parametrize("n", [20, 77])  # 20: split tiles (quantized types); 77: whole tiles
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.F16], ids=lambda t: t.name)
def test_matmul_of_activations_beyond_f16_range(cuda, matrices, qtype, n):
    """Rows of x past f16's 65504 (FFN inputs of some models reach 10^5): the tiles' f16 copies of
    x are scaled by a power of two per row, so every row keeps its precision and none turns
    infinite; ordinary rows of the same product are untouched."""
    rng = np.random.default_rng(n)
    x = rng.normal(0, 1, (n, COLS)).astype(np.float32)
    x[3] *= 4e4  # values up to ~1.6e5
    x[n - 2, 7] = -3e6
    w = cuda.weight(matrices.tensors[qtype.name])
    out = poisoned(cuda, (n, ROWS))
    cuda.matmul(w, cuda.from_numpy(x), out)
    got, want = cuda.to_numpy(out), x.astype(np.float64) @ dense(matrices, qtype.name).T
    assert np.isfinite(got).all()
    for r in range(n):
        assert rel_err(got[r], want[r]) < (1e-4 if qtype in FLOAT_TYPES else 2e-2), f"row {r}"


def with_args(launch, **changes):
    """The launch with some of mv_n*'s arguments changed, by name (matmul.cu MV_PARAMS)."""
    from dataclasses import replace as dc_replace

    names = ["w0", "w1", "w2", "w3", "y0", "y1", "y2", "y3", "rows0", "rows1", "rows2", "rows3", "n_mat", "row_bytes",
             "k", "n", "x", "xq", "team_log2", "n_tblocks", "pre_dec", "pf_row"]
    args = list(launch.args)
    for name, value in changes.items():
        args[names.index(name)] = type(args[names.index(name)])(value)
    return dc_replace(launch, args=tuple(args))


def run_launches(cuda, launches) -> None:
    for launch in launches:
        launch.run()


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_of_the_lean_kernel(cuda, matrices, qtype):
    """mv_n1_occ (mv_n1 held to 80 registers, taken by products of many blocks: n_sm=1 here)
    computes what mv_n1 does, with a norm prologue; and mv_n1 with a lane's first weight steps
    decoded before the wait gives the same values, to the bit, as without."""
    from ember.backends.cuda.ops.matmul import Matmul, xq_bytes

    w = cuda.weight(matrices.tensors[qtype.name])
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (1, COLS)).astype(np.float32)
    norm = cuda.weight(matrices.tensors["norm"])
    outs = {}
    for case in ("base", "occ", "no_pre"):
        y, h = poisoned(cuda, (1, ROWS)), poisoned(cuda, (1, COLS))
        op = Matmul([w], h, [y], xq=cuda.cp.empty(xq_bytes(1, COLS), np.uint8), src=cuda.from_numpy(x),
                    norm_w=norm.data, eps=1e-5, n_sm=1 if case == "occ" else cuda.n_sm)
        (*first, launch) = op.launches(cuda.kernels)
        want_fn = f"{matmul_module_of(qtype)}_occ.mv_n1_occ" if case == "occ" else f"{matmul_module_of(qtype)}.mv_n1"
        if qtype in FLOAT_TYPES and case != "occ":  # normalised by a launch of its own: the product only stores y
            want_fn = f"{matmul_module_of(qtype)}_store.mv_n1_store"
        assert cuda.kernels.name_of(launch.fn) == want_fn
        run_launches(cuda, [*first, with_args(launch, pre_dec=0) if case == "no_pre" else launch])
        outs[case] = (cuda.to_numpy(y), cuda.to_numpy(h))
    base = outs["base"]
    assert rel_err(outs["occ"][0], base[0]) < 1e-5 and rel_err(outs["occ"][1], base[1]) < 1e-6
    np.testing.assert_array_equal(outs["no_pre"][0], base[0])
    want = rms(x.astype(np.float64), dense(matrices, "norm"), 1e-5) @ dense(matrices, qtype.name).T
    assert rel_err(base[0], want) < (1e-5 if qtype in FLOAT_TYPES else 2e-2)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_storing_alone_takes_its_own_kernel(cuda, matrices, qtype):
    """A one-row product that only stores y (x already quantized, no epilogue) runs mv_n1_store,
    mv_n1 compiled without the other paths: the same values to the bit as mv_n1 given the same
    arguments, two matrices at once, with and without the first slices decoded before the wait."""
    from ember.backends.cuda.ops.matmul import Matmul, xq_bytes

    w = cuda.weight(matrices.tensors[qtype.name])
    rng = np.random.default_rng(6)
    x = cuda.from_numpy(rng.normal(0, 1, (1, COLS)).astype(np.float32))
    xq = cuda.cp.empty(xq_bytes(1, COLS), np.uint8)
    Matmul([], x, [], xq=xq)._quant_x(cuda.kernels).run()  # x quantized for the products that read it so
    outs = {}
    for kernel in ("mv_n1_store", "mv_n1"):
        for pre in (True, False):
            y0, y1 = poisoned(cuda, (1, ROWS)), poisoned(cuda, (1, ROWS))
            (launch,) = Matmul([w, w], x, [y0, y1], xq=xq, quant_in=False).launches(cuda.kernels)
            assert cuda.kernels.name_of(launch.fn) == f"{matmul_module_of(qtype)}_store.mv_n1_store"
            if kernel == "mv_n1":
                launch = replace(launch, fn=cuda.kernels.fn(matmul_module_of(qtype), "mv_n1"))
            run_launches(cuda, [launch if pre else with_args(launch, pre_dec=0)])
            outs[kernel, pre] = cuda.to_numpy(y0), cuda.to_numpy(y1)
    for key, (y0, y1) in outs.items():
        np.testing.assert_array_equal(y0, outs["mv_n1", key[1]][0])
        np.testing.assert_array_equal(y1, y0)
    want = cuda.to_numpy(x).astype(np.float64) @ dense(matrices, qtype.name).T
    assert rel_err(outs["mv_n1_store", True][0], want) < (1e-5 if qtype in FLOAT_TYPES else 2e-2)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_grid_walking_its_blocks(cuda, matrices, qtype):
    """A one-row product of more blocks of teams than fit on the GPU at once takes a grid that fits
    and walks the rest: the same values as one block per block of teams, with a norm prologue
    (done once per block), a residual add, and gate and up quantizing their activations. n_sm=1
    here makes a few blocks do the walking."""
    from types import SimpleNamespace

    from ember.backends.cuda.ops.matmul import MODE_RESIDUAL, MODE_SILU, Matmul, xq_bytes

    rng = np.random.default_rng(29)
    w = cuda.weight(matrices.tensors[qtype.name])
    norm = cuda.weight(matrices.tensors["norm"])
    x = rng.normal(0, 1, (1, COLS)).astype(np.float32)
    res0 = rng.normal(0, 1, (1, ROWS)).astype(np.float32)
    gate, up = (cuda.weight(SimpleNamespace(name=nm, type=qtype, shape=(256, COLS),
                                            data=weight(rng, qtype, 256, COLS, 0.05).reshape(-1))) for nm in "gu")

    def run(walk: bool):
        y, h, res = poisoned(cuda, (1, ROWS)), poisoned(cuda, (1, COLS)), cuda.from_numpy(res0)
        g, u, act = (poisoned(cuda, (1, 256)) for _ in range(3))
        ops = [Matmul([w], h, [y], xq=cuda.cp.empty(xq_bytes(1, COLS), np.uint8), src=cuda.from_numpy(x),
                      norm_w=norm.data, eps=1e-5, mode=MODE_RESIDUAL, aux=res, n_sm=1)]
        outs = [y, h, res]
        if qtype not in FLOAT_TYPES:
            aq = cuda.cp.zeros(xq_bytes(1, 256), np.uint8)
            ops.append(Matmul([gate, up], h, [g, u], xq=cuda.cp.empty(xq_bytes(1, COLS), np.uint8),
                              src=cuda.from_numpy(x), norm_w=norm.data, eps=1e-5, mode=MODE_SILU, aux=act,
                              act_q=aq, n_sm=1))
            outs += [g, u, act, aq]
        grids = []
        for op in ops:
            (*first, launch) = op.launches(cuda.kernels)
            if not walk:  # a block per block of teams
                launch = replace(launch, grid=(int(launch.args[19]), 1, 1))
            grids.append(launch.grid[0])
            run_launches(cuda, [*first, launch])
        return [cuda.to_numpy(o) for o in outs], grids

    got, grids = run(True)
    want, full = run(False)
    assert all(a < b for a, b in zip(grids, full)), (grids, full)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)  # each row summed by one team the same way


XS_TYPES = [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K]


# teams of one warp; of 3-5 warps, one a block; of 2 (Q4_K, Q5_K: two teams a block) or 4 (Q8_0) warps
@pytest.mark.parametrize("cols", [COLS, 4608, 4096], ids=["warp", "wide", "two_teams"])
@pytest.mark.parametrize("qtype", XS_TYPES, ids=lambda t: t.name)
def test_large_gated_products_take_the_x_stationary_kernel(cuda, qtype, cols, monkeypatch):
    """Gate and up of one activation row over large matrices (every size here: XS_MIN_BYTES 0) take
    mv_xs, teams that hold x in registers and stream rows: against mv_n1 and the dense product,
    with the activation quantized (the bytes quant_x makes of it) and without."""
    from types import SimpleNamespace

    import ember.backends.cuda.ops.matmul as mm
    from ember.backends.cuda.ops.matmul import MODE_GELU, MODE_SILU, Matmul, xq_bytes

    rng = np.random.default_rng(31)
    rows = 288  # whole blocks of 32 gate/up rows
    data = {nm: weight(rng, qtype, rows, cols, 0.05) for nm in "gu"}
    ws = {nm: cuda.weight(SimpleNamespace(name=nm, type=qtype, shape=(rows, cols), data=d.reshape(-1)))
          for nm, d in data.items()}
    x = cuda.from_numpy(rng.normal(0, 1, (1, cols)).astype(np.float32))
    x64 = cuda.to_numpy(x).astype(np.float64)
    want = {nm: x64 @ dequantize(d.reshape(-1), qtype).reshape(rows, cols).astype(np.float64).T
            for nm, d in data.items()}
    xq = cuda.cp.empty(xq_bytes(1, cols), np.uint8)
    Matmul([], x, [], xq=xq)._quant_x(cuda.kernels).run()
    acts = {MODE_SILU: lambda g: g / (1 + np.exp(-g)),
            MODE_GELU: lambda g: 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))}

    def run(xs: bool, mode: int, quantize: bool):
        monkeypatch.setattr(mm, "XS_MIN_BYTES", 0 if xs else 1 << 60)
        g, u, act = (poisoned(cuda, (1, rows)) for _ in range(3))
        aq = cuda.cp.zeros(xq_bytes(1, rows), np.uint8) if quantize else None
        (launch,) = Matmul([ws["g"], ws["u"]], x, [g, u], xq=xq, quant_in=False, mode=mode, aux=act,
                           act_q=aq).launches(cuda.kernels)
        assert cuda.kernels.name_of(launch.fn).endswith(".mv_xs") == xs
        launch.run()
        return [cuda.to_numpy(o) for o in (g, u, act)] + ([cuda.to_numpy(aq)] if quantize else [])

    for mode, quantize in ((MODE_SILU, True), (MODE_SILU, False), (MODE_GELU, True)):
        got, base = run(True, mode, quantize), run(False, mode, quantize)
        for a, b in zip(got[:3], base[:3]):
            assert rel_err(a, b) < 1e-5
        assert rel_err(got[0], want["g"]) < 2e-2 and rel_err(got[1], want["u"]) < 2e-2
        assert rel_err(got[2], acts[mode](want["g"]) * want["u"]) < 3e-2
        if quantize:
            again = cuda.cp.zeros(xq_bytes(1, rows), np.uint8)
            Matmul([], cuda.from_numpy(got[2]), [], xq=again)._quant_x(cuda.kernels).run()
            np.testing.assert_array_equal(got[3], cuda.to_numpy(again))


@pytest.mark.parametrize("qtype", XS_TYPES, ids=lambda t: t.name)
def test_x_stationary_products_normalising_x_themselves(cuda, qtype, monkeypatch):
    """mv_xs with the norm in its blocks (xs_prologue: each lane normalises and quantizes its own
    slices of x): products that only store y (three matrices, their rows paired across the
    matrices' ends; and one of many rows, more pairs a block) and gate and up. Against the
    product after a quant_x launch (CudaConfig(prologue_k=0)), on mv_n1 and (past
    XS_STORE_ALONE_MIN_BYTES, an output head) on mv_xs, and the dense product of the normalised
    row; h written whole."""
    from types import SimpleNamespace

    import ember.backends.cuda.ops.matmul as mm
    from ember.backends.cuda import CudaConfig
    from ember.backends.cuda.ops.matmul import MODE_SILU, Matmul, xq_bytes

    monkeypatch.setattr(mm, "XS_STORE_MIN_BYTES", 0)
    monkeypatch.setattr(mm, "XS_MIN_BYTES", 0)
    monkeypatch.setattr(mm, "XS_STORE_ALONE_MIN_BYTES", 1 << 60)
    rng = np.random.default_rng(43)
    cols = 4096 if qtype == GGMLType.Q8_0 else 2304  # teams of 4 warps; of 2, lanes past the row idle
    x = rng.normal(0, 1, (1, cols)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    xn = rms(x.astype(np.float64), nw.astype(np.float64), 1e-5)

    def mats(rows_list):
        raws = [weight(rng, qtype, r, cols, 0.05) for r in rows_list]
        ws = [cuda.weight(SimpleNamespace(name=f"w{i}", type=qtype, shape=(r, cols), data=raw.reshape(-1)))
              for i, (r, raw) in enumerate(zip(rows_list, raws))]
        dense_ws = [dequantize(raw.reshape(-1), qtype).reshape(r, cols).astype(np.float64)
                    for r, raw in zip(rows_list, raws)]
        return ws, dense_ws

    def run(ws, rows_list, prologue: bool, **kw):
        h, outs = poisoned(cuda, (1, cols)), [poisoned(cuda, (1, r)) for r in rows_list]
        op = Matmul(ws, h, outs, xq=cuda.cp.empty(xq_bytes(1, cols), np.uint8), src=cuda.from_numpy(x),
                    norm_w=cuda.from_numpy(nw), eps=1e-5, n_sm=cuda.n_sm,
                    cfg=CudaConfig() if prologue else CudaConfig(prologue_k=0), **kw)
        launches = op.launches(cuda.kernels)
        names = [cuda.kernels.name_of(launch.fn).rsplit(".", 1)[-1] for launch in launches]
        for launch in launches:
            launch.run()
        return names, [cuda.to_numpy(o) for o in outs], cuda.to_numpy(h), op

    for rows_list in ([97, 33, 32], [9000]):  # a pair of rows across two matrices; 1125+ pairs a block
        ws, dense_ws = mats(rows_list)
        names, got, h, op = run(ws, rows_list, True)
        assert names == ["mv_xs"], names
        if len(rows_list) == 1:
            assert op.xs_geometry()[2] > mm.XS_STORE_UNIT
        base_names, base, _, _ = run(ws, rows_list, False)
        assert "quant_x" in base_names and "mv_xs" not in base_names, base_names
        monkeypatch.setattr(mm, "XS_STORE_ALONE_MIN_BYTES", 0)  # mv_xs after a quant_x launch (an output head)
        alone_names, alone, _, _ = run(ws, rows_list, False)
        monkeypatch.setattr(mm, "XS_STORE_ALONE_MIN_BYTES", 1 << 60)
        assert alone_names == ["quant_x", "mv_xs"], alone_names
        assert rel_err(h, xn) < 1e-5
        for g, b, a, W in zip(got, base, alone, dense_ws):
            assert rel_err(g, b) < 1e-3 and rel_err(a, b) < 1e-5
            assert rel_err(g, xn @ W.T) < 2e-2
    rows = 96
    ws, dense_ws = mats([rows, rows])
    act = poisoned(cuda, (1, rows))
    aq = cuda.cp.zeros(xq_bytes(1, rows), np.uint8)
    names, got, h, _ = run(ws, [rows, rows], True, mode=MODE_SILU, aux=act, act_q=aq)
    assert names == ["mv_xs"], names
    want_act = cuda.to_numpy(act)
    base_names, base, _, _ = run(ws, [rows, rows], False, mode=MODE_SILU, aux=act,
                                 act_q=cuda.cp.zeros(xq_bytes(1, rows), np.uint8))
    assert base_names == ["quant_x", "mv_xs"], base_names
    assert rel_err(h, xn) < 1e-5
    g, u = (xn @ W.T for W in dense_ws)
    for a, b, want in zip(got, base, (g, u)):
        assert rel_err(a, b) < 1e-3 and rel_err(a, want) < 2e-2
    assert rel_err(want_act, g / (1 + np.exp(-g)) * u) < 3e-2
    again = cuda.cp.zeros(xq_bytes(1, rows), np.uint8)
    Matmul([], cuda.from_numpy(want_act), [], xq=again)._quant_x(cuda.kernels).run()
    np.testing.assert_array_equal(cuda.to_numpy(aq), cuda.to_numpy(again))


def matmul_module_of(qtype) -> str:
    from ember.backends.cuda._kernels import matmul_module

    return matmul_module(qtype)


@pytest.mark.parametrize("tile_rows", [64, 0])
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.F16], ids=lambda t: t.name)
def test_matmul_of_smaller_tiles(cuda, matrices, qtype, tile_rows, monkeypatch):
    """Tensor-core products in blocks of 64 weight rows (twice the blocks) give the same results."""
    from ember.backends.cuda import CudaConfig

    monkeypatch.setattr(cuda, "config", CudaConfig(tile_rows=tile_rows, blas_rows=0))
    w = cuda.weight(matrices.tensors[qtype.name])
    x = cuda.from_numpy(np.random.default_rng(5).normal(0, 1, (200, COLS)).astype(np.float32))
    out = poisoned(cuda, (200, ROWS))
    cuda.matmul(w, x, out)
    monkeypatch.setattr(cuda, "config", CudaConfig(tile_rows=128, blas_rows=0))
    want = poisoned(cuda, (200, ROWS))
    cuda.matmul(w, x, want)
    assert rel_err(cuda.to_numpy(out), cuda.to_numpy(want).astype(np.float64)) < 1e-6


@pytest.mark.parametrize("n", [64, 65, 200])  # 64: ahead of mm_split
@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.Q8_0,
                                   GGMLType.IQ4_XS, GGMLType.IQ2_XXS, GGMLType.TQ2_0], ids=lambda t: t.name)
def test_prompt_products_through_blas(cuda, matrices, qtype, n, monkeypatch):
    """Prompt-sized products of quantized weights: the weight dequantized to f16 a run of rows at a
    time (here runs of 48 of its 301 rows, the last one short) and multiplied by cuBLAS, captured in
    a recorded step's graph; x's rows past f16's range scaled as the tiles scale them. The results
    are the tiles' (both round x and the weight to f16 and sum in f32)."""
    import ember.backends.cuda as cuda_backend
    from ember.backends.cuda import CudaConfig
    from ember.backends.cuda.ops.matmul import BlasGemm

    w = cuda.weight(matrices.tensors[qtype.name])
    rng = np.random.default_rng(n)
    x_h = rng.normal(0, 1, (n, COLS)).astype(np.float32)
    x_h[5] *= 4e4
    x = cuda.from_numpy(x_h)
    monkeypatch.setattr(cuda, "config", CudaConfig(blas_rows=0))
    want = poisoned(cuda, (n, ROWS))
    cuda.matmul(w, x, want)
    monkeypatch.setattr(cuda, "config", CudaConfig(blas_rows=64))
    monkeypatch.setattr(cuda_backend, "BLAS_W_VALUES", 48 * COLS)
    out = poisoned(cuda, (n, ROWS))
    with cuda.record() as rec:
        cuda.matmul(w, x, out)
    assert cuda.blas_error is None
    assert sum(isinstance(launch, BlasGemm) for launch in rec.launches) == -(-ROWS // 48)
    assert rec.graph is not None and cuda.graph_error is None
    got = cuda.to_numpy(out)
    assert np.isfinite(got).all()
    assert rel_err(got, cuda.to_numpy(want).astype(np.float64)) < 1e-4
    exact = x_h.astype(np.float64) @ dense(matrices, qtype.name).T
    for r in (0, 5, n - 1):
        assert rel_err(got[r], exact[r]) < 3e-3, f"row {r}"


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.F16], ids=lambda t: t.name)
def test_matmul_of_long_rows(cuda, qtype, n):
    """Few long rows: teams of several warps per pair of rows (summed through shared memory)."""
    from types import SimpleNamespace

    from ember.backends.cuda.ops.matmul import team_log2

    rows, cols = 70, 8192
    assert team_log2(cols, -(-rows // 2)) > 5
    rng = np.random.default_rng(11)
    raw = weight(rng, qtype, rows, cols, 0.05)
    w = cuda.weight(SimpleNamespace(name="long", type=qtype, shape=(rows, cols), data=raw.reshape(-1)))
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    out = poisoned(cuda, (n, rows))
    cuda.matmul(w, cuda.from_numpy(x), out)
    want = x.astype(np.float64) @ dequantize(raw, qtype).reshape(rows, cols).astype(np.float64).T
    assert rel_err(cuda.to_numpy(out), want) < (1e-5 if qtype in FLOAT_TYPES else 2e-2)


@pytest.mark.parametrize("residual,n", [(False, 1), (False, 3), (True, 1)])  # residual: 12 k bytes a row
@pytest.mark.parametrize("cols", [1056, 1536, 2048])
def test_prologue_of_long_rows(cuda, cols, residual, n):
    """Rows longer than 1024 normalised by the product's own blocks (CudaConfig.prologue_k, up to
    2048): blocks of 256 threads keep the row in registers. The plain norm prologue, and the
    residual one (r += post-normed y, whose last block writes r back)."""
    from types import SimpleNamespace

    from ember.backends.cuda import CudaConfig
    from ember.backends.cuda.ops.matmul import Matmul, ResidualPrologue, xq_bytes

    rng = np.random.default_rng(17)
    rows = 96
    raw = weight(rng, GGMLType.Q8_0, rows, cols, 0.05)
    w = cuda.weight(SimpleNamespace(name="wide_k", type=GGMLType.Q8_0, shape=(rows, cols), data=raw.reshape(-1)))
    W = dequantize(raw, GGMLType.Q8_0).reshape(rows, cols).astype(np.float64)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    h, y, src = poisoned(cuda, (n, cols)), poisoned(cuda, (n, rows)), cuda.from_numpy(x)
    kw = dict(xq=cuda.cp.empty(xq_bytes(n, cols), np.uint8), src=src, norm_w=cuda.from_numpy(nw), eps=1e-5)
    r = x.astype(np.float64)
    if residual:
        y0, pw = rng.normal(0, 2, (n, cols)).astype(np.float32), rng.uniform(0.5, 1.5, cols).astype(np.float32)
        kw.update(pro_res=ResidualPrologue(cuda.from_numpy(y0), cuda.from_numpy(pw), 1e-6, cuda._new_counter()))
        r = r + rms(y0.astype(np.float64), pw.astype(np.float64), 1e-6)
    op = Matmul([w], h, [y], **kw)
    assert op.in_prologue() and not Matmul([w], h, [y], **kw, cfg=CudaConfig(prologue_k=1024)).in_prologue()
    (launch,) = op.launches(cuda.kernels)
    assert launch.block == (256, 1, 1)
    xn = rms(r, nw.astype(np.float64), 1e-5)
    for _ in range(2):
        cuda._run(op)
        assert rel_err(cuda.to_numpy(y), xn @ W.T) < 2e-2
        assert rel_err(cuda.to_numpy(h), xn) < 1e-5
        if residual:
            assert rel_err(cuda.to_numpy(src), r) < 1e-5
            assert int(cuda.to_numpy(kw["pro_res"].counter)[0]) == 0
            src[...] = cuda.from_numpy(x)


QUANT_TYPES = [t for t in ALL_TYPES if t not in FLOAT_TYPES]


def split_op(cuda, ws, x, outs, **kw):
    """A batched-decode product as the backend makes it (mm_split), asserted to take that path."""
    from ember.backends.cuda.ops.matmul import MS_COUNTERS, MS_PART_FLOATS, Matmul, SplitScratch

    buf = SplitScratch(cuda._scratch_f32("mm_split_part", MS_PART_FLOATS),
                       cuda._zeroed_u32("mm_split_counters", MS_COUNTERS))
    op = Matmul(ws, x, outs, mv_rows=8, split_buf=buf, n_sm=cuda.n_sm, **kw)
    assert op.split()
    return op


@pytest.mark.parametrize("spread", ["splits", "one"])
@pytest.mark.parametrize("n", [9, 40, 64])
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_split_products(cuda, matrices, qtype, n, spread, monkeypatch):
    """mm_split (9..64 activation rows): k over several blocks whose partial sums the last block
    of each tile adds up, or one block per tile walking k in chunks; a residual add and the gated
    epilogues; matrices of fewer row tiles than the launch; counters left at zero."""
    from ember.backends.cuda.ops.matmul import MODE_GELU, MODE_RESIDUAL, MODE_SILU, split_plan
    from ember.quant.types import layout

    from ember.backends.cuda.ops import matmul as mm_ops

    assert cuda.tensor_cores, "the H200 takes mm_split"
    if spread == "one":
        monkeypatch.setattr(mm_ops, "MS_MAX_SPLITS", 1)  # one split: every block walks all of k, chunk by chunk
    rng = np.random.default_rng(n)
    w = cuda.weight(matrices.tensors[qtype.name])
    W = dense(matrices, qtype.name)
    small, Ws = sub_matrix(w, 77), W[:77]  # two row tiles of the launch's five
    x = rng.normal(0, 1, (n, COLS)).astype(np.float32)
    xd = cuda.from_numpy(x)
    want = x.astype(np.float64) @ W.T
    tol = 3e-3  # f16 x and weights, f32 sums

    out, out_s = poisoned(cuda, (n, ROWS)), poisoned(cuda, (n, 77))
    op = split_op(cuda, [w, small], xd, [out, out_s])
    upb = layout(qtype).block_size // 32
    n_split, ups = split_plan(COLS // 32, upb, 2 * -(-ROWS // 64), cuda.n_sm)
    assert (n_split > 1) == (spread == "splits") and ups % upb == 0
    assert [launch.grid for launch in op.launches(cuda.kernels)] == [(-(-ROWS // 64), n_split, 2)]
    cuda._run(op)
    assert rel_err(cuda.to_numpy(out), want) < tol
    assert rel_err(cuda.to_numpy(out_s), x.astype(np.float64) @ Ws.T) < tol

    res0 = rng.normal(0, 1, (n, ROWS)).astype(np.float32)
    res = cuda.from_numpy(res0)
    y = poisoned(cuda, (n, ROWS))
    cuda._run(split_op(cuda, [w], xd, [y], mode=MODE_RESIDUAL, aux=res))
    assert rel_err(cuda.to_numpy(y), want) < tol
    assert rel_err(cuda.to_numpy(res), res0 + want) < tol

    for mode, act in ((MODE_SILU, lambda g: g / (1 + np.exp(-g))),
                      (MODE_GELU, lambda g: 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))))):
        g, u, a = poisoned(cuda, (n, ROWS)), poisoned(cuda, (n, ROWS)), poisoned(cuda, (n, ROWS))
        cuda._run(split_op(cuda, [w, w], xd, [g, u], mode=mode, aux=a))
        assert rel_err(cuda.to_numpy(g), want) < tol and rel_err(cuda.to_numpy(u), want) < tol
        assert rel_err(cuda.to_numpy(a), act(want) * want) < tol
    assert not cuda._zeroed_u32("mm_split_counters", 1 << 13).get().any()


@pytest.mark.parametrize("n", [2, 100])
def test_matmuls_of_mixed_types(cuda, matrices, n):
    names = ["Q4_K", "Q6_K", "Q4_K", "F16", "Q8_0"]  # grouped by type, one launch per group
    ws = [cuda.weight(matrices.tensors[name]) for name in names]
    x = np.random.default_rng(1).normal(0, 1, (n, COLS)).astype(np.float32)
    outs = [poisoned(cuda, (n, ROWS)) for _ in names]
    cuda.matmuls(ws, cuda.from_numpy(x), outs)
    for name, out in zip(names, outs):
        assert rel_err(cuda.to_numpy(out), x.astype(np.float64) @ dense(matrices, name).T) < 2e-2, name


@pytest.mark.parametrize("widen", [True, False])
@pytest.mark.parametrize("n", [1, 3, 100])
def test_matmuls_widened_to_one_type(cuda, matrices, n, widen, monkeypatch):
    """Q5_0 and Q4_0 matrices beside a Q8_0 one (Gemma 3's queries, keys and values): one launch
    of the Q8_0 kernel over exact Q8_0 copies, the products as the CPU computes them; where the
    copies would add too many bytes (WIDEN_MAX_BYTES 0 here), a launch per type."""
    from ember.backends import cuda as cuda_backend
    from ember.backends.cuda.ops import matmul as mm_ops

    if not widen:
        monkeypatch.setattr(cuda_backend, "WIDEN_MAX_BYTES", 0)
    names = ["Q5_0", "Q4_0", "Q8_0"]
    ws = [cuda.weight(matrices.tensors[name]) for name in names]
    x = np.random.default_rng(2).normal(0, 1, (n, COLS)).astype(np.float32)
    outs = [poisoned(cuda, (n, ROWS)) for _ in names]
    launched = []
    real = mm_ops.Matmul.launches
    monkeypatch.setattr(mm_ops.Matmul, "launches", lambda op, k: launched.append([w.type for w in op.ws]) or real(op, k))
    cuda.matmuls(ws, cuda.from_numpy(x), outs)
    assert launched == [[GGMLType.Q8_0] * 3 if widen else [GGMLType.Q5_0, GGMLType.Q4_0, GGMLType.Q8_0]]
    for name, out in zip(names, outs):
        assert rel_err(cuda.to_numpy(out), x.astype(np.float64) @ dense(matrices, name).T) < 2e-2, name
    if widen:  # the copies hold the same values
        for w in ws[:2]:
            rows = poisoned(cuda, (ROWS, COLS))
            cuda.get_rows(cuda._wide_copy(w), np.arange(ROWS, dtype=np.int32), rows)
            np.testing.assert_array_equal(cuda.to_numpy(rows), dense(matrices, w.name).astype(np.float32))


def test_bad_shapes_are_clear_errors(cuda, matrices):
    from ember.backends import BackendError

    w = cuda.weight(matrices.tensors["Q4_0"])
    with pytest.raises(BackendError, match="cannot multiply"):
        cuda.matmul(w, cuda.empty((2, COLS + 32)), cuda.empty((2, ROWS)))
    with pytest.raises(BackendError, match="out of range"):
        cuda.get_rows(w, np.array([ROWS], np.int32), cuda.empty((1, COLS)))


# ---- fused decode products (used by recorded steps) ----

def xq_values(cuda, buf, n: int, k: int) -> np.ndarray:
    """Dequantized contents of an activation buffer (int8 * scale), checking its half-sums."""
    raw = cuda.to_numpy(buf)
    q = raw[:n * k].view(np.int8).reshape(n, k // 32, 32).astype(np.float64)
    meta = raw[n * k:n * k + n * (k // 32) * 16].view(np.float32).reshape(n, k // 32, 4).astype(np.float64)
    np.testing.assert_allclose(meta[..., 1], meta[..., 0] * q[..., :16].sum(-1), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(meta[..., 2], meta[..., 0] * q[..., 16:].sum(-1), rtol=1e-6, atol=1e-30)
    assert np.abs(q).max() <= 127
    return (q * meta[..., :1]).reshape(n, k)


def sub_matrix(w, rows: int):
    """The first `rows` rows of a device matrix, as a Weight of its own (same memory)."""
    return replace(w, shape=(rows, w.shape[1]))


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("cols,norm", [(COLS, None), (1536, "apart"), (1536, "in_place")])
def test_quant_x_format(cuda, cols, norm):
    """Rows quantized (and RMS-normalised first, into h) by quant_x: a block per chunk of a row,
    or one block per row when h overwrites x itself."""
    from ember.backends.cuda.ops.matmul import Matmul, xq_bytes

    rng = np.random.default_rng(9)
    x = rng.normal(0, 2, (3, cols)).astype(np.float32)
    x[1, :40] = 0.0  # an all-zero block: scale 0, values 0
    xq = cuda.cp.zeros(xq_bytes(3, cols), np.uint8)
    src = cuda.from_numpy(x)
    if norm is None:
        mm, want = Matmul([], src, [], xq=xq), x
    else:
        w = rng.normal(1, 0.2, cols).astype(np.float32)
        h = src if norm == "in_place" else cuda.empty((3, cols))
        mm = Matmul([], h, [], xq=xq, src=src, norm_w=cuda.from_numpy(w), eps=1e-6)
        x64 = x.astype(np.float64)
        want = (x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + 1e-6) * w).astype(np.float32)
    launch = mm._quant_x(cuda.kernels)
    assert launch.grid[1] == (1 if norm == "in_place" else cols // 256)
    launch.run()
    if norm is not None:
        assert np.allclose(cuda.to_numpy(mm.x), want, rtol=1e-5, atol=1e-6)
    got = xq_values(cuda, xq, 3, cols)
    step = np.abs(want.reshape(3, -1, 32)).max(-1, keepdims=True) / 127
    assert (np.abs(got - want).reshape(3, -1, 32) <= 0.5001 * step + 1e-5 * np.abs(want).max()).all()
    assert (got[1, :32] == 0).all()


@pytest.mark.parametrize("n", [3, 21])  # 21: groups of 8 rows (a batched decode step)
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.F16], ids=lambda t: t.name)
def test_fused_products(cuda, matrices, qtype, n):
    from ember.backends.cuda.ops.matmul import (
        MODE_GELU,
        MODE_RESIDUAL,
        MODE_SILU,
        Matmul,
        xq_bytes,
    )

    rng = np.random.default_rng(2)
    rows = 288  # whole blocks of 32 output rows: the gated product can quantize its output
    w = sub_matrix(cuda.weight(matrices.tensors[qtype.name]), rows)
    W = dense(matrices, qtype.name)[:rows]
    norm = cuda.weight(matrices.tensors["norm"])
    nw = dense(matrices, "norm")
    x = rng.normal(0, 1, (n, COLS)).astype(np.float32)
    xn = rms(x.astype(np.float64), nw, 1e-5)
    tol = 1e-5 if qtype in FLOAT_TYPES else 2e-2
    xq = cuda.cp.empty(xq_bytes(n, COLS), np.uint8)

    y, h = poisoned(cuda, (n, rows)), poisoned(cuda, (n, COLS))
    op = Matmul([w], h, [y], xq=xq, src=cuda.from_numpy(x), norm_w=norm.data, eps=1e-5)
    # up to 8 rows of quantized types: the product's own blocks normalise x (else quant_x first)
    assert op.in_prologue() == (n <= 8 and qtype not in FLOAT_TYPES)
    cuda._run(op)
    assert rel_err(cuda.to_numpy(h), xn) < 1e-5
    assert rel_err(cuda.to_numpy(y), xn @ W.T) < tol

    res0 = rng.normal(0, 1, (n, rows)).astype(np.float32)
    res = cuda.from_numpy(res0)
    cuda._run(Matmul([w], cuda.from_numpy(x), [y], xq=xq, mode=MODE_RESIDUAL, aux=res))
    assert rel_err(cuda.to_numpy(res), res0 + x.astype(np.float64) @ W.T) < tol

    for mode, act in ((MODE_SILU, lambda g: g / (1 + np.exp(-g))),
                      (MODE_GELU, lambda g: 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))))):
        for quantize in (False, True):
            g, u = poisoned(cuda, (n, rows)), poisoned(cuda, (n, rows))
            act_q = cuda.cp.zeros(xq_bytes(n, rows), np.uint8) if quantize else None
            cuda._run(Matmul([w, w], h, [g, u], xq=xq, src=cuda.from_numpy(x), norm_w=norm.data, eps=1e-5,
                             mode=mode, aux=g, act_q=act_q))
            want = xn @ W.T
            assert rel_err(cuda.to_numpy(u), want) < tol
            assert rel_err(cuda.to_numpy(g), act(want) * want) < tol
            if quantize:  # the same bytes quant_x makes of the activation
                again = cuda.cp.zeros(xq_bytes(n, rows), np.uint8)
                Matmul([], g, [], xq=again)._quant_x(cuda.kernels).run()
                np.testing.assert_array_equal(cuda.to_numpy(act_q), cuda.to_numpy(again))


@pytest.mark.parametrize("n", [2, 19])  # 19: groups of 8 rows, one tail over all of them
@pytest.mark.parametrize("post", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.F16], ids=lambda t: t.name)
def test_product_tails(cuda, matrices, qtype, post, n):
    """The last block's row work: [post-norm of y, added into res,] the next norm of res, quantized."""
    rows = 288
    w = sub_matrix(cuda.weight(matrices.tensors[qtype.name]), rows)
    check_tail(cuda, w, dense(matrices, qtype.name)[:rows], post, 1e-5 if qtype in FLOAT_TYPES else 2e-2, n)


@pytest.mark.parametrize("post", [False, True], ids=["llama", "gemma"])
def test_product_tails_of_long_rows(cuda, post):
    """Outputs wider than the tail keeps in registers (16 x 128 values): read again chunk by chunk."""
    from types import SimpleNamespace

    rows, cols = 2336, 256
    raw = weight(np.random.default_rng(13), GGMLType.Q8_0, rows, cols, 0.05)
    w = cuda.weight(SimpleNamespace(name="wide", type=GGMLType.Q8_0, shape=(rows, cols), data=raw.reshape(-1)))
    check_tail(cuda, w, dequantize(raw, GGMLType.Q8_0).reshape(rows, cols).astype(np.float64), post, 2e-2)


def check_tail(cuda, w, W: np.ndarray, post: bool, tol: float, n: int = 2) -> None:
    from ember.backends.cuda.ops.matmul import MODE_RESIDUAL, Matmul, Tail, xq_bytes

    rng = np.random.default_rng(3)
    rows, cols = W.shape
    w1, w2 = rng.uniform(0.5, 1.5, rows), rng.uniform(0.5, 1.5, rows)
    norm1, norm2 = cuda.from_numpy(w1.astype(np.float32)), cuda.from_numpy(w2.astype(np.float32))
    w1, w2 = w1.astype(np.float32).astype(np.float64), w2.astype(np.float32).astype(np.float64)
    xq = cuda.cp.empty(xq_bytes(n, cols), np.uint8)
    counter = cuda._new_counter()
    for rep in range(2):  # the counter is back at zero after each launch
        x = rng.normal(0, 1, (n, cols)).astype(np.float32)
        res0 = rng.normal(0, 3, (n, rows)).astype(np.float32)
        y, pre_h, res = poisoned(cuda, (n, rows)), poisoned(cuda, (n, rows)), cuda.from_numpy(res0)
        pre_q = cuda.cp.zeros(xq_bytes(n, rows), np.uint8)
        tail = Tail(counter, res, add=post, post_w=norm1 if post else None, post_eps=1e-6, pre_w=norm2,
                    pre_eps=1e-5, pre_h=pre_h, pre_q=pre_q)
        cuda._run(Matmul([w], cuda.from_numpy(x), [y], xq=xq, mode=0 if post else MODE_RESIDUAL,
                         aux=None if post else res, tail=tail))
        yy = x.astype(np.float64) @ W.T
        if post:
            yy = rms(yy, w1, 1e-6)
        assert rel_err(cuda.to_numpy(y), yy) < tol
        r = res0 + yy
        assert rel_err(cuda.to_numpy(res), r) < tol
        assert rel_err(cuda.to_numpy(pre_h), rms(r, w2, 1e-5)) < tol
        assert rel_err(xq_values(cuda, pre_q, n, rows), cuda.to_numpy(pre_h)) < 1e-2
        assert int(cuda.to_numpy(counter)[0]) == 0


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("case", ["decode_one", "decode_long_split", "decode_64_seqs"])
def test_attention_quantizes_its_output(cuda, case, merge):
    """The quantized copy of decode attention's output (what the o product reads) holds its values,
    written by a lone split, by the last split's merge (head sizes 64 and 256: one and several
    warps of value pairs) or by attn_combine."""
    from ember.backends.cuda import check_attention
    from ember.backends.cuda.ops import Attention, xq_bytes
    from ember.backends.cuda.ops.attention import split_count

    lengths, new, n_head, n_kv, hd, window, softcap = ATTN_CASES[case]
    rng = np.random.default_rng(8)
    page, max_pages = 16, -(-max(lo + n for lo, n in zip(lengths, new)) // 16) + 1
    batch = paged_batch(rng, lengths, new, page, max_pages)
    n = len(batch.positions)
    cache, _ = fill_cache(cuda, rng, len(lengths) * max_pages * page, n_kv * hd)
    q = cuda.from_numpy(rng.normal(0, 1, (n, n_head * hd)).astype(np.float32))
    k_cache, v_cache = cache
    check_attention(q, k_cache, v_cache, batch, n_head, n_kv)
    n_split = 1 if case == "decode_one" else split_count(n, n_kv, n_head // n_kv, max_pages * page, cuda.n_sm)
    assert (n_split > 1) == (case != "decode_one")  # both ways of writing the output
    part = cuda._scratch_f32("attn_part", n * n_head * n_split * (hd + 2)) if n_split > 1 else None
    out, xq = poisoned(cuda, (n, n_head * hd)), cuda.cp.zeros(xq_bytes(n, n_head * hd), np.uint8)
    cuda._run(Attention(q, k_cache, v_cache, out, part, cuda._input(batch.positions, np.int32),
                        cuda._input(batch.seq_rows, np.int32), cuda._input(batch.block_tables, np.int32), page,
                        n_head, n_kv, window, 1 / math.sqrt(hd), softcap, n_split, xq=xq,
                        counters=cuda._zeroed_u32("attn_counters", n * n_head) if merge else None))
    got = cuda.to_numpy(out)
    step = np.abs(got.reshape(n, -1, 32)).max(-1, keepdims=True) / 127
    err = np.abs(xq_values(cuda, xq, n, n_head * hd) - got).reshape(n, -1, 32)
    assert (err <= 0.5001 * step + 1e-30).all()


# ---- row ops ----

def both(cuda, a: np.ndarray):
    return cuda.from_numpy(a), a.astype(np.float64)


def test_elementwise_ops(cuda, ref, matrices):
    rng = np.random.default_rng(3)
    gate, up = rng.normal(0, 2, (5, 96)).astype(np.float32), rng.normal(0, 1, (5, 96)).astype(np.float32)
    for name in ("silu_mul", "gelu_mul", "add"):
        g_dev, u_dev, out = cuda.from_numpy(gate), cuda.from_numpy(up), poisoned(cuda, gate.shape)
        want = np.empty(gate.shape)
        getattr(cuda, name)(g_dev, u_dev, out)
        getattr(ref, name)(gate.astype(np.float64), up.astype(np.float64), want)
        assert rel_err(cuda.to_numpy(out), want) < 1e-6, name
    x, x64 = both(cuda, gate)
    cuda.scale(x, 0.37)
    assert rel_err(cuda.to_numpy(x), x64 * 0.37) < 1e-7
    bias = cuda.weight(matrices.tensors["norm"])
    x, x64 = both(cuda, rng.normal(0, 1, (4, COLS)).astype(np.float32))
    cuda.add_bias(x, bias)
    assert rel_err(cuda.to_numpy(x), x64 + dense(matrices, "norm")) < 1e-7
    rows = np.array([3, 0, 3], np.int32)
    out = poisoned(cuda, (3, COLS))
    cuda.gather_rows(x, rows, out)
    np.testing.assert_array_equal(cuda.to_numpy(out), cuda.to_numpy(x)[rows])


def test_rms_norm_full_and_per_head(cuda, matrices):
    rng = np.random.default_rng(4)
    x0 = rng.normal(0, 3, (6, COLS)).astype(np.float32)
    w = cuda.weight(matrices.tensors["norm"])
    x, x64 = both(cuda, x0)
    out = poisoned(cuda, x0.shape)
    cuda.rms_norm(x, w, 1e-6, out)
    want = x64 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + 1e-6) * dense(matrices, "norm")
    assert rel_err(cuda.to_numpy(out), want) < 1e-6
    head = cuda.from_numpy(rng.uniform(0.5, 1.5, 64).astype(np.float32))
    head_w = replace(w, shape=(64,), data=head)
    cuda.rms_norm(x, head_w, 1e-6, x)  # in place, rows of 64 (q/k norms)
    rows = x64.reshape(-1, 64)
    want = rows / np.sqrt(np.mean(rows**2, axis=1, keepdims=True) + 1e-6) * cuda.to_numpy(head)
    assert rel_err(cuda.to_numpy(x).reshape(-1, 64), want) < 1e-6


ROPES = {
    "norm": RopeParams(64, neox=False),
    "neox": RopeParams(64, neox=True, freq_base=1e6),
    "partial": RopeParams(32, neox=True),
    "linear": RopeParams(64, neox=False, freq_scale=0.25),
    "yarn": RopeParams(64, neox=True, freq_scale=0.25, ext_factor=1.0, attn_factor=1.1, n_ctx_orig=4096),
}


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("with_factors", [False, True])
def test_rope(cuda, ref, kind, with_factors):
    rng = np.random.default_rng(5)
    p = ROPES[kind]
    factors = rng.uniform(1.0, 8.0, p.n_rot // 2).astype(np.float32) if with_factors else None
    n_head, hd = 3, 64
    pos = np.array([0, 1, 7, 100, 4095, 70000], np.int32)
    batch = AttentionBatch(pos, np.zeros(len(pos), np.int32), np.zeros((1, 1), np.int32), np.zeros(len(pos), np.int64), 1)
    x0 = rng.normal(0, 1, (len(pos), n_head * hd)).astype(np.float32)
    x, want = both(cuda, x0)
    cuda.rope(x, n_head, batch, replace(p, freq_factors=cuda.from_numpy(factors) if with_factors else None))
    ref.rope(want, n_head, batch, replace(p, freq_factors=factors))
    assert rel_err(cuda.to_numpy(x), want) < 1e-6


# ---- KV cache and attention ----

def paged_batch(rng, lengths: list[int], new: list[int], page: int, max_pages: int):
    """Sequences with `lengths` tokens cached, adding `new[i]` tokens each; shuffled pages."""
    n_seq = len(lengths)
    tables = rng.permutation(n_seq * max_pages).astype(np.int32).reshape(n_seq, max_pages)
    pos = np.concatenate([np.arange(lengths[s], lengths[s] + new[s]) for s in range(n_seq)]).astype(np.int32)
    rows = np.repeat(np.arange(n_seq), new).astype(np.int32)
    slots = tables[rows, pos // page].astype(np.int64) * page + pos % page
    return AttentionBatch(pos, rows, tables, slots, page)


def fill_cache(cuda, rng, n_slots, kv_dim):
    k0 = rng.normal(0, 1, (n_slots, kv_dim)).astype(np.float16)
    v0 = rng.normal(0, 1, (n_slots, kv_dim)).astype(np.float16)
    kc, vc = cuda.kv_cache(n_slots, kv_dim, kv_dim)
    kc.set(k0)
    vc.set(v0)
    return (kc, vc), (k0.astype(np.float64), v0.astype(np.float64))


def paged_cache(cuda, rng, lengths, new, kv_dim):
    """A step of `new` tokens after `lengths` cached ones per sequence (pages of 16, one spare page
    a sequence) over a cache of random f16 rows: (batch, cache, its rows in float64)."""
    page, max_pages = 16, -(-max(lo + n for lo, n in zip(lengths, new)) // 16) + 1
    batch = paged_batch(rng, lengths, new, page, max_pages)
    cache, rows = fill_cache(cuda, rng, len(lengths) * max_pages * page, kv_dim)
    return batch, cache, rows


ATTN_CASES = {
    # name: (cached lengths, new tokens, n_head, n_kv, head_dim, window, softcap)
    "decode_one": ([37], [1], 4, 2, 64, 0, 0.0),
    "decode_long_split": ([900], [1], 9, 3, 64, 0, 0.0),
    "decode_64_seqs": ([int(x) for x in np.arange(64) * 7 % 300], [1] * 64, 4, 1, 256, 0, 0.0),
    "prefill_200": ([0], [200], 8, 2, 128, 0, 0.0),
    "mixed_window": ([50, 0, 400], [1, 30, 3], 4, 4, 64, 16, 0.0),
    "softcap_gqa8": ([20, 300], [5, 1], 16, 2, 64, 0, 30.0),
    "many_heads_per_kv": ([130], [3], 20, 2, 32, 0, 0.0),
    # 6 splits: with splits of at least 32 positions, 6 keys alone in one, 71 in three, 32 in one
    "decode_short_splits": ([5, 70, 31], [1, 1, 1], 9, 3, 64, 0, 0.0),
    # head 256 (splits of at least 8): 131 and 401 keys re-split to fill one cluster of 16 (one
    # pass of scores a split), 601 keys too many for it (the global merge)
    "decode_clusters_256": ([130, 400, 600], [1, 1, 1], 4, 1, 256, 0, 0.0),
}


def scalar_attention(cuda, q, cache, out, batch, n_head, n_kv, window, scale, softcap, head_blocks=True,
                     merge=True, min_keys=None, cluster=0, sinks=None):
    """attn (the scalar kernel) for any step, as the planner would lay it out with these choices:
    a block per query head (head_blocks, decode steps) or per chunk of 8; splits merged by the
    last split block (merge; in clusters of `cluster`) or by attn_combine."""
    from ember.backends.cuda.ops import Attention
    from ember.backends.cuda.ops.attention import ATT_HEADS, DECODE_TOKENS, att_min_keys, split_count

    k_cache, v_cache = cache
    n, hd_v, group = q.shape[0], v_cache.shape[1] // n_kv, n_head // n_kv
    hpb = 1 if head_blocks and n <= DECODE_TOKENS else ATT_HEADS
    max_ctx = batch.block_tables.shape[1] * batch.page_size
    n_split = split_count(n, n_kv, group, max_ctx, cuda.n_sm, cuda.config.att_waves, hpb)
    merge = merge and n_split > 1
    cluster = cluster if merge and hd_v % 32 == 0 else 0
    if cluster:
        n_split = -(-n_split // cluster) * cluster
    part = cuda._scratch_f32("attn_part", n * n_head * n_split * (hd_v + 2)) if n_split > 1 else None
    counters = cuda._zeroed_u32("attn_counters", n * n_kv * -(-group // hpb)) if merge else None
    return Attention(q, k_cache, v_cache, out, part, cuda._input(batch.positions, np.int32),
                     cuda._input(batch.seq_rows, np.int32), cuda._input(batch.block_tables, np.int32),
                     batch.page_size, n_head, n_kv, window, scale, softcap, n_split, heads_per_block=hpb,
                     counters=counters, cluster=cluster, min_keys=att_min_keys(hd_v) if min_keys is None else min_keys,
                     sinks=sinks)


@pytest.mark.parametrize("head_blocks,merge,min_keys,cluster", [
    (True, True, None, 16), (False, True, None, 16), (True, True, 0, 16), (True, True, 32, 16), (True, True, None, 8),
    (True, True, None, 0), (False, True, None, 0), (True, True, 0, 0), (True, False, None, 0), (False, False, None, 0)])
@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_kv_store_and_attention(cuda, ref, case, head_blocks, merge, min_keys, cluster):
    """The scalar kernel (f32 arithmetic) for every step; attn_tile has its own test below.
    Decode steps with a block per query head, or per chunk of a kv head's query heads; key splits
    merged by attn's last split block (splits of at least min_keys positions: None, the choice by
    head size; 0, the host's even shares) or, where a cluster of 8 or 16 blocks covers the range,
    through the cluster's shared memory, or by attn_combine. Twice: the merge counters are zero
    again after a launch."""
    lengths, new, n_head, n_kv, hd, window, softcap = ATTN_CASES[case]
    rng = np.random.default_rng(6)
    batch, cache, (k64, v64) = paged_cache(cuda, rng, lengths, new, n_kv * hd)
    n = len(batch.positions)
    k_new = rng.normal(0, 1, (n, n_kv * hd)).astype(np.float32)
    v_new = rng.normal(0, 1, (n, n_kv * hd)).astype(np.float32)
    cuda.kv_store(cache, cuda.from_numpy(k_new), cuda.from_numpy(v_new), batch)
    k64[batch.slots], v64[batch.slots] = k_new.astype(np.float16), v_new.astype(np.float16)
    np.testing.assert_array_equal(cuda.to_numpy(cache[0]).astype(np.float64), k64)
    q = rng.normal(0, 1, (n, n_head * hd)).astype(np.float32)
    out = poisoned(cuda, (n, n_head * hd))
    scale = 1 / math.sqrt(hd)
    want = np.empty((n, n_head * hd))
    ref.attention(q.astype(np.float64), (k64, v64), want, batch, n_head, n_kv, window, scale, softcap)
    op = scalar_attention(cuda, cuda.from_numpy(q), cache, out, batch, n_head, n_kv, window, scale, softcap,
                          head_blocks, merge, min_keys, cluster)
    for _ in range(2):
        cuda._run(op)
        assert rel_err(cuda.to_numpy(out), want) < 1e-5
        if "attn_counters" in cuda._scratch:
            assert not cuda.to_numpy(cuda._scratch["attn_counters"]).any()
        out[...] = cuda.cp.nan


def record_attention_ops(monkeypatch) -> list:
    """The Attention ops the backend launches from now on (in order)."""
    from ember.backends.cuda.ops import attention as att_ops

    taken = []
    real = att_ops.Attention.launches

    def spy(op, kernels):
        taken.append(op)
        return real(op, kernels)

    monkeypatch.setattr(att_ops.Attention, "launches", spy)
    return taken


def sink_logits(rng, n_head: int) -> np.ndarray:
    """Attention sinks' logits, one per head: near the scores, one far above them (the sink takes
    almost all the weight) and one far below (none)."""
    s = rng.normal(0, 1.5, n_head)
    s[0] = 12.0
    s[-1] = -30.0
    return s.astype(np.float32)


@pytest.mark.parametrize("merge,cluster", [(True, 16), (True, 8), (True, 0), (False, 0)])
@pytest.mark.parametrize("case", ["decode_one", "decode_long_split", "decode_clusters_256", "mixed_window",
                                  "decode_short_splits", "prefill_200"])
def test_attention_sinks(cuda, ref, case, merge, cluster, monkeypatch):
    """Attention sinks (gpt-oss: a logit per head in each softmax's denominator) on every way a
    step's attention ends: a split alone, splits merged by the last block, in a cluster or by
    attn_combine (the scalar kernel), and through the planner (tensor-core tiles for prompt steps,
    split and whole)."""
    from ember.backends import Weight
    from ember.quant import GGMLType

    lengths, new, n_head, n_kv, hd, window, softcap = ATTN_CASES[case]
    rng = np.random.default_rng(17)
    batch, cache, (k64, v64) = paged_cache(cuda, rng, lengths, new, n_kv * hd)
    n = len(batch.positions)
    q = rng.normal(0, 1, (n, n_head * hd)).astype(np.float32)
    sinks = sink_logits(rng, n_head)
    scale = 1 / math.sqrt(hd)
    want, plain = np.empty((n, n_head * hd)), np.empty((n, n_head * hd))
    ref.attention(q.astype(np.float64), (k64, v64), want, batch, n_head, n_kv, window, scale, softcap,
                  sinks=Weight("sinks", GGMLType.F32, (n_head,), sinks.astype(np.float64)))
    ref.attention(q.astype(np.float64), (k64, v64), plain, batch, n_head, n_kv, window, scale, softcap)
    assert rel_err(want, plain) > 0.1  # the sinks change the output
    out = poisoned(cuda, (n, n_head * hd))
    cuda._run(scalar_attention(cuda, cuda.from_numpy(q), cache, out, batch, n_head, n_kv, window, scale, softcap,
                               True, merge, None, cluster, sinks=cuda.from_numpy(sinks)))
    assert rel_err(cuda.to_numpy(out), want) < 1e-5
    taken = record_attention_ops(monkeypatch)
    out[...] = cuda.cp.nan
    sink_w = Weight("sinks", GGMLType.F32, (n_head,), cuda.from_numpy(sinks))
    cuda.attention(cuda.from_numpy(q), cache, out, batch, n_head, n_kv, window, scale, softcap, sinks=sink_w)
    assert rel_err(cuda.to_numpy(out), want) < 5e-4  # tiles round probabilities to f16
    if taken[0].tiles and taken[0].n_split > 1:  # the tiles' whole key ranges too
        out[...] = cuda.cp.nan
        cuda._run(replace(taken[0], n_split=1, part=None))
        assert rel_err(cuda.to_numpy(out), want) < 5e-4


TILE_CASES = {
    # name: (cached lengths, new tokens, n_head, n_kv, head_dim, window, softcap)
    "gemma_prompt_512": ([0], [512], 4, 1, 256, 512, 0.0),  # Gemma 3 270M's shape, a sliding layer
    "smollm_two_prompts": ([0, 40], [300, 77], 9, 3, 64, 0, 0.0),  # pieces cut mid-tile by a new sequence
    "decodes_then_chunk": ([30, 500, 7, 64], [1, 1, 1, 200], 8, 2, 128, 0, 0.0),  # a continuous-batching step
    "window_chunk": ([700], [90], 4, 4, 64, 100, 0.0),  # keys start inside the first chunk
    "softcap_heads_chunks": ([33], [70], 20, 2, 128, 0, 30.0),  # 10 heads per kv head: chunks of 8 and 2
    "head_dim_256_gqa8": ([5, 0], [40, 3], 16, 2, 256, 0, 0.0),  # 8 rows per token
    # batched decode steps (one token of each of more than 8 sequences): a piece per token
    "decode_64_seqs": ([int(x) for x in np.arange(64) * 9 % 600], [1] * 64, 9, 3, 64, 0, 0.0),
    "decode_12_seqs_window": ([int(x) for x in np.arange(12) * 97 % 900], [1] * 12, 4, 1, 256, 512, 0.0),
}
UNSPLIT_TILE_CASES: set = set()  # cases whose pieces fill the GPU: key ranges stay whole


@pytest.mark.parametrize("case", sorted(TILE_CASES))
def test_attention_tiles(cuda, ref, case, monkeypatch):
    """attn_tile (tensor cores; q in two f16 parts, probabilities in f16) against the float64
    reference, and the choice of it for steps with many tokens per sequence; key ranges split
    over several blocks (merged by attn_combine) and whole."""
    lengths, new, n_head, n_kv, hd, window, softcap = TILE_CASES[case]
    assert cuda.attention_target.tiles, "the H200 takes tensor-core attention tiles"
    rng = np.random.default_rng(11)
    batch, cache, (k64, v64) = paged_cache(cuda, rng, lengths, new, n_kv * hd)
    n = len(batch.positions)
    q = rng.normal(0, 1, (n, n_head * hd)).astype(np.float32)
    scale = 1 / math.sqrt(hd)
    want = np.empty((n, n_head * hd))
    ref.attention(q.astype(np.float64), (k64, v64), want, batch, n_head, n_kv, window, scale, softcap)
    taken = record_attention_ops(monkeypatch)
    out = poisoned(cuda, (n, n_head * hd))
    cuda.attention(cuda.from_numpy(q), cache, out, batch, n_head, n_kv, window, scale, softcap)
    assert [(op.tiles, op.n_split > 1) for op in taken] == [(True, case not in UNSPLIT_TILE_CASES)]
    assert rel_err(cuda.to_numpy(out), want) < 5e-4  # the probabilities' f16 rounding
    out[...] = cuda.cp.nan
    cuda._run(replace(taken[0], n_split=1, part=None))  # whole key ranges
    assert rel_err(cuda.to_numpy(out), want) < 5e-4


FOLD_CASES = {
    # name: (cached lengths, n_head, n_kv, head_dim, window, softcap, n_split, rope, q/k norms)
    "one_split": ([37], 4, 2, 64, 0, 0.0, 1, "norm", False),
    # p_t in split 18 of 32 (later ones empty), in the last, and alone in split 0 (an empty cache)
    "splits_gqa": ([37, 900, 0], 9, 3, 64, 0, 0.0, 32, "neox", True),
    # group of 10 heads: two head chunks write the same row; window 16 over 131 and 6 keys
    "head_chunks_window_softcap": ([130, 5], 20, 2, 64, 16, 30.0, 4, "partial", True),
    # 9 tokens: one thread per key; full shared query rows (8 heads of 256); YaRN with factors
    "yarn_wide_heads": ([int(x) for x in np.arange(9) * 37 % 300], 8, 1, 256, 0, 0.0, 3, "yarn", True),
    "linear_no_norms": ([64, 17], 8, 8, 128, 0, 0.0, 2, "linear", False),
}


@pytest.mark.parametrize("merge", [0, 1, 8, 16])
@pytest.mark.parametrize("case", sorted(FOLD_CASES))
def test_attention_folds_qkv_post(cuda, case, merge):
    """One token per sequence: the attention launch doing qkv_post's work (norms, rope, the cache
    row) gives the outputs and cache of a qkv_post launch followed by the attention. Splits
    written for attn_combine (merge 0), or merged by the last split block (1) or in clusters of 8
    or 16 blocks where one covers the range (whole clusters of splits), with splits of at least
    32 positions (the token's own position then in an earlier split, or alone in one)."""
    from ember.backends.cuda import rope_args
    from ember.backends.cuda.ops import Attention, QkvPost

    lengths, n_head, n_kv, hd, window, softcap, n_split, rope, norms = FOLD_CASES[case]
    cluster = merge if merge > 1 and n_split > 1 else 0
    if cluster:
        n_split = -(-n_split // cluster) * cluster
    rng = np.random.default_rng(14)
    n, page = len(lengths), 16
    max_pages = max(lengths) // page + 2
    batch = paged_batch(rng, lengths, [1] * n, page, max_pages)
    factors = cuda.from_numpy(rng.uniform(1.0, 8.0, ROPES[rope].n_rot // 2).astype(np.float32)) if rope == "yarn" \
        else None
    rp = rope_args(replace(ROPES[rope], freq_factors=factors))
    q0, k0, v0 = (rng.normal(0, 1, (n, h * hd)).astype(np.float32) for h in (n_head, n_kv, n_kv))
    q_norm, k_norm = (cuda.from_numpy(rng.uniform(0.5, 1.5, hd).astype(np.float32)) if norms else None
                      for _ in range(2))
    part = cuda._scratch_f32("attn_part", n * n_head * n_split * (hd + 2)) if n_split > 1 else None
    pos, rows = cuda._input(batch.positions, np.int32), cuda._input(batch.seq_rows, np.int32)
    tables, slots = cuda._input(batch.block_tables, np.int32), cuda._input(batch.slots, np.int64)
    got = []
    for folded in (False, True):
        (k_cache, v_cache), (k_init, _) = fill_cache(cuda, np.random.default_rng(15), n * max_pages * page, n_kv * hd)
        q, k, v = cuda.from_numpy(q0), cuda.from_numpy(k0), cuda.from_numpy(v0)
        post = QkvPost(q, k, v, q_norm, k_norm, 1e-6, pos, rp, n_head, n_kv, k_cache, v_cache, slots)
        out = poisoned(cuda, (n, n_head * hd))
        counters = cuda._zeroed_u32("attn_counters", n * n_head) if merge and n_split > 1 else None
        att = Attention(q, k_cache, v_cache, out, part, pos, rows, tables, page, n_head, n_kv, window,
                        1 / math.sqrt(hd), softcap, n_split, one_token_per_seq=True, post=post if folded else None,
                        counters=counters, min_keys=32, cluster=cluster)
        if not folded:
            cuda._run(post)
        cuda._run(att)
        got.append([cuda.to_numpy(a) for a in (out, k_cache, v_cache)])
        if folded:  # q and k keep the product's values
            np.testing.assert_array_equal(cuda.to_numpy(q), q0)
            np.testing.assert_array_equal(cuda.to_numpy(k), k0)
    (out_a, k_a, v_a), (out_b, k_b, v_b) = got
    assert rel_err(out_b, out_a) < 1e-5
    np.testing.assert_array_equal(v_b, v_a)
    # the same f32 key rounded to f16: at most one unit in the last place apart
    np.testing.assert_allclose(k_b.astype(np.float32), k_a.astype(np.float32), rtol=1e-3, atol=1e-7)
    others = np.ones(len(k_init), bool)
    others[batch.slots] = False
    np.testing.assert_array_equal(k_b[others].astype(np.float64), k_init[others])  # no stray writes
    assert (k_b[batch.slots].astype(np.float64) != k_init[batch.slots]).mean() > 0.9  # the rows were written


# ---- sampling reductions ----

@pytest.mark.parametrize("vocab", [49152, 262144, 300])
def test_top_k_and_argmax(cuda, vocab):
    rng = np.random.default_rng(12)
    n = 6
    x = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    x[1, :] = -np.inf
    x[1, [7, 90]] = 2.5  # equal maxima: the lower id is the argmax
    x[2, :] = 1.0  # all equal: argmax 0; top k: k values of 1.0, distinct ids
    x[3, -1] = 100.0  # the maximum at the last id
    x[4, ::3] = -np.inf
    # k <= 8: rows cut into slices of many blocks (lists of 1, 2, 4, 8); larger k: a block per row
    for k in (1, 2, 3, 5, 8, 9, 40, 256):
        ids, vals = cuda.cp.full((n, k), -1, np.int32), poisoned(cuda, (n, k))
        cuda.top_k(cuda.from_numpy(x), k, ids, vals)
        ids, vals = cuda.to_numpy(ids), cuda.to_numpy(vals)
        want = -np.sort(-x, axis=1)[:, :k]
        np.testing.assert_array_equal(vals, want)
        np.testing.assert_array_equal(np.take_along_axis(x, ids, 1), vals)  # ids point at their values
        assert all(len(set(r)) == k for r in ids.tolist())
        if k == 1:
            np.testing.assert_array_equal(ids[:, 0], x.argmax(1))
        else:  # rows without ties: the same ids as a stable sort
            for r in (0, 3, 5):
                np.testing.assert_array_equal(ids[r], np.argsort(-x[r], kind="stable")[:k])
    from ember.backends import BackendError

    with pytest.raises(BackendError, match="top_k needs"):
        cuda.top_k(cuda.from_numpy(x), 257, cuda.cp.empty((n, 257), np.int32), cuda.empty((n, 257)))


# ---- whole models ----

PAGE = 4
MODEL_TYPES = [GGMLType.F16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.IQ4_XS,
               GGMLType.IQ2_XXS, GGMLType.IQ2_S, GGMLType.IQ3_S, GGMLType.IQ1_M, GGMLType.TQ1_0]  # a low-bit type of each decoder kind


class Driver:
    """Steps one model for several sequences over shuffled pages, with inputs at fixed addresses
    (as the engine's runner keeps them), optionally recording the first step of each shape."""

    def __init__(self, model, n_seq: int, max_len: int, seed: int):
        pages_per_seq = -(-max_len // PAGE)
        perm = np.random.default_rng(seed).permutation(n_seq * pages_per_seq).astype(np.int32)
        self.tables = perm.reshape(n_seq, pages_per_seq)
        self.model, self.cache = model, model.new_kv_cache(n_seq * pages_per_seq, PAGE)
        self.lengths = [0] * n_seq
        cap = n_seq * max_len
        self.tokens, self.pos = np.zeros(cap, np.int32), np.zeros(cap, np.int32)
        self.rows, self.slots, self.out = np.zeros(cap, np.int32), np.zeros(cap, np.int64), np.zeros(cap, np.int32)
        self.recordings: dict = {}

    def step(self, tokens_per_seq: list[list[int]], record: bool = False) -> np.ndarray:
        toks, pos, rows = [], [], []
        for s, toks_s in enumerate(tokens_per_seq):
            toks += toks_s
            pos += range(self.lengths[s], self.lengths[s] + len(toks_s))
            rows += [s] * len(toks_s)
            self.lengths[s] += len(toks_s)
        n = len(toks)
        self.tokens[:n], self.pos[:n], self.rows[:n] = toks, pos, rows
        self.slots[:n] = self.tables[self.rows[:n], self.pos[:n] // PAGE].astype(np.int64) * PAGE + self.pos[:n] % PAGE
        self.out[:n] = np.arange(n)
        attn = AttentionBatch(self.pos[:n], self.rows[:n], self.tables, self.slots[:n], PAGE)
        step = Step(self.tokens[:n], attn, self.out[:n])
        backend = self.model.backend
        if not record:
            return np.array(self.model.forward(step, self.cache), np.float64)
        hit = self.recordings.get(n)
        if hit is not None:
            backend.replay(hit[0])
            return np.array(hit[1], np.float64)
        with backend.record() as rec:
            logits = self.model.forward(step, self.cache)
        self.recordings[n] = (rec, logits)
        return np.array(logits, np.float64)


def script(model, n_seq: int, seed: int = 1, record: bool = False, keep: list | None = None) -> list[np.ndarray]:
    """Prefill every sequence (different lengths, one step), decode a few steps, then a mixed step.
    keep: a list that receives the Driver (its recordings)."""
    rng = np.random.default_rng(seed)
    v = model.n_vocab
    d = Driver(model, n_seq=n_seq, max_len=48, seed=seed)
    if keep is not None:
        keep.append(d)
    outs = [d.step([list(rng.integers(0, v, 3 + (5 * s) % 11)) for s in range(n_seq)], record)]
    for _ in range(4):
        outs.append(d.step([[int(rng.integers(v))] for _ in range(n_seq)], record))
    outs.append(d.step([list(rng.integers(0, v, 1 + s % 3)) for s in range(n_seq)], record))
    return outs


def model_file(tmp_path_factory, arch: str, qtype: GGMLType) -> Path:
    shape = Shape(n_layer=6 if arch == "gemma3" else 2)  # gemma3: five local layers, then a global one
    path = tmp_path_factory.mktemp(f"{arch}_{qtype.name}") / "m.gguf"
    return write_model(path, arch, qtype, shape, tied=qtype != GGMLType.Q8_0)


def assert_logits_close(got: list, want: list, qtype: GGMLType) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        err = np.abs(g - w).max() / np.abs(w).max()
        # f16 KV cache everywhere; int8 activations (decode) or f16 tiles (prefill) for quantized weights
        assert err < (2e-3 if qtype in FLOAT_TYPES else 3e-2), f"step {i}: relative error {err:.2e}"
        assert (g.argmax(1) == w.argmax(1)).mean() >= 0.9, f"step {i}: argmax differs"


@pytest.mark.parametrize("n_seq", [1, 64])
@pytest.mark.parametrize("qtype", MODEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_model_matches_reference(tmp_path_factory, cuda, ref, arch, qtype, n_seq):
    path = model_file(tmp_path_factory, arch, qtype)
    with GGUFFile(path) as f:
        got = script(load_model(f, cuda), n_seq)
        want = script(load_model(f, ref), n_seq)
    assert_logits_close(got, want, qtype)


@pytest.mark.parametrize("graphs,fuse", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("arch,qtype", [("llama", GGMLType.Q4_K), ("gemma3", GGMLType.Q8_0), ("llama", GGMLType.F16),
                                        ("llama", GGMLType.Q4_1)])  # Q4_1 past 8 rows: grouped matrix-vector kernels
@pytest.mark.parametrize("n_seq", [1, 5, 20])
def test_replay_matches_direct(tmp_path_factory, arch, qtype, graphs, fuse, n_seq):
    """Steps recorded once and replayed (fused, as a CUDA graph) give the logits of direct runs."""
    from ember.backends.cuda import CudaConfig

    backend = get_backend("cuda", config=CudaConfig(graphs=graphs, fuse=fuse))
    path = model_file(tmp_path_factory, arch, qtype)
    with GGUFFile(path) as f:
        model = load_model(f, backend)
        direct = script(model, n_seq, record=False)
        replayed = script(model, n_seq, record=True)
    if graphs:
        assert backend.graph_error is None, backend.graph_error
    for i, (a, b) in enumerate(zip(replayed, direct)):
        err = np.abs(a - b).max() / np.abs(b).max()
        # fused norms sum in another order: an int8 rounding of an activation may flip
        assert err < (1e-4 if qtype in FLOAT_TYPES else 5e-3), f"step {i}: replay differs from direct by {err:.2e}"


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_model_of_long_rows_normalising_in_the_x_stationary_kernel(tmp_path_factory, ref, qtype, monkeypatch):
    """A llama of d_model 2304 (past mv_n1's norm prologue), mv_xs's size thresholds at 0: its
    recorded decode steps normalise x inside mv_xs (q/k/v, gate and up, the head) instead of
    quant_x launches, and give the reference's logits and those of the steps with quant_x
    launches (CudaConfig(prologue_k=2048))."""
    import ember.backends.cuda.ops.matmul as mm
    from ember.backends.cuda import CudaConfig

    monkeypatch.setattr(mm, "XS_MIN_BYTES", 0)
    monkeypatch.setattr(mm, "XS_STORE_MIN_BYTES", 0)
    path = tmp_path_factory.mktemp(f"wide_{qtype.name}") / "m.gguf"
    write_model(path, "llama", qtype, Shape(d_model=2304), tied=True)
    got, names = {}, {}
    for prologue_k in (16384, 2048):
        backend, keep = get_backend("cuda", config=CudaConfig(prologue_k=prologue_k)), []
        with GGUFFile(path) as f:
            got[prologue_k] = script(load_model(f, backend), 1, record=True, keep=keep)
        rec = keep[0].recordings[1][0]  # the decode step
        names[prologue_k] = [backend.kernels.name_of(x.fn).rsplit(".", 1)[-1] for x in rec.launches if hasattr(x, "fn")]
    with GGUFFile(path) as f:
        want = script(load_model(f, ref), 1)
    xs, old = names[16384], names[2048]
    assert xs.count("mv_xs") >= 2 * 2 and xs.count("quant_x") < old.count("quant_x"), (xs, old)
    assert_logits_close(got[16384], want, qtype)
    for i, (a, b) in enumerate(zip(got[16384], got[2048])):
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err < 1e-2, f"step {i}: mv_xs's own norm differs from quant_x's by {err:.2e}"  # int8 roundings flip


@pytest.mark.parametrize("arch,qtype", [("llama", GGMLType.Q4_1), ("gemma3", GGMLType.Q4_K)])
@pytest.mark.parametrize("n_seq", [1, 5])
def test_early_launched_kernels_compute_the_same(tmp_path_factory, arch, qtype, n_seq):
    """Captured steps whose kernels start before their predecessors end (programmatic dependent
    launch, Hopper and later) give exactly the logits of the same graphs launched in order."""
    from ember.backends.cuda import CudaConfig

    path = model_file(tmp_path_factory, arch, qtype)
    results = {}
    for pdl in (True, False):
        backend = get_backend("cuda", config=CudaConfig(pdl=pdl))
        if pdl and int(backend.device.compute_capability) < 90:
            pytest.skip("programmatic dependent launch needs compute capability 9.0")
        with GGUFFile(path) as f:
            results[pdl] = script(load_model(f, backend), n_seq, record=True)
        assert backend.graph_error is None, backend.graph_error
        if pdl:
            assert backend.pdl_error is None and backend.describe()["pdl"], backend.pdl_error
    for i, (a, b) in enumerate(zip(results[True], results[False])):
        assert np.array_equal(a, b), f"step {i}: early launches changed the logits by {np.abs(a - b).max():.2e}"


@pytest.mark.parametrize("arch,qtype", [("llama", GGMLType.Q4_1), ("gemma3", GGMLType.Q4_K)])
@pytest.mark.parametrize("n_seq", [1, 5])
def test_decode_attention_folding_computes_the_same(tmp_path_factory, arch, qtype, n_seq):
    """Replayed decode steps whose attention launches do the qkv_post work give the logits of
    direct runs (qkv_post launches); prompt steps keep their qkv_post launches."""
    from ember.backends.cuda.ops import Attention, Launch

    path = model_file(tmp_path_factory, arch, qtype)
    backend, keep = get_backend("cuda"), []
    with GGUFFile(path) as f:
        model = load_model(f, backend)
        direct = script(model, n_seq, record=False)
        replayed = script(model, n_seq, record=True, keep=keep)
    assert backend.graph_error is None, backend.graph_error
    for n, (rec, _) in keep[0].recordings.items():
        attns = [op for op in rec.ops if isinstance(op, Attention)]
        names = [backend.kernels.name_of(x.fn) for x in rec.launches if isinstance(x, Launch)]
        decode = n == n_seq
        assert all(a.one_token_per_seq == decode for a in attns), n
        assert all(a.tiles == (not decode) for a in attns), n  # prompt steps: tensor-core tiles
        kinds = ("attention.attn", "attention.attn_cluster", "attention_tile")
        assert sum(x == kinds[0] or x.startswith(kinds[1:]) for x in names) == len(attns)
        assert names.count("ops.qkv_post") == (0 if decode else len(attns)), n
    for i, (a, b) in enumerate(zip(replayed, direct)):
        err = np.abs(a - b).max() / np.abs(b).max()
        # an int8 rounding of the attention output may flip (the same values, another kernel)
        assert err < 5e-3, f"step {i}: folding changed the logits by {err:.2e}"
        assert (a.argmax(1) == b.argmax(1)).mean() >= 0.9, f"step {i}: argmax differs"


# ---- the engine ----

def greedy_runs(path: Path, device: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from concurrent.futures import ThreadPoolExecutor

    from ember.engine import LLM
    from ember.sampler import SamplingParams

    with LLM(str(path), device=device, slots=len(prompts), ctx=128) as llm:
        with ThreadPoolExecutor(len(prompts)) as pool:
            runs = pool.map(lambda p: llm.generate(p, n, SamplingParams.greedy_params()).token_ids, prompts)
            return list(runs)


def cpu_or_reference() -> str:
    try:
        get_backend("cpu")
        return "cpu"
    except Exception:  # the CPU extension is not built on this machine
        return "reference"


def last_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """The float64 reference's logits after `tokens` (one prompt step)."""
    with GGUFFile(path) as f:
        return Driver(load_model(f, get_backend("reference")), n_seq=1, max_len=len(tokens) + 1, seed=0).step([tokens])[-1]


@pytest.mark.parametrize("n_prompts", [1, 64])
def test_engine_greedy_matches_cpu(tmp_path, n_prompts):
    """Greedy runs of the engine on the GPU give the CPU's tokens. Where a run parts from the
    CPU's, the token it took must tie the best one to within the GPU's rounding (f16 attention
    inputs in prompt steps): the random model has near-equal logits (1e-4 apart, seen), and either
    choice there is right."""
    path = write_model(tmp_path / "v.gguf", "llama", GGMLType.F16, Shape(n_layer=2), vocab=True, tied=False)
    rng = np.random.default_rng(7)
    prompts = [[1] + rng.integers(3, 300, 4 + i % 9).tolist() for i in range(n_prompts)]
    got = greedy_runs(path, "cuda", prompts, 12)
    want = greedy_runs(path, cpu_or_reference(), prompts, 12)
    parted = [i for i in range(n_prompts) if got[i] != want[i]]
    assert len(parted) <= max(1, n_prompts // 16), f"runs {parted} differ from the CPU's"
    for i in parted:
        j = next(j for j, (a, b) in enumerate(zip(got[i], want[i])) if a != b)
        logits = last_logits(path, prompts[i] + want[i][:j])
        gap = (logits.max() - logits[got[i][j]]) / np.abs(logits).max()
        assert gap < 1e-3, f"run {i} took token {got[i][j]} at {j}, {gap:.1e} below the best"


def test_engine_ahead_steps(tmp_path):
    """Decode steps launched before the host read the step before them, their tokens taken from
    its best ids on the GPU (the default there), give the tokens of steps run one at a time (the
    same kernels): streams of several lengths, with and without a ban (ignore_eos), one alone.
    Which tokens share a step depends on when the engine sees each request, and a step of a
    different number of rows may take other kernels: one stream may part from the other run's at
    a near-tie of the random model, where both tokens must be within rounding of the best (the
    float64 reference's logits), as in test_engine_greedy_matches_cpu. F16 weights, as there:
    with a quantized type, a prompt of a few tokens in a step of its own takes the decode
    products, which quantize x to int8 where the tiles of a larger step round it to f16 hi + lo,
    and the cached keys then differ by up to ~1% (Q8_0: a stream parted at a gap of 0.56% of the
    largest logit, in 2 of about 10 runs)."""
    from ember.engine import LLM, Request, TokenEvent
    from ember.sampler import SamplingParams

    path = write_model(tmp_path / "a.gguf", "llama", GGMLType.F16, Shape(n_layer=2), vocab=True, tied=False)
    rng = np.random.default_rng(9)
    prompts = [[1] + rng.integers(3, 300, 3 + i % 7).tolist() for i in range(8)]
    no_eos = SamplingParams(temperature=0.0, ignore_eos=True)
    runs = {}
    for ahead in (False, None):
        with LLM(str(path), device="cuda", slots=8, ctx=128, decode_ahead=ahead) as llm:
            eng = llm.engine
            handles = [eng.submit(Request(p, 6 + 3 * i, no_eos if i % 2 else SamplingParams.greedy_params()))
                       for i, p in enumerate(prompts)]
            got = [[ev.token for ev in h if isinstance(ev, TokenEvent)] for h in handles]
            alone = llm.generate(prompts[3], 20, no_eos).token_ids
            runs[ahead] = got, alone, eng.metrics.ahead_steps
    assert runs[False][2] == 0 and runs[None][2] >= 20
    streams = list(zip(prompts + [prompts[3]], runs[None][0] + [runs[None][1]], runs[False][0] + [runs[False][1]]))
    parted = [(p, a, b) for p, a, b in streams if a != b]
    assert len(parted) <= 1, f"{len(parted)} streams differ"
    for prompt, a, b in parted:
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        eos = 2  # synth's vocabulary: a stream that ended there took it (the events leave it out)
        logits = last_logits(path, prompt + a[:j])
        for tok in ((a + [eos])[j], (b + [eos])[j]):
            assert (logits.max() - logits[tok]) / np.abs(logits).max() < 1e-3, f"token {tok} at {j} is not a tie"


def test_copy_pages(cuda):
    """The copy-on-write kernel: several pages at once, chained pairs in order, odd widths."""
    from test_engine import check_copy_pages

    check_copy_pages(cuda)


SERVE_NO_JIT = r"""
import sys
import numpy as np
import cupy.cuda.compiler as compiler
from ember.engine import LLM
from ember.sampler import SamplingParams

compiled = []
inner = compiler._compile_with_cache_cuda
def counting(source, *args, **kwargs):
    import traceback
    compiled.append("".join(traceback.format_stack(limit=8)))
    return inner(source, *args, **kwargs)

with LLM(sys.argv[1], device="cuda", slots=8, ctx=256) as llm:
    compiler._compile_with_cache_cuda = counting
    rng = np.random.default_rng(1)
    shared = [1] + rng.integers(3, 300, 40).tolist()  # two full pages and part of a third
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: llm.generate(shared, 6, SamplingParams(temperature=0.8, top_p=0.9, seed=i)).token_ids,
                      range(8)))
        list(pool.map(lambda i: llm.generate(shared + [5 + i], 6, SamplingParams.greedy_params()).token_ids,
                      range(8)))
print("COMPILED", len(compiled))
for s in compiled[:3]:
    print(s)
"""


def test_serving_compiles_no_cupy_kernels(tmp_path):
    """Serving (prompts sharing pages, copy on write, sampling, batched decode) launches only
    ember's own precompiled kernels: a CuPy operation would compile a kernel the first time
    in a process (0.1-0.3 s, mid-request). Own process: earlier tests may have compiled them."""
    import os
    import subprocess
    import sys

    path = write_model(tmp_path / "v.gguf", "llama", GGMLType.Q4_0, Shape(n_layer=2), vocab=True, tied=False)
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path / "cupy"), PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", SERVE_NO_JIT, str(path)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "COMPILED 0" in run.stdout, run.stdout[-4000:]
