"""Attention over shared prefixes: sequences whose page tables begin with the same pages (the prefix
cache's system prompt) have those keys read once for all their tokens and merged with each sequence's
own keys. Checked against float64 attention and against the same values on pages of their own (the
per-sequence path), with sliding windows, grouped heads, softcaps, sinks and quantized caches."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ember.quant.types import GGMLType
from kv_cases import AttnCase, Ref, quantized_batch
from kv_cases import attention_ref as quantized_ref
from test_cpu_ops import F16_NAN, attention_ref, buf, isa, make_batch, pool, pools, run_attention  # noqa: F401
from test_kv_types import run_quantized_attention


def share_prefix(tables, keys, values, rows, groups, pages, ps, caches=()):
    """In each group, point members[1:]'s first `pages` table entries (as far as each sequence reaches)
    at members[0]'s pages, and make their keys and values those pages' values. Their own pages become
    NaN in `caches` (f16 bits), so a read of them shows. Returns the per-sequence copy of the caches
    (the same values on each sequence's own pages), taken before the pages are shared."""
    reach = {s: min(pages, math.ceil(len(keys[s]) / ps)) for members in groups for s in members[1:]}

    def slots(s, lead=None):
        return (tables[rows[s if lead is None else lead], :reach[s], None] * ps + np.arange(ps)).ravel()

    for members in groups:
        for s in members[1:]:
            for cache in caches:
                cache[slots(s)] = cache[slots(s, members[0])]
            used = min(len(keys[s]), reach[s] * ps)
            keys[s][:used], values[s][:used] = keys[members[0]][:used], values[members[0]][:used]
    copied = [c.copy() for c in caches]
    for members in groups:
        for s in members[1:]:
            for cache in caches:
                cache[slots(s)] = F16_NAN
            tables[rows[s], :reach[s]] = tables[rows[members[0]], :reach[s]]
    return copied


CASES = {
    # the agent workload's decode step: 8 sequences, one system prompt of 75 pages, SmolLM2's heads
    "decode_8_seqs": (AttnCase(9, 3, 64, 64, 16, 0, 0.0, tuple((1300 + 17 * s, 1) for s in range(8))),
                      [list(range(8))], 75),
    # drafted rows riding along: several tokens a sequence, blocks mixing sequences
    "drafts": (AttnCase(9, 3, 64, 64, 16, 0, 0.0, tuple((500 + 9 * s, 1 + s) for s in range(8))),
               [list(range(8))], 25),
    # windows starting before, inside and after the shared keys; softcap; 4 heads a kv head
    "window_softcap_gqa4": (AttnCase(8, 2, 64, 64, 16, 300, 30.0, ((700, 3), (420, 2), (380, 4), (640, 1))),
                            [[0, 1, 2, 3]], 24),
    # two groups, a sequence of its own, one member inside the prefix, tokens interleaved
    "nested_groups": (AttnCase(6, 2, 40, 24, 16, 0, 5.0,
                               ((200, 2), (180, 1), (150, 3), (90, 1), (260, 1), (230, 2), (100, 1)),
                               interleave=True), [[0, 1, 2, 3], [4, 5]], 10),
    # one kv head of 256: the first pass's key ranges split over threads
    "hd256_split": (AttnCase(4, 1, 256, 256, 16, 0, 0.0, ((1100, 1), (1030, 1))), [[0, 1]], 60),
}


def shared_batch(name: str):
    case, groups, pages = CASES[name]
    b = make_batch(case, np.random.default_rng(len(name)))
    rows = {s: int(b.tok_seq[np.flatnonzero(b.tok_owner == s)[0]]) for s in range(len(case.seqs))}
    own = share_prefix(b.block_tables, b.keys, b.values, rows, groups, pages, case.page_size, (b.k_cache, b.v_cache))
    return case, b, own


@pytest.mark.parametrize("name", list(CASES))
def test_shared_prefix_attention(isa, pool, name):
    case, b, _ = shared_batch(name)
    scale = 1.0 / math.sqrt(case.hd_k)
    out = run_attention(pool, case, b, scale)
    np.testing.assert_allclose(out, attention_ref(case, b, scale), rtol=1e-4, atol=3e-6)


@pytest.mark.parametrize("name", ["decode_8_seqs", "window_softcap_gqa4", "nested_groups"])
def test_shared_prefix_matches_the_per_sequence_path(isa, pool, name):
    """The same values on each sequence's own pages (no pages shared): the same output but for rounding."""
    case, b, own = shared_batch(name)
    scale = 1.0 / math.sqrt(case.hd_k)
    shared = run_attention(pool, case, b, scale)
    b.k_cache, b.v_cache = own
    b.block_tables = make_batch(case, np.random.default_rng(len(name))).block_tables  # before sharing
    np.testing.assert_allclose(shared, run_attention(pool, case, b, scale), rtol=2e-5, atol=1e-6)


def test_shared_prefix_with_sinks(isa, pool):
    case, b, _ = shared_batch("decode_8_seqs")
    scale = 1.0 / math.sqrt(case.hd_k)
    sinks = np.random.default_rng(3).normal(0, 2, case.n_head).astype(np.float32)
    sinks[::2] = 40.0
    out = run_attention(pool, case, b, scale, sinks)
    np.testing.assert_allclose(out, attention_ref(case, b, scale, sinks), rtol=1e-4, atol=3e-6)


@pytest.mark.parametrize("types", [(GGMLType.Q8_0, GGMLType.Q8_0), (GGMLType.Q4_0, GGMLType.BF16)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_shared_prefix_reads_quantized_rows(isa, pool, types):
    case = AttnCase(9, 3, 64, 64, 16, 0, 0.0, tuple((400 + 20 * s, 1 + s % 2) for s in range(5)))
    q, k_cache, v_cache, keys, values, pos, seq, tables = quantized_batch(case, np.random.default_rng(5), *types)
    share_prefix(tables, keys, values, {s: s for s in range(5)}, [[0, 1, 2, 3, 4]], 20, case.page_size)
    scale = 1.0 / math.sqrt(case.hd_k)
    out = run_quantized_attention(pool, case, q, k_cache, v_cache, pos, seq, tables, types, scale)
    want = quantized_ref(case, Ref(q, keys, values, pos, seq), scale)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=3e-6)
