"""Pieces shared by the architecture files: metadata access, weights, buffers, KV cache.

An architecture declares what it relies on as it reads it: every hyper-parameter with the range
its code can compute with (`Metadata.int`, `Metadata.float`), every tensor with its shape
(`Weights.get`, `Weights.vector` for the float vectors kernels read directly), the layer count and
the vocabulary against the tensors (`check_layers`, `Model.embeddings`). Anything else is refused
at load with one ModelError line naming the key or tensor, what was expected and what was found.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import NamedTuple, Any

import numpy as np

from ..backends import AttentionBatch, Backend, RopeParams, Weight, kv_rotation
from ..quant import GGMLType, layout


# Largest logits buffer kept between steps (floats): 64 rows of a 262k vocabulary.
LOGIT_BUFFER_FLOATS = 1 << 24
# Largest count or length a hyper-parameter may have: sizes and positions stay far inside the
# kernels' 32-bit integers (a 10M-token context fits).
MAX_SIZE = 1 << 27
MAX_ROPE_BASE = 1e12  # rotary bases in use are 1e4 .. 1e8


class ModelError(ValueError):
    """The file does not describe a model ember can run (missing tensor, bad hyper-parameter...)."""


class Metadata:
    """Typed access to `<arch>.<key>` hyper-parameters, each read with the range its use allows."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.md, self.arch = metadata, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.md.get(f"{self.arch}.{key}", default)

    def int(self, key: str, default: int | None = None, lo: int = 0, hi: int = MAX_SIZE) -> int:
        """An integer in lo..hi (a per-layer array must hold one value)."""
        value = self._scalar(key, default)
        ok = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_)) \
            and math.isfinite(value) and int(value) == value and lo <= value <= hi
        if not ok:
            raise self.error(key, value, f"an integer from {lo} to {hi}")
        return int(value)

    def float(self, key: str, default: float | None = None, above: float | None = None,
              at_most: float | None = None) -> float:
        """A finite number, greater than `above` and at most `at_most` where given."""
        value = self._scalar(key, default)
        ok = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_)) \
            and math.isfinite(value) and (above is None or value > above) and (at_most is None or value <= at_most)
        if not ok:
            bounds = [f"above {above:g}"] * (above is not None) + [f"at most {at_most:g}"] * (at_most is not None)
            raise self.error(key, value, " ".join(["a finite number", " and ".join(bounds)]).strip())
        return float(value)

    def check(self, key: str, ok: bool, value: Any, expected: str) -> None:
        """A condition between hyper-parameters, reported against `key`."""
        if not ok:
            raise self.error(key, value, expected)

    def error(self, key: str, value: Any, expected: str) -> ModelError:
        value = value.item() if isinstance(value, np.generic) else value
        return ModelError(f"metadata '{self.arch}.{key}' is {value!r}; expected {expected}")

    def _scalar(self, key: str, default: Any) -> Any:
        value = self.get(key, default)
        if value is None:
            raise ModelError(f"metadata '{self.arch}.{key}' is missing")
        if np.ndim(value) != 0:  # per-layer arrays: ember needs one value
            values = set(np.asarray(value).tolist())
            if len(values) != 1:
                raise ModelError(f"metadata '{self.arch}.{key}' varies per layer ({sorted(values)}), not supported")
            value = values.pop()
        return value


def check_layers(gguf, hp: Metadata, n_layer: int) -> None:
    """block_count must match the layers whose tensors the file holds (blk.0 .. blk.N-1)."""
    found = sorted({int(m.group(1)) for name in gguf.tensors if (m := re.match(r"blk\.(\d+)\.", name))})
    if found != list(range(n_layer)):
        raise hp.error("block_count", n_layer, f"the number of layers the file has tensors for ({_layers(found)})")


def _layers(found: list[int]) -> str:
    if not found:
        return "none"
    if found == list(range(found[0], found[-1] + 1)):
        return f"{len(found)}: blk.{found[0]} .. blk.{found[-1]}"
    return f"{len(found)}: " + ", ".join(f"blk.{i}" for i in found[:6]) + (" ..." if len(found) > 6 else "")


def rope_dims(hp: Metadata, head_dim: int) -> int:
    """rope.dimension_count: an even count of leading dimensions of each head that are rotated."""
    n_rot = hp.int("rope.dimension_count", head_dim, lo=2, hi=head_dim)
    hp.check("rope.dimension_count", n_rot % 2 == 0, n_rot, f"an even number from 2 to the head size {head_dim}")
    return n_rot


def rope_scaling(hp: Metadata, n_rot: int, neox: bool, freq_base: float, freq_factors=None) -> RopeParams:
    """Rotary parameters from `<arch>.rope.scaling.*` (none, linear or yarn), ggml's parametrisation.

    As in llama.cpp, a scaling factor applies whatever the type; yarn adds the ramp blend.
    """
    kind = hp.get("rope.scaling.type", "none") or "none"
    if kind not in ("none", "linear", "yarn"):
        raise hp.error("rope.scaling.type", kind, "none, linear or yarn")
    key = "rope.scaling.factor" if hp.get("rope.scaling.factor") is not None else "rope.scale_linear"
    factor = hp.float(key, 0.0, at_most=1e6)  # 0: none
    hp.check(key, factor == 0 or factor >= 1e-6, factor, "0 (none) or a factor from 1e-06 to 1e+06")
    freq_scale = 1.0 / factor if factor > 0 else 1.0
    key = "rope.scaling.original_context_length" if hp.get("rope.scaling.original_context_length") is not None \
        else "context_length"
    n_ctx_orig = hp.int(key, 0)
    params = RopeParams(n_rot, neox, freq_base, freq_scale, n_ctx_orig=n_ctx_orig, freq_factors=freq_factors)
    if kind != "yarn":
        return params
    hp.check(key, n_ctx_orig > 0, n_ctx_orig, "a context length from 1 (yarn scaling needs it)")
    return replace(params, ext_factor=1.0,
                   attn_factor=hp.float("rope.scaling.attn_factor", 1.0, above=0.0, at_most=1e3),
                   beta_fast=hp.float("rope.scaling.yarn_beta_fast", 32.0, above=0.0, at_most=1e6),
                   beta_slow=hp.float("rope.scaling.yarn_beta_slow", 1.0, above=0.0, at_most=1e6))


class Weights:
    """The model's tensors, handed to the backend once and looked up by GGUF name."""

    def __init__(self, gguf, backend: Backend):
        self.gguf, self.backend = gguf, backend

    def get(self, name: str, shape: tuple[int, ...] | None = None, optional: bool = False,
            streamed: bool = True) -> Weight | None:
        tensor = self.gguf.tensors.get(name)
        if tensor is None:
            if optional:
                return None
            raise ModelError(f"tensor '{name}' is missing from the file")
        if shape is not None and tuple(tensor.shape) != shape:
            raise ModelError(f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {shape}")
        return self.backend.weight(tensor, streamed)

    def split(self, name: str, sizes: list[int], cols: int) -> list[Weight]:
        """A fused projection (rows of several matrices stacked, e.g. attn_qkv) as one weight per
        part, each a view of its rows."""
        tensor = self.gguf.tensors.get(name)
        if tensor is None:
            raise ModelError(f"tensor '{name}' is missing from the file")
        if tuple(tensor.shape) != (sum(sizes), cols):
            raise ModelError(f"tensor '{name}' has shape {tuple(tensor.shape)}, expected {(sum(sizes), cols)}")
        ends = np.cumsum([0, *sizes]).tolist()
        return [self.backend.weight(tensor.rows(lo, hi)) for lo, hi in zip(ends, ends[1:])]

    def vector(self, name: str, n: int, optional: bool = False) -> Weight | None:
        """A float32 vector of n values (norm weights, biases, rope factors: kernels read them as
        plain floats)."""
        tensor = self.gguf.tensors.get(name)
        if tensor is not None and tensor.type != GGMLType.F32:
            raise ModelError(f"tensor '{name}' has type {tensor.type.name}, expected F32")
        return self.get(name, (n,), optional)


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

    def __init__(self, backend: Backend, kv_dims: list[tuple[int, int]], n_pages: int, page_size: int,
                 k_type: GGMLType = GGMLType.F16, v_type: GGMLType = GGMLType.F16,
                 head_dims: list[tuple[int, int]] | None = None):
        """head_dims: (k, v) head size of every layer, which decides the rotation of quantized rows
        (backends.kv_rotation; None: no rotation)."""
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"KV cache needs at least one page of one slot (got {n_pages} x {page_size})")
        for t in (k_type, v_type):
            if t not in backend.capabilities.kv_types:
                raise ValueError(f"the {backend.name} backend has no {t.name.lower()} KV cache "
                                 f"(it has: {', '.join(sorted(x.name.lower() for x in backend.capabilities.kv_types))})")
        for t, heads in zip((k_type, v_type), zip(*head_dims) if head_dims else ((), ())):
            block = layout(t).block_size  # (1 for f16 and bf16)
            odd = sorted({h for h in heads if h % block})
            if odd:
                raise ValueError(f"a {t.name.lower()} KV cache stores each head in blocks of {block} values; this "
                                 f"model's heads of {odd[0]} values need f16 or bf16")
        self.n_pages, self.page_size = n_pages, page_size
        self.backend = backend
        self.k_type, self.v_type = k_type, v_type
        self.layers = [backend.kv_cache(n_pages * page_size, k, v, k_type, v_type) for k, v in kv_dims]
        if head_dims is not None:
            self.layers = [replace(layer, k_rot=kv_rotation(k_type, hk, True), v_rot=kv_rotation(v_type, hv, False),
                                   parts=_head_parts(backend, k, v, hk, hv))
                           for layer, (k, v), (hk, hv) in zip(self.layers, kv_dims, head_dims)]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page's keys and values in every layer."""
        return self.nbytes // (self.n_pages * self.page_size) * self.page_size

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """A host copy of pages (n, page_nbytes) uint8: each page's keys then values, layer by layer,
        a page's slots in order, each slot's row whole (whatever a layer's parts: slot files and disk
        tiers hold one format for every backend)."""
        idx, P = self._slots(pages), self.page_size
        out = []
        for layer in self.layers:
            for a in layer:
                rows = np.ascontiguousarray(self.backend.to_numpy(a[self._index(a, idx)]))
                page = rows.view(np.uint8).reshape(len(pages), layer.parts, P, -1)  # as the backend lays it
                out.append(page.transpose(0, 2, 1, 3).reshape(len(pages), -1))
        return np.concatenate(out, axis=1)

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        """Pages = data (n, page_nbytes) uint8 as read_pages gave it."""
        idx, at, P = self._slots(pages), 0, self.page_size
        for layer in self.layers:
            for a in layer:
                width = a.shape[1] * a.dtype.itemsize * P
                page = data[:, at:at + width].reshape(len(pages), P, layer.parts, -1).transpose(0, 2, 1, 3)
                rows = np.ascontiguousarray(page).reshape(-1).view(a.dtype).reshape(len(idx), a.shape[1])
                a[self._index(a, idx)] = rows if isinstance(a, np.ndarray) else self.backend.from_numpy(rows)
                at += width

    def _index(self, a, idx: np.ndarray):
        """idx as an index of the backend's array a (on the device where a is)."""
        return idx if isinstance(a, np.ndarray) else self.backend.from_numpy(idx)

    def _slots(self, pages: list[int]) -> np.ndarray:
        P = self.page_size
        return (np.asarray(pages, np.int64)[:, None] * P + np.arange(P, dtype=np.int64)).ravel()

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Every layer's keys and values of page src into page dst, for each (src, dst) pair (copy
        on write): 64 sequences taking their own copy of a shared prompt's last page are one copy
        per layer, not 64. Pairs whose destination is another pair's source are copied in order. A
        backend with its own copy_pages (capabilities) does the copying (CUDA: a kernel of its own,
        no per-process compile of a gather)."""
        if not pairs:
            return
        srcs = {s for s, _ in pairs}
        if len(pairs) > 1 and any(d in srcs for _, d in pairs):
            for pair in pairs:
                self.copy_pages([pair])
            return
        if self.backend.capabilities.copy_pages:
            self.backend.copy_pages(self.layers, pairs, self.page_size)
            return
        P = self.page_size
        offs = np.arange(P, dtype=np.int64)
        src_i = (np.array([s for s, _ in pairs], np.int64)[:, None] * P + offs).ravel()
        dst_i = (np.array([d for _, d in pairs], np.int64)[:, None] * P + offs).ravel()
        for k, v in self.layers:
            k[dst_i] = k[src_i]
            v[dst_i] = v[src_i]


def _head_parts(backend: Backend, k_dim: int, v_dim: int, k_head: int, v_head: int) -> int:
    """Parts a layer's cache rows are laid out in on this backend (KVLayer.parts): one a kv head
    where the backend lays pages out by head and the rows cut evenly, else 1."""
    if not backend.capabilities.kv_head_parts or k_head <= 0 or v_head <= 0 or k_dim % k_head or v_dim % v_head:
        return 1
    heads = k_dim // k_head
    return heads if v_dim // v_head == heads else 1


@dataclass(slots=True)
class Step:
    """One forward pass: the tokens, where their KV lives, which rows need logits."""

    tokens: np.ndarray  # (n,) int32
    attn: AttentionBatch
    output_rows: np.ndarray  # (n_out,) int32 indices into tokens
    top_k: int = 0  # > 0: each output row reduced on the device to its k best (capabilities.top_k)
    # > 0 (capabilities.chain_tokens): token ids -r - 1 stand for the first of row r's best ids
    # of the step before (prev_k of them a row) that the token's row of bans (n, prev_k) lacks
    prev_k: int = 0
    bans: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.tokens)


class Classifier:
    """A classification head over pooled rows (llama.cpp's rank pooling): `cls` (+ bias) then tanh
    where the file has it, then `cls.output` (+ bias); a softmax over the outputs where the family's
    outputs are label logits (Qwen3 rerankers: "yes" and "no"). Score = the first output."""

    def __init__(self, weights: Weights, d: int, softmax: bool):
        gguf = weights.gguf
        self.backend, self.softmax = weights.backend, softmax
        self.dense = weights.get("cls.weight", (d, d), optional=True)
        self.dense_b = weights.vector("cls.bias", d, optional=True)
        out = gguf.tensors.get("cls.output.weight")
        n_out = out.shape[0] if out is not None and len(out.shape) == 2 else 1
        self.out = weights.get("cls.output.weight", (n_out, d), optional=True)
        self.out_b = weights.vector("cls.output.bias", n_out, optional=True)
        self.n_out = n_out if self.out is not None else d

    @staticmethod
    def present(gguf) -> bool:
        return "cls.weight" in gguf.tensors or "cls.output.weight" in gguf.tensors

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """(n, n_out) scores of pooled rows (n, d)."""
        B, x = self.backend, self.backend.from_numpy(np.ascontiguousarray(rows, np.float32))
        if self.dense is not None:
            h = B.empty(x.shape)
            B.matmul(self.dense, x, h)
            if self.dense_b is not None:
                B.add_bias(h, self.dense_b)
            B.tanh(h)
            x = h
        if self.out is not None:
            h = B.empty((x.shape[0], self.n_out))
            B.matmul(self.out, x, h)
            if self.out_b is not None:
                B.add_bias(h, self.out_b)
            x = h
        y = np.array(B.to_numpy(x), np.float64)
        if self.softmax:
            y = np.exp(y - y.max(axis=1, keepdims=True))
            y /= y.sum(axis=1, keepdims=True)
        return y.astype(np.float32)


class TopLogits(NamedTuple):
    """The k best logits of each output row: ids (n_out, k) int32 and values (n_out, k), best first."""

    ids: np.ndarray
    values: np.ndarray


class Model:
    """Base of the architecture classes: holds the backend, weights and buffers."""

    arch = ""
    causal = True  # a token sees the tokens before it (False: an encoder, every token of its sequence)
    generates = True  # has a language-model head (False: an encoder, embeddings only)

    def __init__(self, gguf, backend: Backend):
        self.backend = backend
        self.weights = Weights(gguf, backend)
        self.buffers = Buffers(backend)
        self.n_vocab = 0
        self.n_ctx_train = 0

    def embeddings(self, gguf, hp: Metadata, d_model: int) -> None:
        """token_embd.weight, and output.weight (tied to it where absent): a row for each token of
        the vocabulary (tokenizer.ggml.tokens, which `<arch>.vocab_size` must agree with)."""
        tokens = gguf.metadata.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens) if isinstance(tokens, list) else None
        if hp.get("vocab_size") is not None:
            n = hp.int("vocab_size", lo=1)
            hp.check("vocab_size", n_tokens in (None, n), n,
                     f"the number of tokens of tokenizer.ggml.tokens ({n_tokens})")
            n_tokens = n
        embd = gguf.tensors.get("token_embd.weight")
        n_vocab = n_tokens or (embd.shape[0] if embd is not None and len(embd.shape) == 2 else 0)
        tied = "output.weight" not in gguf.tensors  # then every token reads the table whole, as the head
        self.tok_embd = self.weights.get("token_embd.weight", (n_vocab, d_model), streamed=tied)
        self.head = self.weights.get("output.weight", (n_vocab, d_model), optional=True) or self.tok_embd
        self.n_vocab = n_vocab

    def kv_dims(self) -> list[tuple[int, int]]:
        """(k_dim, v_dim) of every layer's cache rows (same-shaped layers: from `args`)."""
        a = self.args
        return [(a.n_kv_head * a.head_dim, a.n_kv_head * a.head_dim)] * a.n_layer

    def kv_head_dims(self) -> list[tuple[int, int]]:
        """(key, value) head size of every layer (same-shaped layers: from `args`)."""
        a = self.args
        return [(a.head_dim, a.head_dim)] * a.n_layer

    def set_context(self, n_ctx: int) -> None:
        """The longest sequence the model will be asked to run (a family whose rotary factors
        depend on it picks them here)."""

    def finish_logits(self, out) -> None:
        """What the architecture does to the output rows after the projection (scales, caps)."""

    def new_kv_cache(self, n_pages: int, page_size: int, k_type: GGMLType = GGMLType.F16,
                     v_type: GGMLType = GGMLType.F16) -> KVCache:
        return KVCache(self.backend, self.kv_dims(), n_pages, page_size, k_type, v_type, self.kv_head_dims())

    def forward(self, step: Step, cache: KVCache) -> np.ndarray:
        """Run the step; return logits (n_out, n_vocab) as a host float array."""
        raise NotImplementedError

    def trunk(self, step: Step, cache: KVCache):
        """The step's hidden states (n, d_model) after the last layer, before the final norm."""
        raise NotImplementedError

    def hidden(self, step: Step, cache: KVCache) -> np.ndarray:
        """The rows step.output_rows of the final hidden states (after the final norm), on the host
        (n_out, d_model): what embeddings are pooled from. Each sequence of the step is whole."""
        x = self.trunk(step, cache)
        return self.final_rows(x, step, lambda h: self.backend.rms_norm(h, self.out_norm, self.args.eps, h))

    def classifier(self) -> Classifier | None:
        """The file's classification head (rerankers), or None."""
        if not Classifier.present(self.weights.gguf):
            return None
        return Classifier(self.weights, self.args.d_model, softmax=self.arch in ("qwen3",))

    def final_rows(self, x, step: Step, norm=None) -> np.ndarray:
        """The output rows of x, normed by `norm(h)` in place where given, copied to the host."""
        h = self.buffers.get("hidden", len(step.output_rows), x.shape[1])
        self.backend.gather_rows(x, step.output_rows, h)
        if norm is not None:
            norm(h)
        return np.array(self.backend.to_numpy(h), np.float32)

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
        self.finish_logits(out)
        if step.top_k:  # only the best ids and their logits cross to the host
            ids = self._top_ids(step.top_k)[:len(rows)]
            vals = self.buffers.get(f"top_vals{step.top_k}", len(rows), step.top_k)
            self.backend.top_k(out, step.top_k, ids, vals)
            return TopLogits(self.backend.to_numpy(ids), self.backend.to_numpy(vals))
        return self.backend.to_numpy(out)
