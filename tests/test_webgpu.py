"""The WebGPU backend on whatever adapter wgpu finds (on a machine without a GPU, Mesa's lavapipe):
every weight type's kernels against the numpy references of ember.quant, every other op against the
float64 reference backend, the engine on a synthetic model against the CPU backend, and greedy
generation of the two real models against the CPU backend and llama.cpp's golden tokens."""
from __future__ import annotations

import numpy as np
import pytest

from ember.backends import AttentionBatch, BackendError, RopeParams, Weight, get_backend
from ember.backends import webgpu
from ember.quant import GGMLType, dequantize
from conftest import golden
from synth import Shape, weight, write_model
from test_backend_protocol import run_engine

T = GGMLType
pytestmark = pytest.mark.webgpu
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32]


def _backend_or_skip():
    pytest.importorskip("wgpu", reason="wgpu is not installed (pip install 'ember[webgpu]')")
    from ember.backends.webgpu import _device

    if not _device.adapters():
        pytest.skip("no WebGPU adapter (no Vulkan, Metal or D3D12 driver; on Linux without a GPU, "
                    "apt-get install mesa-vulkan-drivers gives lavapipe)")
    return get_backend("webgpu")


@pytest.fixture(scope="module")
def gpu():
    backend = _backend_or_skip()
    backend.int8_min_k = 0  # the int8 decode products (mvq) at the tests' short rows too
    return backend


@pytest.fixture
def plan(gpu, request):
    """Run a test under one of the product plans (a thread a row; GPU matvec summed in workgroup
    memory, and tiles; the same summed by subgroups where the adapter has them), restored after."""
    before = gpu.row_products, gpu.subgroups
    if request.param == "subgroups" and not before[1]:
        pytest.skip("the adapter has no subgroups")
    gpu.row_products, gpu.subgroups = request.param == "rows", request.param == "subgroups"
    yield request.param
    gpu.row_products, gpu.subgroups = before


class Tensor:
    """What Backend.weight reads of a GGUF tensor."""

    def __init__(self, name, qtype, shape, data):
        self.name, self.type, self.shape, self.data = name, qtype, shape, data


def matrix(gpu, qtype, rows, cols, seed=0):
    raw = weight(np.random.default_rng(seed), qtype, rows, cols, 1.0)
    ref = dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)
    return gpu.weight(Tensor("w", qtype, (rows, cols), raw)), ref


def product(gpu, w, x):
    out = gpu.empty((x.shape[0], w.shape[0]))
    gpu.matmul(w, gpu.from_numpy(x.astype(np.float32)), out)
    return gpu.to_numpy(out)


def close(got, want, rel=1e-3):
    """f32 sums against float64: within rel of the largest value (or of 1)."""
    scale, err = max(float(np.abs(want).max()), 1.0), float(np.abs(got - want).max())
    assert err <= rel * scale, f"max error {err:.3g} at scale {scale:.3g}"


def q8(x):
    """x rounded as quant_q8 rounds it for the integer decode products: blocks of 32 values, each to
    the nearest (ties to even) multiple of d = max|x| / 127, in f32."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    m = np.abs(b).max(-1, keepdims=True)
    d = m / np.float32(127)
    inv = np.where(m > 0, np.float32(1) / np.where(m > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    return (np.round(b * inv) * d).reshape(x.shape).astype(np.float64)


INT8_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K)  # decode products on int8 x (mvq)
MM_INT8_TYPES = INT8_TYPES + (T.Q5_K,)  # prompt tiles on int8 x (mmq)


def seen(gpu, qtype, x):
    """x as a product of x.shape[0] rows of qtype reads it: the decode products of INT8_TYPES (mvq)
    on int8 blocks of it."""
    return q8(x) if quants(gpu, qtype, x.shape[0], x.shape[-1]) else x


def quants(gpu, qtype, n, k=None) -> int:
    """Dispatches rounding x before a product of n rows (of k values) of qtype (quant_q8 before mvq
    for decode rows of int8_min_k values and more, before mmq for the prompt tiles at every k)."""
    if not gpu.int8_products:
        return 0
    if gpu._mvp(n):
        return int(qtype in INT8_TYPES and (k is None or k >= gpu.int8_min_k))
    return int(not gpu.row_products and qtype in MM_INT8_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_and_rows_match_the_quant_reference(gpu, qtype):
    rows, cols = 70, 512  # rows not a multiple of any tile
    w, ref = matrix(gpu, qtype, rows, cols, seed=int(qtype))
    x = np.random.default_rng(1).standard_normal((11, cols))
    for n in (1, 3, 11):
        close(product(gpu, w, x[:n]), seen(gpu, qtype, x[:n]) @ ref.T)
    ids = np.array([69, 0, 5, 5], np.int32)
    out = gpu.empty((4, cols))
    gpu.get_rows(w, ids, out)
    assert np.array_equal(gpu.to_numpy(out), ref[ids].astype(np.float32))


def sums(gpu, qtype, n, rows, k) -> int:
    """mmq_sum dispatches after a product of n activation rows: 1 where mmq splits k (its tiles too
    few to fill a GPU), else 0."""
    if not quants(gpu, qtype, n) or gpu._mvp(n):
        return 0
    tiles = -(-rows // webgpu.MMQ_ROWS) * -(-n // webgpu.MM_TILE)
    return int(webgpu._mmq_splits(tiles, k // 32)[1] > 1)


def dispatched(gpu) -> tuple:
    """(module, entry point) of the step's last dispatch."""
    return gpu.kernels.names()[id(gpu._step().dispatches[-1].pipeline)]


def entries(gpu, start: int) -> list:
    """The entry points of the step's dispatches from index start on."""
    names = gpu.kernels.names()
    return [names[id(d.pipeline)][1] for d in gpu._step().dispatches[start:]]


@pytest.mark.parametrize("plan", ["rows", "lanes", "subgroups"], indirect=True)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_matvec_of_every_type(gpu, plan, qtype):
    """The decode kernel (mvp: 2 rows a workgroup, 8-value pieces; its builds for 1, 2, 4 and 8 rows,
    summed by subgroups or in workgroup memory; on CPU adapters one row only, mv_row beyond) on
    every type: an odd row count (the last workgroup's second row is past the end) and widths
    whose pieces do not fill the lanes' last round (k = 288: 36 pieces of 32-lane rounds; 2304:
    mvq's 72 items of 32 values, 2 rounds and 8). The 32-value block types take mvq (mvp's pieces
    on x rounded to int8 blocks: against that x), Q4_K and Q6_K their own mvq (64 lanes for one
    row), the others mvp."""
    cols = 2304 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 288
    w, ref = matrix(gpu, qtype, 45, cols, seed=30 + int(qtype))
    x = np.random.default_rng(5).standard_normal((8, cols))
    for n in (1, 2, 3, 8):
        out = gpu.empty((n, 45))
        gpu.matmul(w, gpu.from_numpy(x[:n].astype(np.float32)), out)
        module, entry = dispatched(gpu)
        if plan == "rows" and n > 1:
            assert entry == "mv_row"
        else:
            built = {1: 1, 2: 2, 3: 4, 8: 8}[n]
            own = qtype in (T.Q4_K, T.Q6_K)  # their own mvq: 64 lanes for one row
            wide = ("+w64" if own else "+w128") if n == 1 and plan != "rows" else ""  # one row, few weight rows
            assert entry == ("mvq" if qtype in INT8_TYPES else "mvp")
            lanes = int(wide[2:]) if wide else 32
            teams = gpu.mv_teams.get(lanes, 1) if plan != "rows" else 1
            wide += f"+t{teams}" if teams > 1 else ""  # the build's teams of lanes
            assert module.endswith(f"+mv{built}+{'sg' if plan == 'subgroups' else 'wg'}{wide}")
        close(gpu.to_numpy(out), seen(gpu, qtype, x[:n]) @ ref.T)


@pytest.mark.parametrize("plan", ["lanes"], indirect=True)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_decode_products_on_f32_x_with_int8_products_off(gpu, plan, qtype):
    """int8_products off (the lane benchmark's baseline): the f32 decode entries (Q4_K's and Q6_K's
    mvk from 2 rows, mvp otherwise), no rounding of x."""
    w, ref = matrix(gpu, qtype, 45, 768, seed=9)
    x = np.random.default_rng(10).standard_normal((3, 768))
    gpu.int8_products = False
    try:
        for n in (1, 3):
            out = gpu.empty((n, 45))
            gpu.matmul(w, gpu.from_numpy(x[:n].astype(np.float32)), out)
            assert dispatched(gpu)[1] == ("mvk" if qtype != T.Q4_1 and n > 1 else "mvp")
            close(gpu.to_numpy(out), x[:n] @ ref.T)
    finally:
        gpu.int8_products = True


@pytest.mark.parametrize("plan", ["lanes"], indirect=True)
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K], ids=lambda t: t.name)
def test_int8_products_from_their_row_length(gpu, plan, qtype, monkeypatch):
    """As served, decode products take int8 x from rows of INT8_MIN_K values (the 8B's shapes) and
    f32 x below (a small model's, where the roundings cost more than they save)."""
    from ember.backends.webgpu import INT8_MIN_K

    monkeypatch.setattr(gpu, "int8_min_k", INT8_MIN_K)
    for cols in (INT8_MIN_K // 2, INT8_MIN_K):
        w, ref = matrix(gpu, qtype, 9, cols, seed=cols)
        x = np.random.default_rng(12).standard_normal((1, cols))
        out = gpu.empty((1, 9))
        before = len(gpu._step().dispatches)
        gpu.matmul(w, gpu.from_numpy(x.astype(np.float32)), out)
        assert entries(gpu, before) == (["quant_q8", "mvq"] if cols >= INT8_MIN_K else ["mvp"])
        close(gpu.to_numpy(out), seen(gpu, qtype, x) @ ref.T)


@pytest.mark.parametrize("sums", ["sg", "wg"])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_decode_matvec_with_wider_workgroups(gpu, qtype, sums):
    """mvp (and Q4_K's and Q6_K's mvq) built with 64 and 128 lanes a team, and with several teams
    a workgroup, each on rows of its own (bench/webgpu.py --lanes times them), gives the product
    of the 32-lane build, at widths that leave lanes idle in the last round and teams past the
    last row."""
    from ember.backends.webgpu import MATRIX_TYPES, MV_ROWS, _groups
    from ember.backends.webgpu._kernels import mv_build
    from ember.backends.webgpu._step import Dispatch

    if sums == "sg" and "subgroup" not in gpu.device.features:
        pytest.skip("the adapter has no subgroups")
    cols = 768 if qtype in (T.Q4_K, T.Q6_K) else 544
    w, ref = matrix(gpu, qtype, 45, cols, seed=7)
    x = np.random.default_rng(8).standard_normal((1, cols))
    out = gpu.empty((1, 45))
    with gpu.record() as rec:
        gpu.matmul(w, gpu.from_numpy(x.astype(np.float32)), out)
        host = gpu.to_numpy(out)
    d = rec.dispatches[-1]  # the product (after quant_q8 for mvq)
    entry = gpu.kernels.names()[id(d.pipeline)][1]
    # (4, 4): teams narrower than a subgroup of 8 or more lanes (their butterfly)
    for lanes, teams in ((64, 1), (128, 1), (32, 4), (32, 3), (64, 2), (4, 4)):
        pipe = gpu.kernels.pipeline(f"{MATRIX_TYPES[qtype]}+mv1+{sums}{mv_build(lanes, teams)}", entry)
        rec.dispatches[-1] = Dispatch(pipe, d.bindings, d.params, _groups(-(-45 // (MV_ROWS * teams))))
        rec.build(gpu.device, gpu.wgpu)
        gpu.replay(rec)
        close(host, seen(gpu, qtype, x) @ ref.T)


@pytest.mark.parametrize("plan", ["rows", "lanes", "subgroups"], indirect=True)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_both_product_plans(gpu, plan, qtype):
    """Decode (1..8 rows) and prompt (tiles of 32) shapes under each plan."""
    w, ref = matrix(gpu, qtype, 45, 256, seed=3)
    x = np.random.default_rng(2).standard_normal((40, 256))
    for n in (1, 8, 9, 40):
        close(product(gpu, w, x[:n]), seen(gpu, qtype, x[:n]) @ ref.T)


@pytest.mark.parametrize("plan", ["rows", "lanes", "subgroups"], indirect=True)
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_products_of_several_matrices_in_one_dispatch(gpu, plan, qtype):
    """Queries, keys and values (and gate and up) of one buffer: one dispatch whose rows run over
    the matrices back to back (tiles and workgroups straddling them), each into its own output."""
    sizes = (45, 13, 20)
    mats = [matrix(gpu, qtype, rows, 256, seed=10 + i) for i, rows in enumerate(sizes)]
    x = np.random.default_rng(4).standard_normal((40, 256))
    for count in (2, 3):
        ws, refs = zip(*mats[:count])
        for n in (1, 8, 40):
            outs = [gpu.empty((n, w.shape[0])) for w in ws]
            before = len(gpu._step().dispatches)
            gpu.matmuls(list(ws), gpu.from_numpy(x[:n].astype(np.float32)), outs)
            rows = sum(w.shape[0] for w in ws)
            assert len(gpu._step().dispatches) == before + 1 + quants(gpu, qtype, n) + sums(gpu, qtype, n, rows, 256)
            for out, r in zip(outs, refs):
                close(gpu.to_numpy(out), seen(gpu, qtype, x[:n]) @ r.T)
    other = T.Q6_K if qtype != T.Q6_K else T.Q8_0  # a matrix of another type: a dispatch of its own
    (w0, r0), (w1, r1), (w2, r2) = mats[0], matrix(gpu, other, 7, 256, seed=20), mats[1]
    outs = [gpu.empty((8, w.shape[0])) for w in (w0, w1, w2)]
    before = len(gpu._step().dispatches)
    gpu.matmuls([w0, w1, w2], gpu.from_numpy(x[:8].astype(np.float32)), outs)
    # x's int8 blocks made once where both types take them (mvq)
    assert len(gpu._step().dispatches) == before + 2 + max(quants(gpu, qtype, 8), quants(gpu, other, 8))
    for out, r, t in zip(outs, (r0, r1, r2), (qtype, other, qtype)):
        close(gpu.to_numpy(out), seen(gpu, t, x[:8]) @ r.T)


@pytest.mark.parametrize("plan", ["rows", "lanes", "subgroups"], indirect=True)
@pytest.mark.parametrize("op", ["silu_mul", "gelu_mul"])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_gated_products_in_the_gate_and_up_dispatch(gpu, ref, plan, op, qtype):
    """Gate and up in one decode dispatch, then act(gate) * up over either: the product's dispatch
    pairs their rows and writes the gated values itself (one dispatch, not two); both outputs hold
    what the two ops give (the CPU adapters' mv_row from 2 rows: the two dispatches, same values).
    Q4_K and Q6_K through their own decode entry (mvq, after x's rounding), Q4_1 through mvp."""
    (wg, rg), (wu, ru) = matrix(gpu, qtype, 37, 512, seed=40), matrix(gpu, qtype, 37, 512, seed=41)
    x = np.random.default_rng(6).standard_normal((8, 512)) * 0.3
    for n in (1, 3, 8):
        for into in ("gate", "up"):
            xs = seen(gpu, qtype, x[:n])
            gate, up = (rx.astype(np.float32).astype(np.float64) for rx in (xs @ rg.T, xs @ ru.T))
            (g0, r0), (u0, ru0) = both(gpu, ref, gate), both(gpu, ref, up)
            getattr(ref, op)(r0, ru0, r0 if into == "gate" else ru0)
            go, uo = gpu.empty((n, 37)), gpu.empty((n, 37))
            before = len(gpu._step().dispatches)
            gpu.matmuls([wg, wu], gpu.from_numpy(x[:n].astype(np.float32)), [go, uo])
            getattr(gpu, op)(go, uo, go if into == "gate" else uo)
            fused = plan != "rows" or n == 1
            assert len(gpu._step().dispatches) == before + (1 if fused else 2) + quants(gpu, qtype, n)
            close(gpu.to_numpy(go), r0, rel=1e-4)
            close(gpu.to_numpy(uo), ru0, rel=1e-4)


@pytest.mark.parametrize("plan", ["lanes", "subgroups"], indirect=True)
@pytest.mark.parametrize("n", [1, 3])
def test_int8_blocks_made_by_the_norm_before_the_products(gpu, ref, plan, n):
    """The residual add and norm before Q4_K and Q6_K decode products (a layer's q/k then its
    Q6_K v, as Q4_K_M files have them; and the post-norm families' norm, add and norm) write x's
    int8 blocks themselves: no quant_q8 dispatch, the
    second type's product reads the same blocks; the products as on the rounded x; into a new
    array or over h, on rows of 512 and of 4608 values. A product's
    output as the next product's x is rounded by a quant_q8 of its own."""
    rng = np.random.default_rng(11)
    for d, into in ((512, "new"), (512, "h"), (4608, "new"), (4608, "h")):
        x, h, nw = rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.uniform(0.5, 1.5, d)
        (wq, rq), (wk, rk), (wv, rv) = (matrix(gpu, t, r, d, seed=50 + r) for t, r in ((T.Q4_K, 40), (T.Q4_K, 24), (T.Q6_K, 24)))
        (gx, rx), (gh, rh) = both(gpu, ref, x), both(gpu, ref, h)
        gn, rn = (gpu.empty((n, d)), ref.empty((n, d))) if into == "new" else (gh, rh)
        for b, (xx, hh, nn) in ((gpu, (gx, gh, gn)), (ref, (rx, rh, rn))):
            b.add(xx, hh, xx)
            b.rms_norm(xx, vector(b, nw), 1e-6, nn)
        outs = [gpu.empty((n, w.shape[0])) for w in (wq, wk, wv)]
        before = len(gpu._step().dispatches)
        gpu.matmuls([wq, wk, wv], gn, outs)
        names = entries(gpu, before - 1)
        assert names == ["add_rms_norm", "mvq", "mvq"]
        close(gpu.to_numpy(gx), ref.to_numpy(rx))
        normed = ref.to_numpy(rn)
        close(gpu.to_numpy(gn), normed)
        for out, r in zip(outs, (rq, rk, rv)):
            close(gpu.to_numpy(out), q8(normed.astype(np.float32)) @ r.T)
    d = 512
    x, h, nw = rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.uniform(0.5, 1.5, d)
    (wq, rq), (wk, rk), (wv, rv) = (matrix(gpu, t, r, d, seed=50 + r) for t, r in ((T.Q4_K, 40), (T.Q4_K, 24), (T.Q6_K, 24)))
    # the post-norm families' norm, add and norm (one dispatch) before a product: the same
    post = rng.uniform(0.5, 1.5, d)
    (gx, rx), (gh, rh) = both(gpu, ref, x), both(gpu, ref, h)
    for b, (xx, hh) in ((gpu, (gx, gh)), (ref, (rx, rh))):
        b.rms_norm(hh, vector(b, post), 1e-6, hh)
        b.add(xx, hh, xx)
        b.rms_norm(xx, vector(b, nw), 1e-6, hh)
    out = gpu.empty((n, 24))
    before = len(gpu._step().dispatches)
    gpu.matmul(wv, gh, out)
    names = entries(gpu, before - 1)
    assert names == ["norm_add_rms_norm", "mvq"]
    normed = ref.to_numpy(rh)
    close(gpu.to_numpy(gh), normed)
    close(gpu.to_numpy(out), q8(normed.astype(np.float32)) @ rv.T)
    # a product's output into the next product
    (ws, rs) = matrix(gpu, T.Q4_K, d, d, seed=60)
    gs = gpu.from_numpy(normed.astype(np.float32))
    tmp, out = gpu.empty((n, d)), gpu.empty((n, 40))
    before = len(gpu._step().dispatches)
    gpu.matmul(ws, gs, tmp)
    gpu.matmul(wq, tmp, out)
    names = entries(gpu, before)
    assert names == ["quant_q8", "mvq", "quant_q8", "mvq"]
    mid = (q8(normed.astype(np.float32)) @ rs.T).astype(np.float32)
    close(gpu.to_numpy(tmp), mid)
    close(gpu.to_numpy(out), q8(gpu.to_numpy(tmp)) @ rq.T)


def test_kernels_compile_without_runtime_checks(gpu, monkeypatch):
    """The kernels' modules are made without naga's runtime checks (wgpu-native's trusted call through
    wgpu-py's handles), not by wgpu's default call; the module made so runs."""
    from ember.backends.webgpu import _kernels

    assert _kernels.RUNTIME_CHECKS == 0
    code = """
@group(0) @binding(0) var<storage, read_write> O: array<f32>;
@compute @workgroup_size(4)
fn main(@builtin(local_invocation_index) t: u32) { for (var i = 0u; i < 3u; i++) { O[t] += f32(t + i); } }"""
    monkeypatch.setattr(gpu.device, "create_shader_module", lambda **_: pytest.fail("the default call was taken"))
    module = _kernels.create_module(gpu.device, code, 0)
    monkeypatch.undo()
    wgpu = gpu.wgpu
    pipe = gpu.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    buf = gpu.device.create_buffer(size=16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    group = gpu.device.create_bind_group(layout=pipe.get_bind_group_layout(0),
                                         entries=[{"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": 16}}])
    enc = gpu.device.create_command_encoder()
    p = enc.begin_compute_pass()
    p.set_pipeline(pipe)
    p.set_bind_group(0, group)
    p.dispatch_workgroups(1, 1, 1)
    p.end()
    gpu.device.queue.submit([enc.finish()])
    got = np.frombuffer(gpu.device.queue.read_buffer(buf), np.float32)
    assert got.tolist() == [3.0, 6.0, 9.0, 12.0]


@pytest.mark.parametrize("plan", ["lanes"], indirect=True)
@pytest.mark.parametrize("tile", ["mm", "mm2", "mmq"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_prompt_tiles_of_every_type_at_ragged_edges(gpu, plan, tile, qtype, monkeypatch):
    """The prompt kernels (mm: 64 x 64 output tiles; mm2: 128 weight rows by 64; mmq: mm2's tiles
    on x as int8 blocks, for the types that have it; k in runs of 32) on every type: rows and
    activation rows short of, just past and two tiles plus one past a tile (the last tile's rows
    and activation rows past the ends read but never stored), k of an odd number of runs (96) or
    of super-blocks (768)."""
    if tile == "mm2" and gpu.device.limits["max-compute-workgroup-storage-size"] < webgpu.MM2_STORAGE:
        pytest.skip("the adapter's workgroup memory is too small for mm2")
    if tile == "mmq" and qtype not in MM_INT8_TYPES:
        pytest.skip("the type has no int8 prompt tiles")
    monkeypatch.setattr(webgpu, "MMQ_MIN_GROUPS", 1)  # whole tiles over all of k (test_int8_tiles_split_k)
    before = gpu.mm_rows, gpu.int8_products
    gpu.mm_rows, gpu.int8_products = (128 if tile == "mm2" else 64), tile == "mmq"
    try:
        cols = 768 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 96
        x = np.random.default_rng(7).standard_normal((129, cols))
        edge = 64 if tile == "mm" else 128
        for rows in (edge - 1, edge + 1, 2 * edge + 1):
            w, ref = matrix(gpu, qtype, rows, cols, seed=50 + rows + int(qtype))
            for n in (9, 64, 129):
                out = gpu.empty((n, rows))
                gpu.matmul(w, gpu.from_numpy(x[:n].astype(np.float32)), out)
                assert dispatched(gpu)[1] == tile
                close(gpu.to_numpy(out), seen(gpu, qtype, x[:n]) @ ref.T)
    finally:
        gpu.mm_rows, gpu.int8_products = before


@pytest.mark.parametrize("plan", ["lanes"], indirect=True)
@pytest.mark.parametrize("qtype", MM_INT8_TYPES, ids=lambda t: t.name)
def test_int8_tiles_split_k(gpu, plan, qtype):
    """Where its tiles are too few to fill a GPU, mmq splits k (here 24 runs of 32 into 6 splits of
    4, and 9 runs into 2 of 5 and 4), each split's sums into a scratch that mmq_sum adds up: for
    one matrix and for three of one buffer (their outputs apart), activation rows short of a tile
    and past one, as the product on the rounded x."""
    rng = np.random.default_rng(int(qtype))
    before_int8 = gpu.int8_products
    gpu.int8_products = True
    try:
        for cols in ((768, 288) if qtype not in (T.Q4_K, T.Q5_K, T.Q6_K) else (768,)):
            mats = [matrix(gpu, qtype, rows, cols, seed=70 + rows) for rows in (130, 24, 40)]
            x = rng.standard_normal((70, cols))
            assert webgpu._mmq_splits(2 * 2, cols // 32)[1] > 1
            for count in (1, 3):
                ws, refs = zip(*mats[:count])
                for n in (20, 70):
                    outs = [gpu.empty((n, w.shape[0])) for w in ws]
                    before = len(gpu._step().dispatches)
                    gpu.matmuls(list(ws), gpu.from_numpy(x[:n].astype(np.float32)), outs)
                    assert entries(gpu, before) == ["quant_q8", "mmq", "mmq_sum"]
                    for out, r in zip(outs, refs):
                        close(gpu.to_numpy(out), seen(gpu, qtype, x[:n]) @ r.T)
    finally:
        gpu.int8_products = before_int8


@pytest.mark.parametrize("plan", ["lanes"], indirect=True)
def test_prompt_tiles_write_only_their_outputs(gpu, plan):
    """The edge tiles store nothing past the rows (outputs are rows wide: a stray value would land
    in the next activation row's) nor past the activation rows (an output longer than n keeps its
    tail)."""
    w, ref = matrix(gpu, T.Q4_1, 70, 256, seed=60)
    x = np.random.default_rng(8).standard_normal((80, 256))
    out = gpu.from_numpy(np.full((90, 70), 7.0, np.float32))
    gpu.matmul(w, gpu.from_numpy(x.astype(np.float32)), out)
    got = gpu.to_numpy(out)
    close(got[:80], seen(gpu, T.Q4_1, x) @ ref.T)
    assert (got[80:] == 7.0).all()


@pytest.mark.parametrize("plan", ["rows"], indirect=True)
def test_cpu_adapters_take_tiles_where_they_pay(gpu, plan):
    """The CPU adapters' plan: a thread a row (mv_row) for a few activation rows, tiles (mm, mm2) from
    a whole tile of them on, and back to rows where the last tile would be mostly padding."""
    w, ref = matrix(gpu, T.Q4_K, 70, 256, seed=61)
    x = np.random.default_rng(9).standard_normal((128, 256))
    tile = "mm" if gpu.mm_rows == 64 else "mm2"
    for n, entry in ((9, "mv_row"), (53, "mv_row"), (64, tile), (70, "mv_row"), (128, tile)):
        out = gpu.empty((n, 70))
        gpu.matmul(w, gpu.from_numpy(x[:n].astype(np.float32)), out)
        assert dispatched(gpu)[1] == entry, n
        close(gpu.to_numpy(out), x[:n] @ ref.T)


@pytest.mark.parametrize("plan", ["rows", "lanes"], indirect=True)
def test_matrices_beyond_a_binding_are_split_by_rows(gpu, plan):
    """Parts of 20 rows: a dispatch each, into the output's columns from the part's first row
    (decode, and prompt tiles larger than a part)."""
    before = gpu.max_binding
    gpu.max_binding = 20 * 272 + 16  # 20 rows of Q8_0 x 256 (8 blocks of 34 bytes) a buffer
    try:
        w, ref = matrix(gpu, T.Q8_0, 50, 256)
    finally:
        gpu.max_binding = before
    assert [p[:2] for p in w.data.parts] == [(0, 20), (20, 20), (40, 10)]
    x = np.random.default_rng(0).standard_normal((70, 256))
    for n in (3, 70):
        close(product(gpu, w, x[:n]), seen(gpu, T.Q8_0, x[:n]) @ ref.T)
    ids = np.array([49, 0, 21, 39], np.int32)
    out = gpu.empty((4, 256))
    gpu.get_rows(w, ids, out)
    assert np.array_equal(gpu.to_numpy(out), ref[ids].astype(np.float32))


@pytest.fixture(scope="module")
def ref():
    return get_backend("reference")


def both(gpu, ref, a):
    return gpu.from_numpy(np.asarray(a, np.float32)), ref.from_numpy(np.asarray(a, np.float32))


def vector(backend, values):
    return Weight("v", T.F32, (len(values),), backend.from_numpy(np.asarray(values, np.float32)))


def test_elementwise_ops(gpu, ref):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 96)) * 3, rng.standard_normal((5, 96))
    for op in ("add", "silu_mul", "gelu_mul"):
        for alias in ("none", "a", "b"):
            (ga, ra), (gb, rb) = both(gpu, ref, a), both(gpu, ref, b)
            go, ro = {"a": (ga, ra), "b": (gb, rb)}.get(alias, (gpu.empty((5, 96)), ref.empty((5, 96))))
            getattr(gpu, op)(ga, gb, go)
            getattr(ref, op)(ra, rb, ro)
            close(gpu.to_numpy(go), ro)
    for op, arg in (("scale", 0.7), ("softcap", 2.0)):
        g, r = both(gpu, ref, a)
        getattr(gpu, op)(g, arg)
        getattr(ref, op)(r, arg)
        close(gpu.to_numpy(g), r)
    g, r = both(gpu, ref, a)
    gpu.add_bias(g, vector(gpu, b[0]))
    ref.add_bias(r, vector(ref, b[0]))
    close(gpu.to_numpy(g), r)
    batch = AttentionBatch(np.array([0, 3, 8, 40, 100], np.int32), np.zeros(5, np.int32), np.zeros((1, 1), np.int32),
                           np.zeros(5, np.int64), 16)
    g, r = both(gpu, ref, a)
    gpu.pos_scale(g, batch, 8, 0.1, 1.0)
    ref.pos_scale(r, batch, 8, 0.1, 1.0)
    close(gpu.to_numpy(g), r)


def test_rows_norms_and_top_k(gpu, ref):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 128))
    w = rng.uniform(0.5, 1.5, 64)
    for weights, d, in_place in ((w, 64, True), (None, 128, False), (w[:64], 64, False)):
        (g, r), (go, ro) = both(gpu, ref, x), both(gpu, ref, np.zeros_like(x))
        gw, rw = (vector(gpu, weights), vector(ref, weights)) if weights is not None else (None, None)
        gpu.rms_norm(g, gw, 1e-5, g if in_place else go)
        ref.rms_norm(r, rw, 1e-5, r if in_place else ro)
        close(gpu.to_numpy(g if in_place else go), r if in_place else ro)
    long_x, long_w = rng.standard_normal((2, 4600)), rng.uniform(0.5, 1.5, 4600)  # past the registers' 4096
    for in_place in (True, False):
        (g, r), (go, ro) = both(gpu, ref, long_x), both(gpu, ref, np.zeros_like(long_x))
        gpu.rms_norm(g, vector(gpu, long_w), 1e-5, g if in_place else go)
        ref.rms_norm(r, vector(ref, long_w), 1e-5, r if in_place else ro)
        close(gpu.to_numpy(g if in_place else go), r if in_place else ro)
    for onto_h in (True, False):  # x += h then a norm of x (one pass on the device), onto h or elsewhere
        h = rng.standard_normal((6, 128))
        (g, r), (gh, rh), (go, ro) = both(gpu, ref, x), both(gpu, ref, h), both(gpu, ref, np.zeros_like(x))
        gw, rw = vector(gpu, w.repeat(2)), vector(ref, w.repeat(2))
        gpu.add(g, gh, g)
        gpu.rms_norm(g, gw, 1e-5, gh if onto_h else go)
        ref.add(r, rh, r)
        ref.rms_norm(r, rw, 1e-5, rh if onto_h else ro)
        close(gpu.to_numpy(g), r)
        close(gpu.to_numpy(gh if onto_h else go), rh if onto_h else ro)
    rows = np.array([5, 0, 2], np.int32)
    g, out = gpu.from_numpy(x.astype(np.float32)), gpu.empty((3, 128))
    gpu.gather_rows(g, rows, out)
    assert np.array_equal(gpu.to_numpy(out), x[rows].astype(np.float32))
    logits = np.round(rng.standard_normal((3, 1000)) * 4) / 4  # many ties: lowest id first
    ids, vals = gpu.empty((3, 20), np.int32), gpu.empty((3, 20))
    gpu.top_k(gpu.from_numpy(logits.astype(np.float32)), 20, ids, vals)
    want_ids, want_vals = np.zeros((3, 20), np.int32), np.zeros((3, 20))
    ref.top_k(logits, 20, want_ids, want_vals)
    assert np.array_equal(gpu.to_numpy(ids), want_ids) and np.array_equal(gpu.to_numpy(vals), want_vals)
    with pytest.raises(BackendError, match="top_k needs"):
        gpu.top_k(gpu.from_numpy(logits.astype(np.float32)), 0, ids, vals)


def test_residual_add_and_norm_in_one_dispatch_on_long_rows(gpu, ref):
    """x += h then the norm of x (add_rms_norm, 256 threads a row): rows of many rounds, not a
    multiple of one nor of 4 (4602 = 17 x 256 + 250: the tail after 4 values a thread), the norm written over h or into a third array, with
    and without weights; one dispatch, as the two ops give."""
    rng = np.random.default_rng(9)
    x, h, w = rng.standard_normal((3, 4602)), rng.standard_normal((3, 4602)), rng.uniform(0.5, 1.5, 4602)
    for weights in (True, False):
        for over_h in (True, False):
            (gx, rx), (gh, rh), (go, ro) = both(gpu, ref, x), both(gpu, ref, h), both(gpu, ref, np.zeros_like(x))
            before = len(gpu._step().dispatches)
            for b, (xx, hh, oo) in ((gpu, (gx, gh, go)), (ref, (rx, rh, ro))):
                b.add(xx, hh, xx)
                b.rms_norm(xx, vector(b, w) if weights else None, 1e-6, hh if over_h else oo)
            assert len(gpu._step().dispatches) == before + 1
            close(gpu.to_numpy(gx), rx)
            close(gpu.to_numpy(gh if over_h else go), rh if over_h else ro)


def post_norm_add_norm(gpu, ref, x, h, post, nxt):
    """h normed in place, added into x, the next norm onto h: one dispatch, as the separate ops give."""
    (gx, rx), (gh, rh) = both(gpu, ref, x), both(gpu, ref, h)
    before = len(gpu._step().dispatches)
    for b, (xx, hh) in ((gpu, (gx, gh)), (ref, (rx, rh))):
        b.rms_norm(hh, vector(b, post) if post is not None else None, 1e-6, hh)
        b.add(xx, hh, xx)
        b.rms_norm(xx, vector(b, nxt) if nxt is not None else None, 1e-6, hh)
    assert len(gpu._step().dispatches) == before + 1
    close(gpu.to_numpy(gx), rx)
    close(gpu.to_numpy(gh), rh)


def test_norms_fused_into_one_dispatch(gpu, ref):
    """Queries' then keys' per-head norms in place: one dispatch; a block's output normed in place,
    added to the residual stream and the next norm taken onto it (post-norm families): one
    dispatch; each as the separate ops give (with and without weights)."""
    rng = np.random.default_rng(7)
    q, k, wq, wk = rng.standard_normal((3, 4 * 32)), rng.standard_normal((3, 2 * 32)), rng.uniform(0.5, 1.5, 32), \
        rng.uniform(0.5, 1.5, 32)
    for weights in (True, False):  # without weights, rows of the arrays' width: heads as rows
        (gq, rq), (gk, rk) = both(gpu, ref, q if weights else q.reshape(-1, 32)), \
            both(gpu, ref, k if weights else k.reshape(-1, 32))
        before = len(gpu._step().dispatches)
        for (g, r), w in (((gq, rq), wq), ((gk, rk), wk)):
            gpu.rms_norm(g, vector(gpu, w) if weights else None, 1e-6, g)
            ref.rms_norm(r, vector(ref, w) if weights else None, 1e-6, r)
        assert len(gpu._step().dispatches) == before + 1
        close(gpu.to_numpy(gq), rq)
        close(gpu.to_numpy(gk), rk)
    for d in (96, 4600):  # and rows longer than a thread's registers hold (16 x 256 values), the rest re-read
        x, h = rng.standard_normal((5, d)), rng.standard_normal((5, d)) * 4
        post, nxt = rng.uniform(0.5, 1.5, d), rng.uniform(0.5, 1.5, d)
        for weights in (True, False):
            post_norm_add_norm(gpu, ref, x, h, post if weights else None, nxt if weights else None)
    x, h = rng.standard_normal((5, 96)), rng.standard_normal((5, 96)) * 4
    post, nxt = rng.uniform(0.5, 1.5, 96), rng.uniform(0.5, 1.5, 96)
    (gx, rx), (gh, rh) = both(gpu, ref, x), both(gpu, ref, h)  # another eps: three dispatches, same values
    before = len(gpu._step().dispatches)
    for b, (xx, hh) in ((gpu, (gx, gh)), (ref, (rx, rh))):
        b.rms_norm(hh, vector(b, post), 1e-5, hh)
        b.add(xx, hh, xx)
        b.rms_norm(xx, vector(b, nxt), 1e-6, hh)
    assert len(gpu._step().dispatches) == before + 2  # the add and the norm after it still one
    close(gpu.to_numpy(gh), rh)


@pytest.mark.parametrize("plan", ["rows", "lanes"], indirect=True)
@pytest.mark.parametrize("vocab,k", [(16394, 20), (20000, 1), (49152, 5)])
def test_top_k_of_long_rows_in_two_stages(gpu, ref, plan, vocab, k):
    """On GPUs, rows of 4 chunks of 4096 and more: a workgroup a chunk leaves its k best, a second
    dispatch ranks those (the last chunk shorter than k at 16394); on CPU adapters one workgroup a
    row. The same ids and values, lowest id first among ties."""
    logits = np.round(np.random.default_rng(vocab).standard_normal((3, vocab)) * 2) / 2  # many ties
    logits[1, vocab - 3:] = 50.0  # the best in the last, short chunk
    ids, vals = gpu.empty((3, k), np.int32), gpu.empty((3, k))
    before = len(gpu._step().dispatches)
    gpu.top_k(gpu.from_numpy(logits.astype(np.float32)), k, ids, vals)
    assert len(gpu._step().dispatches) == before + (1 if plan == "rows" else 2)
    want_ids, want_vals = np.zeros((3, k), np.int32), np.zeros((3, k))
    ref.top_k(logits, k, want_ids, want_vals)
    assert np.array_equal(gpu.to_numpy(ids), want_ids) and np.array_equal(gpu.to_numpy(vals), want_vals)


@pytest.mark.parametrize("neox,factors,yarn", [(False, False, False), (True, True, False), (True, False, True)])
def test_rope(gpu, ref, neox, factors, yarn):
    rng = np.random.default_rng(2)
    n, n_head, hd, n_rot = 4, 3, 64, 48
    x = rng.standard_normal((n, n_head * hd))
    ff = rng.uniform(1.0, 4.0, n_rot // 2) if factors else None
    p = RopeParams(n_rot, neox, 10000.0, 0.25 if yarn else 1.0, ext_factor=1.0 if yarn else 0.0, n_ctx_orig=4096)
    batch = AttentionBatch(np.array([0, 7, 300, 2047], np.int32), np.zeros(n, np.int32), np.zeros((1, 1), np.int32),
                           np.zeros(n, np.int64), 16)
    keys = rng.standard_normal((n, 2 * hd))  # rotated right after the queries: one dispatch on the device
    (g, r), (gk, rk) = both(gpu, ref, x), both(gpu, ref, keys)
    gp = RopeParams(**{**_fields(p), "freq_factors": None if ff is None else gpu.from_numpy(ff.astype(np.float32))})
    rp = RopeParams(**{**_fields(p), "freq_factors": ff})
    gpu.rope(g, n_head, batch, gp)
    gpu.rope(gk, 2, batch, gp)
    ref.rope(r, n_head, batch, rp)
    ref.rope(rk, 2, batch, rp)
    np.testing.assert_allclose(gpu.to_numpy(g), r, atol=2e-3)  # f32 angles at position 2047
    np.testing.assert_allclose(gpu.to_numpy(gk), rk, atol=2e-3)
    # rotated keys stored right after (with the values: 96 wide, another width): the rope's
    # dispatch stores them (one dispatch for the three ops), the caches as the reference's; with
    # the queries' and keys' per-head norms before (Gemma 3), those too (one dispatch for five)
    norm_w = rng.uniform(0.5, 1.5, (2, hd))
    for normed in (False, True):
        (g, r), (gk, rk) = both(gpu, ref, x), both(gpu, ref, keys)
        gv, rv = both(gpu, ref, rng.standard_normal((n, 96)))
        gkv, rkv = gpu.kv_cache(16, 2 * hd, 96), ref.kv_cache(16, 2 * hd, 96)
        batch = AttentionBatch(batch.positions, batch.seq_rows, batch.block_tables, np.array([9, 2, 15, 4]), 16)
        before = len(gpu._step().dispatches)
        for b, (q_, k_, v_), kv, rope in ((gpu, (g, gk, gv), gkv, gp), (ref, (r, rk, rv), rkv, rp)):
            if normed:
                b.rms_norm(q_, vector(b, norm_w[0]), 1e-6, q_)
                b.rms_norm(k_, vector(b, norm_w[1]), 1e-6, k_)
            b.rope(q_, n_head, batch, rope)
            b.rope(k_, 2, batch, rope)
            b.kv_store(kv, k_, v_, batch)
        assert len(gpu._step().dispatches) == before + 1
        np.testing.assert_allclose(gpu.to_numpy(g), r, atol=2e-3)
        np.testing.assert_allclose(gpu.to_numpy(gk), rk, atol=2e-3)
        for got, want in zip(gkv, rkv):
            np.testing.assert_allclose(gpu.to_numpy(got).astype(np.float64), np.asarray(want, np.float64), atol=4e-3)


@pytest.mark.parametrize("plan", ["lanes", "subgroups"], indirect=True)
@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K), (T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0)], ids=lambda t: f"{t[0].name}-{t[1].name}")
@pytest.mark.parametrize("factors", [False, True], ids=["plain", "factors"])
def test_decode_products_rotate_and_store_queries_keys_and_values(gpu, ref, plan, types, factors):
    """A decode layer's q, k, v products, rope and kv_store: where rope pairs are adjacent (llama's
    layout) the products rotate the queries and keys and store the keys and values into the caches
    themselves (no rope or rope_store dispatch), also where the values are of another type and so
    a product of their own (Q4_K_M's Q6_K values); with neox pairs, the rope's own store stays. The
    outputs and both caches as the reference's, at 1 and 2 tokens."""
    if not gpu.kv_products:
        pytest.skip("the adapter binds too few storage buffers for the products that store")
    rng = np.random.default_rng(7)
    n_head, n_kv, hd, cols = 4, 2, 64, 256
    qt, vt = types
    (wq, rq), (wk, rk), (wv, rv) = (matrix(gpu, t, rows, cols, seed=60 + i)
                                    for i, (t, rows) in enumerate(((qt, n_head * hd), (qt, n_kv * hd), (vt, n_kv * hd))))
    ff = rng.uniform(1.0, 4.0, hd // 2) if factors else None
    for neox in (False, True):
        for n in (1, 2):
            x = rng.standard_normal((n, cols)) * 0.5
            p = RopeParams(hd, neox, 10000.0, 1.0)
            gp = RopeParams(**{**_fields(p), "freq_factors": None if ff is None else gpu.from_numpy(ff.astype(np.float32))})
            rp = RopeParams(**{**_fields(p), "freq_factors": ff})
            batch = AttentionBatch(np.array([5, 300][:n], np.int32), np.zeros(n, np.int32), np.zeros((1, 1), np.int32),
                                   np.array([9, 2][:n], np.int64), 16)
            gkv, rkv = gpu.kv_cache(16, n_kv * hd, n_kv * hd), ref.kv_cache(16, n_kv * hd, n_kv * hd)
            outs = [gpu.empty((n, w.shape[0])) for w in (wq, wk, wv)]
            before = len(gpu._step().dispatches)
            gpu.matmuls([wq, wk, wv], gpu.from_numpy(x.astype(np.float32)), outs)
            gpu.rope(outs[0], n_head, batch, gp)
            gpu.rope(outs[1], n_kv, batch, gp)
            gpu.kv_store(gkv, outs[1], outs[2], batch)
            ran = entries(gpu, before)
            assert ("rope_store" in ran) == neox and "rope" not in ran and "kv_store" not in ran
            assert len(ran) == (1 if qt == vt else 2) + quants(gpu, qt, n, cols) + int(neox)
            want = [ref.from_numpy(seen(gpu, t, x) @ r.T) for t, r in ((qt, rq), (qt, rk), (vt, rv))]
            ref.rope(want[0], n_head, batch, rp)
            ref.rope(want[1], n_kv, batch, rp)
            ref.kv_store(rkv, want[1], want[2], batch)
            for got, w in zip(outs, want):
                close(gpu.to_numpy(got), np.asarray(w, np.float64))
            for got, w in zip(gkv, rkv):  # f16 caches: rounding's relative error
                close(gpu.to_numpy(got).astype(np.float64), np.asarray(w, np.float64), rel=2e-3)


def _fields(p: RopeParams) -> dict:
    return {k: getattr(p, k) for k in RopeParams.__slots__}


def _filled_caches(gpu, ref, rng, n_seq: int, pages: int, page: int, width: int):
    """Both backends' key and value caches filled with the same f16-exact random rows, on the
    shuffled pages of n_seq tables of `pages` pages each; returns the tables and the caches."""
    n_pages = n_seq * pages
    tables = rng.permutation(n_pages).reshape(n_seq, pages).astype(np.int32)
    n_slots = n_pages * page
    k_all = rng.standard_normal((n_slots, width)).astype(np.float16).astype(np.float64)
    v_all = rng.standard_normal((n_slots, width)).astype(np.float16).astype(np.float64)
    gkv, rkv = gpu.kv_cache(n_slots, width, width), ref.kv_cache(n_slots, width, width)
    store = AttentionBatch(np.zeros(n_slots, np.int32), np.zeros(n_slots, np.int32), tables,
                           np.arange(n_slots, dtype=np.int64), page)
    gpu.kv_store(gkv, gpu.from_numpy(k_all.astype(np.float32)), gpu.from_numpy(v_all.astype(np.float32)), store)
    ref.kv_store(rkv, k_all, v_all, store)
    return tables, gkv, rkv


def _decode_rows(gpu, ref, rng, hd: int, n_head: int, n_kv: int, positions: list):
    """A decode batch (a token of each of len(positions) sequences at those positions, on shuffled
    16-slot pages of tables reaching 384 keys), both backends' filled caches, their queries and
    empty outputs."""
    n, page = len(positions), 16
    tables, gkv, rkv = _filled_caches(gpu, ref, rng, n, 24, page, n_kv * hd)
    positions = np.array(positions, np.int32)
    seq_rows = np.arange(n, dtype=np.int32)
    slots = tables[seq_rows, positions // page].astype(np.int64) * page + positions % page
    batch = AttentionBatch(positions, seq_rows, tables, slots, page)
    q = both(gpu, ref, rng.standard_normal((n, n_head * hd)))
    return batch, (gkv, rkv), q, (gpu.empty((n, n_head * hd)), ref.empty((n, n_head * hd)))


@pytest.mark.parametrize("plan", ["rows", "lanes"], indirect=True)
@pytest.mark.parametrize("hd,window,softcap", [(64, 0, 0.0), (80, 40, 0.0), (256, 0, 30.0)])
def test_decode_attention_in_chunks_of_keys(gpu, ref, plan, hd, window, softcap):
    """Decode rows (a token each of 3 sequences at positions 0, 70 and 300, on shuffled pages of a
    table reaching 384 keys): a GPU splits each (head, token)'s keys into chunks of a workgroup
    each, merged after (attn_part, attn_merge); a CPU adapter runs them whole. Head sizes whose
    value words fill the workgroup evenly or not, a window past one chunk, a soft-cap; GQA."""
    rng = np.random.default_rng(5)
    n_head, n_kv = 8, 2
    batch, (gkv, rkv), (gq, rq), (go, ro) = _decode_rows(gpu, ref, rng, hd, n_head, n_kv, [0, 70, 300])
    before = len(gpu._step().dispatches)
    gpu.attention(gq, gkv, go, batch, n_head, n_kv, window, 0.125, softcap)
    assert len(gpu._step().dispatches) - before == (1 if plan == "rows" else 2)
    ref.attention(rq, rkv, ro, batch, n_head, n_kv, window, 0.125, softcap)
    np.testing.assert_allclose(gpu.to_numpy(go), ro, atol=1e-4)


@pytest.mark.parametrize("plan", ["rows", "lanes"], indirect=True)
def test_many_decode_rows_split_their_keys(gpu, ref, plan):
    """A decode step of 40 sequences a token each (320 (head, token) rows, past ATT_SPLIT_BELOW) on a
    GPU still splits the rows' keys into chunks, merged after; a CPU adapter runs them whole. The
    more rows, the fewer and longer the chunks (about ATT_SPLIT_GROUPS workgroups in all; a few rows
    keep ATT_MAX_CHUNKS)."""
    assert webgpu._split_chunks(9, 640) == (32, 20) and webgpu._split_chunks(32, 4096) == (64, 64)
    assert webgpu._split_chunks(2048, 640) == (96, 7) and webgpu._split_chunks(40000, 640) == (640, 1)
    rng = np.random.default_rng(9)
    n_head, n_kv, hd = 8, 2, 64
    positions = list(rng.integers(0, 384, 40))
    batch, (gkv, rkv), (gq, rq), (go, ro) = _decode_rows(gpu, ref, rng, hd, n_head, n_kv, positions)
    chunks = webgpu._split_chunks(40 * n_head, 384)[1]
    before = len(gpu._step().dispatches)
    gpu.attention(gq, gkv, go, batch, n_head, n_kv, 0, 0.125, 0.0)
    step = gpu._step()
    whole = ["attn_tile" if gpu.tile_attention else "attention"]  # the CPU adapters' kernel (on this adapter)
    assert entries(gpu, before) == (whole if plan == "rows" else ["attn_part", "attn_merge"])
    if plan != "rows":
        assert step.dispatches[before].groups == (n_head, 40, chunks)
    ref.attention(rq, rkv, ro, batch, n_head, n_kv, 0, 0.125, 0.0)
    np.testing.assert_allclose(gpu.to_numpy(go), ro, atol=1e-4)


@pytest.mark.parametrize("plan", ["lanes", "subgroups"], indirect=True)
@pytest.mark.parametrize("hd", [64, 80, 256])
def test_int8_blocks_made_by_the_attention_merge(gpu, ref, plan, hd):
    """A decode product of the attention's output (the o projection): the chunks' merge writes the
    output's int8 blocks itself where a head is whole blocks (no quant_q8 dispatch), else quant_q8
    rounds it; the output as before, the product as on the rounded output."""
    rng = np.random.default_rng(8)
    n_head, n_kv = 8, 2
    batch, (gkv, rkv), (gq, rq), (go, ro) = _decode_rows(gpu, ref, rng, hd, n_head, n_kv, [5, 70, 300])
    w, rw = matrix(gpu, T.Q8_0, 48, n_head * hd, seed=70)
    out = gpu.empty((3, 48))
    before = len(gpu._step().dispatches)
    gpu.attention(gq, gkv, go, batch, n_head, n_kv, 0, 0.125, 0.0)
    gpu.matmul(w, go, out)
    names = entries(gpu, before)
    assert names == ["attn_part", "attn_merge"] + ["quant_q8"] * (hd % 32 != 0) + ["mvq"]
    ref.attention(rq, rkv, ro, batch, n_head, n_kv, 0, 0.125, 0.0)
    np.testing.assert_allclose(gpu.to_numpy(go), ro, atol=1e-4)
    close(gpu.to_numpy(out), q8(gpu.to_numpy(go)) @ rw.T)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 20.0)])
def test_paged_attention(gpu, ref, window, softcap):
    """Two sequences on shuffled pages: a prompt of 9 tokens (causal within it) and a decode token
    after 30 cached positions; GQA (4 query heads on 2 kv heads); the cache round-trips f16."""
    rng = np.random.default_rng(3)
    n_head, n_kv, hd, page = 4, 2, 32, 8
    tables = np.array([[5, 2, 7, 0, 0], [1, 6, 3, 4, 8]], np.int32)
    n_slots = 9 * page
    k_all = rng.standard_normal((n_slots, n_kv * hd)).astype(np.float16).astype(np.float64)
    v_all = rng.standard_normal((n_slots, n_kv * hd)).astype(np.float16).astype(np.float64)
    gkv, rkv = gpu.kv_cache(n_slots, n_kv * hd, n_kv * hd), ref.kv_cache(n_slots, n_kv * hd, n_kv * hd)
    gk, gv = gkv
    store = AttentionBatch(np.zeros(n_slots, np.int32), np.zeros(n_slots, np.int32), tables,
                           np.arange(n_slots, dtype=np.int64), page)
    gpu.kv_store(gkv, gpu.from_numpy(k_all.astype(np.float32)), gpu.from_numpy(v_all.astype(np.float32)), store)
    ref.kv_store(rkv, k_all, v_all, store)
    positions = np.array([*range(9), 30], np.int32)
    seq_rows = np.array([0] * 9 + [1], np.int32)
    slots = tables[seq_rows, positions // page].astype(np.int64) * page + positions % page
    batch = AttentionBatch(positions, seq_rows, tables, slots, page)
    q = rng.standard_normal((10, n_head * hd))
    gq, rq = both(gpu, ref, q)
    go, ro = gpu.empty((10, n_head * hd)), ref.empty((10, n_head * hd))
    gpu.attention(gq, gkv, go, batch, n_head, n_kv, window, 0.2, softcap)
    ref.attention(rq, rkv, ro, batch, n_head, n_kv, window, 0.2, softcap)
    np.testing.assert_allclose(gpu.to_numpy(go), ro, atol=1e-4)
    gpu.copy_pages([gkv], [(1, 0), (3, 2)], page)
    keys = gpu.to_numpy(gk).astype(np.float64)
    assert np.array_equal(keys[0:page], k_all[page:2 * page]) and np.array_equal(keys[2 * page:3 * page],
                                                                                  k_all[3 * page:4 * page])


@pytest.mark.parametrize("n_head,n_kv,hd,window,softcap", [
    (4, 1, 256, 0, 0.0),    # Gemma 3's group of 4 on one kv head, 256 wide: 2 tokens a tile
    (9, 3, 64, 0, 0.0),     # SmolLM2's groups of 3: 2 tokens of 3 heads, 6 rows
    (16, 1, 80, 50, 20.0),  # a group of 16: two tiles of 8 heads, one token each; window, soft-cap
    (6, 6, 32, 0, 0.0),     # no GQA: 8 tokens a tile
])
@pytest.mark.parametrize("kernel", ["attn_tile", "attention", "attn_flash", "attn_flash+chunks"])
def test_prompt_attention_in_tiles_of_rows(gpu, ref, n_head, n_kv, hd, window, softcap, kernel, monkeypatch):
    """attn_tile (CPU adapters): prompts of two sequences (300 tokens from position 0, so past two
    tiles of 128 keys; 21 tokens after 180 cached positions), then three decode tokens of other
    sequences, so that tiles straddle sequences and take them in turns; each workgroup's rows share
    the keys it loads. The same through the row kernel (a workgroup a (head, token)) and attn_flash
    (GPUs: tiles of 32 query rows against tiles of 64 keys; heads of 80 and 256 values, a thread's
    last value vec4s partly or wholly past the head; its rows' keys in one pass, or split into
    chunks of 64-128 keys, relative to each row's first key under a window, merged by attn_merge)."""
    monkeypatch.setattr(gpu, "tile_attention", kernel == "attn_tile")
    monkeypatch.setattr(gpu, "flash_attention", kernel.startswith("attn_flash"))
    monkeypatch.setattr(webgpu, "FL_MIN_GROUPS", 256 if kernel == "attn_flash+chunks" else 1)
    rng = np.random.default_rng(n_head * 1000 + hd)
    page = 16
    tables, gkv, rkv = _filled_caches(gpu, ref, rng, 5, 32, page, n_kv * hd)
    positions = np.array([*range(300), *range(180, 201), 0, 77, 511], np.int32)
    seq_rows = np.array([0] * 300 + [1] * 21 + [2, 3, 4], np.int32)
    slots = tables[seq_rows, positions // page].astype(np.int64) * page + positions % page
    batch = AttentionBatch(positions, seq_rows, tables, slots, page)
    n = len(positions)
    gq, rq = both(gpu, ref, rng.standard_normal((n, n_head * hd)))
    go, ro = gpu.empty((n, n_head * hd)), ref.empty((n, n_head * hd))
    before = len(gpu._step().dispatches)
    gpu.attention(gq, gkv, go, batch, n_head, n_kv, window, 0.125, softcap)
    if kernel.startswith("attn_flash"):
        want = [gpu.kernels.pipeline(f"ops+fl{-(-hd // 64)}", "attn_flash")]
        if kernel.endswith("chunks"):
            want.append(gpu.kernels.pipeline("ops", "attn_merge"))
    else:
        want = [gpu.kernels.pipeline("ops", kernel)]
    assert [d.pipeline for d in gpu._step().dispatches[before:]] == want
    ref.attention(rq, rkv, ro, batch, n_head, n_kv, window, 0.125, softcap)
    np.testing.assert_allclose(gpu.to_numpy(go), ro, atol=1e-4)


def test_flash_tiles_follow_sequences_and_replays(gpu, ref, monkeypatch):
    """attn_flash's tiles each within a sequence (a decode row alone in its tile, not taking turns
    with its neighbours over their keys): a step of two prompts with decode rows before, between and
    after them, recorded, then replayed after the runner's arrays changed in place to another
    layout of as many tokens and sequences (the tile list is the host's, remade on each run); both
    as the reference gives. A sequence whose tokens are not together falls back to tiles from 0."""
    assert webgpu._flash_tiles(np.array([2, 0, 0, 0, 3, 1, 1]), 7, 2, 4 + 4).tolist() == [
        [0, 1], [1, 2], [3, 1], [4, 1], [5, 2], [0, 0], [0, 0], [0, 0]]
    assert webgpu._flash_tiles(np.array([0, 1, 0, 1, 0, 1]), 6, 2, 5).tolist() == [[0, 2], [2, 2], [4, 2], [0, 0], [0, 0]]
    if not gpu.flash_attention:
        monkeypatch.setattr(gpu, "flash_attention", True)
    monkeypatch.setattr(webgpu, "FL_MIN_GROUPS", 1)
    rng = np.random.default_rng(12)
    n_head, n_kv, hd, page = 9, 3, 64, 16
    tables, gkv, rkv = _filled_caches(gpu, ref, rng, 5, 32, page, n_kv * hd)
    layouts = [([2] + [0] * 40 + [3] + [1] * 21 + [4], [300] + list(range(40)) + [77] + list(range(180, 201)) + [511]),
               ([3, 4] + [1] * 30 + [2] + [0] * 31, [12, 200] + list(range(30)) + [450] + list(range(100, 131)))]
    n = len(layouts[0][0])
    positions, seq_rows, slots = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int64)
    batch = AttentionBatch(positions, seq_rows, tables, slots, page)
    gq, rq = both(gpu, ref, rng.standard_normal((n, n_head * hd)))
    go, ro = gpu.empty((n, n_head * hd)), ref.empty((n, n_head * hd))

    def lay(i):
        seq_rows[:], positions[:] = layouts[i]
        slots[:] = tables[seq_rows, positions // page].astype(np.int64) * page + positions % page
        ref.attention(rq, rkv, ro, batch, n_head, n_kv, 0, 0.125, 0.0)

    lay(0)
    with gpu.record() as rec:
        gpu.attention(gq, gkv, go, batch, n_head, n_kv, 0, 0.125, 0.0)
        host = gpu.to_numpy(go)
    assert "attn_flash" in [gpu.kernels.names()[id(d.pipeline)][1] for d in rec.dispatches]
    np.testing.assert_allclose(host, ro, atol=1e-4)
    lay(1)
    gpu.replay(rec)
    np.testing.assert_allclose(host, ro, atol=1e-4)
    # the replay's tile list is layout 1's: a decode row alone in its tile (any tiling covering every
    # token once gives the same values, so the list itself is checked)
    flash = next(d for d in rec.dispatches if gpu.kernels.names()[id(d.pipeline)][1] == "attn_flash")
    tp, at = int(flash.params[12]), int(flash.params[16])
    tiles = -(-n // tp) + len(tables)
    got = rec.host_ints[at:at + 2 * tiles].reshape(tiles, 2)
    assert got.tolist() == webgpu._flash_tiles(seq_rows, n, tp, tiles).tolist() and got[:2].tolist() == [[0, 1], [1, 1]]


def test_recorded_steps_read_new_inputs_on_replay(gpu):
    """A recording replays with the values its host inputs hold then, and fills the same arrays."""
    w, ref = matrix(gpu, T.Q8_0, 40, 64)
    ids = np.array([3, 4], np.int32)
    x, y = gpu.empty((2, 64)), gpu.empty((2, 40))
    with gpu.record() as rec:
        gpu.get_rows(w, ids, x)
        gpu.matmul(w, x, y)
        host = gpu.to_numpy(y)
    close(host, ref[[3, 4]] @ ref.T)
    ids[:] = [39, 0]
    gpu.replay(rec)
    close(host, ref[[39, 0]] @ ref.T)
    assert rec.encode_s > 0 and rec.wait_s > 0
    if "timestamp-query" in gpu.device.features:  # the adapter's time for the step (bench/webgpu.py)
        assert 0 < rec.gpu_time(gpu.device, gpu.wgpu) < 10


@pytest.mark.parametrize("queue", ["native", "wgpu-py"])
def test_queued_replays_and_ids_chosen_on_the_device(gpu, queue, monkeypatch):
    """A step queued without waiting (replay(wait=False)) fills its downloads at wait_mark, after
    a second queued behind it (submitted and read back through wgpu-native's functions, or
    wgpu-py's where those are missing); ids -r - 1 take the first of row r's best ids (on the
    device) that the token's bans lack, as the engine's greedy choice would."""
    from ember.backends.webgpu import _step

    if queue == "wgpu-py":
        monkeypatch.setattr(_step, "native_queue", lambda: None)
    else:
        assert _step.native_queue() is not None
    w, ref = matrix(gpu, T.Q8_0, 40, 64)
    best = gpu.from_numpy(np.array([[5, 7, 9], [11, 3, 2]], np.int32))
    ids = np.array([-2, -1, 4], np.int32)
    bans = np.array([[11, -1, -1], [5, 7, -1], [-1, -1, -1]], np.int32)
    x, y = gpu.empty((3, 64)), gpu.empty((3, 40))
    with gpu.record() as first:
        gpu.get_rows(w, ids, x, prev=best, bans=bans)
        rows = gpu.to_numpy(x)
    close(rows, ref[[3, 9, 4]])
    with gpu.record() as second:
        gpu.matmul(w, x, y)
        products = gpu.to_numpy(y)
    bans[:] = -1
    bans[1, 0] = 5
    gpu.replay(first, wait=False)
    one = gpu.mark()
    gpu.replay(second, wait=False)
    two = gpu.mark()
    gpu.wait_mark(two)
    close(products, ref[[11, 7, 4]] @ ref.T)
    gpu.wait_mark(one)
    close(rows, ref[[11, 7, 4]])
    if queue == "native":  # a step dropped with its results unread: its map's callback still runs safely
        import gc

        gpu.replay(second, wait=False)
        del second
        gc.collect()
        gpu.replay(first)
        gpu.synchronize()
        assert not _step.native_queue()._asked
    with pytest.raises(BackendError, match="out of range"):
        gpu.get_rows(w, np.array([-3], np.int32), x[:1], prev=best, bans=bans[:1])
    with pytest.raises(BackendError, match="bans"):
        gpu.get_rows(w, ids, x, prev=best, bans=bans[:2])


def test_replays_encode_alike_through_the_python_loop(gpu, monkeypatch):
    """Where the native encoding helper is not built, replays loop over wgpu-native's functions in
    Python: the same results."""
    from wgpu.backends.wgpu_native._api import ffi, lib
    from ember.backends.webgpu import _step

    w, ref = matrix(gpu, T.Q4_0, 40, 64)
    ids = np.array([3, 4], np.int32)
    x, y = gpu.empty((2, 64)), gpu.empty((2, 40))
    ops = ("SetPipeline", "SetBindGroup", "DispatchWorkgroups")
    loop = _step._python_encoder(tuple(getattr(lib, f"wgpuComputePassEncoder{op}") for op in ops), ffi.NULL)
    address = _step.native_encoder()[1]
    monkeypatch.setattr(_step, "native_encoder", lambda: (loop, address))
    with gpu.record() as rec:
        gpu.get_rows(w, ids, x)
        gpu.matmul(w, x, y)
        host = gpu.to_numpy(y)
    ids[:] = [39, 0]
    gpu.replay(rec)
    # x is dequantized rows: many values fall on the int8 rounding's ties, which a GPU's inexact
    # 1 / d may tip the other way (one step of x's block in a sum: under 2e-3 of the largest)
    close(host, seen(gpu, T.Q4_0, ref[[39, 0]]) @ ref.T, rel=4e-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("webgpu") / "tiny.gguf", "llama", T.Q4_K, Shape(n_vocab=384),
                       vocab=True, tied=False)


@pytest.mark.parametrize("plan", ["rows", "lanes"], indirect=True)
def test_the_engine_gives_the_cpu_backends_tokens(gpu, tiny, plan):
    """Batched greedy and sampled requests, recorded steps, the device's top_k and decode steps
    queued ahead: the tokens the CPU backend gives, under a CPU adapter's plan and a GPU's
    (matrix-vector lanes, decode attention in chunks of keys)."""
    theirs, _ = run_engine(tiny, get_backend("cpu", threads=1))
    ours, engine = run_engine(tiny, gpu)
    assert ours == theirs and engine.last_error is None
    assert engine.metrics.argmax_steps > 0 and engine.runner._recordings


def test_eight_streams_decode_as_on_the_cpu(gpu, tiny):
    """Eight greedy requests of different lengths batched together (decode steps of 8 rows, so the
    products take their 8-row form): the CPU backend's tokens."""
    from ember.engine import Engine, EngineConfig, Request
    from ember.gguf_loader import GGUFFile
    from ember.models import load_model
    from ember.sampler import SamplingParams
    from ember.tokenizer import Tokenizer
    from test_backend_protocol import events

    results = []
    for backend in (get_backend("cpu", threads=1), gpu):
        with GGUFFile(tiny) as f:
            config = EngineConfig(n_ctx=64, max_seqs=8)
            engine = Engine(load_model(f, backend), Tokenizer.from_metadata(f.metadata), config)
            try:
                greedy = SamplingParams(temperature=0.0, ignore_eos=True)
                results.append(events([engine.submit(Request([1, *range(20 + i, 24 + 2 * i)], 6, greedy))
                                       for i in range(8)]))
            finally:
                engine.close()
    assert results[0] == results[1]


def test_padded_decode_steps_give_the_cpu_backends_tokens(gpu, tiny, monkeypatch):
    """A GPU adapter pads decode steps (12 decoding sequences run as a step of 16, the extra 4 at
    the pad page): the tokens are the CPU backend's unpadded ones, and the padded shape is recorded
    once (a recording for each of the decode-ahead steps' two parities) and replayed. Forced here
    on the adapter the tests run on (a CPU adapter runs each count as it is)."""
    import random
    from dataclasses import replace

    from ember.engine import Engine, EngineConfig, Request
    from ember.gguf_loader import GGUFFile
    from ember.models import load_model
    from ember.sampler import SamplingParams
    from ember.tokenizer import Tokenizer
    from test_backend_protocol import events

    monkeypatch.setattr(gpu, "capabilities", replace(gpu.capabilities, pad_decode_steps=True))
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(2, 12))] for _ in range(12)]
    results, seen = [], []
    for backend in (get_backend("cpu", threads=1), gpu):
        with GGUFFile(tiny) as f:
            engine = Engine(load_model(f, backend), Tokenizer.from_metadata(f.metadata),
                            EngineConfig(n_ctx=64, max_seqs=16, prefix_cache=False))
            try:
                runner = engine.runner
                real_run = runner._run

                def spy(step, key, wait, first_sight=False):
                    seen.append((backend is gpu, step.n, key in runner._recordings))
                    return real_run(step, key, wait, first_sight)

                runner._run = spy
                assert (runner.pad_page is not None) == (backend is gpu)
                greedy = SamplingParams(temperature=0.0, ignore_eos=True)
                results.append(events([engine.submit(Request(p, 8, greedy)) for p in prompts]))
            finally:
                engine.close()
    assert results[0] == results[1]
    padded = [hit for on_gpu, n, hit in seen if on_gpu and n == 16]
    # recorded at its first steps (the plain step, and an ahead step of each parity), replayed after
    assert len(padded) >= 6 and not padded[0] and all(padded[3:])
    assert all(n <= 8 or n == 16 for on_gpu, n, _ in seen if on_gpu and n <= 16)


def test_prefix_cache_copies_pages_on_the_device(gpu, tiny):
    """Requests sharing a prompt share its pages (copy on write of the last one on the device)."""
    from ember.engine import Engine, EngineConfig, Request
    from ember.gguf_loader import GGUFFile
    from ember.models import load_model
    from ember.sampler import SamplingParams
    from ember.tokenizer import Tokenizer
    from test_backend_protocol import events

    prompt = [1, *range(10, 30)]
    results = []
    for backend in (get_backend("cpu", threads=1), gpu):
        with GGUFFile(tiny) as f:
            engine = Engine(load_model(f, backend), Tokenizer.from_metadata(f.metadata),
                            EngineConfig(n_ctx=64, max_seqs=4, page_size=8))
            try:
                first = events([engine.submit(Request(prompt, 4, SamplingParams.greedy_params()))])
                greedy = SamplingParams.greedy_params()
                rest = events([engine.submit(Request(prompt + [i], 4, greedy)) for i in (40, 41)])
                results.append((first, rest, engine.metrics.prompt_tokens_cached))
            finally:
                engine.close()
    assert results[0][:2] == results[1][:2] and results[1][2] > 0


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_real_models_match_llama_cpp(gpu, model_path, name):
    """llama.cpp's golden data (first case): the greedy tokens up to its first near-tie (at most 4),
    and the teacher-forced log-probabilities of 6 steps within test_golden's per-step bound."""
    from ember.engine import LLM
    from ember.sampler import SamplingParams

    from ember.hub import FetchError, ModelNotFound

    try:
        path = model_path(name)
    except (FetchError, ModelNotFound) as e:  # a GPU machine without network or the model cache
        pytest.skip(f"{name} is not here: {e}")
    case = golden(name, "greedy")["cases"][0]
    upto = min(4, next((i for i, s in enumerate(case["steps"]) if s["top"][0][1] - s["top"][1][1] < 0.3), 4))
    llm = LLM(path, device="webgpu", ctx=256)
    try:
        out = llm.generate(case["prompt_ids"], max_tokens=upto, sampling=SamplingParams.greedy_params())
        scores = llm.score(case["prompt_ids"] + case["completion_ids"][:6], top=1)
    finally:
        llm.close()
    assert out.token_ids[:upto] == case["completion_ids"][:upto]
    theirs = np.array([s["logprob"] for s in case["steps"][:6]])
    err = np.abs(scores.logprobs[len(case["prompt_ids"]) - 1:] - theirs)
    assert err.max() <= 0.3 and err.mean() <= 0.1, err


def test_auto_never_takes_a_software_adapter(gpu):
    """lavapipe (a CPU adapter) is taken only when asked for: auto prefers the CPU backend to it."""
    from ember.backends.webgpu import _device

    if any(_device.is_discrete(a) for a in _device.adapters()):
        pytest.skip("this machine has a discrete GPU: auto may take it")
    assert get_backend("auto", threads=1).name == "cpu"
    for bad, says in (("webgpu:x", "expected webgpu or webgpu:N"), ("webgpu:99", "does not exist")):
        with pytest.raises(BackendError, match=says):
            get_backend(bad)


SLOW = pytest.mark.slow
FAMILY_CASES = ["gemma2", "mistral3", *(pytest.param(n, marks=SLOW) for n in
                                     ("granite", "olmo2", "phi3", "qwen2", "qwen3", "smollm3"))]


@pytest.mark.parametrize("plan", ["rows", "lanes"], indirect=True)
@pytest.mark.parametrize("name", FAMILY_CASES)
def test_families_follow_the_float64_reference(gpu, ref, tmp_path, name, plan, monkeypatch):
    """Prefill of two sequences together then decode over a shuffled paged cache (test_models'
    script), each family's Q4_K_M-style mix (gemma2: both soft-caps and a window; mistral3: YaRN and
    the attention temperature; qwen2: biases), held to the CPU and CUDA backends' bounds
    (test_families.assert_follows_reference: each row's KL divergence from float64 and the argmax).
    On GPUs the prompt tiles take x rounded to 8 bits in blocks of 32 (mmq) as llama.cpp's do, and
    some of these random positions are ill-conditioned: qwen2's second prompt row moves 0.35 nats
    under that rounding (the f32 tiles on x rounded beforehand give the same logits), so there one
    row in ten may move (rows_move)."""
    from families import write_family
    from ember.backends.webgpu import INT8_MIN_K
    from test_families import assert_follows_reference

    monkeypatch.setattr(gpu, "int8_min_k", INT8_MIN_K)  # as served
    assert_follows_reference(gpu, ref, write_family(tmp_path / f"{name}.gguf", name), f16=False,
                             rows_move=not gpu.row_products)
