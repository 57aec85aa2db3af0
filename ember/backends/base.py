"""The interface between model code and compute backends.

Model files describe the math as a sequence of these ops on backend arrays; a backend
decides how each op runs (C kernels, GPU kernels, or float64 numpy for reference).
Every op writes into an `out` array owned by the caller, so a forward pass allocates
nothing once its buffers exist.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..quant.types import GGMLType


class BackendError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Weight:
    """A model tensor as the backend holds it. `shape` is numpy order (rows, cols)."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    data: Any  # backend-specific storage (CPU: the zero-copy view of the file's bytes)


@dataclass(frozen=True, slots=True)
class RopeParams:
    """Rotary embedding of one attention layer, in ggml's parametrisation."""

    n_rot: int
    neox: bool
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    freq_factors: Any = None  # backend array (n_rot/2,) or None


@dataclass(slots=True)
class AttentionBatch:
    """Where each token of a step lives in the paged KV cache (host int arrays).

    positions (n,) int32: position of each token in its sequence.
    seq_rows (n,) int32: row of `block_tables` holding the token's sequence's page table.
    block_tables (n_seq, max_pages) int32: page ids of each sequence, in position order.
    slots (n,) int64: cache slot written for each token = page * page_size + offset.
    """

    positions: np.ndarray
    seq_rows: np.ndarray
    block_tables: np.ndarray
    slots: np.ndarray
    page_size: int

    @property
    def n_tokens(self) -> int:
        return len(self.positions)


# The KV cache's storage types, as llama.cpp's --cache-type-k/-v name them.
KV_TYPES = {"f16": GGMLType.F16, "bf16": GGMLType.BF16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}


def kv_type(name: str) -> GGMLType:
    """The type a --cache-type name stands for (ValueError for an unknown one)."""
    t = KV_TYPES.get(name.lower())
    if t is None:
        raise ValueError(f"unknown KV cache type {name!r} (have: {', '.join(KV_TYPES)})")
    return t


def kv_rotation(t: GGMLType, head_dim: int, largest: bool) -> int:
    """Values per Walsh-Hadamard block a cache of type t rotates its rows by (0: none), as llama.cpp
    does: block types only, heads of a multiple of 64; keys in the largest power of two dividing the
    head (largest), values in 64."""
    if t in (GGMLType.F16, GGMLType.BF16) or head_dim % 64:
        return 0
    return head_dim & -head_dim if largest else 64


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer's key and value storage, rows of `k_type` and `v_type` (unpacks as (k, v)).
    k_rot, v_rot > 0: keys (and the queries meeting them), values (and the attention output) are
    rotated in blocks of that many values (kv_rotation): quantization then meets no outliers.
    parts > 1 (backends with capabilities.kv_head_parts): a slot's row is cut into that many equal
    parts (one a kv head), and within a page of the cache each part's rows lie together: a page's
    bytes are those of its rows either way, but a slot's row is not one run of them (KVCache's
    read_pages and write_pages give and take rows whole)."""

    k: Any
    v: Any
    k_type: GGMLType = GGMLType.F16
    v_type: GGMLType = GGMLType.F16
    k_rot: int = 0
    v_rot: int = 0
    parts: int = 1

    def __iter__(self):
        yield self.k
        yield self.v

    def __getitem__(self, i: int):
        return (self.k, self.v)[i]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do beyond the ops every backend has. The engine asks this declaration,
    never the backend's attributes; each capability comes with the methods named here."""

    # top_k(logits, k, ids, vals): each row of logits reduced to its k best where the logits are
    # (greedy steps then bring back token ids, not rows of vocabulary size)
    top_k: bool = False
    # record() -> context manager yielding a recording, replay(recording): a step's ops recorded
    # once and replayed in one call
    record: bool = False
    max_recorded_tokens: int = 0  # steps up to this many tokens are worth recording (at least the runner's 64)
    # replay(recording, wait=False) returns once the step is queued; mark() -> a point in the
    # device's queue, wait_mark(mark) until the work before it is done (the host overlaps the device)
    overlap: bool = False
    # get_rows(w, ids, out, prev=, bans=): ids -r - 1 name the first of row r's best ids of the step
    # before (prev, on the device) not among that token's bans: a decode step launched before the
    # host has read the one before it (the engine's decode-ahead)
    chain_tokens: bool = False
    pad_decode_steps: bool = False  # decode steps cost about the same padded to a few recorded sizes
    # copy_pages(layers, pairs, page_size) of its own (else the KV cache copies with array indexing)
    copy_pages: bool = False
    # the KV cache's storage types kv_cache takes (F16 everywhere; quantized rows are read in place)
    kv_types: frozenset = frozenset({GGMLType.F16})
    # kv_store and attention take caches whose pages hold each kv head's rows together (KVLayer.parts)
    kv_head_parts: bool = False

    def __post_init__(self):
        if self.overlap and not self.record:
            raise ValueError("overlap needs record: only replayed steps run while the host goes on")
        if self.chain_tokens and not (self.overlap and self.top_k):
            raise ValueError("chain_tokens needs overlap and top_k")
        if self.max_recorded_tokens < 0:
            raise ValueError(f"max_recorded_tokens must be >= 0, got {self.max_recorded_tokens}")


class Backend(Protocol):
    """What a backend provides. Arrays are the backend's own type (numpy on the CPU). A backend
    is a module or package `ember.backends.<name>` exporting a class `Backend`, which declares
    its `capabilities` (a class attribute; an instance may narrow or widen it for the device it
    opened, as WebGPU's does for a GPU against a CPU adapter) and has the methods they name besides
    the ops below."""

    name: str
    n_threads: int
    capabilities: Capabilities

    def weight(self, tensor, streamed: bool = True) -> Weight:
        """Make a GGUF tensor (gguf_loader.TensorInfo) usable by the ops. streamed: each token reads
        all of it (a matrix of the products); False for a table whose rows are looked up (an
        embedding that is not also the output head), which a backend may leave in the file's
        mapping."""

    def settle(self) -> None:
        """Every weight of the model has been made: the backend may now move them where it reads
        them fastest, in the background (nothing to do for a backend that copied them already)."""

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> Any: ...

    def from_numpy(self, a: np.ndarray) -> Any: ...

    def to_numpy(self, a) -> np.ndarray: ...

    def kv_cache(self, n_slots: int, k_dim: int, v_dim: int, k_type: GGMLType = GGMLType.F16,
                 v_type: GGMLType = GGMLType.F16) -> KVLayer:
        """Key and value storage of one layer: n_slots rows of k_dim keys stored as k_type and of
        v_dim values as v_type (types among capabilities.kv_types)."""

    def supports(self, qtype: GGMLType) -> bool: ...

    # ---- ops ----
    def get_rows(self, w: Weight, ids: np.ndarray, out) -> None:
        """out (n, cols) = rows ids of w."""

    def matmul(self, w: Weight, x, out) -> None:
        """out (n, rows) = x (n, cols) @ w.T"""

    def matmuls(self, ws: list[Weight], x, outs: list) -> None:
        """outs[j] = x @ ws[j].T for matrices sharing one input (computed together where possible)."""

    def gather_rows(self, x, rows, out) -> None:
        """out[r] = x[rows[r]]"""

    def add_bias(self, x, b: Weight) -> None:
        """x (n, d) += b (d,)"""

    def rms_norm(self, x, w: Weight | None, eps: float, out) -> None:
        """Rows of x (n, d) (d = w's length) normalised and scaled; out may be x."""

    def rope(self, x, n_head: int, batch: AttentionBatch, p: RopeParams) -> None:
        """Rotate x (n, n_head * head_dim) in place at the batch's positions."""

    def silu_mul(self, gate, up, out) -> None: ...

    def gelu_mul(self, gate, up, out) -> None: ...

    def add(self, a, b, out) -> None: ...

    def layer_norm(self, x, w: Weight | None, b: Weight | None, eps: float, out) -> None:
        """Rows of x (n, d) centred, normalised, scaled by w and shifted by b (either may be None);
        out may be x. (Encoders: BERT and its kin.)"""

    def gelu(self, x, out) -> None:
        """out = gelu_tanh(x) elementwise, no gate; out may be x."""

    def tanh(self, x) -> None:
        """x = tanh(x) elementwise (classification heads)."""

    def scale(self, x, s: float) -> None: ...

    def softcap(self, x, cap: float) -> None:
        """x = cap * tanh(x / cap) elementwise (cap > 0): Gemma 2's final-logit soft-capping."""

    def pos_scale(self, x, batch: AttentionBatch, length: int, scale: float, offset: float = 0.0) -> None:
        """Row t of x (n, d) *= 1 + scale * log(floor((position_t + offset) / length) + 1) (length >= 1):
        queries tempered by their position (Mistral 3's and Llama 4's attention temperature)."""

    def kv_store(self, cache: tuple[Any, Any], k, v, batch: AttentionBatch) -> None:
        """Write this step's k (n, k_dim) and v (n, v_dim) at the batch's slots."""

    def attention(
        self, q, cache: tuple[Any, Any], out, batch: AttentionBatch, n_head: int, n_kv_head: int,
        window: int, scale: float, softcap: float = 0.0, sinks: Weight | None = None,
    ) -> None:
        """Causal attention of q (n, n_head * hd_k) over the cache; out (n, n_head * hd_v). sinks
        (n_head,): a logit per head that joins each softmax's denominator with no value (gpt-oss)."""

    # ---- mixture of experts (selections: row t * k + u is token t's u-th expert) ----
    def route_experts(self, logits, k: int, norm: bool, ids, weights) -> None:
        """ids (n, k) int32 and weights (n, k) = each row's k most probable experts under
        softmax(logits (n, n_expert)), best first (lower id among equals), with their probabilities,
        divided by their sum when `norm`. All on the backend's side: no host round trip."""

    def expert_matmuls(self, ws: list[Weight], x, ids, outs: list) -> None:
        """outs[j] (n * k, rows_j): row t * k + u = ws[j][ids[t, u]] @ x_row, ws[j] stacked experts
        (n_expert, rows_j, cols) and x_row row t of x (n, cols) (a token's input, shared by its
        experts) or row t * k + u of x (n * k, cols). Each chosen expert's rows are read once per call."""

    def expert_sum(self, y, weights, out) -> None:
        """out (n, d) = sum over u of weights[t, u] * y[t * k + u]   (y (n * k, d))."""

    def expert_bias(self, y, b: Weight, ids) -> None:
        """y (n * k, d) += row ids[t, u] of b (n_expert, d) for row t * k + u: the chosen experts' biases."""

    def swiglu_oai(self, gate, up, out, alpha: float, limit: float) -> None:
        """out = g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit):
        gpt-oss's clamped SwiGLU (alpha 1.702, limit 7)."""
