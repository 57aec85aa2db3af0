"""Embeddings and rerank scores: whole sequences through a model's trunk, pooled.

    with Embeddings("model.gguf") as e:
        vectors = e.embed(["a text", "another"])          # (n, d), normalized
        scores = e.rank("a query", ["doc one", "doc two"])  # classification head or pooled

An `Embedder` owns its model (no generation runs on it): one worker thread takes the sequences of
every waiting request and packs them into steps of at most `max_batch_tokens` tokens (a sequence
is never split: an encoder sees it whole), so concurrent clients share steps. Each step starts
from an empty paged cache. Pooling as llama.cpp's: none (every token's vector), mean, cls (the
first token), last, rank (the first token of an encoder, the last of a decoder, through the
file's classification head).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ..backends import AttentionBatch
from ..models import KVCache, Model, Step
from .release import ReleasedOnClose

POOLINGS = ("none", "mean", "cls", "last", "rank")
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # <arch>.pooling_type
PAGE_SIZE = 16


class EmbeddingError(ValueError):
    """A request the embedder cannot serve (empty or too long a sequence, no classification head);
    n_tokens: the length of a sequence longer than the context."""

    def __init__(self, message: str, n_tokens: int | None = None):
        super().__init__(message)
        self.n_tokens = n_tokens


@dataclass(frozen=True, slots=True)
class EmbedConfig:
    """pooling: one of POOLINGS, or None for the file's (<arch>.pooling_type), else mean for a
    decoder and cls for an encoder; normalize: llama.cpp's embd_normalize (-1 none, 0 max-abs
    scaled to int16's range, 1 taxicab, 2 euclidean, p > 2 p-norm), for pooled vectors."""

    n_ctx: int = 512  # longest sequence
    pooling: str | None = None
    normalize: int = 2
    max_batch_tokens: int = 2048
    max_seqs: int = 64  # sequences a step at most

    def __post_init__(self):
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.normalize < -1:
            raise ValueError(f"normalize must be -1 (none) or more, got {self.normalize}")
        if min(self.n_ctx, self.max_batch_tokens, self.max_seqs) < 1:
            raise ValueError("n_ctx, max_batch_tokens and max_seqs must be at least 1")


def file_pooling(model: Model, metadata: dict) -> str:
    """The pooling the file asks for, else mean for a decoder, cls for an encoder."""
    value = metadata.get(f"{model.arch}.pooling_type")
    if isinstance(value, (int, np.integer)) and int(value) in GGUF_POOLING:
        return GGUF_POOLING[int(value)]
    return "mean" if model.causal else "cls"


def normalized(v: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize of one vector."""
    x = v.astype(np.float64)
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = np.abs(x).max(initial=0.0) / 32760.0
    elif norm == 2:
        total = np.sqrt((x * x).sum())
    else:
        total = (np.abs(x) ** norm).sum() ** (1.0 / norm)
    return (x * (1.0 / total if total > 0 else 0.0)).astype(np.float32)


@dataclass(slots=True)
class Job:
    """One request's sequences and where their results go."""

    seqs: list[list[int]]
    rank: bool
    normalize: int
    future: Future = field(default_factory=Future)
    results: list = field(default_factory=list)
    done: int = 0


class Embedder:
    """Runs whole sequences through `model` and pools them (see the module's docstring)."""

    def __init__(self, model: Model, config: EmbedConfig, metadata: dict | None = None):
        self.model, self.config = model, config
        self.pooling = config.pooling or file_pooling(model, metadata or {})
        self.head = model.classifier() if self.pooling == "rank" else None
        self.n_ctx = min(config.n_ctx, model.n_ctx_train) if not model.causal else config.n_ctx
        tokens = max(config.max_batch_tokens, self.n_ctx)
        self.pages_per_seq = -(-self.n_ctx // PAGE_SIZE)
        self.cache = KVCache(model.backend, model.kv_dims(), -(-tokens // PAGE_SIZE) + config.max_seqs, PAGE_SIZE)
        self.steps = self.tokens = 0  # steps run and tokens computed
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="ember-embed", daemon=True)
        self._worker.start()

    @property
    def dim(self) -> int:
        return self.model.args.d_model

    # ---- requests ----
    def submit(self, seqs: list[list[int]], rank: bool = False, normalize: int | None = None) -> Future:
        """A future of one result per sequence: its pooled vector (d,), every token's (len, d) with
        pooling none, or with rank=True its score (the classification head's first output)."""
        self.check(seqs, rank)
        if self._closed:
            raise RuntimeError("the embedder is closed")
        job = Job([list(s) for s in seqs], rank, self.config.normalize if normalize is None else normalize)
        job.results = [None] * len(seqs)
        if not seqs:
            job.future.set_result([])
            return job.future
        self._queue.put(job)
        return job.future

    def embed(self, seqs: list[list[int]], normalize: int | None = None) -> list[np.ndarray]:
        return self.submit(seqs, normalize=normalize).result()

    def rank(self, seqs: list[list[int]]) -> list[float]:
        return self.submit(seqs, rank=True).result()

    def check(self, seqs: list[list[int]], rank: bool) -> None:
        if rank and self.pooling != "rank":
            raise EmbeddingError("reranking needs rank pooling (a model with a classification head, "
                                 "served with --reranking or --pooling rank)")
        if not rank and self.pooling == "rank":
            raise EmbeddingError("this model is served for reranking (rank pooling): it gives scores, not embeddings")
        for s in seqs:
            if not s:
                raise EmbeddingError("an input is empty (no tokens)")
            if len(s) > self.n_ctx:
                raise EmbeddingError(f"an input has {len(s)} tokens; the context holds {self.n_ctx}", len(s))
            if min(s) < 0 or max(s) >= self.model.n_vocab:
                raise EmbeddingError(f"a token id is outside the vocabulary (0 .. {self.model.n_vocab - 1})")

    # ---- the worker ----
    def _loop(self) -> None:
        pending: list[tuple[Job, int]] = []  # (job, sequence index) not yet run
        while True:
            if not pending:
                job = self._queue.get()
                if job is None:
                    return
                pending += [(job, i) for i in range(len(job.seqs))]
            while True:  # everything waiting joins
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._closed = True
                    break
                pending += [(job, i) for i in range(len(job.seqs))]
            batch, pending = self._take(pending)
            self._run(batch)
            if self._closed and not pending:
                return

    def _take(self, pending: list) -> tuple[list, list]:
        """The first sequences that fit one step (at least one), and the rest."""
        total, n = 0, 0
        for job, i in pending:
            size = len(job.seqs[i])
            if n and (total + size > self.config.max_batch_tokens or n >= self.config.max_seqs):
                break
            total, n = total + size, n + 1
        return pending[:n], pending[n:]

    def _run(self, batch: list) -> None:
        try:
            outs = self.run_step([job.seqs[i] for job, i in batch])
        except Exception as e:  # every job of the step fails with the step
            for job in {id(j): j for j, _ in batch}.values():
                if not job.future.done():
                    job.future.set_exception(e)
            return
        for (job, i), rows in zip(batch, outs):
            if job.future.done():
                continue
            job.results[i] = self.finish(rows, job)
            job.done += 1
            if job.done == len(job.seqs):
                job.future.set_result(job.results)

    def finish(self, rows: np.ndarray, job: Job):
        """One sequence's result from its pooled rows."""
        if job.rank:
            return float(self.head(rows[None, :])[0, 0]) if self.head is not None else float(rows[0])
        if rows.ndim == 2:  # pooling none: every token's vector, as it is
            return rows
        return normalized(rows, job.normalize)

    def run_step(self, seqs: list[list[int]]) -> list[np.ndarray]:
        """Pooled rows of each sequence (pooling none: (len, d) each) from one forward pass."""
        step, spans = self.step(seqs)
        hidden = self.model.hidden(step, self.cache)
        self.steps, self.tokens = self.steps + 1, self.tokens + step.n
        if self.pooling in ("none", "mean"):
            parts = [hidden[lo:hi] for lo, hi in spans]
            return parts if self.pooling == "none" else [p.mean(axis=0, dtype=np.float64).astype(np.float32) for p in parts]
        return list(hidden)

    def step(self, seqs: list[list[int]]) -> tuple[Step, list[tuple[int, int]]]:
        """The step of whole sequences, each on pages of its own, and each one's rows."""
        lens = [len(s) for s in seqs]
        starts = np.cumsum([0] + lens)
        tokens = np.concatenate([np.asarray(s, np.int32) for s in seqs])
        seq_rows = np.repeat(np.arange(len(seqs), dtype=np.int32), lens)
        positions = np.arange(len(tokens), dtype=np.int32) - np.repeat(starts[:-1], lens).astype(np.int32)
        pages = [-(-n // PAGE_SIZE) for n in lens]
        first_page = np.cumsum([0] + pages)
        tables = np.zeros((len(seqs), max(pages)), np.int32)
        for r, (lo, count) in enumerate(zip(first_page, pages)):
            tables[r, :count] = np.arange(lo, lo + count)
        slots = tables[seq_rows, positions // PAGE_SIZE].astype(np.int64) * PAGE_SIZE + positions % PAGE_SIZE
        attn = AttentionBatch(positions, seq_rows, tables, slots, PAGE_SIZE)
        spans = list(zip(starts[:-1].tolist(), starts[1:].tolist()))
        if self.pooling in ("none", "mean"):
            out = np.arange(len(tokens), dtype=np.int32)
        else:
            out = np.array([hi - 1 if self.takes_last else lo for lo, hi in spans], np.int32)
        return Step(tokens, attn, out), spans

    @property
    def takes_last(self) -> bool:
        """last pooling, and rank pooling on a decoder (llama.cpp's choice), read the last token."""
        return self.pooling == "last" or (self.pooling == "rank" and self.model.causal)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join(timeout=60)


class Embeddings(ReleasedOnClose):
    """A GGUF model opened for embeddings or reranking: tokenize, embed, rank. `model`: a path or a
    known name. Keyword arguments: EmbedConfig's fields, and device and threads. close() gives the
    model's memory back also while the object is kept (using it then raises EngineClosed)."""

    def __init__(self, model: str | os.PathLike, *, device: str = "auto", threads: int | None = None, **config):
        from .. import hub
        from ..backends import get_backend
        from ..gguf_loader import GGUFFile
        from ..models import load_model
        from ..tokenizer import Tokenizer

        t0 = time.perf_counter()
        self.path = hub.resolve(model)
        self.gguf = GGUFFile(self.path)
        try:
            self.backend = get_backend(device, threads=threads)
            self.model = load_model(self.gguf, self.backend)
            self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
            config.setdefault("n_ctx", min(self.model.n_ctx_train or 512, 8192))
            self.embedder = Embedder(self.model, EmbedConfig(**config), self.gguf.metadata)
        except BaseException:
            self.gguf.close()
            raise
        self.load_s = time.perf_counter() - t0

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    def embed(self, texts: list[str], normalize: int | None = None) -> list[np.ndarray]:
        return self.embedder.embed([self.tokenize(t) for t in texts], normalize)

    def rank(self, query: str, documents: list[str]) -> list[float]:
        return self.embedder.rank([rank_ids(self.tokenizer, self.gguf.metadata, query, d) for d in documents])

    def close(self) -> None:
        if self.closed:
            return
        self.embedder.close()
        self.gguf.close()
        self._release(("embedder", "model", "backend"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def rank_ids(tokenizer, metadata: dict, query: str, document: str) -> list[int]:
    """A query and a document as one sequence, as llama-server writes it: the file's rerank
    template (tokenizer.chat_template.rerank, with {query} and {document}) where it has one, else
    [BOS] query [EOS] [SEP] document [EOS], each special token where the vocabulary adds it."""
    template = metadata.get("tokenizer.chat_template.rerank")
    if isinstance(template, str) and template:
        text = template.replace("{query}", query).replace("{document}", document)
        return tokenizer.encode(text, add_special=False, parse_special=True)
    q = tokenizer.encode(query, add_special=False, parse_special=False)
    d = tokenizer.encode(document, add_special=False, parse_special=False)
    eos = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
    ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    ids += q + ([eos] if tokenizer.add_eos and eos is not None else [])
    ids += [tokenizer.sep_id] if tokenizer.add_sep and tokenizer.sep_id is not None else []
    return ids + d + ([eos] if tokenizer.add_eos and eos is not None else [])
