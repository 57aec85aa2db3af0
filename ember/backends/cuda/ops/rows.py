"""Row-wise and elementwise ops: embeddings, norms, activations, adds, rope, the KV-cache write."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._kernels import matmul_module
from .base import Launch, elementwise, f32, i32, i64, ptr


@dataclass(eq=False)
class GetRows:
    """out (n, cols) = rows ids (n,) of w. With prev: ids -r - 1 name the first id of row r of prev
    (device int32 (rows, prev_k), best first) that row t of bans (device int32 (n, prev_k), -1
    padded) does not hold (see get_rows)."""

    w: Any
    ids: Any  # device int32 (n,)
    out: Any
    prev: Any = None
    prev_k: int = 0
    bans: Any = None

    def launches(self, kernels) -> list[Launch]:
        rows, cols = self.w.shape
        n = self.out.shape[0]
        grid = (-(-(cols // 32) // 128), n, 1)
        args = (ptr(self.w.data.buf), i64(self.w.data.row_bytes), i32(rows), i32(cols), ptr(self.ids), ptr(self.out),
                ptr(self.prev), i32(self.prev_k), ptr(self.bans))
        return [Launch(kernels.fn(matmul_module(self.w.type), "get_rows"), grid, (128, 1, 1), args)]


@dataclass(eq=False)
class RmsNorm:
    """out (rows, d) = x / rms(x) * w over rows of d = w's length; out may be x."""

    x: Any
    w: Any  # device f32 (d,) or None
    eps: float
    out: Any
    d: int

    @property
    def rows(self) -> int:
        return self.x.size // self.d

    def launches(self, kernels) -> list[Launch]:
        args = (ptr(self.x), ptr(self.w), ptr(self.out), i32(self.rows), i32(self.d), f32(self.eps))
        return [Launch(kernels.fn("ops", "rms_norm"), (-(-self.rows // 4), 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class LayerNorm:
    """out (rows, d) = (x - mean) / sqrt(var + eps) * w + b over rows of d; w, b device f32 (d,) or None."""

    x: Any
    w: Any
    b: Any
    eps: float
    out: Any

    def launches(self, kernels) -> list[Launch]:
        rows, d = self.x.shape
        args = (ptr(self.x), ptr(self.w), ptr(self.b), ptr(self.out), i32(rows), i32(d), f32(self.eps))
        return [Launch(kernels.fn("ops", "layer_norm"), (-(-rows // 4), 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class Gelu:
    """out = gelu_tanh(x), no gate"""

    x: Any
    out: Any

    def launches(self, kernels) -> list[Launch]:
        n = self.x.size
        return [elementwise(kernels, "gelu", n, ptr(self.x), ptr(self.out), i64(n))]


@dataclass(eq=False)
class Tanh:
    x: Any

    def launches(self, kernels) -> list[Launch]:
        n = self.x.size
        return [elementwise(kernels, "tanh_inplace", n, ptr(self.x), i64(n))]


@dataclass(eq=False)
class NormAdd:
    """Fused: h = rms_norm(h) * w, then x += h (rows of d)."""

    h: Any
    w: Any
    x: Any
    eps: float
    d: int

    def launches(self, kernels) -> list[Launch]:
        rows = self.h.size // self.d
        args = (ptr(self.h), ptr(self.w), ptr(self.x), i32(rows), i32(self.d), f32(self.eps))
        return [Launch(kernels.fn("ops", "norm_add"), (-(-rows // 4), 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class GatedAct:
    """out = act(gate) * up, act "silu" or "gelu" (tanh form)."""

    act: str
    gate: Any
    up: Any
    out: Any

    def launches(self, kernels) -> list[Launch]:
        n = self.gate.size
        return [elementwise(kernels, f"{self.act}_mul", n, ptr(self.gate), ptr(self.up), ptr(self.out), i64(n))]


@dataclass(eq=False)
class Add:
    a: Any
    b: Any
    out: Any

    def launches(self, kernels) -> list[Launch]:
        n = self.a.size
        return [elementwise(kernels, "add", n, ptr(self.a), ptr(self.b), ptr(self.out), i64(n))]


@dataclass(eq=False)
class Scale:
    x: Any
    s: float

    def launches(self, kernels) -> list[Launch]:
        n = self.x.size
        return [elementwise(kernels, "scale", n, ptr(self.x), f32(self.s), i64(n))]


@dataclass(eq=False)
class Softcap:
    """x = cap * tanh(x / cap)"""

    x: Any
    cap: float

    def launches(self, kernels) -> list[Launch]:
        n = self.x.size
        return [elementwise(kernels, "softcap", n, ptr(self.x), f32(self.cap), i64(n))]


@dataclass(eq=False)
class PosScale:
    """Row t of x (rows, d) *= 1 + scale * log(floor((pos[t] + offset) / length) + 1)"""

    x: Any
    pos: Any  # (rows,) int32 on the device
    length: int
    scale: float
    offset: float

    def launches(self, kernels) -> list[Launch]:
        rows, d = self.x.shape
        return [elementwise(kernels, "pos_scale", rows * d, ptr(self.x), ptr(self.pos), i32(rows), i32(d),
                            i32(self.length), f32(self.scale), f32(self.offset))]


@dataclass(eq=False)
class AddRow:
    """x (rows, d) += b (d,)"""

    x: Any
    b: Any

    def launches(self, kernels) -> list[Launch]:
        rows, d = self.x.shape
        return [elementwise(kernels, "add_row", rows * d, ptr(self.x), ptr(self.b), i32(rows), i32(d))]


@dataclass(eq=False)
class GatherRows:
    """out[r] = x[idx[r]]"""

    x: Any
    idx: Any  # device int32 (n,)
    out: Any

    def launches(self, kernels) -> list[Launch]:
        n, d = self.out.shape
        return [elementwise(kernels, "gather_rows", n * d, ptr(self.x), ptr(self.idx), ptr(self.out), i32(n), i32(d))]


@dataclass(frozen=True)
class RopeArgs:
    """RopeParams resolved for the kernels (YaRN ramp bounds and magnitude scale computed here)."""

    n_rot: int
    neox: bool
    base: float
    freq_scale: float
    ext_factor: float
    mscale: float
    corr_low: float
    corr_high: float
    freq_factors: Any  # device f32 (n_rot/2,) or None

    def kernel_args(self) -> tuple:
        return (i32(self.n_rot), i32(int(self.neox)), f32(self.base), f32(self.freq_scale), f32(self.ext_factor),
                f32(self.mscale), f32(self.corr_low), f32(self.corr_high), ptr(self.freq_factors))


@dataclass(eq=False)
class Rope:
    """x (n, n_head * head_dim) rotated in place at positions pos."""

    x: Any
    n_head: int
    pos: Any  # device int32 (n,)
    p: RopeArgs

    def launches(self, kernels) -> list[Launch]:
        n, width = self.x.shape
        args = (ptr(self.x), ptr(self.pos), i32(self.n_head), i32(width // self.n_head), *self.p.kernel_args())
        return [Launch(kernels.fn("ops", "rope"), (n, 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class KvStore:
    k: Any
    v: Any
    k_cache: Any
    v_cache: Any
    slots: Any  # device int64 (n,)

    def launches(self, kernels) -> list[Launch]:
        n = self.k.shape[0]
        args = (ptr(self.k), ptr(self.v), ptr(self.k_cache), ptr(self.v_cache), ptr(self.slots),
                i32(self.k_cache.shape[1]), i32(self.v_cache.shape[1]))
        return [Launch(kernels.fn("ops", "kv_store"), (n, 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class CopyPages:
    """For each (src, dst) row of pairs: page dst of every layer's keys and values = page src."""

    layers: list  # [(k_cache, v_cache)]: f16 (n_slots, dim), or u8 (n_slots, row bytes)
    pairs: Any  # device int32 (n, 2)
    page: int  # slots per page

    def launches(self, kernels) -> list[Launch]:
        n = self.pairs.shape[0]
        out = []
        for k, v in self.layers:
            # in units of 16 bits (rows of any KV type are whole numbers of them)
            k_dim, v_dim = k.shape[1] * k.dtype.itemsize // 2, v.shape[1] * v.dtype.itemsize // 2
            chunks = max(1, min(64, -(-self.page * max(k_dim, v_dim) // (8 * 256))))
            out.append(Launch(kernels.fn("ops", "copy_pages"), (chunks, n, 1), (256, 1, 1),
                              (ptr(k), ptr(v), ptr(self.pairs), i32(self.page), i32(k_dim), i32(v_dim))))
        return out


NO_ROPE = RopeArgs(0, False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, None)
