"""The CUDA backend's fusion pass, without a GPU: it works on op records and array addresses only,
so arrays here are address ranges (the pass never touches their contents)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ember.backends.base import Weight
from ember.backends.cuda._fuse import fuse
from ember.backends.cuda._ops import (
    MODE_GELU,
    MODE_RESIDUAL,
    MODE_SILU,
    Add,
    Attention,
    GatedAct,
    KvStore,
    Matmul,
    NormAdd,
    QkvPost,
    RmsNorm,
    Rope,
    RopeArgs,
)
from ember.quant import GGMLType

MAX_SMEM = 227 * 1024


class Addr:
    """A device array as the fusion pass sees it: an address range with a shape."""

    _next = 1 << 20

    def __init__(self, *shape, dtype=np.float32, at: int | None = None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = math.prod(shape)
        self.nbytes = self.size * self.dtype.itemsize
        if at is None:
            at, Addr._next = Addr._next, Addr._next + self.nbytes + 4096
        self.data = type("Ptr", (), {"ptr": at})()

    def rows(self, n: int) -> Addr:
        """The first n rows (same address), as the model's buffers hand out per step."""
        return Addr(n, *self.shape[1:], dtype=self.dtype, at=self.data.ptr)


def mat(rows: int, cols: int, qtype=GGMLType.Q4_K) -> Weight:
    return Weight("w", qtype, (rows, cols), None)


ROPE = RopeArgs(64, False, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0, None)


def llama_layer(n: int, d=256, ff=512, heads=4, kv_heads=2, hd=64):
    """The op records of one llama layer (what the backend records for LlamaModel.forward)."""
    x, h = Addr(n, d), Addr(n, d)
    q, k, v, att = Addr(n, heads * hd), Addr(n, kv_heads * hd), Addr(n, kv_heads * hd), Addr(n, heads * hd)
    g, u = Addr(n, ff), Addr(n, ff)
    kc, vc = Addr(64, kv_heads * hd, dtype=np.float16), Addr(64, kv_heads * hd, dtype=np.float16)
    pos, slots, rows, tables = Addr(n, dtype=np.int32), Addr(n, dtype=np.int64), Addr(n, dtype=np.int32), Addr(1, 16)
    ops = [
        RmsNorm(x, Addr(d), 1e-5, h, d),
        Matmul([mat(heads * hd, d), mat(kv_heads * hd, d), mat(kv_heads * hd, d)], h, [q, k, v]),
        Rope(q, heads, pos, ROPE),
        Rope(k, kv_heads, pos, ROPE),
        KvStore(k, v, kc, vc, slots),
        Attention(q, kc, vc, att, None, pos, rows, tables, 16, heads, kv_heads, 0, 0.125, 0.0, 1),
        Matmul([mat(d, heads * hd)], att, [h]),
        Add(x, h, x),
        RmsNorm(x, Addr(d), 1e-5, h, d),
        Matmul([mat(ff, d), mat(ff, d)], h, [g, u]),
        GatedAct("silu", g, u, g),
        Matmul([mat(d, ff)], g, [h]),
        Add(x, h, x),
    ]
    return ops, {"x": x, "h": h, "q": q, "k": k, "g": g, "u": u}


def test_llama_decode_layer_fuses_to_six_kernels():
    ops, a = llama_layer(n=1)
    fused = fuse(ops, MAX_SMEM)
    assert [type(op) for op in fused] == [Matmul, QkvPost, Attention, Matmul, Matmul, Matmul]
    qkv, _, _, wo, ffn, down = fused
    assert qkv.norm_w is not None and qkv.x is a["x"] and qkv.h_out is a["h"]
    assert wo.mode == MODE_RESIDUAL and wo.aux is a["x"]
    assert ffn.norm_w is not None and ffn.mode == MODE_SILU and ffn.aux is a["g"]
    assert down.mode == MODE_RESIDUAL and down.aux is a["x"]


def test_prefill_products_stay_unfused():
    ops, _ = llama_layer(n=64)  # tensor-core path: only the row ops fuse
    fused = fuse(ops, MAX_SMEM)
    assert [type(op) for op in fused] == [RmsNorm, Matmul, QkvPost, Attention, Matmul, Add, RmsNorm, Matmul,
                                          GatedAct, Matmul, Add]
    assert all(op.norm_w is None and op.mode == 0 for op in fused if isinstance(op, Matmul))


def test_gemma_layer():
    n, d, ff, hd = 2, 256, 512, 64
    x, h, q, k, v, att = Addr(n, d), Addr(n, d), Addr(n, 4 * hd), Addr(n, hd), Addr(n, hd), Addr(n, 4 * hd)
    g, u = Addr(n, ff), Addr(n, ff)
    kc, vc, pos, slots = Addr(64, hd), Addr(64, hd), Addr(n, dtype=np.int32), Addr(n, dtype=np.int64)
    ops = [
        RmsNorm(x, Addr(d), 1e-6, h, d),
        Matmul([mat(4 * hd, d), mat(hd, d, GGMLType.Q6_K), mat(hd, d)], h, [q, k, v]),
        RmsNorm(q, Addr(hd), 1e-6, q, hd),
        RmsNorm(k, Addr(hd), 1e-6, k, hd),
        Rope(q, 4, pos, ROPE),
        Rope(k, 1, pos, ROPE),
        KvStore(k, v, kc, vc, slots),
        Attention(q, kc, vc, att, None, pos, pos, Addr(1, 8), 16, 4, 1, 512, 0.125, 0.0, 1),
        Matmul([mat(d, 4 * hd)], att, [h]),
        RmsNorm(h, Addr(d), 1e-6, h, d),
        Add(x, h, x),
        RmsNorm(x, Addr(d), 1e-6, h, d),
        Matmul([mat(ff, d), mat(ff, d)], h, [g, u]),
        GatedAct("gelu", g, u, g),
        Matmul([mat(d, ff)], g, [h]),
        RmsNorm(h, Addr(d), 1e-6, h, d),
        Add(x, h, x),
    ]
    fused = fuse(ops, MAX_SMEM)
    assert [type(op) for op in fused] == [Matmul, QkvPost, Attention, Matmul, NormAdd, Matmul, Matmul, NormAdd]
    assert fused[1].q_norm is not None and fused[1].k_norm is not None
    assert fused[5].mode == MODE_GELU and fused[5].norm_w is not None
    assert fused[3].mode == 0  # its output is normalised before the residual add


def test_in_place_norm_is_not_fused_into_a_product():
    x = Addr(1, 256)
    ops = [RmsNorm(x, Addr(256), 1e-5, x, 256), Matmul([mat(320, 256)], x, [Addr(1, 320)])]
    assert [type(op) for op in fuse(ops, MAX_SMEM)] == [RmsNorm, Matmul]


@pytest.mark.parametrize("case", ["residual_is_input", "add_of_other_arrays", "partial_view"])
def test_residual_fusion_needs_disjoint_arrays(case):
    x, h, other = Addr(1, 256), Addr(1, 256), Addr(1, 256)
    if case == "residual_is_input":
        ops = [Matmul([mat(256, 256)], x, [h]), Add(x, h, x)]
    elif case == "add_of_other_arrays":
        ops = [Matmul([mat(256, 256)], x, [h]), Add(other, x, other)]
    else:  # the add reads a different view of h's memory
        big = Addr(2, 256, at=h.data.ptr)
        ops = [Matmul([mat(256, 256)], x, [h]), Add(other, big.rows(1), other)]
        assert [type(op) for op in fuse(ops, MAX_SMEM)] == [Matmul]  # same address and shape: still h
        return
    assert [type(op) for op in fuse(ops, MAX_SMEM)] == [Matmul, Add]


def test_mixed_type_gate_and_up_stay_apart():
    x, g, u = Addr(1, 256), Addr(1, 512), Addr(1, 512)
    ops = [Matmul([mat(512, 256), mat(512, 256, GGMLType.Q6_K)], x, [g, u]), GatedAct("silu", g, u, g)]
    assert [type(op) for op in fuse(ops, MAX_SMEM)] == [Matmul, GatedAct]


def test_rope_with_different_positions_is_not_fused():
    q, k, v = Addr(3, 256), Addr(3, 128), Addr(3, 128)
    p1, p2 = Addr(3, dtype=np.int32), Addr(3, dtype=np.int32)
    ops = [Rope(q, 4, p1, ROPE), Rope(k, 2, p2, ROPE), KvStore(k, v, Addr(64, 128), Addr(64, 128), Addr(3))]
    assert [type(op) for op in fuse(ops, MAX_SMEM)] == [Rope, Rope, KvStore]
