"""Turns a scheduler plan into one batched forward pass of the model.

The step's inputs (token ids, positions, page tables, cache slots, rows needing logits)
are written into arrays allocated once, at fixed addresses. On a backend that can record
(the CPU backend, CUDA graphs), the second step of each shape is recorded and later steps of
that shape replay it in one native call, so decoding costs one Python call per step, not one
per op.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends import AttentionBatch
from ..models import KVCache, Model, Step
from ..models.base import TopLogits
from ..sampler.sampler import first_not_banned
from .scheduler import Plan

MAX_RECORDED_TOKENS = 64  # larger steps are compute-bound on a CPU: Python's share is negligible there
MAX_RECORDINGS = 64
MAX_SEEN = 4096  # step shapes remembered as run once
MAX_LARGE_RECORDINGS = 8  # larger steps, where a backend records them too (kept apart: decode shapes stay)
MAX_AHEAD_K = 64  # best ids a row an ahead step may choose from (the engine's MAX_DEVICE_BEST)


@dataclass(frozen=True, slots=True)
class Ahead:
    """What an ahead step (a decode step run before the host has read the step before it) needs:
    each chunk's token is the greedy choice from its sequence's row of that step's best ids."""

    k: int  # best ids a row of the step before, best first
    rows: list[int]  # each chunk's row in the step before
    bans: list  # each chunk's banned ids (the choice is the first best id not among them)
    prev: object = None  # the step before's results (TopLogits), where the host makes the choice


@dataclass(slots=True)
class Launched:
    """A step on its way: its plan, how its results come back (top_k > 0: each row's k best ids
    and their logits, TopLogits), where they will be, a mark of the device's queue to wait for
    (None where the step ran before launch returned), and whether its shape was recorded as it ran
    (then its time holds the recording's too)."""

    plan: Plan
    top_k: int
    out: Any
    mark: Any = None
    recorded: bool = False


class StepInputs:
    """Fixed-address input arrays sized for the largest step (and its padding: pad_seqs table rows)."""

    def __init__(self, max_tokens: int, max_seqs: int, pages_per_seq: int, pad_seqs: int = 0):
        self.tokens = np.zeros(max_tokens, np.int32)
        self.positions = np.zeros(max_tokens, np.int32)
        self.seq_rows = np.zeros(max_tokens, np.int32)
        self.slots = np.zeros(max_tokens, np.int64)
        self.rows = np.zeros(max_tokens, np.int32)
        self.tables = np.zeros((max_seqs + pad_seqs, pages_per_seq), np.int32)
        self.bans = np.full(max_tokens * MAX_AHEAD_K, -1, np.int32)  # ahead steps: (n, k) views of it


def decode_bucket(n: int) -> int:
    """Tokens a padded decode step of n sequences runs: n up to 8 (the matrix-vector kernels take
    each count as it is), else the next power of two."""
    return n if n <= 8 else 1 << (n - 1).bit_length()


class ModelRunner:
    def __init__(self, model: Model, cache: KVCache, max_tokens: int, max_seqs: int, pages_per_seq: int,
                 pad_page: int | None = None):
        """pad_page: a cache page no sequence uses. Given one, on a backend that asks for it
        (pad_decode_steps: a GPU, where a recorded step's launches cost the same for a few more
        rows), decode steps of more than 8 sequences run as decode_bucket(n) sequences, the extra
        ones all the same token at position 0 of pad_page: the few shapes are recorded the first
        time they come, and a batch whose streams end one by one keeps replaying them."""
        self.model, self.cache = model, cache
        self.page_size = cache.page_size
        caps = model.backend.capabilities
        self.pad_page = pad_page if caps.pad_decode_steps else None
        pad_seqs = decode_bucket(max_seqs) - max_seqs if self.pad_page is not None else 0
        self.inputs = StepInputs(max_tokens, max_seqs, pages_per_seq, pad_seqs)
        self._arange = np.arange(max(max_tokens, max_seqs), dtype=np.int32)
        self._table_of: list = [None] * (max_seqs + pad_seqs)  # the pages each table row holds (_decode_step)
        self.recordable = caps.record
        # a GPU launches hundreds of small kernels per step: it records prompt-sized steps as well
        self.max_recorded = max(MAX_RECORDED_TOKENS, caps.max_recorded_tokens)
        self._recordings: OrderedDict = OrderedDict()  # shape -> (recording, logits array)
        self._large: OrderedDict = OrderedDict()  # the same, for steps of more than MAX_RECORDED_TOKENS
        self._seen: OrderedDict = OrderedDict()  # shapes run once, not recorded (yet)
        self._view_cache: dict = {}  # (tokens, table rows, logit rows) -> views of the inputs (_views)
        self.max_out = model.max_output_rows
        # a device that runs a replayed step while the host goes on (replay(wait=False), mark, wait_mark)
        self.overlaps = caps.overlap
        # ...and takes an ahead step's tokens from the step before's best ids on the device
        self.chains = caps.chain_tokens
        self._parity = 0  # ahead steps alternate between two recordings of their shape (see run)
        self.recorded = False  # whether the last step run recorded its shape

    def _seen_before(self, key) -> bool:
        """Whether a step of this shape ran before. A shape is recorded the second time it comes:
        continuous batching makes many shapes that come once (prompt chunks beside changing
        numbers of decodes: 65 of 69 prompt-sized steps of 64 streams x 512 tokens), and recording
        costs more than running (on a GPU, capturing and uploading the graph)."""
        if key in self._seen:
            return True
        self._seen[key] = None
        if len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        return False

    def launch(self, plan: Plan, top_k: int = 0, ahead: Ahead | None = None) -> Launched:
        """Start the step (see run); on a device that overlaps, it may still be running when this
        returns: `wait` for its results."""
        out = self.run(plan, top_k, wait=False, ahead=ahead)
        return Launched(plan, top_k, out, self.model.backend.mark() if self.overlaps else None, self.recorded)

    def wait(self, step: Launched):
        """The launched step's results, once the device has computed them."""
        if step.mark is not None:
            self.model.backend.wait_mark(step.mark)
        return step.out

    def run(self, plan: Plan, top_k: int = 0, wait: bool = True, ahead: Ahead | None = None):
        """Copy pages as planned, run the step; returns the logits of every chunk's logit rows,
        in plan order (valid until the next run), or with top_k > 0 only each row's k best
        (TopLogits: ids and values, reduced on the device). wait=False: a replayed step may
        still be running on the device when this returns (see launch).
        ahead: a step of decode chunks whose tokens the step before is still choosing (see Ahead):
        on a device that chains tokens they are read there; elsewhere (the step before has run)
        the host chooses them from ahead.prev. An ahead step's results stay valid through the next
        step's run (ahead steps alternate between two recordings of a shape), so that the engine
        may launch the step after one before reading it."""
        if plan.copies:
            self.cache.copy_pages(plan.copies)
        step = self.step(plan, ahead)
        step.top_k = top_k
        key = (step.n, len(step.attn.block_tables), len(step.output_rows), top_k)
        if ahead is not None:
            self._parity ^= 1
            key += (step.prev_k, self._parity)
        decode = all(c.n - len(c.draft) == 1 for c in plan.chunks)  # drafted decodes included
        logits = self._run(step, key, wait, first_sight=decode)
        rows = sum(len(c.logit_rows) for c in plan.chunks)
        if len(step.output_rows) != rows:  # rows past the plan's own are padding (_bucketed, _pad_decode)
            return first_rows(logits, rows)
        return logits

    def _run(self, step: Step, key: tuple, wait: bool, first_sight: bool = False):
        """first_sight: record the shape the first time it comes (decode steps: their shapes are
        few, and every later step of the batch has one of them; drafted ones add one a draft length)."""
        store, limit = (self._recordings, MAX_RECORDINGS) if step.n <= MAX_RECORDED_TOKENS else \
            (self._large, MAX_LARGE_RECORDINGS)
        self.recorded = False
        hit = store.get(key)
        if hit is not None:
            store.move_to_end(key)
            if wait or not self.overlaps:
                self.model.backend.replay(hit[0])
            else:
                self.model.backend.replay(hit[0], wait=False)
            return hit[1]
        if not self.recordable or step.n > self.max_recorded or not (first_sight or self._seen_before(key)):
            return self.model.forward(step, self.cache)
        with self.model.backend.record() as rec:
            logits = self.model.forward(step, self.cache)
        self.recorded = True
        store[key] = (rec, logits)
        if len(store) > limit:
            store.popitem(last=False)
        return logits

    def step(self, plan: Plan, ahead: Ahead | None = None) -> Step:
        """Write the plan's inputs into the fixed arrays; returns views of them."""
        inp, chunks = self.inputs, plan.chunks
        if ahead is not None:
            if not all(c.n == 1 for c in chunks) or len(ahead.rows) != len(chunks):
                raise ValueError("an ahead step is one decode token for each of its rows of the step before")
            return self._ahead_step(chunks, ahead)
        if all(c.n == 1 for c in chunks):
            return self._decode_step(chunks)
        n = sum(c.n for c in chunks)
        at = n_rows = 0
        inp.tables[:len(chunks)] = 0
        self._table_of[:len(chunks)] = [None] * len(chunks)
        for i, c in enumerate(chunks):
            end = at + c.n
            inp.tokens[at:end] = c.token_ids()
            inp.positions[at:end] = np.arange(c.start, c.start + c.n, dtype=np.int32)
            inp.seq_rows[at:end] = i
            inp.tables[i, :len(c.seq.pages)] = c.seq.pages
            for r in c.logit_rows:
                inp.rows[n_rows] = at + r - c.start
                n_rows += 1
            at = end
        if n > MAX_RECORDED_TOKENS:  # prompt-sized: shapes in buckets, so that recordings come again
            n_seqs, n_rows = self._bucketed(len(chunks), n_rows)
            return self._written(n, n_seqs, n_rows)
        return self._written(n, len(chunks), n_rows)

    def _bucketed(self, n_seqs: int, n_rows: int) -> tuple[int, int]:
        """Page-table rows and logit rows of a prompt-sized step, rounded up to powers of two: with
        continuous batching the numbers of sequences and of rows needing logits change from step
        to step. Extra table rows are never read (no token refers to them); extra logit rows
        repeat the last one and are dropped from the results (run)."""
        seqs = min(1 << (n_seqs - 1).bit_length(), len(self.inputs.tables))
        rows = min(1 << max(0, n_rows - 1).bit_length(), self.max_out) if n_rows else 0
        self.inputs.rows[n_rows:rows] = self.inputs.rows[n_rows - 1] if n_rows else 0
        return max(seqs, n_seqs), max(rows, n_rows)

    def _ahead_step(self, chunks, ahead: Ahead) -> Step:
        """_decode_step for an ahead step: its tokens named by their rows of the step before
        (chains) or chosen here from that step's results."""
        k = ahead.k
        if not 0 < k <= MAX_AHEAD_K:
            raise ValueError(f"an ahead step chooses from 1 to {MAX_AHEAD_K} best ids a row, not {k}")
        if self.chains:
            tokens = [-r - 1 for r in ahead.rows]
        else:
            # a row without a usable logit (-1) gets token 0 here: the host fails its sequence when it
            # reads that row, and drops its row of this step (as the device does, see get_rows)
            tokens = [max(first_not_banned(ahead.prev.ids[r], bans), 0) for r, bans in zip(ahead.rows, ahead.bans)]
        step = self._decode_step(chunks, tokens)
        if self.chains:
            m = step.n  # padded rows (token 0, no bans) included
            bans = self.inputs.bans[:m * k].reshape(m, k)
            bans.fill(-1)
            for i, b in enumerate(ahead.bans):
                if len(b) > k:
                    raise ValueError(f"{len(b)} banned ids leave no choice among {k}")
                bans[i, :len(b)] = list(b)
            step.prev_k, step.bans = k, bans
        return step

    def _decode_step(self, chunks, tokens: list[int] | None = None) -> Step:
        """step() for chunks of one token each (decode): whole-array writes from Python lists, the
        cache slots computed here (numpy's per-call cost exceeds the arithmetic of a few rows), and
        a page-table row rewritten only when its pages changed (entries past a sequence's pages
        are never read: attention reads the pages of the positions it attends)."""
        inp, n, P = self.inputs, len(chunks), self.page_size
        inp.tokens[:n] = [c.seq.tokens[c.start] for c in chunks] if tokens is None else tokens
        inp.positions[:n] = [c.start for c in chunks]
        inp.seq_rows[:n] = self._arange[:n]
        inp.slots[:n] = [c.seq.pages[c.start // P] * P + c.start % P for c in chunks]
        n_rows = 0
        for i, c in enumerate(chunks):
            pages = c.seq.pages
            if self._table_of[i] != pages:
                inp.tables[i, :len(pages)] = pages
                self._table_of[i] = list(pages)
            if c.logit_rows:
                inp.rows[n_rows] = i
                n_rows += 1
        size = decode_bucket(n)
        if (self.pad_page is None or size == n or size > len(inp.tokens) or size > len(inp.tables)
                or n_rows + size - n > self.max_out):
            return self._views(n, n, n_rows)
        return self._pad_decode(n, size, n_rows)

    def _pad_decode(self, n: int, size: int, n_rows: int) -> Step:
        """A decode step of n sequences made one of `size`: sequences n .. size-1 are the same
        token (0) at position 0 of the pad page, each with a logit row, dropped by run(). They write
        identical keys and values to one slot no sequence reads, and read only that slot."""
        inp, extra = self.inputs, size - n
        inp.tokens[n:size] = 0
        inp.positions[n:size] = 0
        inp.seq_rows[n:size] = self._arange[n:size]
        inp.slots[n:size] = self.pad_page * self.page_size
        pad = [self.pad_page]
        for i in range(n, size):
            if self._table_of[i] != pad:
                inp.tables[i, 0] = self.pad_page
                self._table_of[i] = pad
        inp.rows[n_rows:n_rows + extra] = self._arange[n:size]
        return self._views(size, size, n_rows + extra)

    def _written(self, n: int, n_seqs: int, n_rows: int) -> Step:
        """The step's views once tokens, positions, sequence rows, tables and logit rows of n
        tokens are written: the cache slots follow from those."""
        P, inp = self.page_size, self.inputs
        pos, seq_rows = inp.positions[:n], inp.seq_rows[:n]
        inp.slots[:n] = inp.tables[seq_rows, pos // P].astype(np.int64) * P + pos % P
        return self._views(n, n_seqs, n_rows)

    def _views(self, n: int, n_seqs: int, n_rows: int) -> Step:
        """A Step over the first n tokens, n_seqs table rows and n_rows logit rows of the inputs. The
        views of a shape are made once: the arrays never move, and decoding comes back to a few shapes."""
        key = (n, n_seqs, n_rows)
        views = self._view_cache.get(key)
        if views is None:
            inp = self.inputs
            attn = AttentionBatch(inp.positions[:n], inp.seq_rows[:n], inp.tables[:n_seqs], inp.slots[:n],
                                  self.page_size)
            views = self._view_cache[key] = (inp.tokens[:n], attn, inp.rows[:n_rows])
            if len(self._view_cache) > MAX_SEEN:
                self._view_cache.pop(next(iter(self._view_cache)))
        return Step(*views)


def first_rows(logits, n: int):
    """The first n rows of a step's logits."""
    if isinstance(logits, TopLogits):
        return TopLogits(logits.ids[:n], logits.values[:n])
    return logits[:n]
