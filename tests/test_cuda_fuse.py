"""The CUDA backend's fusion pass and launch building, without a GPU: they work on op records and
array addresses only, so arrays here are address ranges (the pass never touches their contents),
and launches are checked against the kernels' parameter lists in the CUDA sources."""
from __future__ import annotations

import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ember.backends.base import Weight
from ember.backends.cuda._fuse import fuse
from ember.backends.cuda.ops import (
    MODE_GELU,
    MODE_RESIDUAL,
    MODE_SILU,
    Add,
    Attention,
    GatedAct,
    GatherRows,
    GetRows,
    KvStore,
    Matmul,
    NormAdd,
    QkvPost,
    RmsNorm,
    Rope,
    RopeArgs,
    SplitScratch,
    xq_bytes,
)
from ember.quant import GGMLType

KERNELS = Path(__file__).resolve().parents[1] / "ember" / "backends" / "cuda" / "kernels"


class Addr:
    """A device array as the fusion pass sees it: an address range with a shape."""

    _next = 1 << 20

    def __init__(self, *shape, dtype=np.float32, at: int | None = None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = math.prod(shape)
        self.nbytes = self.size * self.dtype.itemsize
        if at is None:
            at, Addr._next = Addr._next, -(-(Addr._next + self.nbytes + 4096) // 256) * 256  # aligned as CuPy's
        self.data = type("Ptr", (), {"ptr": at})()

    def rows(self, n: int) -> Addr:
        """The first n rows (same address), as the model's buffers hand out per step."""
        return Addr(n, *self.shape[1:], dtype=self.dtype, at=self.data.ptr)


def counter() -> Addr:
    return Addr(1, dtype=np.uint32)


def mat(rows: int, cols: int, qtype=GGMLType.Q4_K) -> Weight:
    buf = type("Matrix", (), {"buf": Addr(rows * cols), "row_bytes": cols})()
    return Weight("w", qtype, (rows, cols), buf)


SPLIT = {}  # the backend's mm_split buffers, when a test turns the path on


def matmul(ws: list, x: Addr, outs: list) -> Matmul:
    """A product as the backend records it: with its quantized-activation buffer on the decode path,
    and mm_split's buffers for 9..64 rows where SPLIT holds them."""
    n, k = x.shape
    split = dict(SPLIT, mv_rows=8) if SPLIT and n > 8 else {}
    return Matmul(ws, x, outs, xq=Addr(xq_bytes(n, k), dtype=np.uint8) if n <= 8 else None, **split)


@pytest.fixture
def split_path(monkeypatch):
    from ember.backends.cuda.ops.matmul import MS_COUNTERS, MS_PART_FLOATS

    monkeypatch.setattr(sys.modules[__name__], "SPLIT", dict(
        split_buf=SplitScratch(Addr(MS_PART_FLOATS), Addr(MS_COUNTERS, dtype=np.uint32))))


ROPE = RopeArgs(64, False, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0, None)


def llama_layer(n: int, x: Addr, h: Addr, d=256, ff=512, heads=4, kv_heads=2, hd=64, single=False, qkv=None):
    """The op records of one llama layer (what the backend records for LlamaModel.forward); single:
    a step of one token per sequence; qkv: the q, k, v buffers (the model's, shared by layers)."""
    q, k, v = qkv or (Addr(n, heads * hd), Addr(n, kv_heads * hd), Addr(n, kv_heads * hd))
    att = Addr(n, heads * hd)
    g, u = Addr(n, ff), Addr(n, ff)
    kc, vc = Addr(64, kv_heads * hd, dtype=np.float16), Addr(64, kv_heads * hd, dtype=np.float16)
    pos, slots, rows, tables = Addr(n, dtype=np.int32), Addr(n, dtype=np.int64), Addr(n, dtype=np.int32), Addr(1, 16)
    attn_norm, ffn_norm = Addr(d), Addr(d)
    ops = [
        RmsNorm(x, attn_norm, 1e-5, h, d),
        matmul([mat(heads * hd, d), mat(kv_heads * hd, d), mat(kv_heads * hd, d)], h, [q, k, v]),
        Rope(q, heads, pos, ROPE),
        Rope(k, kv_heads, pos, ROPE),
        KvStore(k, v, kc, vc, slots),
        Attention(q, kc, vc, att, None, pos, rows, tables, 16, heads, kv_heads, 0, 0.125, 0.0, 1,
                  one_token_per_seq=single),
        matmul([mat(d, heads * hd)], att, [h]),
        Add(x, h, x),
        RmsNorm(x, ffn_norm, 1e-5, h, d),
        matmul([mat(ff, d), mat(ff, d)], h, [g, u]),
        GatedAct("silu", g, u, g),
        matmul([mat(d, ff)], g, [h]),
        Add(x, h, x),
    ]
    return ops, {"g": g, "attn_norm": attn_norm, "ffn_norm": ffn_norm, "q": q, "k": k, "v": v, "kc": kc, "vc": vc,
                 "slots": slots, "pos": pos, "att": att}


def test_llama_layers_by_default_normalise_in_quant_x_launches():
    """A llama layer's norms are quant_x launches of the products reading them (a tail doing
    them measured slower); the other hand-overs (attention, gated product) stay."""
    x, h = Addr(1, 256), Addr(1, 256)
    ops1, a1 = llama_layer(1, x, h)
    ops2, a2 = llama_layer(1, x, h)
    fused = fuse(ops1 + ops2, counter)
    assert [type(op) for op in fused] == [Matmul, QkvPost, Attention, Matmul, Matmul, Matmul] * 2
    assert all(op.tail is None for op in fused if isinstance(op, Matmul))
    _, _, attn, wo, ffn, down = fused[:6]
    assert attn.xq is wo.xq and not wo.quant_in and wo.mode == MODE_RESIDUAL
    assert ffn.norm_w is a1["ffn_norm"] and ffn.quant_in and ffn.act_q is down.xq and not down.quant_in
    assert fused[6].norm_w is a2["attn_norm"] and fused[6].quant_in


def test_without_counters_no_tails_form():
    x, h = Addr(1, 256), Addr(1, 256)
    ops, _ = llama_layer(1, x, h)
    fused = fuse(ops)
    assert [type(op) for op in fused] == [Matmul, QkvPost, Attention, Matmul, Matmul, Matmul]
    assert fused[3].tail is None and fused[4].norm_w is not None and fused[4].quant_in


def test_prefill_products_stay_unfused():
    x, h = Addr(65, 256), Addr(65, 256)
    ops, _ = llama_layer(65, x, h)  # tensor-core path (more than 64 rows): only the row ops fuse
    fused = fuse(ops, counter)
    assert [type(op) for op in fused] == [RmsNorm, Matmul, QkvPost, Attention, Matmul, Add, RmsNorm, Matmul,
                                          GatedAct, Matmul, Add]
    assert all(op.norm_w is None and op.mode == 0 and op.tail is None for op in fused if isinstance(op, Matmul))


def test_batched_decode_products_fuse_their_epilogues(split_path):
    """9..64 rows of quantized weights (mm_split): the residual adds and the gate go into the
    products' epilogues; norms stay launches of their own (the products read x as f32)."""
    x, h = Addr(40, 256), Addr(40, 256)
    ops, a = llama_layer(40, x, h)
    fused = fuse(ops, counter)
    assert [type(op) for op in fused] == [RmsNorm, Matmul, QkvPost, Attention, Matmul, RmsNorm, Matmul, Matmul]
    qkv, wo, ffn, down = (op for op in fused if isinstance(op, Matmul))
    assert all(op.split() and not op.matvec() for op in (qkv, wo, ffn, down))
    assert qkv.mode == 0 and wo.mode == MODE_RESIDUAL and wo.aux is x and down.mode == MODE_RESIDUAL
    assert ffn.mode == MODE_SILU and ffn.aux is a["g"] and ffn.act_q is None and down.quant_in
    launches = [launch for op in fused for launch in op.launches(FakeKernels())]
    splits = [launch for launch in launches if launch.fn[1] == "mm_split"]
    assert len(splits) == 4 and all(launch.block == (256, 1, 1) for launch in splits)
    assert splits[0].grid[2] == 3 and splits[2].grid[2] == 2  # q, k, v; gate and up
    for launch in splits:
        assert [arg.dtype for arg in launch.args] == [param_dtype(p) for p in kernel_params("mm_split")]


def test_batched_gate_needs_room_for_partial_sums(split_path):
    """A gate whose partial sums would not fit the shared buffer leaves the product on mm_tile,
    unfused; so do products of many row tiles."""
    n, ff = 64, 4000
    x, g, u = Addr(n, 256), Addr(n, ff), Addr(n, ff)
    ops = [matmul([mat(ff, 256), mat(ff, 256)], x, [g, u]), GatedAct("silu", g, u, g)]
    assert ops[0].split()
    assert [type(op) for op in fuse(ops, counter)] == [Matmul]
    need = replace(ops[0], mode=MODE_SILU)._split_geometry([0, 1])[3]
    assert need == 2 * n * 63 * 64  # gate and up sums of 63 row tiles, one split
    part = Addr(need - 1)  # one float short
    ops[0] = replace(ops[0], split_buf=replace(ops[0].split_buf, part=part))
    assert ops[0].split()
    assert [type(op) for op in fuse(ops, counter)] == [Matmul, GatedAct]
    assert not replace(ops[0], ws=[mat(33 * 64 * 4, 256)] * 2).split()  # 264 row tiles: mm_tile


def gemma_layer(n: int, x: Addr, d=256, ff=512, hd=64, single=False):
    h, q, k, v, att = Addr(n, d), Addr(n, 4 * hd), Addr(n, hd), Addr(n, hd), Addr(n, 4 * hd)
    g, u = Addr(n, ff), Addr(n, ff)
    kc, vc, pos, slots = Addr(64, hd), Addr(64, hd), Addr(n, dtype=np.int32), Addr(n, dtype=np.int64)
    post_attn, ffn_norm, post_ffn = Addr(d), Addr(d), Addr(d)
    ops = [
        RmsNorm(x, Addr(d), 1e-6, h, d),
        matmul([mat(4 * hd, d), mat(hd, d, GGMLType.Q6_K), mat(hd, d)], h, [q, k, v]),
        RmsNorm(q, Addr(hd), 1e-6, q, hd),
        RmsNorm(k, Addr(hd), 1e-6, k, hd),
        Rope(q, 4, pos, ROPE),
        Rope(k, 1, pos, ROPE),
        KvStore(k, v, kc, vc, slots),
        Attention(q, kc, vc, att, None, pos, pos, Addr(1, 8), 16, 4, 1, 512, 0.125, 0.0, 1, one_token_per_seq=single),
        matmul([mat(d, 4 * hd)], att, [h]),
        RmsNorm(h, post_attn, 1e-6, h, d),
        Add(x, h, x),
        RmsNorm(x, ffn_norm, 1e-6, h, d),
        matmul([mat(ff, d), mat(ff, d)], h, [g, u]),
        GatedAct("gelu", g, u, g),
        matmul([mat(d, ff)], g, [h]),
        RmsNorm(h, post_ffn, 1e-6, h, d),
        Add(x, h, x),
    ]
    return ops, {"h": h, "post_attn": post_attn, "ffn_norm": ffn_norm, "post_ffn": post_ffn, "q_norm": ops[2].w,
                 "k_norm": ops[3].w}


def test_gemma_layer():
    x = Addr(2, 256)
    ops, a = gemma_layer(2, x)
    fused = fuse(ops, counter)
    assert [type(op) for op in fused] == [Matmul, QkvPost, Attention, Matmul, Matmul, Matmul]
    qkv, post, attn, wo, ffn, down = fused
    assert post.q_norm is not None and post.k_norm is not None
    assert len(qkv.groups()) == 2  # Q4_K and Q6_K: two launches sharing one quant_x
    assert attn.xq is wo.xq
    # o: only stored; the feed-forward product's blocks normalise it, add it into x and normalise x
    # (a residual prologue: its last block through the prologue writes x and h back)
    assert wo.mode == 0 and wo.tail is None
    pro = ffn.pro_res
    assert pro.y is a["h"] and pro.post_w is a["post_attn"] and ffn.src is x and ffn.x is a["h"]
    assert ffn.norm_w is a["ffn_norm"] and pro.yout is None and pro.counter is not None and ffn.in_prologue()
    assert ffn.mode == MODE_GELU and ffn.act_q is down.xq
    # down: its tail does the post-norm and the residual add (no product follows it here)
    assert down.tail.add and down.tail.post_w is a["post_ffn"] and down.tail.pre_w is None


def test_post_norm_stays_a_tail_where_the_next_product_cannot_take_it():
    """Two layers: the second layer's q/k/v products are of two types (two launches): no
    prologue, so the first layer's down product keeps its tail, which also does the next norm;
    and rows too long for the residual prologue's shared memory keep the tail too."""
    x = Addr(1, 256)
    layer1, a1 = gemma_layer(1, x)
    layer2, a2 = gemma_layer(1, x)
    fused = fuse(layer1 + layer2, counter)
    down1, qkv2 = fused[5], fused[6]
    assert down1.tail.add and down1.tail.pre_w is not None and down1.tail.pre_q is qkv2.xq and qkv2.pro_res is None
    wide = Addr(8, 1024)
    ops, a = gemma_layer(8, wide, d=1024)
    wo, ffn = fuse(ops, counter)[3:5]
    assert wo.tail is not None and wo.tail.pre_w is a["ffn_norm"] and ffn.pro_res is None


def test_gemma_without_counters_keeps_norm_add():
    fused = fuse(gemma_layer(1, Addr(1, 256))[0])
    assert [type(op) for op in fused] == [Matmul, QkvPost, Attention, Matmul, NormAdd, Matmul, Matmul, NormAdd]


def test_in_place_norm_feeds_a_product():
    x = Addr(1, 256)
    w = Addr(256)
    fused = fuse([RmsNorm(x, w, 1e-5, x, 256), matmul([mat(320, 256)], x, [Addr(1, 320)])], counter)
    assert [type(op) for op in fused] == [Matmul]
    assert fused[0].src is x and fused[0].x is x and fused[0].norm_w is w


def test_gathered_rows_normalised_in_place_feed_the_head():
    x, g, idx, out = Addr(3, 256), Addr(2, 256), Addr(2, dtype=np.int32), Addr(2, 1000)
    ops = [GatherRows(x, idx, g), RmsNorm(g, Addr(256), 1e-5, g, 256), matmul([mat(1000, 256)], g, [out])]
    fused = fuse(ops, counter)
    assert [type(op) for op in fused] == [Matmul]
    assert fused[0].src is x and fused[0].idx is idx and fused[0].x is g


@pytest.mark.parametrize("case", ["residual_is_input", "add_of_other_arrays", "partial_view"])
def test_residual_fusion_needs_disjoint_arrays(case):
    x, h, other = Addr(1, 256), Addr(1, 256), Addr(1, 256)
    if case == "residual_is_input":
        ops = [matmul([mat(256, 256)], x, [h]), Add(x, h, x)]
    elif case == "add_of_other_arrays":
        ops = [matmul([mat(256, 256)], x, [h]), Add(other, x, other)]
    else:  # the add reads a different view of h's memory
        big = Addr(2, 256, at=h.data.ptr)
        ops = [matmul([mat(256, 256)], x, [h]), Add(other, big.rows(1), other)]
        assert [type(op) for op in fuse(ops, counter)] == [Matmul]  # same address and shape: still h
        return
    assert [type(op) for op in fuse(ops, counter)] == [Matmul, Add]


def test_mixed_type_gate_and_up_stay_apart():
    x, g, u = Addr(1, 256), Addr(1, 512), Addr(1, 512)
    ops = [matmul([mat(512, 256), mat(512, 256, GGMLType.Q6_K)], x, [g, u]), GatedAct("silu", g, u, g)]
    assert [type(op) for op in fuse(ops, counter)] == [Matmul, GatedAct]


def test_activation_quantizing_needs_whole_blocks_of_rows():
    x, g, u, h = Addr(1, 256), Addr(1, 496), Addr(1, 496), Addr(1, 256)
    ops = [matmul([mat(496, 256), mat(496, 256)], x, [g, u]), GatedAct("silu", g, u, g),
           matmul([mat(256, 496, GGMLType.Q8_0)], g, [h])]
    fused = fuse(ops, counter)
    assert fused[0].mode == MODE_SILU and fused[0].act_q is None and fused[1].quant_in  # 496 % 32 != 0


def test_float_product_reads_the_tail_output_unquantized():
    """A post-norm tail before a float product (no residual prologue: it normalises nothing
    itself) also does that product's norm, into h alone."""
    x, h, h2, y = Addr(1, 256), Addr(1, 256), Addr(1, 256), Addr(1, 64)
    ops = [matmul([mat(256, 256)], Addr(1, 256), [h]), RmsNorm(h, Addr(256), 1e-6, h, 256), Add(x, h, x),
           RmsNorm(x, Addr(256), 1e-5, h2, 256), matmul([mat(64, 256, GGMLType.F16)], h2, [y])]
    fused = fuse(ops, counter)
    assert [type(op) for op in fused] == [Matmul, Matmul]
    assert fused[0].tail.add and fused[0].tail.pre_h is h2 and fused[0].tail.pre_q is None
    assert not fused[1].quant_in and fused[1].norm_w is None


def test_rope_with_different_positions_is_not_fused():
    q, k, v = Addr(3, 256), Addr(3, 128), Addr(3, 128)
    p1, p2 = Addr(3, dtype=np.int32), Addr(3, dtype=np.int32)
    ops = [Rope(q, 4, p1, ROPE), Rope(k, 2, p2, ROPE), KvStore(k, v, Addr(64, 128), Addr(64, 128), Addr(3))]
    assert [type(op) for op in fuse(ops, counter)] == [Rope, Rope, KvStore]


# ---- qkv_post folded into the attention (decode steps) ----

def test_decode_attention_does_the_qkv_post_work():
    """One token per sequence: the attention launch normalises, rotates and stores k and v itself;
    the model's q, k, v buffers, shared by the layers, are overwritten by the next layer's product."""
    x, h = Addr(1, 256), Addr(1, 256)
    qkv = (Addr(1, 256), Addr(1, 128), Addr(1, 128))
    ops1, a1 = llama_layer(1, x, h, single=True, qkv=qkv)
    ops2, _ = llama_layer(1, x, h, single=True, qkv=qkv)
    fused = fuse(ops1 + ops2, counter)
    assert [type(op) for op in fused] == [Matmul, Attention, Matmul, Matmul, Matmul] * 2
    _, attn, wo, _, _ = fused[:5]
    post = attn.post
    assert post.q is a1["q"] and post.k is a1["k"] and post.v is a1["v"] and post.slots is a1["slots"]
    assert post.k_cache is a1["kc"] and post.v_cache is a1["vc"] and post.pos is a1["pos"] and post.q_norm is None
    assert attn.xq is wo.xq and not wo.quant_in  # the output is still quantized for the o product
    assert fused[6].post is not None and fused[6].post.k_cache is not a1["kc"]


def test_gemma_decode_attention_does_the_head_norms():
    ops, a = gemma_layer(3, Addr(3, 256), single=True)
    fused = fuse(ops, counter)
    assert [type(op) for op in fused] == [Matmul, Attention, Matmul, Matmul, Matmul]
    post = fused[1].post
    assert post.q_norm is a["q_norm"] and post.k_norm is a["k_norm"] and post.eps == 1e-6 and post.n_kv == 1
    assert fused[1].window == 512 and fused[1].xq is fused[2].xq


def test_qkv_post_stays_apart_for_several_tokens_per_sequence():
    x, h = Addr(3, 256), Addr(3, 256)
    ops, _ = llama_layer(3, x, h, single=False)
    fused = fuse(ops, counter)
    assert [type(op) for op in fused] == [Matmul, QkvPost, Attention, Matmul, Matmul, Matmul]
    assert fused[2].post is None


def test_qkv_post_stays_apart_for_other_value_head_sizes():
    """hd_v != hd_k: keys of 64 values a head, values of 32 (the folded form needs them equal)."""
    n = 1
    q, k, v, att = Addr(n, 256), Addr(n, 128), Addr(n, 64), Addr(n, 128)
    kc, vc = Addr(64, 128, dtype=np.float16), Addr(64, 64, dtype=np.float16)
    pos, slots = Addr(n, dtype=np.int32), Addr(n, dtype=np.int64)
    ops = [Rope(q, 4, pos, ROPE), Rope(k, 2, pos, ROPE), KvStore(k, v, kc, vc, slots),
           Attention(q, kc, vc, att, None, pos, Addr(n, dtype=np.int32), Addr(1, 16), 16, 4, 2, 0, 0.125, 0.0, 1,
                     one_token_per_seq=True)]
    assert [type(op) for op in fuse(ops, counter)] == [QkvPost, Attention]
    vc_same = Addr(64, 128, dtype=np.float16)  # the same step with values of 64: folded
    ops[2:] = [KvStore(k, Addr(n, 128), kc, vc_same, slots), replace(ops[3], v_cache=vc_same)]
    assert [type(op) for op in fuse(ops, counter)] == [Attention]


def test_qkv_post_stays_apart_when_q_or_k_is_read_later():
    """The folded form leaves q and k unrotated: a later op reading either keeps the QkvPost."""
    for reader in ("q", "k"):
        x, h = Addr(1, 256), Addr(1, 256)
        ops, a = llama_layer(1, x, h, single=True)
        other = Addr(*a[reader].shape)
        fused = fuse(ops + [Add(a[reader], other, other)], counter)
        assert QkvPost in [type(op) for op in fused], reader


# ---- launches against the kernels' parameter lists ----

class FakeKernels:
    """Stands in for compiled modules: a launch's function is (module, name)."""

    max_smem = 0

    def fn(self, module: str, name: str):
        return (module, name)


def strip_comments(src: str) -> str:
    return re.sub(r"//[^\n]*", "", src)


def kernel_params(name: str) -> list[str]:
    """Parameters of kernel `name` as written in the sources (the *_PARAMS macros expanded)."""
    src = strip_comments("".join(p.read_text() for p in sorted(KERNELS.glob("*.c*"))))
    macros = {m.group(1): m.group(2).replace("\\\n", " ")
              for m in re.finditer(r"#define (\w+_PARAMS)((?:[^\n]*\\\n)*[^\n]*)", src)}
    m = re.search(r"extern \"C\" __global__ void(?: __cluster_dims__\([\w, ]+\))?(?: __launch_bounds__\([\w, *]+\))?\s+" + name + r"\(([^)]*)\)", src)
    assert m, f"kernel {name} not found"
    params = m.group(1)
    for macro, text in macros.items():
        params = params.replace(macro, text)
    return [" ".join(p.split()) for p in params.split(",") if p.strip()]


def param_count(name: str) -> int:
    return len(kernel_params(name))


def param_type(param: str) -> str:
    """A parameter's C type without its name ("const float *__restrict__ q" -> "const float *")."""
    return re.sub(r"\s*\b\w+$", "", param.replace("__restrict__", "")).strip()


def param_dtype(param: str) -> np.dtype:
    """The numpy scalar type a launch must pass for a parameter (its width is the C type's)."""
    t = param_type(param)
    if "*" in t:
        return np.dtype(np.uint64)
    return np.dtype({"int": np.int32, "i32": np.int32, "unsigned": np.uint32, "u32": np.uint32, "float": np.float32,
                     "i64": np.int64, "long long": np.int64}[t.replace("const ", "")])


def test_launch_arguments_match_the_kernels():
    x, h = Addr(2, 256), Addr(2, 256)
    ops1, _ = llama_layer(2, x, h)
    ops2, _ = llama_layer(2, x, h)
    gem, _ = gemma_layer(2, Addr(2, 256))
    head = [GatherRows(x, Addr(1, dtype=np.int32), Addr(1, 256).rows(1)),
            GetRows(mat(512, 256), Addr(2, dtype=np.int32), Addr(2, 256)),
            GetRows(mat(512, 256), Addr(2, dtype=np.int32), Addr(2, 256), Addr(4, 3, dtype=np.int32), 3,
                    Addr(2, 3, dtype=np.int32))]
    folded = fuse(llama_layer(2, x, h, single=True)[0] + gemma_layer(2, Addr(2, 256), single=True)[0], counter)
    assert sum(isinstance(op, Attention) and op.post is not None for op in folded) == 2
    seen = set()
    for op in fuse(ops1 + ops2, counter) + fuse(gem, counter) + ops1 + head + folded:
        for launch in op.launches(FakeKernels()):
            _, name = launch.fn
            seen.add(name)
            # each argument as wide as its C parameter (the driver reads the sizes the kernel declares)
            assert [a.dtype for a in launch.args] == [param_dtype(p) for p in kernel_params(name)], name
            assert len(launch.grid) == 3 and len(launch.block) == 3
    split = Attention(Addr(1, 256), Addr(64, 128), Addr(64, 128), Addr(1, 256), Addr(1, 4, 4, 66), Addr(1), Addr(1),
                      Addr(1, 4), 16, 4, 2, 0, 0.125, 0.0, 4, xq=Addr(xq_bytes(1, 256), dtype=np.uint8))
    post = folded[1].post
    many = replace(split, part=Addr(1, 4, 20, 66), n_split=20)  # merged by attn_combine32
    merged = replace(split, counters=Addr(8, dtype=np.uint32))  # merged by attn's last split block
    for op in (split, many, merged,
               replace(split, post=replace(post, q=split.q, k_cache=split.k_cache, v_cache=split.v_cache))):
        for launch in op.launches(FakeKernels()):
            seen.add(launch.fn[1])
            assert [a.dtype for a in launch.args] == [param_dtype(p) for p in kernel_params(launch.fn[1])]
    assert {"mv_n2", "quant_x", "attn", "attn_combine", "attn_combine32", "qkv_post", "gather_rows", "rms_norm",
            "rope", "get_rows"} <= seen


def param_name(param: str) -> str:
    return param.split()[-1].lstrip("*")


def test_folded_attention_passes_its_inputs_by_name():
    """The attn launch's arguments, named by the kernel's parameters: the QkvPost's inputs in the
    folded form, null pointers (the unfolded kernel) otherwise."""
    ops, a = gemma_layer(1, Addr(1, 256), single=True)
    attn = fuse(ops, counter)[1]
    p = attn.post
    names = [param_name(q) for q in kernel_params("attn")]
    (launch,) = attn.launches(FakeKernels())
    args = dict(zip(names, launch.args))
    assert len(names) == len(launch.args) == len(args)
    want = {"q": p.q, "k_cache": p.k_cache, "v_cache": p.v_cache, "k_new": p.k, "v_new": p.v,
            "q_norm": a["q_norm"], "k_norm": a["k_norm"], "slots": p.slots, "pos": p.pos}
    assert {k: int(args[k]) for k in want} == {k: v.data.ptr for k, v in want.items()}
    assert args["eps"] == np.float32(1e-6) and args["n_rot"] == 64 and args["neox"] == 0 and args["base"] == 10000.0
    assert args["freq_scale"] == 1.0 and args["mscale"] == 1.0 and args["scale"] == np.float32(0.125)
    (launch,) = replace(attn, post=None).launches(FakeKernels())
    args = dict(zip(names, launch.args))
    assert all(int(args[k]) == 0 for k in ("k_new", "v_new", "q_norm", "k_norm", "slots", "freq_factors"))


def test_attention_with_counters_merges_its_own_splits():
    """Split decode attention given counters is one attn launch that writes (and quantizes) the
    output itself; without counters, or with one split, attn_combine and the plain form."""
    names = [param_name(q) for q in kernel_params("attn")]
    xq, counters = Addr(xq_bytes(1, 256), dtype=np.uint8), Addr(8, dtype=np.uint32)
    split = Attention(Addr(1, 256), Addr(64, 128), Addr(64, 128), Addr(1, 256), Addr(1, 4, 4, 66), Addr(1), Addr(1),
                      Addr(1, 4), 16, 4, 2, 0, 0.125, 0.0, 4, xq=xq, heads_per_block=1)
    (launch,) = replace(split, counters=counters).launches(FakeKernels())
    args = dict(zip(names, launch.args))
    assert launch.fn == ("attention", "attn") and launch.grid == (4, 4, 1)
    assert int(args["counters"]) == counters.data.ptr and int(args["xq"]) == xq.data.ptr
    assert int(args["part"]) == split.part.data.ptr and args["n_split"] == 4
    attn, combine = split.launches(FakeKernels())
    assert combine.fn == ("attention", "attn_combine") and int(dict(zip(names, attn.args))["counters"]) == 0
    assert int(dict(zip(names, attn.args))["xq"]) == 0  # the combine quantizes
    (single,) = replace(split, n_split=1, part=None, counters=counters).launches(FakeKernels())
    assert int(dict(zip(names, single.args))["counters"]) == 0
    with pytest.raises(AssertionError, match="counter per"):
        replace(split, counters=Addr(3, dtype=np.uint32)).launches(FakeKernels())


def test_products_widen_mixed_types_q8_0_holds():
    """Q5_0 / Q4_0 beside Q8_0 (Gemma 3 270M's queries, keys and values) take Q8_0 copies while
    those add at most 1 MiB to read; one type, types Q8_0 cannot hold exactly (Q4_1, K-quants),
    or larger matrices keep a launch per type."""
    from ember.backends.cuda import widens

    def w(qtype, rows, cols=640):
        return Weight("w", qtype, (rows, cols), None)

    gemma = [w(GGMLType.Q5_0, 1024), w(GGMLType.Q5_0, 256), w(GGMLType.Q8_0, 256)]
    assert widens(gemma)  # 1280 rows x 240 more bytes
    assert widens([w(GGMLType.Q4_0, 512), w(GGMLType.Q8_0, 512)])
    assert not widens([w(GGMLType.Q5_0, 1024), w(GGMLType.Q5_0, 256)])  # one type already
    assert not widens([w(GGMLType.Q4_1, 1024), w(GGMLType.Q8_0, 256)])
    assert not widens([w(GGMLType.Q4_K, 1024, 2048), w(GGMLType.Q8_0, 256, 2048)])
    assert not widens([w(GGMLType.Q4_0, 4096, 4096), w(GGMLType.Q8_0, 1024, 4096)])  # 8.4 MB more


def test_attention_cluster_size_follows_the_split_size():
    """8 blocks where they cover 256 positions in splits of the minimum size (heads of 64 values:
    32 keys a split), else 16 (heads of 256: 8 keys)."""
    from ember.backends.cuda.ops.attention import att_cluster_size, att_min_keys

    assert att_cluster_size(att_min_keys(64)) == 8
    assert att_cluster_size(att_min_keys(128)) == att_cluster_size(att_min_keys(256)) == 16


@pytest.mark.parametrize("cluster", [8, 16])
def test_attention_in_clusters_takes_whole_clusters_of_splits(cluster):
    """Merged splits with a cluster size launch attn_cluster<size> (same arguments as attn) over
    whole clusters of splits; without counters the cluster size is unused."""
    assert kernel_params(f"attn_cluster{cluster}") == kernel_params("attn")
    counters = Addr(8, dtype=np.uint32)
    split = Attention(Addr(1, 256), Addr(64, 128), Addr(64, 128), Addr(1, 256), Addr(1, 4, 32, 66), Addr(1), Addr(1),
                      Addr(1, 4), 16, 4, 2, 0, 0.125, 0.0, 32, heads_per_block=1, counters=counters, cluster=cluster)
    (launch,) = split.launches(FakeKernels())
    assert launch.fn == ("attention", f"attn_cluster{cluster}") and launch.grid == (32, 4, 1)
    assert [launch.fn for launch in replace(split, counters=None).launches(FakeKernels())] == [
        ("attention", "attn"), ("attention", "attn_combine32")]
    with pytest.raises(AssertionError, match="whole clusters"):
        replace(split, n_split=12, part=Addr(1, 4, 12, 66)).launches(FakeKernels())


def test_large_gated_products_take_the_x_stationary_kernel():
    """Llama-3.1-8B's gate and up (14336 x 4096, one activation row, activation quantized) take
    mv_xs: a block per 32 pairs, teams of a lane per lane step (64 lanes in Q4_K, 128 in Q8_0),
    arguments as wide as the kernel's; smaller products, rows past a team of 512 lanes, stores and
    batched steps keep mv_n*."""
    from ember.backends.cuda.ops.matmul import MODE_SILU

    x = Addr(1, 4096)
    for qtype, block in ((GGMLType.Q4_K, 128), (GGMLType.Q8_0, 128), (GGMLType.Q5_K, 128)):
        gate, up = mat(14336, 4096, qtype), mat(14336, 4096, qtype)
        op = Matmul([gate, up], x, [Addr(1, 14336), Addr(1, 14336)], xq=Addr(xq_bytes(1, 4096), dtype=np.uint8),
                    quant_in=False, mode=MODE_SILU, aux=Addr(1, 14336),
                    act_q=Addr(xq_bytes(1, 14336), dtype=np.uint8))
        (launch,) = op.launches(FakeKernels())
        assert launch.fn == (f"matmul_{int(qtype)}_xs", "mv_xs") and launch.grid == (448, 1, 1), launch
        assert launch.block[0] == block
        assert [a.dtype for a in launch.args] == [param_dtype(p) for p in kernel_params("mv_xs")]
        assert replace(op, ws=[mat(256, 4096, qtype)] * 2).launches(FakeKernels())[0].fn[1] != "mv_xs"  # 2 MiB
        assert replace(op, mode=MODE_RESIDUAL, ws=[gate]).launches(FakeKernels())[0].fn[1] != "mv_xs"
    assert not replace(op, ws=[mat(14336, 4096, GGMLType.Q4_1)] * 2).takes_xs()
    assert not replace(op, ws=[mat(14336, 4096, GGMLType.Q6_K)] * 2).takes_xs()
    long_x = Addr(1, 32768)  # 1024 Q8_0 blocks a row: more lanes than a team takes
    assert not replace(op, x=long_x, ws=[mat(512, 32768, GGMLType.Q8_0)] * 2).takes_xs()
    assert not replace(op, x=Addr(2, 4096)).takes_xs()


def test_llama_8b_layers_normalise_inside_the_x_stationary_kernel():
    """At Llama-3.1-8B's shape (d 4096, past mv_n1's norm prologue) a layer's two norms and the
    head's are done by mv_xs's own blocks: q/k/v in one launch (pairs of rows across q, k and v),
    gate and up in one, the head in one (more pairs a block); no quant_x launch. Q4_K_M's q/k/v
    (v in Q6_K) and CudaConfig(prologue_k=2048) keep the quant_x launches (the head, past
    XS_STORE_ALONE_MIN_BYTES, still on mv_xs)."""
    from ember.backends.cuda import CudaConfig

    d, ff, kv = 4096, 14336, 1024
    x, h = Addr(1, d), Addr(1, d)
    ops, a = llama_layer(1, x, h, d=d, ff=ff, heads=32, kv_heads=8, hd=128, single=True)
    head = matmul([mat(128256, d)], h, [Addr(1, 128256)])
    fused = fuse(ops + [RmsNorm(x, Addr(d), 1e-5, h, d), head], counter)
    mms = [op for op in fused if isinstance(op, Matmul)]
    qkv, wo, ffn, down, out = mms
    names = [[launch.fn[1] for launch in op.launches(FakeKernels())] for op in mms]
    assert names == [["mv_xs"], ["mv_n1"], ["mv_xs"], ["mv_n1"], ["mv_xs"]], names
    for op in (qkv, ffn, out):
        (launch,) = op.launches(FakeKernels())
        assert op.xs_prologue() and [a.dtype for a in launch.args] == [param_dtype(p) for p in kernel_params("mv_xs")]
        assert int(launch.args[-4]) == op.src.data.ptr and int(launch.args[-1]) == op.x.data.ptr  # src, h
        assert int(launch.args[15]) == 0  # no xq read
    assert qkv.xs_geometry() == (64, 128, 6, 512)  # 3072 pairs: 4 a block would be over 4 blocks an SM
    assert ffn.xs_geometry() == (64, 128, 32, ff // 32)
    team, threads, unit, blocks = out.xs_geometry()
    assert unit == -(-128256 // 2 // (4 * 132)) and blocks == -(-128256 // 2 // unit)
    old = [replace(op, cfg=CudaConfig(prologue_k=2048)) for op in (qkv, ffn, out)]
    assert [[launch.fn[1] for launch in op.launches(FakeKernels())] for op in old] == [
        ["quant_x", "mv_n1_occ"], ["quant_x", "mv_xs"], ["quant_x", "mv_xs"]]  # the head: 525 MB
    assert out.launches(FakeKernels())[0].smem == 4 * d and old[2].launches(FakeKernels())[1].smem == 0
    mixed = replace(qkv, ws=[qkv.ws[0], qkv.ws[1], mat(kv, d, GGMLType.Q6_K)])
    names = [launch.fn[1] for launch in mixed.launches(FakeKernels())]
    assert names[0] == "quant_x" and len(names) == 3 and "mv_xs" not in names, names


def test_gated_products_of_more_blocks_than_fit_take_narrower_teams():
    """A gated product quantizing its activation takes blocks of 32 rows: teams of 8 lanes (256
    threads), of 4 (128 threads) where the blocks of 256 would not all be resident at once."""
    from ember.backends.cuda.ops.matmul import MODE_SILU

    for rows, threads in ((8960, 256), (14336, 128)):
        op = Matmul([mat(rows, 1536, GGMLType.Q4_1)] * 2, Addr(1, 1536), [Addr(1, rows)] * 2,
                    xq=Addr(xq_bytes(1, 1536), dtype=np.uint8), quant_in=False, mode=MODE_SILU, aux=Addr(1, rows),
                    act_q=Addr(xq_bytes(1, rows), dtype=np.uint8), n_sm=132)
        (launch,) = op.launches(FakeKernels())
        assert launch.block[0] == threads and launch.grid[0] == rows // 32, (rows, launch)


def test_decode_products_prefetch_what_fits_in_l2():
    """A decode product's teams prefetch their whole rows into L2 while the resident blocks' rows fit
    in L2_PREFETCH_BYTES, else that budget shared out in whole 128-byte lines."""
    from ember.backends.cuda.ops.matmul import L2_PREFETCH_BYTES

    def pf_row(rows, k, qtype=GGMLType.Q8_0):
        op = Matmul([mat(rows, k, qtype)], Addr(1, k), [Addr(1, rows)],
                    xq=Addr(xq_bytes(1, k), dtype=np.uint8), quant_in=False, n_sm=132)
        (launch,) = op.launches(FakeKernels())
        return int(launch.args[21]), op.ws[0].data.row_bytes, launch

    got, row_bytes, _ = pf_row(576, 576)
    assert got == row_bytes
    got, row_bytes, launch = pf_row(128256, 4096, GGMLType.Q6_K)  # a head of a type mv_xs does not take
    teams = launch.grid[0] * launch.block[0] >> int(launch.args[18])
    assert 0 < got < row_bytes and got % 128 == 0 and got * 2 * teams <= L2_PREFETCH_BYTES


def test_decode_products_of_several_rows_stage_x_in_shared_memory():
    """Products of 2-8 activation rows of quantized weights stage x in chunks of whole runs of 512
    values (matmul.cu x_slot's alignment) as large as CudaConfig.mv_stage bytes hold for the block's
    rows (one chunk where the row fits); one row, float weights and mv_stage 0 read x where it lies."""
    from ember.backends.cuda.config import CudaConfig

    def staged(n, k, qtype=GGMLType.Q4_K, cfg=CudaConfig()):
        op = Matmul([mat(1024, k, qtype)], Addr(n, k), [Addr(n, 1024)], xq=Addr(xq_bytes(n, k), dtype=np.uint8),
                    quant_in=False, cfg=cfg, n_sm=132)
        (launch,) = op.launches(FakeKernels())
        return int(launch.args[22]), launch.smem, launch.fn[1]

    assert staged(1, 4096)[0] == 0
    for n, k, nmax in ((2, 4096, 2), (3, 4096, 4), (8, 4096, 8), (8, 14336, 8), (4, 2560, 4)):
        kc, smem, name = staged(n, k)
        assert name == f"mv_n{nmax}" and kc % 512 == 0 and smem == xq_bytes(n, kc), (n, k, kc)
        assert smem <= CudaConfig().mv_stage and (kc >= k or xq_bytes(n, kc + 512) > CudaConfig().mv_stage), (n, k, kc)
    assert staged(2, 2560)[0] == 2560  # the whole row in one chunk
    assert staged(8, 4096, GGMLType.F16)[:2] == (0, 0)
    assert staged(8, 4096, cfg=CudaConfig(mv_stage=0))[:2] == (0, 0)
    with pytest.raises(ValueError, match="mv_stage"):
        CudaConfig(mv_stage=100)


def test_attention_clusters_of_16_only_where_they_fit():
    """Decode attention at head size 128 takes clusters of 16 splits while 16 blocks per (token,
    head) piece fit the GPU's slots (Llama-3.1-8B's 32 query heads do not: 8)."""
    from ember.backends.cuda.ops.attention import AttentionStep, AttentionTarget, plan_attention

    t = AttentionTarget(n_sm=132, tiles=True, clusters=True)
    for n_head, n_kv, cluster in ((12, 2, 16), (32, 8, 8), (4, 1, 16)):
        s = AttentionStep(1, 1, 4096, n_head, n_kv, 128, 128, True, True)
        plan = plan_attention(t, s)
        assert plan.cluster == cluster and plan.n_split % cluster == 0, (n_head, plan)


def test_products_of_more_blocks_than_fit_take_the_lean_kernel():
    """mv_n1_occ where mv_n1's blocks would not all be resident at once (two of 256 threads or
    four of 128 a multiprocessor), mv_n1_store otherwise for a product that only stores y, and
    mv_n1 for one with an epilogue."""
    x = Addr(1, 1536)
    for rows, want in ((2048, "mv_n1_store"), (8960, "mv_n1_occ"), (151936, "mv_n1_occ")):
        op = Matmul([mat(rows, 1536, GGMLType.Q8_0)], x, [Addr(1, rows)], xq=Addr(xq_bytes(1, 1536), dtype=np.uint8),
                    quant_in=False, n_sm=132)
        (launch,) = op.launches(FakeKernels())
        slots = 132 * (2 if launch.block[0] == 256 else 4)
        assert launch.fn[1] == want and (launch.grid[0] > slots) == (want == "mv_n1_occ"), (rows, launch.grid)
        res = replace(op, mode=MODE_RESIDUAL, aux=Addr(1, rows))  # an epilogue: the generic kernel where it fits
        assert res.launches(FakeKernels())[0].fn[1] == ("mv_n1_occ" if want == "mv_n1_occ" else "mv_n1")
    (launch,) = Matmul([mat(8960, 1536, GGMLType.Q8_0)], Addr(2, 1536), [Addr(2, 8960)],
                       xq=Addr(xq_bytes(2, 1536), dtype=np.uint8), quant_in=False).launches(FakeKernels())
    assert launch.fn[1] == "mv_n2"  # more rows: the batch kernels, unchanged


def test_one_row_products_of_few_blocks_widen_their_teams():
    """A one-row product of at least 1 MiB of weights whose blocks would be fewer than the
    multiprocessors takes teams twice as wide (up to a warp) while half a team's lanes keep a lane
    step: a 1.5 B model's q, k and v (2048 rows of 1536 Q4_K values, 256 threads a block for the
    norm prologue) on 128 blocks instead of 64. Products of enough blocks, of rows too short to
    share, of more activation rows, or of fewer bytes (SmolLM2's q, k and v) keep theirs."""
    from ember.backends.cuda import CudaConfig
    from ember.backends.cuda.config import MV_PROLOGUE_MAX_K
    from ember.backends.cuda.ops.matmul import fill_team_log2, team_log2

    def geometry(rows, k, qtype, n=1):  # a norm prologue; past mv_n1's, a quant_x launch (not mv_xs's own)
        op = Matmul([mat(rows, k, qtype)], Addr(n, k), [Addr(n, rows)], xq=Addr(xq_bytes(n, k), dtype=np.uint8),
                    src=Addr(n, k), norm_w=Addr(k), eps=1e-5, n_sm=132, cfg=CudaConfig(prologue_k=MV_PROLOGUE_MAX_K))
        (*_, launch) = op.launches(FakeKernels())
        return launch.grid[0], int(launch.args[18])  # blocks, team_log2

    def unfilled(rows, k, qtype, n=1):  # teams as team_log2 picks them, blocks of 256 threads past k 1024
        spl = 2 if qtype in (GGMLType.Q4_K, GGMLType.Q5_K) else 1
        tl = team_log2(k // spl, -(-rows // 2) * -(-n // 8))
        return -(-(-(-rows // 2)) // ((256 if k > 1024 else 128) >> tl)) * -(-n // 8), tl

    assert geometry(2048, 1536, GGMLType.Q4_K) == (128, 5) and unfilled(2048, 1536, GGMLType.Q4_K) == (64, 4)
    assert geometry(2048, 1536, GGMLType.Q4_K, n=2) == unfilled(2048, 1536, GGMLType.Q4_K, n=2)
    assert geometry(1536, 8960, GGMLType.Q8_0)[1] == unfilled(1536, 8960, GGMLType.Q8_0)[1]
    assert geometry(8960, 1536, GGMLType.Q8_0) == unfilled(8960, 1536, GGMLType.Q8_0)  # 384 blocks
    assert geometry(960, 576, GGMLType.Q4_1) == unfilled(960, 576, GGMLType.Q4_1)  # 0.55 MB
    assert fill_team_log2(3, 4, 100, 128, 132) == 3  # four lane steps a row: teams of 8 at most
    assert fill_team_log2(2, 16, 100, 128, 132) == 5


def test_float_rows_take_lane_steps_of_sixteen_bytes():
    """Float decode products step a lane through 16-byte vectors (4 values of F32, 8 of F16), so their
    teams are sized by those: a MoE router (128 F32 rows of 2048, one token) takes teams of 128 lanes,
    four vectors a lane, where 32-value slices would have left it at a warp a team, two slices a lane."""
    from ember.backends.cuda.ops.matmul import float_vec

    assert (float_vec(GGMLType.F32), float_vec(GGMLType.F16), float_vec(GGMLType.BF16)) == (4, 8, 8)

    def geometry(rows, k, qtype):
        op = Matmul([mat(rows, k, qtype)], Addr(1, k), [Addr(1, rows)], n_sm=132)
        (launch,) = op.launches(FakeKernels())
        return launch.grid[0], int(launch.args[18])  # blocks, team_log2

    assert geometry(128, 2048, GGMLType.F32) == (64, 7)
    assert geometry(128, 2048, GGMLType.F16) == (64, 7)  # 256 vectors: two a lane
    assert geometry(4096, 4096, GGMLType.F16)[1] == 5  # enough teams: a warp each, 16 vectors a lane


def test_one_row_products_load_their_first_weights_before_the_wait():
    """pre_dec: the 32-value block types hold a lane's first steps on mv_n1 and mv_n1_store (two
    with a norm prologue, whose own work follows the wait), Q4_K and Q5_K one step (as raw bytes)
    on mv_n1_store only; mv_n1_occ and the batch kernels none."""
    def pre_dec(qtype, rows=512, k=256, **kw):
        op = Matmul([mat(rows, k, qtype)], Addr(1, k), [Addr(1, rows)], xq=Addr(xq_bytes(1, k), dtype=np.uint8), **kw)
        (*_, launch) = op.launches(FakeKernels())
        return launch.fn[1], int(launch.args[20])

    prologue = dict(src=Addr(1, 256), norm_w=Addr(256), eps=1e-5)
    assert pre_dec(GGMLType.Q8_0, **prologue) == ("mv_n1", 1)  # a lane's steps: one
    assert pre_dec(GGMLType.Q8_0, k=2048, src=Addr(1, 2048), norm_w=Addr(2048), eps=1e-5) == ("mv_n1", 2)
    assert pre_dec(GGMLType.Q8_0, quant_in=False) == ("mv_n1_store", 1)
    assert pre_dec(GGMLType.Q4_K, **prologue) == ("mv_n1", 0)
    assert pre_dec(GGMLType.Q4_K, quant_in=False) == ("mv_n1_store", 1)
    assert pre_dec(GGMLType.Q6_K, quant_in=False) == ("mv_n1_store", 0)
    assert pre_dec(GGMLType.Q8_0, rows=151936, quant_in=False) == ("mv_n1_occ", 0)
    two = Matmul([mat(512, 256, GGMLType.Q8_0)], Addr(2, 256), [Addr(2, 512)],
                 xq=Addr(xq_bytes(2, 256), dtype=np.uint8), quant_in=False)
    assert int(two.launches(FakeKernels())[0].args[20]) == 0


def test_gated_product_quantizing_its_output_runs_32_rows_per_block():
    x, g, u, h = Addr(1, 256), Addr(1, 512), Addr(1, 512), Addr(1, 256)
    ops = [matmul([mat(512, 256), mat(512, 256)], x, [g, u]), GatedAct("silu", g, u, g), matmul([mat(256, 512)], g, [h])]
    gated, down = fuse(ops, counter)
    quant, launch = gated.launches(FakeKernels())  # its input comes unquantized: quant_x first
    assert quant.fn == ("ops", "quant_x") and quant.grid == (1, 1, 1)
    assert launch.block == (256, 1, 1) and launch.grid == (512 // 32, 1, 1)
    (launch,) = down.launches(FakeKernels())  # its input was quantized by the gated product
    assert launch.fn == ("matmul_12_store", "mv_n1_store")  # storing h alone


def nvrtc_or_skip():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # no CuPy, or no NVRTC library: nothing to compile with here
        pytest.skip(f"NVRTC is not available: {type(e).__name__}")


def test_kernel_cache_can_be_filled_without_a_gpu(tmp_path):
    """Modules compile for a named architecture into a cache folder (NVRTC only, no GPU); a second
    build finds the cubin there instead of compiling again."""
    nvrtc_or_skip()
    from ember.backends.cuda._kernels import build_cubin

    path, seconds = build_cubin("sample", "90", tmp_path)
    assert seconds is not None and path.parent == tmp_path and path.read_bytes()[:4] == b"\x7fELF"
    again, seconds_again = build_cubin("sample", "90", tmp_path)
    assert again == path and seconds_again is None
    other, _ = build_cubin("sample", "80", tmp_path)  # another architecture: another entry
    assert other != path


@pytest.mark.parametrize("heads_per_block", [1, 2, 3, 8])
def test_attention_blocks_cover_every_query_head_once(heads_per_block):
    """attn takes its heads per block from the grid (ceil(group / chunks), chunks = grid y / kv
    heads): for every group size, the chunks the host asks for give each query head of a kv head
    exactly one block, and no chunk is empty."""
    for n_kv in (1, 3):
        for group in range(1, 41):
            n_head = group * n_kv
            att = Attention(Addr(1, n_head * 64), Addr(64, n_kv * 64), Addr(64, n_kv * 64), Addr(1, n_head * 64),
                            None, Addr(1), Addr(1), Addr(1, 4), 16, n_head, n_kv, 0, 0.125, 0.0, 1,
                            heads_per_block=heads_per_block)
            (launch,) = att.launches(FakeKernels())
            assert launch.fn == ("attention", "attn")
            n_hc = launch.grid[1] // n_kv
            assert launch.grid[1] == n_kv * n_hc
            hpb = -(-group // n_hc)  # as the kernel derives it
            assert hpb <= min(heads_per_block, 8)
            heads = []
            for y in range(launch.grid[1]):
                g, hc = divmod(y, n_hc)
                h0, gh = g * group + hc * hpb, min(hpb, group - hc * hpb)
                assert gh >= 1
                heads += range(h0, h0 + gh)
            assert sorted(heads) == list(range(n_head))


def ptx_entries(module: str) -> set[str]:
    """The kernels of one module, from its PTX (NVRTC, no GPU)."""
    from cupy.cuda import nvrtc

    from ember.backends.cuda._kernels import module_source

    prog = nvrtc.createProgram(module_source(module), f"{module}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-std=c++17", "-arch=compute_90"])
        return set(re.findall(r"\.entry (\w+)", nvrtc.getPTX(prog).decode()))
    finally:
        nvrtc.destroyProgram(prog)


def test_attention_launches_name_the_modules_holding_their_kernels():
    """attn and the split merges live in "attention", each head size's tensor-core tiles in an
    attention_tile<hd> module of their own."""
    nvrtc_or_skip()
    asked = set()
    for hd in (64, 128, 256):
        for tiles, n_split in ((False, 1), (False, 4), (False, 20), (True, 1), (True, 4)):
            n = 64 if tiles else 1
            att = Attention(Addr(n, 4 * hd), Addr(64, 2 * hd), Addr(64, 2 * hd), Addr(n, 4 * hd),
                            Addr(n, 4, n_split, hd + 2) if n_split > 1 else None, Addr(n), Addr(n), Addr(1, 4), 16, 4,
                            2, 0, 0.125, 0.0, n_split, tiles=tiles)
            asked |= {launch.fn for launch in att.launches(FakeKernels())}
    modules = {module for module, _ in asked}
    assert modules == {"attention", "attention_tile64", "attention_tile128", "attention_tile256"}
    entries = {module: ptx_entries(module) for module in modules}
    for module, name in asked:
        assert name in entries[module], (module, name)
    assert entries["attention"] == {"attn", "attn_cluster8", "attn_cluster16", "attn_combine", "attn_combine32"}
    assert all(entries[f"attention_tile{hd}"] == {f"attn_tile{hd}"} for hd in (64, 128, 256))


def test_products_name_the_modules_holding_their_kernels():
    """Each matmul.cu kernel a launch asks for is an entry of the module it names: matmul_<type>
    (mv_n1, the tiles, mm_split, get_rows), matmul_<type>_batch (mv_n2, mv_n4, mv_n8),
    matmul_<type>_occ (mv_n1_occ) or matmul_<type>_store (mv_n1_store), checked on the modules'
    PTX (NVRTC, no GPU)."""
    nvrtc_or_skip()
    from ember.backends.cuda._kernels import matmul_module

    entries = {module: ptx_entries(module) for module in ("matmul_12", "matmul_12_batch", "matmul_12_occ",
                                                          "matmul_12_store")}
    asked = set()
    for n in (1, 2, 3, 5, 8, 20, 64, 65, 200):
        x, y = Addr(n, 256), Addr(n, 512)
        op = Matmul([mat(512, 256)], x, [y], xq=Addr(xq_bytes(n, 256), dtype=np.uint8) if n <= 64 else None)
        ops = [op, GetRows(mat(512, 256), Addr(n, dtype=np.int32), Addr(n, 256)), replace(op, n_sm=1)]
        if n <= 8:  # an epilogue: the generic one-row kernel
            ops.append(replace(op, mode=MODE_RESIDUAL, aux=Addr(n, 512)))
        if n > 8:
            ops.append(replace(op, mv_rows=8, split_buf=SplitScratch(Addr(1 << 20), Addr(64, dtype=np.uint32))))
        for o in ops:
            for launch in o.launches(FakeKernels()):
                asked.add(launch.fn)
    for module, name in asked:
        if module.startswith("matmul_"):
            assert name in entries[module], (module, name)
            assert module == matmul_module(GGMLType.Q4_K, name)
    assert {name for module, name in asked if module == "matmul_12_batch"} == {"mv_n2", "mv_n4", "mv_n8"}
    assert entries["matmul_12_batch"] == {"mv_n2", "mv_n4", "mv_n8"}
    assert ("matmul_12_occ", "mv_n1_occ") in asked and entries["matmul_12_occ"] == {"mv_n1_occ"}
    assert ("matmul_12_store", "mv_n1_store") in asked and entries["matmul_12_store"] == {"mv_n1_store"}
    assert {"mv_n1", "mm_tile", "mm_tile64", "mm_split", "get_rows"} <= entries["matmul_12"]


def test_batch_modules_compile_after_the_first_token_needs():
    """Modules asked for with prefetch_later are not compiled while a model loads: they are queued
    when a module is first needed, behind every module asked for before then; one of them needed
    first is built at once."""
    import types

    from ember.backends.cuda._kernels import Kernels

    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(is_hip=True)),
                               RawModule=lambda code, options: types.SimpleNamespace(get_function=lambda n: n))
    kernels = Kernels(cp, types.SimpleNamespace(compute_capability="90", attributes={}))
    order = []
    kernels._build = lambda module: (order.append(module), module)[1]
    kernels.prefetch("ops")
    kernels.prefetch_later("matmul_12_batch")
    kernels.prefetch("matmul_12")
    kernels.prefetch_later("matmul_8_batch")
    for f in list(kernels._futures.values()):
        f.result()
    assert sorted(order) == ["matmul_12", "ops"]  # nothing later yet
    assert kernels.fn("matmul_12", "mv_n1") == "mv_n1"
    for f in list(kernels._futures.values()):
        f.result()
    assert sorted(order[2:]) == ["matmul_12_batch", "matmul_8_batch"]
    kernels.prefetch_later("matmul_6_batch")
    assert kernels.fn("matmul_6_batch", "mv_n2") == "mv_n2"  # needed now: built, not left waiting
    assert "matmul_6_batch" in order and not kernels._later


def test_config_checks_its_fields():
    from ember.backends.cuda import CudaConfig

    assert CudaConfig() == CudaConfig(graphs=True, fuse=True, pdl=True, mv_rows=64, prologue_k=16384, tile_rows=0,
                                      att_waves=2)
    for bad in (dict(mv_rows=0), dict(mv_rows=65), dict(prologue_k=16385), dict(tile_rows=32), dict(att_waves=0)):
        with pytest.raises(ValueError):
            CudaConfig(**bad)
    with pytest.raises(AttributeError):
        CudaConfig().graphs = False  # frozen: read once


def test_attention_plans_follow_the_step():
    """Decode steps of up to 8 tokens: the scalar kernel, a block per query head, splits merged
    by the last split block, in clusters where the device has them (8 blocks at head size 64, 16
    at 256); batched decode and prompt steps: tensor-core tiles, merged by attn_combine."""
    from ember.backends.cuda.ops.attention import AttentionStep, AttentionTarget, plan_attention

    h200 = AttentionTarget(132, tiles=True, clusters=True)
    decode = AttentionStep(1, 1, 4096, 9, 3, 64, 64, single=True, contiguous=True)
    plan = plan_attention(h200, decode)
    assert not plan.tiles and plan.heads_per_block == 1 and plan.merge and plan.cluster == 8
    assert plan.n_split % 8 == 0 and plan.min_keys == 32 and plan.counters(decode) == 9
    wide = plan_attention(h200, AttentionStep(1, 1, 4096, 4, 1, 256, 256, single=True, contiguous=True))
    assert wide.cluster == 16 and wide.min_keys == 8
    older = plan_attention(AttentionTarget(108, tiles=True, clusters=False), decode)
    assert older.merge and older.cluster == 0
    assert plan_attention(h200, AttentionStep(1, 1, 16, 9, 3, 64, 64, single=True, contiguous=True)).n_split == 1
    batched = plan_attention(h200, AttentionStep(64, 64, 4096, 9, 3, 64, 64, single=True, contiguous=True))
    assert batched.tiles and not batched.merge and batched.n_split > 1
    prompt = AttentionStep(512, 1, 1024, 4, 1, 256, 256, single=False, contiguous=True)
    assert plan_attention(h200, prompt).tiles
    assert not plan_attention(AttentionTarget(132, tiles=False, clusters=False), prompt).tiles
    odd = plan_attention(h200, AttentionStep(512, 1, 1024, 4, 1, 96, 96, single=False, contiguous=True))
    assert not odd.tiles and odd.heads_per_block == 8  # no tile module for heads of 96


# ---- mixture-of-experts layers (gpt-oss: biases on the experts) ----

def expert_stack(n_expert: int, m: int, k: int, qtype=GGMLType.MXFP4) -> Weight:
    buf = type("Matrix", (), {"buf": Addr(n_expert * m * k), "row_bytes": k})()
    return Weight("experts", qtype, (n_expert, m, k), buf)


def expert_bias_stack(n_expert: int, m: int) -> Weight:
    return Weight("bias", GGMLType.F32, (n_expert, m), type("Matrix", (), {"buf": Addr(n_expert, m)})())


def moe_ops(n: int, ids: Addr, d=256, ff=512, n_expert=8, k=4, qtype=GGMLType.MXFP4):
    """A gpt-oss feed-forward as ember/models/_moe.py records it, and its stacks and outputs."""
    from ember.backends.cuda.ops.experts import ExpertBias, ExpertMatmul, ExpertScratch, ExpertSum, SwigluOai

    h, out = Addr(n, d), Addr(n, d)
    gate, up, down = expert_stack(n_expert, ff, d, qtype), expert_stack(n_expert, ff, d, qtype), \
        expert_stack(n_expert, d, ff, qtype)
    bg, bu, bd = expert_bias_stack(n_expert, ff), expert_bias_stack(n_expert, ff), expert_bias_stack(n_expert, d)
    g, u, y = Addr(n * k, ff), Addr(n * k, ff), Addr(n * k, d)
    scratch = ExpertScratch(Addr(xq_bytes(n * k, ff), dtype=np.uint8), Addr(n * k, dtype=np.int32),
                            Addr(64, 4, dtype=np.int32), Addr(1, dtype=np.int32))
    ops = [ExpertMatmul([gate, up], h, k, ids, [g, u], scratch, -1), ExpertBias(g, bg, ids), ExpertBias(u, bu, ids),
           SwigluOai(g, u, g, 1.702, 7.0), ExpertMatmul([down], g, 1, ids, [y], scratch, -1), ExpertBias(y, bd, ids),
           ExpertSum(y, Addr(n, k), out)]
    return ops, (bg, bu, bd)


@pytest.mark.parametrize("n", [1, 64])
def test_expert_biases_fold_into_the_products(n):
    """Each ExpertBias right after the product that wrote its rows (same routing) goes into that
    product's launches, which store y + the chosen expert's bias row: three launches a layer fewer."""
    from ember.backends.cuda.ops.experts import ExpertBias, ExpertMatmul

    ids = Addr(n, 4, dtype=np.int32)
    ops, (bg, bu, bd) = moe_ops(n, ids)
    fused = fuse(ops, counter)
    assert [type(op).__name__ for op in fused] == ["ExpertMatmul", "ExpertMatmul", "ExpertSum"]  # the act in the down's
    assert fused[0].biases == [bg, bu] and fused[1].biases == [bd]
    for op in (fused[0], fused[1]):
        launches = op.launches(FakeKernels())
        products = [la for la in launches if la.fn[1] in ("expert_mv", "expert_tile")]
        assert products and {la.fn[1] for la in products} == {"expert_mv" if n == 1 else "expert_tile"}
        got = []  # expert_mv: a launch for gate and up (grid z), each matrix's bias after its output
        for la in products:
            got += [int(la.args[-5]), int(la.args[-2])][:la.grid[2]] if la.fn[1] == "expert_mv" else [int(la.args[-1])]
        assert got == [b.data.buf.data.ptr for b in op.biases]
    # another routing's biases, or rows the product did not write, stay a launch of their own
    other = Addr(n, 4, dtype=np.int32)
    apart = [ops[0], ExpertBias(ops[0].ys[0], bg, other), ExpertBias(Addr(n * 4, 512), bu, ids)]
    assert [type(op) for op in fuse(apart, counter)] == [ExpertMatmul, ExpertBias, ExpertBias]
    assert fuse(apart, counter)[0].biases is None


@pytest.mark.parametrize("act", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("n", [1, 64])
def test_expert_activation_folds_into_the_down_products_rounding(act, n):
    """The gated activation between the experts' gate/up and down products goes into the down product's
    quant_x_llama launch, which reads gate and up, stores act(gate) * up where the activation stored it
    and rounds it: one launch a layer fewer. Not where the down product reads something else, x is shared
    by a token's selections, a stack is float (its launch reads x before quant_x_llama), or out partly
    overlaps gate."""
    from ember.backends.cuda.ops import GatedAct
    from ember.backends.cuda.ops.experts import ACT_CODES, ExpertMatmul, SwigluOai

    ids = Addr(n, 4, dtype=np.int32)
    ops, _ = moe_ops(n, ids, qtype=GGMLType.Q4_K)
    g, u = ops[0].ys
    ops[3] = SwigluOai(g, u, g, 1.702, 7.0) if act == "swiglu_oai" else GatedAct(act, g, u, g)
    fused = fuse(ops, counter)
    assert [type(op).__name__ for op in fused] == ["ExpertMatmul", "ExpertMatmul", "ExpertSum"]
    assert fused[1].act is ops[3]
    launches = fused[1].launches(FakeKernels())
    assert [la.fn[1] for la in launches][0] == "quant_x_llama"
    args = [int(a) if a.dtype.kind in "iu" else float(a) for a in launches[0].args]
    assert args[0] == g.data.ptr and args[5:8] == [u.data.ptr, g.data.ptr, ACT_CODES[act]]
    assert args[8:] == ([pytest.approx(1.702), 7.0] if act == "swiglu_oai" else [0.0, 0.0])
    # unfused, the launch reads x alone
    plain_args = ops[4].launches(FakeKernels())[0].args
    assert int(plain_args[0]) == g.data.ptr and [int(a) for a in plain_args[5:8]] == [0, 0, 0]

    def down(x, x_div=1, qtype=GGMLType.Q4_K):
        return ExpertMatmul([expert_stack(8, 256, 512, qtype)], x, x_div, ids, [Addr(n * 4, 256)], ops[4].scratch, -1)

    gated = GatedAct("silu", g, u, g)
    assert len(fuse([gated, down(Addr(n * 4, 512))], counter)) == 2  # reads other rows
    assert len(fuse([gated, down(g, 4)], counter)) == 2  # one x a token
    assert len(fuse([gated, down(g, qtype=GGMLType.F16)], counter)) == 2  # a float stack
    shifted = Addr(n * 4, 512, at=g.data.ptr + 4 * 8)  # out starting inside gate
    assert len(fuse([GatedAct("silu", g, u, shifted), down(shifted)], counter)) == 2


def test_residual_add_folds_into_the_expert_sum():
    """x += the experts' weighted sum h: the sum's threads add it into x as they store h (either order of
    the add's inputs); not where x overlaps what the sum reads or the add writes elsewhere."""
    from ember.backends.cuda.ops import Add
    from ember.backends.cuda.ops.experts import ExpertSum

    n, k, d = 3, 4, 256
    y, w, h, x = Addr(n * k, d), Addr(n, k), Addr(n, d), Addr(n, d)
    for add in (Add(x, h, x), Add(h, x, x)):
        (es,) = fuse([ExpertSum(y, w, h), add], counter)
        assert isinstance(es, ExpertSum) and es.res is x
        (la,) = es.launches(FakeKernels())
        assert int(la.args[-1]) == x.data.ptr
        assert [a.dtype for a in la.args] == [param_dtype(p) for p in kernel_params("expert_sum")]
    assert int(ExpertSum(y, w, h).launches(FakeKernels())[0].args[-1]) == 0
    assert len(fuse([ExpertSum(y, w, h), Add(x, h, Addr(n, d))], counter)) == 2  # the sum lands elsewhere
    assert len(fuse([ExpertSum(y, w, h), Add(y.rows(n), h, y.rows(n))], counter)) == 2  # x is y's rows


@pytest.mark.parametrize("n", [1, 64])
def test_routing_shares_the_launch_of_the_experts_rounding(n):
    """RouteExperts then the expert products reading its ids: the routing runs in blocks of the products'
    quant_x_llama launch (route_quant_x_llama: the route's blocks first, then quant_x_llama's grid flattened),
    arguments as the kernel declares them. Not where the products read other ids, their x is the routing's
    output, or they are float stacks (no rounding launch)."""
    from ember.backends.cuda.ops.experts import ExpertMatmul, RouteExperts

    ids, weights, logits = Addr(n, 4, dtype=np.int32), Addr(n, 4), Addr(n, 8)
    ops, _ = moe_ops(n, ids, qtype=GGMLType.Q4_K)
    route = RouteExperts(logits, 4, True, ids, weights)
    fused = fuse([route] + ops, counter)
    assert [type(op).__name__ for op in fused] == ["ExpertMatmul", "ExpertMatmul", "ExpertSum"]
    assert fused[0].route is route and fused[1].route is None
    la = fused[0].launches(FakeKernels())[0]
    assert la.fn[1] == "route_quant_x_llama"
    assert [a.dtype for a in la.args] == [param_dtype(p) for p in kernel_params("route_quant_x_llama")]
    route_blocks, qy = -(-n // 4), -(-256 // 1024)
    assert la.grid == (route_blocks + n * qy, 1, 1) and int(la.args[7]) == route_blocks and int(la.args[-1]) == qy
    alone = [op.launches(FakeKernels())[0] for op in (route, ops[0])]
    assert [int(a) for a in la.args[:7]] == [int(a) for a in alone[0].args]
    assert [int(a) if a.dtype.kind in "iu" else float(a) for a in la.args[8:-1]] == \
        [int(a) if a.dtype.kind in "iu" else float(a) for a in alone[1].args]

    def gate_up(ids_, x, qtype=GGMLType.Q4_K):
        return ExpertMatmul([expert_stack(8, 512, 256, qtype)], x, 4, ids_, [Addr(n * 4, 512)], ops[0].scratch, -1)

    assert len(fuse([route, gate_up(Addr(n, 4, dtype=np.int32), Addr(n, 256))], counter)) == 2  # other ids
    assert len(fuse([route, gate_up(ids, Addr(n, 256, at=weights.data.ptr))], counter)) == 2  # x is the weights
    assert len(fuse([route, gate_up(ids, Addr(n, 256), GGMLType.F16)], counter)) == 2  # a float stack


def test_expert_launch_arguments_match_the_kernels():
    """expert_mv, expert_tile, expert_group and expert_matmul (float stacks) get arguments as wide as
    the kernels' parameters, with and without biases (a null pointer without)."""
    seen = set()
    for qtype in (GGMLType.MXFP4, GGMLType.F16):
        for n in (1, 64):
            ids = Addr(n, 4, dtype=np.int32)
            ops, _ = moe_ops(n, ids, qtype=qtype)
            for op in [o for o in ops + fuse(ops, counter) if hasattr(o, "ws")]:
                for launch in op.launches(FakeKernels()):
                    seen.add(launch.fn[1])
                    assert [a.dtype for a in launch.args] == [param_dtype(p) for p in kernel_params(launch.fn[1])]
                    if launch.fn[1] in ("expert_tile", "expert_matmul") and op.biases is None:
                        assert int(launch.args[-1]) == 0
                    if launch.fn[1] == "expert_mv" and op.biases is None:  # its last: the team width
                        assert int(launch.args[-2]) == 0
    assert {"expert_mv", "expert_tile", "expert_group", "expert_matmul", "quant_x_llama"} <= seen
