"""Fusion of a recorded step's ops, before the step is captured into a CUDA graph.

At one token per sequence a step is hundreds of tiny kernels, and their launch gaps, not the
bytes they move, set the step time. Neighbouring ops are merged where one kernel can do both.
First, pairs as the ops arrive:

  RmsNorm(x -> h) + Matmul(h)            -> Matmul whose quant_x launch normalises x (writing h)
  GatherRows(x -> g) + that, normed in place -> the quant_x launch gathers the rows itself
  Matmul(gate, up) + SiluMul/GeluMul     -> Matmul writing gate, up and act(gate) * up
  Matmul(-> h) + Add(r, h -> r)          -> Matmul writing h and adding it into r
  RmsNorm(h -> h) + Add(r, h -> r)       -> NormAdd
  Matmul(-> h) + NormAdd(h, r)           -> Matmul whose tail normalises h and adds it into r
  ExpertMatmul(-> y) + ExpertBias(y)     -> ExpertMatmul adding the chosen experts' bias rows as it
                                            stores y (gpt-oss: three launches a layer fewer)
  GatedAct/SwigluOai(-> a) + ExpertMatmul(a) -> ExpertMatmul whose quant_x_llama computes a from gate
                                            and up as it rounds it (and stores it): a launch a layer fewer
  ExpertSum(-> h) + Add(x, h -> x)       -> ExpertSum adding h into x as it stores it
  RouteExperts(-> ids) + ExpertMatmul(ids) -> ExpertMatmul whose quant_x_llama launch also routes
                                            (other blocks of it: the two are independent)
  [RmsNorm q, RmsNorm k,] Rope q, Rope k, KvStore -> QkvPost
  QkvPost + Attention, one token per sequence -> Attention doing the QkvPost's work (decode steps)

then producers take over the next product's activation work (decode products read x quantized):

  Matmul with a post-norm tail + Matmul normalising r -> the second one's blocks do the post-norm
      and residual add before their own norm (residual prologue; its last block writes r back)
  Matmul with a tail + Matmul normalising r  -> the tail also normalises and quantizes r
  gated Matmul + Matmul(act)             -> the gated one quantizes act in its epilogue
  Attention + Matmul(out)                -> attention quantizes its output

Every fused op writes everything its parts wrote, so no liveness analysis is needed; the rules
only check that no output overlaps an input another block of the same kernel still reads. The
one exception: an attention doing the QkvPost's work leaves q and k as the product wrote them
(its blocks normalise and rotate copies), so it forms only where no later op reads them.
Products fuse on the matrix-vector path (decode), where the fusions are prologues and
epilogues; batched-decode products (mm_split) fuse a residual add or a gate into the epilogue.
Pure Python on array addresses: testable without a GPU.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace

from .ops import (
    MODE_GELU,
    MODE_RESIDUAL,
    MODE_SILU,
    MODE_STORE,
    Add,
    Attention,
    GatedAct,
    GatherRows,
    KvStore,
    Matmul,
    NormAdd,
    QkvPost,
    ResidualPrologue,
    RmsNorm,
    Rope,
    Tail,
)
from .ops.base import quantized
from .ops.experts import ExpertBias, ExpertMatmul, ExpertSum, RouteExperts, SwigluOai


def fuse(ops: list, new_counter: Callable | None = None) -> list:
    """The fused op list. new_counter() gives a zeroed device uint32 for each tail or residual
    prologue; without it, neither forms. Tails form where they take over a post-norm and residual
    add (gemma's layers); a plain residual add keeps the next norm in that product's quant_x
    launch, which measured faster than a tail doing it."""
    merged: list = []
    for op in ops:
        merged.append(op)
        while len(merged) >= 2:
            pair = merge_pair(merged[-2], merged[-1], new_counter)
            if pair is None:
                break
            merged[-2:] = [pair]
    merged = fold_qkv_posts(fuse_qkv_post(merged))
    return hand_over_activations(merged, new_counter)


def merge_pair(a, b, new_counter):
    """One op doing a then b, or None."""
    if isinstance(a, RmsNorm) and isinstance(b, Matmul):
        return norm_into_matmul(a, b)
    if isinstance(a, GatherRows) and isinstance(b, Matmul):
        return gather_into_matmul(a, b)
    if isinstance(a, Matmul) and isinstance(b, GatedAct):
        return gate_into_matmul(a, b)
    if isinstance(a, Matmul) and isinstance(b, Add):
        return residual_into_matmul(a, b)
    if isinstance(a, RmsNorm) and isinstance(b, Add):
        return norm_add(a, b)
    if isinstance(a, Matmul) and isinstance(b, NormAdd) and new_counter is not None:
        return norm_add_into_tail(a, b, new_counter)
    if isinstance(a, ExpertMatmul) and isinstance(b, ExpertBias):
        return bias_into_experts(a, b)
    if isinstance(a, (GatedAct, SwigluOai)) and isinstance(b, ExpertMatmul):
        return act_into_experts(a, b)
    if isinstance(a, ExpertSum) and isinstance(b, Add):
        return residual_into_expert_sum(a, b)
    if isinstance(a, RouteExperts) and isinstance(b, ExpertMatmul):
        return route_beside_quant(a, b)
    return None


def route_beside_quant(route: RouteExperts, em: ExpertMatmul):
    """em routed by route, whose quant_x_llama launch also does the routing in blocks of its own: where
    em quantizes x at all (every matrix quantized) and neither part reads what the other writes."""
    if em.route is not None or not same(em.ids, route.ids) or any(not quantized(w.type) for w in em.ws):
        return None
    writes = [route.ids, route.weights]
    reads = [em.x] + ([em.act.gate, em.act.up] if em.act is not None else [])
    q_writes = [em.scratch.xq] + ([em.act.out] if em.act is not None else [])
    if any(overlap(a, b) for a in writes for b in reads + q_writes) or any(overlap(route.logits, b) for b in q_writes):
        return None
    return replace(em, route=route)


def residual_into_expert_sum(es: ExpertSum, add: Add):
    """es whose threads also add each sum into the residual (x + h, as the add kernel sums it)."""
    res = residual_of(add, es.out)
    if es.res is not None or res is None or any(overlap(res, o) for o in (es.y, es.weights, es.out)):
        return None
    return replace(es, res=res)


def act_into_experts(act, em: ExpertMatmul):
    """em whose x is act's out, computed by its quant_x_llama launch from act's gate and up. Only where
    every matrix is quantized (float stacks read x itself, before that launch) and x is one row a
    selection. The launch reads gate[i] and up[i] and writes out[i] in one thread, so out may be gate or
    up exactly but must not partly overlap them."""
    if em.act is not None or em.x_div != 1 or not same(em.x, act.out) or any(not quantized(w.type) for w in em.ws):
        return None
    if not (act.gate.shape == act.up.shape == act.out.shape):
        return None
    for src in (act.gate, act.up):
        if overlap(act.out, src) and not same(act.out, src):
            return None
    return replace(em, act=act)


def bias_into_experts(em: ExpertMatmul, eb: ExpertBias):
    """em whose product into eb's rows adds eb's biases (the same routing, no bias there yet)."""
    if not same(em.ids, eb.ids):
        return None
    for i, y in enumerate(em.ys):
        if same(y, eb.y):
            biases = list(em.biases or [None] * len(em.ys))
            if biases[i] is not None:
                return None
            biases[i] = eb.b
            return replace(em, biases=biases)
    return None


def plain(mm: Matmul) -> bool:
    """A decode product with no epilogue fused into it yet (a norm prologue is allowed)."""
    return mm.matvec() and mm.mode == MODE_STORE and mm.tail is None and mm.act_q is None


def plain_or_split(mm: Matmul) -> bool:
    """plain, or a batched-decode product (mm_split) with no epilogue yet: those fuse a residual
    add or a gate too."""
    return plain(mm) or (mm.split() and mm.mode == MODE_STORE and mm.tail is None and mm.act_q is None)


def keeps_path(before: Matmul, after: Matmul):
    """after, if it still takes the path before took (mm_split's gate needs partial sums room)."""
    return after if after.matvec() or not before.split() or after.split() else None


def norm_into_matmul(norm: RmsNorm, mm: Matmul):
    if not (plain(mm) and mm.norm_w is None and mm.quant_in and same(mm.x, norm.out) and norm.w is not None
            and norm.d == mm.k):
        return None
    if any(overlap(o, norm.x) or overlap(o, norm.out) for o in mm.outs):
        return None
    # quant_x reads each row of x whole before writing it: h may be x itself
    return replace(mm, src=norm.x, norm_w=norm.w, eps=norm.eps)


def gather_into_matmul(g: GatherRows, mm: Matmul):
    """The gathered rows, normalised in place, feed the product: quant_x gathers them itself."""
    if mm.norm_w is None or mm.idx is not None or not (same(mm.src, g.out) and same(mm.x, g.out)):
        return None
    if overlap(g.x, g.out) or g.x.shape[1] != mm.k or any(overlap(o, g.x) for o in mm.outs):
        return None
    return replace(mm, src=g.x, idx=g.idx)


def gate_into_matmul(mm: Matmul, act: GatedAct):
    if not plain_or_split(mm) or len(mm.ws) != 2:
        return None
    gate, up = mm.ws
    if gate.type != up.type or gate.shape != up.shape:
        return None
    if not (same(act.gate, mm.outs[0]) and same(act.up, mm.outs[1]) and act.out.shape == act.gate.shape):
        return None
    # The kernel writes gate, up, then the activation, element by element in one thread: the
    # activation may land on gate or up exactly, but must not overlap anything else.
    in_place = same(act.out, mm.outs[0]) or same(act.out, mm.outs[1])
    if (not in_place and reads_overlap(mm, act.out)) or overlap(act.out, mm.x):
        return None
    return keeps_path(mm, replace(mm, mode=MODE_SILU if act.act == "silu" else MODE_GELU, aux=act.out))


def residual_of(add: Add, h):
    """The residual x where add is x += h (x + h or h + x, written into x), else None."""
    if same(add.a, h) and same(add.b, add.out) or same(add.b, h) and same(add.a, add.out):
        return add.out
    return None


def residual_into_matmul(mm: Matmul, add: Add):
    if not plain_or_split(mm) or len(mm.ws) != 1:
        return None
    h = mm.outs[0]
    res = residual_of(add, h)
    if res is None or overlap(res, h) or reads_overlap(mm, res):
        return None
    return keeps_path(mm, replace(mm, mode=MODE_RESIDUAL, aux=res))


def norm_add(norm: RmsNorm, add: Add):
    h = norm.out
    if norm.w is None or not same(norm.x, h) or norm.d != h.shape[-1]:
        return None
    if residual_of(add, h) is None or overlap(add.out, h):
        return None
    return NormAdd(h=h, w=norm.w, x=add.out, eps=norm.eps, d=norm.d)


def norm_add_into_tail(mm: Matmul, na: NormAdd, new_counter):
    """The product's output h, normalised and added into the residual by its last block."""
    if not plain(mm) or len(mm.ws) != 1 or not same(na.h, mm.outs[0]) or na.d != mm.ws[0].shape[0]:
        return None
    if overlap(na.x, na.h) or reads_overlap(mm, na.x):
        return None
    tail = Tail(counter=new_counter(), res=na.x, add=True, post_w=na.w, post_eps=na.eps)
    return replace(mm, tail=tail)


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


def fold_qkv_posts(ops: list) -> list:
    out: list = []
    for i, op in enumerate(ops):
        folded = None
        if isinstance(op, Attention) and out and isinstance(out[-1], QkvPost):
            folded = fold_qkv_post(out[-1], op, ops[i + 1:])
        if folded is None:
            out.append(op)
        else:
            out[-1] = folded
    return out


def fold_qkv_post(post: QkvPost, att: Attention, later: list):
    """The attention doing post's work itself (attn in attention.cu), or None. Only where every
    token is the only one of its sequence: a token's blocks write its key and value to the cache
    and read them back, and no other token's blocks read that row."""
    if not att.one_token_per_seq or att.post is not None or att.tiles:
        return None
    if not (same(post.q, att.q) and same(post.pos, att.pos) and same(post.k_cache, att.k_cache)
            and same(post.v_cache, att.v_cache)):
        return None
    hd_k, hd_v = att.k_cache.shape[1] // att.n_kv, att.v_cache.shape[1] // att.n_kv
    if post.n_head != att.n_head or post.n_kv != att.n_kv or hd_k != hd_v or post.p.n_rot > hd_k:
        return None
    widths = (post.q.shape[1], post.k.shape[1], post.v.shape[1])
    if widths != (att.n_head * hd_k, att.n_kv * hd_k, att.n_kv * hd_v) or post.slots.shape[0] != post.q.shape[0]:
        return None
    # other blocks of the launch still read q, k and v while one writes the output or the cache
    written = (att.out, att.part, att.xq, att.k_cache, att.v_cache)
    if any(overlap(w, r) for w in written for r in (post.q, post.k, post.v)):
        return None
    if not unread_later(later, (post.q, post.k)):  # they keep the product's values
        return None
    return replace(att, post=post)


def unread_later(ops: list, arrays) -> bool:
    """Whether no op of `ops` reads (or writes in part) any of `arrays` before a product
    overwrites it whole. Every array an op refers to counts as read, but a product's outputs."""
    live = list(arrays)
    for op in ops:
        if not is_dataclass(op):  # a record of unknown fields: it may read anything
            return False
        outs = op.outs if isinstance(op, Matmul) else []
        refs = [a for f in fields(op) if not (outs and f.name == "outs") for a in arrays_in(getattr(op, f.name))]
        if any(overlap(a, r) for a in live for r in refs):
            return False
        live = [a for a in live if not any(same(a, o) for o in outs)]
        if not live:
            break
    return True


def arrays_in(value):
    """The device arrays a record refers to, through lists and nested records."""
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from arrays_in(v)
    elif hasattr(value, "nbytes") and hasattr(getattr(value, "data", None), "ptr"):
        yield value
    elif is_dataclass(value) and not isinstance(value, type):
        for f in fields(value):
            yield from arrays_in(getattr(value, f.name))


# ---- producers writing the next product's activations ----

def hand_over_activations(ops: list, new_counter) -> list:
    out = list(ops)
    for i in range(len(out) - 1):
        a, b = out[i], out[i + 1]
        if not isinstance(b, Matmul) or not b.matvec() or not b.quant_in:
            continue
        pair = None
        if isinstance(a, Matmul) and new_counter is not None and a.tail is not None:
            pair = post_norm_into_prologue(a, b, new_counter) or norm_into_tail(a, b, new_counter)
        if pair is None and isinstance(a, Matmul):
            pair = act_quant(a, b)
        if pair is None and isinstance(a, Attention):
            pair = attention_quant(a, b)
        if pair is not None:
            out[i], out[i + 1] = pair
    return out


def post_norm_into_prologue(p: Matmul, c: Matmul, new_counter):
    """p's tail adds its post-normed output y into the residual r, and c normalises r: c's blocks
    do both instead, each from y and r (the tail ran in one block after all of p's), and p only
    writes y."""
    t = p.tail
    if t is None or not t.add or t.post_w is None or t.pre_w is not None or len(p.ws) != 1:
        return None
    if c.norm_w is None or c.idx is not None or c.tail is not None or not same(c.src, t.res) or c.n != p.n:
        return None
    y, res = p.outs[0], t.res
    if tuple(y.shape) != tuple(res.shape) or overlap(y, res):
        return None
    pro = ResidualPrologue(y, t.post_w, t.post_eps, new_counter(), yout=None if same(y, c.x) else y)
    cand = replace(c, pro_res=pro)
    if not cand.in_prologue():
        return None
    # c's blocks read y and r while others write c's outputs, and its last block writes r and y
    written = [*c.outs, c.aux, c.act_q, c.xq]
    if any(overlap(w, y) or overlap(w, res) for w in written) or overlap(c.x, res):
        return None
    if not same(y, c.x) and overlap(y, c.x):  # h is written whole by one block, y read by all
        return None
    return replace(p, tail=None), cand


def norm_into_tail(p: Matmul, c: Matmul, new_counter):
    """p's tail adds into the residual r and c normalises r: the tail does c's norm too."""
    if c.norm_w is None or c.idx is not None or len(p.ws) != 1 or not p.matvec() or p.act_q is not None:
        return None
    if not (p.mode == MODE_STORE and p.tail is not None and p.tail.add and p.tail.pre_w is None):
        return None
    res = p.tail.res
    d = p.ws[0].shape[0]
    if not same(c.src, res) or c.k != d or d % 32 or c.n != p.n:
        return None
    if overlap(c.x, res) or (c.xq is not None and (overlap(c.xq, res) or reads_overlap(p, c.xq))):
        return None
    if c.needs_xq and c.xq is None:
        return None
    # c.x may be p's own output h: the tail overwrites row j of it only after reading it
    tail = replace(p.tail, pre_w=c.norm_w, pre_eps=c.eps, pre_h=c.x, pre_q=c.xq if c.needs_xq else None)
    return replace(p, tail=tail), replace(c, src=None, norm_w=None, eps=0.0, quant_in=False)


def act_quant(p: Matmul, c: Matmul):
    """A gated product's activation rows quantized by it, for the next product reading them."""
    if p.mode not in (MODE_SILU, MODE_GELU) or p.act_q is not None or p.tail is not None or not p.matvec():
        return None
    rows = p.ws[0].shape[0]
    if c.norm_w is not None or not c.needs_xq or c.xq is None or not same(c.x, p.aux) or rows % 32 or c.n != p.n \
            or not c.matvec():
        return None
    if reads_overlap(p, c.xq) or overlap(c.xq, p.aux):
        return None
    return replace(p, act_q=c.xq), replace(c, quant_in=False)


def attention_quant(a: Attention, c: Matmul):
    """Attention's output quantized as it is written, for the product reading it."""
    hd_v = a.v_cache.shape[1] // a.n_kv
    if hd_v % 32 or a.tiles or a.xq is not None or c.norm_w is not None or not c.needs_xq or c.xq is None \
            or not c.matvec():
        return None
    reads = (a.q, a.post.k, a.post.v) if a.post is not None else (a.q,)
    if not same(c.x, a.out) or overlap(c.xq, a.out) or any(overlap(c.xq, r) for r in reads):
        return None
    return replace(a, xq=c.xq), replace(c, quant_in=False)


# ---- array identity on device addresses ----

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
    """Whether `out` overlaps what a product reads or writes besides it (x, src, xq, outs)."""
    return (overlap(out, mm.x) or overlap(out, mm.src) or overlap(out, mm.xq)
            or any(overlap(out, o) for o in mm.outs))


def same_rope(a, b) -> bool:
    fields = ("n_rot", "neox", "base", "freq_scale", "ext_factor", "mscale", "corr_low", "corr_high")
    return all(getattr(a, f) == getattr(b, f) for f in fields) and (
        a.freq_factors is b.freq_factors or same(a.freq_factors, b.freq_factors))
