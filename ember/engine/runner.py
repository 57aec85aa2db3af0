"""Turns a scheduler plan into one batched forward pass of the model."""
from __future__ import annotations

import numpy as np

from ..backends import AttentionBatch
from ..models import KVCache, Model, Step
from .scheduler import Plan


class ModelRunner:
    def __init__(self, model: Model, cache: KVCache):
        self.model, self.cache = model, cache
        self.page_size = cache.page_size

    def run(self, plan: Plan) -> np.ndarray:
        """Copy pages as planned, run the step; returns the logits of every chunk's logit rows,
        in plan order (valid until the next run)."""
        for src, dst in plan.copies:
            self.cache.copy_page(src, dst)
        return self.model.forward(self.step(plan), self.cache)

    def step(self, plan: Plan) -> Step:
        P = self.page_size
        chunks = plan.chunks
        tokens = np.concatenate([np.asarray(c.seq.tokens[c.start:c.start + c.n], np.int32) for c in chunks])
        positions = np.concatenate([np.arange(c.start, c.start + c.n, dtype=np.int32) for c in chunks])
        seq_rows = np.repeat(np.arange(len(chunks), dtype=np.int32), [c.n for c in chunks])
        width = max(len(c.seq.pages) for c in chunks)
        tables = np.zeros((len(chunks), width), np.int32)
        for i, c in enumerate(chunks):
            tables[i, :len(c.seq.pages)] = c.seq.pages
        slots = tables[seq_rows, positions // P].astype(np.int64) * P + positions % P
        offsets = np.cumsum([0] + [c.n for c in chunks[:-1]])
        rows = [off + r - c.start for off, c in zip(offsets, chunks) for r in c.logit_rows]
        attn = AttentionBatch(positions, seq_rows, tables, slots, P)
        return Step(tokens, attn, np.asarray(rows, np.int32))
