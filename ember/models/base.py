"""Pieces shared by the architecture files: metadata access, weights, buffers, KV cache."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Any

import numpy as np

from ..backends import AttentionBatch, Backend, RopeParams, Weight


# Largest logits buffer kept between steps (floats): 64 rows of a 262k vocabulary.
LOGIT_BUFFER_FLOATS = 1 << 24


class ModelError(ValueError):
    """The file does not describe a model ember can run (missing tensor, bad hyper-parameter...)."""


class Metadata:
    """Typed access to `<arch>.<key>` hyper-parameters with clear errors."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.md, self.arch = metadata, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.md.get(f"{self.arch}.{key}", default)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise ModelError(f"metadata '{self.arch}.{key}' is missing")
        if np.ndim(value) != 0:  # per-layer arrays: ember needs one value
            values = set(np.asarray(value).tolist())
            if len(values) != 1:
                raise ModelError(f"metadata '{self.arch}.{key}' varies per layer ({sorted(values)}), not supported")
            value = values.pop()
        if int(value) != value or value < 0:
            raise ModelError(f"metadata '{self.arch}.{key}' = {value!r} is not a non-negative integer")
        return int(value)

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if value is None:
            raise ModelError(f"metadata '{self.arch}.{key}' is missing")
        return float(value)


def rope_scaling(hp: Metadata, n_rot: int, neox: bool, freq_base: float, freq_factors=None) -> RopeParams:
    """Rotary parameters from `<arch>.rope.scaling.*` (none, linear or yarn), ggml's parametrisation.

    As in llama.cpp, a scaling factor applies whatever the type; yarn adds the ramp blend.
    """
    kind = hp.get("rope.scaling.type", "none") or "none"
    factor = float(hp.get("rope.scaling.factor", 0.0) or hp.get("rope.scale_linear", 0.0) or 0.0)
    freq_scale = 1.0 / factor if factor > 0 else 1.0
    n_ctx_orig = int(hp.get("rope.scaling.original_context_length", 0) or hp.get("context_length", 0) or 0)
    params = RopeParams(n_rot, neox, freq_base, freq_scale, n_ctx_orig=n_ctx_orig, freq_factors=freq_factors)
    if kind in ("none", "linear"):
        return params
    if kind == "yarn":
        return replace(params, ext_factor=1.0,
                       attn_factor=float(hp.get("rope.scaling.attn_factor", 1.0)),
                       beta_fast=float(hp.get("rope.scaling.yarn_beta_fast", 32.0)),
                       beta_slow=float(hp.get("rope.scaling.yarn_beta_slow", 1.0)))
    raise ModelError(f"rope scaling type '{kind}' is not supported")


class Weights:
    """The model's tensors, handed to the backend once and looked up by GGUF name."""

    def __init__(self, gguf, backend: Backend):
        self.gguf, self.backend = gguf, backend

    def get(self, name: str, shape: tuple[int, ...] | None = None, optional: bool = False) -> Weight | None:
        tensor = self.gguf.tensors.get(name)
        if tensor is None:
            if optional:
                return None
            raise ModelError(f"tensor '{name}' is missing from the file")
        if shape is not None and tuple(tensor.shape) != shape:
            raise ModelError(f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {shape}")
        return self.backend.weight(tensor)


class Buffers:
    """Activation buffers reused across forward passes (grown on demand, never per op)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._store: dict[str, Any] = {}

    def get(self, name: str, n: int, width: int, dtype=np.float32):
        """A (n, width) buffer named `name`; the same memory every step of at most that size."""
        buf = self._store.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1] != width:
            buf = self.backend.empty((max(n, 1), width), dtype)
            self._store[name] = buf
        return buf[:n]


class KVCache:
    """Paged key/value storage of every layer: pages of `page_size` token slots.

    Which pages a sequence uses is the caller's business (the engine's page tables);
    the cache only owns the memory.
    """

    def __init__(self, backend: Backend, kv_dims: list[tuple[int, int]], n_pages: int, page_size: int):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"KV cache needs at least one page of one slot (got {n_pages} x {page_size})")
        self.n_pages, self.page_size = n_pages, page_size
        self.backend = backend
        self.layers = [backend.kv_cache(n_pages * page_size, k, v) for k, v in kv_dims]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Every layer's keys and values of page src into page dst, for each (src, dst) pair (copy
        on write): 64 sequences taking their own copy of a shared prompt's last page are one copy
        per layer, not 64. Pairs whose destination is another pair's source are copied in order. A
        backend with its own copy_pages does the copying (CUDA: a kernel of its own, no per-process
        compile of a gather)."""
        if not pairs:
            return
        srcs = {s for s, _ in pairs}
        if len(pairs) > 1 and any(d in srcs for _, d in pairs):
            for pair in pairs:
                self.copy_pages([pair])
            return
        own = getattr(self.backend, "copy_pages", None)
        if own is not None:
            own(self.layers, pairs, self.page_size)
            return
        P = self.page_size
        offs = np.arange(P, dtype=np.int64)
        src_i = (np.array([s for s, _ in pairs], np.int64)[:, None] * P + offs).ravel()
        dst_i = (np.array([d for _, d in pairs], np.int64)[:, None] * P + offs).ravel()
        for k, v in self.layers:
            k[dst_i] = k[src_i]
            v[dst_i] = v[src_i]


@dataclass(slots=True)
class Step:
    """One forward pass: the tokens, where their KV lives, which rows need logits."""

    tokens: np.ndarray  # (n,) int32
    attn: AttentionBatch
    output_rows: np.ndarray  # (n_out,) int32 indices into tokens
    top_k: int = 0  # > 0: each output row reduced on the device to its k best (a backend with top_k)
    # > 0 (a backend that chains_tokens): token ids -r - 1 stand for the first of row r's best ids
    # of the step before (prev_k of them a row) that the token's row of bans (n, prev_k) lacks
    prev_k: int = 0
    bans: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.tokens)


class TopLogits(NamedTuple):
    """The k best logits of each output row: ids (n_out, k) int32 and values (n_out, k), best first."""

    ids: np.ndarray
    values: np.ndarray


class Model:
    """Base of the architecture classes: holds the backend, weights and buffers."""

    arch = ""

    def __init__(self, gguf, backend: Backend):
        self.backend = backend
        self.weights = Weights(gguf, backend)
        self.buffers = Buffers(backend)
        self.n_vocab = 0
        self.n_ctx_train = 0

    def kv_dims(self) -> list[tuple[int, int]]:
        """(k_dim, v_dim) of every layer's cache rows (same-shaped layers: from `args`)."""
        a = self.args
        return [(a.n_kv_head * a.head_dim, a.n_kv_head * a.head_dim)] * a.n_layer

    def new_kv_cache(self, n_pages: int, page_size: int) -> KVCache:
        return KVCache(self.backend, self.kv_dims(), n_pages, page_size)

    def forward(self, step: Step, cache: KVCache) -> np.ndarray:
        """Run the step; return logits (n_out, n_vocab) as a host float array."""
        raise NotImplementedError

    @property
    def max_output_rows(self) -> int:
        """Most rows of logits one step may ask for (bounds the logits buffer)."""
        return max(1, LOGIT_BUFFER_FLOATS // max(self.n_vocab, 1))

    def embed(self, w: Weight, step: Step, out) -> None:
        """out = the step's token embeddings (rows of w); in a step after one whose best ids have
        not reached the host (prev_k), tokens taken from those on the device."""
        if step.prev_k:
            self.backend.get_rows(w, step.tokens, out, prev=self._top_ids(step.prev_k), bans=step.bans)
        else:
            self.backend.get_rows(w, step.tokens, out)

    def _top_ids(self, k: int):
        """The best ids' buffer of k a row, at one address for every step (a step may read the
        ids the step before it wrote there)."""
        return self.buffers.get(f"top_ids{k}", self.max_output_rows, k, np.int32)

    def logits(self, x, step: Step, norm: Weight, eps: float, head: Weight) -> np.ndarray:
        """Final norm and output projection of the rows that need logits: (n_out, n_vocab) on the
        host, valid until the next step."""
        rows = step.output_rows
        if len(rows) > self.max_output_rows:
            raise ValueError(f"{len(rows)} rows of logits asked for; at most {self.max_output_rows} per step")
        h = self.buffers.get("out_in", len(rows), x.shape[1])
        self.backend.gather_rows(x, rows, h)
        self.backend.rms_norm(h, norm, eps, h)
        out = self.buffers.get("logits", len(rows), self.n_vocab)
        self.backend.matmul(head, h, out)
        if step.top_k:  # only the best ids and their logits cross to the host
            ids = self._top_ids(step.top_k)[:len(rows)]
            vals = self.buffers.get(f"top_vals{step.top_k}", len(rows), step.top_k)
            self.backend.top_k(out, step.top_k, ids, vals)
            return TopLogits(self.backend.to_numpy(ids), self.backend.to_numpy(vals))
        return self.backend.to_numpy(out)
