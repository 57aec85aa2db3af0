"""Fusion of a recorded step's ops, before the step is captured into a CUDA graph.

At one token per sequence a step is hundreds of tiny kernels, and their launch gaps, not the
bytes they move, set the step time. Neighbouring ops are merged where one kernel can do both:

  RmsNorm(x -> h) + Matmul(h)            -> Matmul normalising x itself (and still writing h)
  Matmul(gate, up) + SiluMul/GeluMul     -> Matmul writing gate, up and act(gate) * up
  Matmul(-> h) + Add(r, h -> r)          -> Matmul writing h and adding it into r
  RmsNorm(h -> h) + Add(r, h -> r)       -> NormAdd
  [RmsNorm q, RmsNorm k,] Rope q, Rope k, KvStore -> QkvPost

Every fused op writes everything its parts wrote, so no liveness analysis is needed; the rules
only check that no output overlaps an input another block of the same kernel still reads.
Products fuse only on the matrix-vector path (decode), where the fusions are epilogues and
prologues of one kernel. Pure Python on array addresses: testable without a GPU.
"""
from __future__ import annotations

from dataclasses import replace

from ._ops import (
    MODE_GELU,
    MODE_RESIDUAL,
    MODE_SILU,
    MODE_STORE,
    Add,
    GatedAct,
    KvStore,
    Matmul,
    NormAdd,
    QkvPost,
    RmsNorm,
    Rope,
    use_matvec,
)


def fuse(ops: list, max_smem: int) -> list:
    merged: list = []
    for op in ops:
        merged.append(op)
        while len(merged) >= 2:
            pair = merge_pair(merged[-2], merged[-1], max_smem)
            if pair is None:
                break
            merged[-2:] = [pair]
    return fuse_qkv_post(merged)


def merge_pair(a, b, max_smem: int):
    """One op doing a then b, or None."""
    if isinstance(a, RmsNorm) and isinstance(b, Matmul):
        return norm_into_matmul(a, b, max_smem)
    if isinstance(a, Matmul) and isinstance(b, GatedAct):
        return gate_into_matmul(a, b, max_smem)
    if isinstance(a, Matmul) and isinstance(b, Add):
        return residual_into_matmul(a, b, max_smem)
    if isinstance(a, RmsNorm) and isinstance(b, Add):
        return norm_add(a, b)
    return None


def norm_into_matmul(norm: RmsNorm, mm: Matmul, max_smem: int):
    if not (mm.norm_w is None and mm.mode == MODE_STORE and same(mm.x, norm.out) and norm.w is not None):
        return None
    if norm.d != mm.k or not matvec(mm, max_smem) or overlap(norm.out, norm.x):
        return None
    if any(overlap(o, norm.x) or overlap(o, norm.out) for o in mm.outs):
        return None
    return replace(mm, x=norm.x, norm_w=norm.w, eps=norm.eps, h_out=norm.out)


def gate_into_matmul(mm: Matmul, act: GatedAct, max_smem: int):
    if mm.mode != MODE_STORE or len(mm.ws) != 2 or not matvec(mm, max_smem):
        return None
    gate, up = mm.ws
    if gate.type != up.type or gate.shape != up.shape:
        return None
    if not (same(act.gate, mm.outs[0]) and same(act.up, mm.outs[1]) and act.out.shape == act.gate.shape):
        return None
    # The kernel writes gate, up, then the activation, element by element in one thread: the
    # activation may land on gate or up exactly, but must not overlap anything else.
    in_place = same(act.out, mm.outs[0]) or same(act.out, mm.outs[1])
    if (not in_place and reads_overlap(mm, act.out)) or overlap(act.out, mm.x) or overlap(act.out, mm.h_out):
        return None
    return replace(mm, mode=MODE_SILU if act.act == "silu" else MODE_GELU, aux=act.out)


def residual_into_matmul(mm: Matmul, add: Add, max_smem: int):
    if mm.mode != MODE_STORE or len(mm.ws) != 1 or not matvec(mm, max_smem):
        return None
    h = mm.outs[0]
    if same(add.a, h) and same(add.b, add.out) or same(add.b, h) and same(add.a, add.out):
        res = add.out
    else:
        return None
    if overlap(res, h) or reads_overlap(mm, res):
        return None
    return replace(mm, mode=MODE_RESIDUAL, aux=res)


def norm_add(norm: RmsNorm, add: Add):
    h = norm.out
    if norm.w is None or not same(norm.x, h) or norm.d != h.shape[-1]:
        return None
    if not (same(add.out, add.a) and same(add.b, h)) and not (same(add.out, add.b) and same(add.a, h)):
        return None
    if overlap(add.out, h):
        return None
    return NormAdd(h=h, w=norm.w, x=add.out, eps=norm.eps, d=norm.d)


def fuse_qkv_post(ops: list) -> list:
    out, i = [], 0
    while i < len(ops):
        fused, used = match_qkv_post(ops, i)
        if fused is None:
            out.append(ops[i])
            i += 1
        else:
            out.append(fused)
            i += used
    return out


def match_qkv_post(ops: list, i: int):
    """[RmsNorm q, RmsNorm k,] Rope q, Rope k, KvStore(k, v) at ops[i:], or (None, 0)."""
    norms = ops[i:i + 2]
    with_norms = len(norms) == 2 and all(isinstance(o, RmsNorm) for o in norms)
    j = i + 2 if with_norms else i
    seq = ops[j:j + 3]
    if len(seq) != 3 or not (isinstance(seq[0], Rope) and isinstance(seq[1], Rope) and isinstance(seq[2], KvStore)):
        return None, 0
    rq, rk, st = seq
    q, k = rq.x, rk.x
    hd = q.shape[1] // rq.n_head
    if k.shape[1] // rk.n_head != hd or not same(rq.pos, rk.pos) or not same_rope(rq.p, rk.p) or not same(st.k, k):
        return None, 0
    if rq.p.n_rot > 512 or overlap(q, k) or overlap(q, st.v) or overlap(k, st.v):
        return None, 0
    q_norm = k_norm = None
    eps = 0.0
    if with_norms:
        nq, nk = norms
        in_place = same(nq.x, q) and same(nq.out, q) and same(nk.x, k) and same(nk.out, k)
        if not (in_place and nq.d == hd and nk.d == hd and nq.eps == nk.eps and nq.w is not None and nk.w is not None):
            return None, 0
        q_norm, k_norm, eps = nq.w, nk.w, nq.eps
    fused = QkvPost(q=q, k=k, v=st.v, q_norm=q_norm, k_norm=k_norm, eps=eps, pos=rq.pos, p=rq.p, n_head=rq.n_head,
                    n_kv=rk.n_head, k_cache=st.k_cache, v_cache=st.v_cache, slots=st.slots)
    return fused, (j - i) + 3


# ---- array identity on device addresses ----

def matvec(mm: Matmul, max_smem: int) -> bool:
    return all(use_matvec(w.type, mm.n, mm.k, max_smem) for w in mm.ws)


def address(a) -> int:
    return a.data.ptr


def same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (address(a) == address(b) and a.shape == b.shape and a.dtype == b.dtype)


def overlap(a, b) -> bool:
    if a is None or b is None:
        return False
    pa, pb = address(a), address(b)
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def reads_overlap(mm: Matmul, out) -> bool:
    """Whether `out` overlaps what a product reads or writes besides it (x, h_out, outs)."""
    return overlap(out, mm.x) or overlap(out, mm.h_out) or any(overlap(out, o) for o in mm.outs)


def same_rope(a, b) -> bool:
    fields = ("n_rot", "neox", "base", "freq_scale", "ext_factor", "mscale", "corr_low", "corr_high")
    return all(getattr(a, f) == getattr(b, f) for f in fields) and (
        a.freq_factors is b.freq_factors or same(a.freq_factors, b.freq_factors))
