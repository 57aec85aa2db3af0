"""Mixture-of-experts ops: routing, grouped expert products (experts.cu) and the weighted sum. The
expert ids stay on the device: the products read them there, every expert's blocks take part in the
grid (those nobody chose return at once), so a step's launches have a fixed shape and are captured
like the others."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....quant.types import GGMLType
from .base import MATRIX_TYPES, Launch, f32, i32, i64, ptr

EXP_ROWS = 8  # rows of a block of expert_matmul, one a warp (experts.cu)
ROUTE_MAX_EXPERTS = 256  # route_experts holds 8 experts a lane (ops.cu)
# Types of stacked experts: every matrix type, and MXFP4 (gpt-oss's experts; unit_q in quant.cuh)
EXPERT_TYPES = MATRIX_TYPES | {GGMLType.MXFP4}


def experts_module(qtype) -> str:
    return f"experts_{int(qtype)}"


@dataclass(eq=False)
class RouteExperts:
    """ids (n, k) int32 and weights (n, k) = each row's k most probable experts of softmax(logits)."""

    logits: Any  # (n, n_expert)
    k: int
    norm: bool
    ids: Any
    weights: Any

    def launches(self, kernels) -> list[Launch]:
        n, n_expert = self.logits.shape
        args = (ptr(self.logits), ptr(self.ids), ptr(self.weights), i32(n), i32(n_expert), i32(self.k),
                i32(int(self.norm)))
        return [Launch(kernels.fn("ops", "route_experts"), (-(-n // 4), 1, 1), (128, 1, 1), args)]


@dataclass(eq=False)
class ExpertMatmul:
    """y (n_sel, m): row s = w[ids[s]] @ x[s // x_div], w stacked experts (n_expert, m, k)."""

    w: Any  # Weight (data: DeviceMatrix of the whole stack)
    x: Any
    x_div: int
    ids: Any  # device int32, n_sel values
    y: Any

    def launches(self, kernels) -> list[Launch]:
        n_expert, m, k = self.w.shape
        row_bytes = self.w.data.row_bytes
        args = (ptr(self.w.data.buf), i64(row_bytes), i64(m * row_bytes), i32(m), i32(k), ptr(self.x),
                i32(self.x_div), ptr(self.ids), i32(self.ids.size), ptr(self.y))
        fn = kernels.fn(experts_module(self.w.type), "expert_matmul")
        return [Launch(fn, (-(-m // EXP_ROWS), n_expert, 1), (32 * EXP_ROWS, 1, 1), args)]


@dataclass(eq=False)
class ExpertSum:
    """out (n, d) = sum over u of weights[t, u] * y[t * k + u]."""

    y: Any
    weights: Any
    out: Any

    def launches(self, kernels) -> list[Launch]:
        n, k = self.weights.shape
        d = self.out.shape[1]
        args = (ptr(self.y), ptr(self.weights), ptr(self.out), i32(n), i32(k), i32(d))
        return [Launch(kernels.fn("ops", "expert_sum"), (-(-(n * d) // 256), 1, 1), (256, 1, 1), args)]


@dataclass(eq=False)
class ExpertBias:
    """y (n_sel, d) += b[ids[s]] for each row s (b: the stacked biases, (n_expert, d) f32)."""

    y: Any
    b: Any  # Weight (data: DeviceMatrix)
    ids: Any

    def launches(self, kernels) -> list[Launch]:
        rows, d = self.y.shape
        args = (ptr(self.y), ptr(self.b.data.buf), ptr(self.ids), i32(rows), i32(d))
        return [Launch(kernels.fn("ops", "expert_bias"), (-(-(rows * d) // 256), 1, 1), (256, 1, 1), args)]


@dataclass(eq=False)
class SwigluOai:
    """out = g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit)."""

    gate: Any
    up: Any
    out: Any
    alpha: float
    limit: float

    def launches(self, kernels) -> list[Launch]:
        n = self.gate.size
        args = (ptr(self.gate), ptr(self.up), ptr(self.out), i64(n), f32(self.alpha), f32(self.limit))
        return [Launch(kernels.fn("ops", "swiglu_oai"), (-(-n // 256), 1, 1), (256, 1, 1), args)]
