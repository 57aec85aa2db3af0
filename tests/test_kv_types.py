"""Quantized KV caches: the C kernels (quantize on write, attention reading the quantized rows in
place) against the numpy quantizers of ember.quant and a float64 attention, on every SIMD path."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from ember.backends import KV_TYPES, kv_type
from ember.backends.cpu._native import ffi, lib
from ember.quant import quantize
from ember.quant.types import GGMLType

from kv_cases import CASES, Ref, attention_ref, quantized_batch, step_logits
from test_cpu_ops import buf, from_parts, in_parts, isa, pool, pools  # noqa: F401 (fixtures)

QUANTIZED = [GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0]


def row_bytes(t: GGMLType, n: int) -> int:
    return int(lib.ember_kv_row_bytes(int(t), n))


def test_row_bytes_and_names():
    assert [row_bytes(t, 64) for t in (GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0)] == [128, 128, 68, 36]
    assert row_bytes(GGMLType.Q8_0, 48) == -1 and row_bytes(GGMLType.Q4_1, 64) == -1
    assert kv_type("Q8_0") is GGMLType.Q8_0 and set(KV_TYPES) == {"f16", "bf16", "q8_0", "q4_0"}
    with pytest.raises(ValueError, match="q5_0"):
        kv_type("q5_0")


def run_quantized_attention(pool, case, q, k_cache, v_cache, pos, seq, tables, types, scale, parts=1) -> np.ndarray:
    """ember_attention over caches of the given (K, V) types, laid out in `parts` first."""
    out = np.full((len(pos), case.n_head, case.hd_v), np.nan, np.float32)
    k_cache, v_cache = (in_parts(c, case.page_size, parts) for c in (k_cache, v_cache))
    lib.ember_attention(pool, buf(q), buf(k_cache, "uint8_t"), buf(v_cache, "uint8_t"), buf(out), len(pos),
                        case.n_head, case.n_kv_head, case.hd_k, case.hd_v, buf(pos, "int32_t"), buf(seq, "int32_t"),
                        buf(tables, "int32_t"), tables.shape[1], case.page_size, case.window, scale, case.softcap,
                        int(types[0]), int(types[1]), ffi.NULL, parts)
    return out


@pytest.mark.parametrize("t", QUANTIZED, ids=lambda t: t.name)
def test_kv_store_matches_the_numpy_quantizer(isa, pool, t):
    rng = np.random.default_rng(int(t))
    n_tok, k_dim, v_dim, n_slots = 37, 256, 64, 80
    k = (rng.standard_normal((n_tok, k_dim)) * 3).astype(np.float32)
    v = rng.standard_normal((n_tok, v_dim)).astype(np.float32)
    k[0, :32] = 0  # an all-zero block: scale 0, no division by it
    v[1, :32] = -v[1, :32].max()  # Q4_0's extreme value is negative here
    slots = rng.permutation(n_slots)[:n_tok].astype(np.int64)
    k_cache = np.full((n_slots, row_bytes(t, k_dim)), 0xAB, np.uint8)
    v_cache = np.full((n_slots, row_bytes(t, v_dim)), 0xAB, np.uint8)
    lib.ember_kv_store(pool, buf(k), buf(v), buf(k_cache, "uint8_t"), buf(v_cache, "uint8_t"),
                       buf(slots, "int64_t"), n_tok, k_dim, v_dim, int(t), int(t), 1, 1)
    np.testing.assert_array_equal(k_cache[slots], quantize(k, t))
    np.testing.assert_array_equal(v_cache[slots], quantize(v, t))
    untouched = np.setdiff1d(np.arange(n_slots), slots)
    assert (k_cache[untouched] == 0xAB).all()
    # the backend's layout: pages of 16 slots, each of 2 kv heads' rows together (v: heads of 32 values)
    k_parts, v_parts = np.full_like(k_cache, 0xCD), np.full_like(v_cache, 0xCD)
    lib.ember_kv_store(pool, buf(k), buf(v), buf(k_parts, "uint8_t"), buf(v_parts, "uint8_t"),
                       buf(slots, "int64_t"), n_tok, k_dim, v_dim, int(t), int(t), 16, 2)
    k_rows, v_rows = from_parts(k_parts, 16, 2), from_parts(v_parts, 16, 2)
    np.testing.assert_array_equal(k_rows[slots], k_cache[slots])
    np.testing.assert_array_equal(v_rows[slots], v_cache[slots])
    assert (k_rows[untouched] == 0xCD).all() and (v_rows[untouched] == 0xCD).all()


@pytest.mark.parametrize("name", ["gqa3_prefill_chunk", "hd256_long_decode"])
@pytest.mark.parametrize("types", [(GGMLType.Q8_0, GGMLType.Q8_0), (GGMLType.Q4_0, GGMLType.Q4_0),
                                   (GGMLType.BF16, GGMLType.Q8_0)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_attention_reads_quantized_rows(isa, pool, name, types):
    case = CASES[name]
    q, k_cache, v_cache, keys, values, pos, seq, tables = quantized_batch(case, np.random.default_rng(7), *types)
    scale = 1.0 / math.sqrt(case.hd_k)
    out = run_quantized_attention(pool, case, q, k_cache, v_cache, pos, seq, tables, types, scale)
    want = attention_ref(case, Ref(q, keys, values, pos, seq), scale)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=3e-6)
    in_heads = run_quantized_attention(pool, case, q, k_cache, v_cache, pos, seq, tables, types, scale, case.n_kv_head)
    np.testing.assert_array_equal(in_heads, out)


@pytest.mark.parametrize("block", [64, 256])
def test_hadamard_rotation_matches_numpy_and_undoes_itself(isa, pool, block):
    from ember.backends.reference import hadamard

    x = np.random.default_rng(block).standard_normal((5, 512)).astype(np.float32)
    out = np.empty_like(x)
    lib.ember_hadamard(pool, buf(x), buf(out), 5, 512, block)
    np.testing.assert_allclose(out, hadamard(x, block), rtol=1e-5, atol=1e-5)
    lib.ember_hadamard(pool, buf(out), buf(out), 5, 512, block)  # in place; H H = I
    np.testing.assert_allclose(out, x, rtol=1e-5, atol=1e-5)


def test_rotation_follows_llama_cpp():
    from ember.backends import kv_rotation

    assert [kv_rotation(GGMLType.Q8_0, hd, True) for hd in (64, 128, 192, 256, 80)] == [64, 128, 64, 256, 0]
    assert [kv_rotation(GGMLType.Q4_0, hd, False) for hd in (64, 256, 96)] == [64, 64, 0]
    assert kv_rotation(GGMLType.F16, 128, True) == kv_rotation(GGMLType.BF16, 128, False) == 0


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_model_logits_with_a_quantized_cache_match_the_reference(tmp_path, kv):
    """A small model's logits, a prompt then decode steps, on the CPU and on the float64 reference
    with the same cache type (rotated, quantized rows): the same function of the tokens."""
    from synth import Shape, write_model

    from ember.backends import get_backend
    from ember.gguf_loader import GGUFFile
    from ember.models import load_model

    path = write_model(tmp_path / "m.gguf", "llama", GGMLType.F16, Shape(n_layer=2, head_dim=64), vocab=True)
    tokens = np.random.default_rng(1).integers(3, 300, 44).tolist()
    logits = {}
    for device in ("cpu", "reference"):
        with GGUFFile(path) as f:
            model = load_model(f, get_backend(device))
            cache = model.new_kv_cache(8, 16, kv_type(kv), kv_type(kv))
            assert cache.layers[0].k_rot == 64 and cache.layers[0].v_rot == 64
            logits[device] = step_logits(model, cache, tokens, 40)
    for got, want in zip(logits["cpu"], logits["reference"]):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 2e-3, err


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_pages_leave_and_enter_the_cache_as_whole_rows(tmp_path, kv):
    """The CPU cache lays a page out by kv head (KVLayer.parts); read_pages gives each slot's row whole,
    the format slot files and disk tiers keep for every backend. Pages read from it and written into a
    cache of whole rows, or into another laid out by head, decode the next token to the same logits."""
    from synth import Shape, write_model

    from ember.backends import AttentionBatch, get_backend
    from ember.gguf_loader import GGUFFile
    from ember.models import KVCache, Step, load_model

    path = write_model(tmp_path / "m.gguf", "llama", GGMLType.F16, Shape(n_layer=2, head_dim=64), vocab=True)
    tokens = np.random.default_rng(2).integers(3, 300, 45).tolist()
    with GGUFFile(path) as f:
        model = load_model(f, get_backend("cpu"))
        t = kv_type(kv)
        cache = model.new_kv_cache(8, 16, t, t)
        assert [layer.parts for layer in cache.layers] == [2, 2]  # Shape's 2 kv heads
        step_logits(model, cache, tokens[:44], 40)  # pages 7, 6, 5 (step_logits takes them in reverse)
        pages = [7, 6, 5]
        data = cache.read_pages(pages)
        assert data.shape == (3, cache.page_nbytes)
        rows = KVCache(model.backend, model.kv_dims(), 8, 16, t, t)  # no head sizes given: whole rows
        assert [layer.parts for layer in rows.layers] == [1, 1]
        rows.layers = [replace(r, k_rot=c.k_rot, v_rot=c.v_rot) for r, c in zip(rows.layers, cache.layers)]
        again = model.new_kv_cache(8, 16, t, t)
        for other in (rows, again):
            other.write_pages(pages, data)
            np.testing.assert_array_equal(other.read_pages(pages), data)
        # a slot's key row whole: head 1 of slot 7 * 16 + 3 sits a page's head-0 rows after head 0
        k = cache.layers[0].k.reshape(-1)
        head = row_bytes(t, 64)
        first = 7 * 16 * 2 * head + 3 * head
        np.testing.assert_array_equal(rows.layers[0].k[7 * 16 + 3],
                                      np.concatenate([k[first:first + head], k[first + 16 * head:][:head]]))
        P = 16
        table = np.arange(8)[::-1].astype(np.int32)[None, :]
        pos = np.array([44], np.int32)
        slots = table[0, pos // P].astype(np.int64) * P + pos % P
        step = Step(np.asarray(tokens[44:], np.int32), AttentionBatch(pos, np.zeros(1, np.int32), table, slots, P),
                    np.array([0], np.int32))
        want = np.array(model.forward(step, cache))
        for other in (rows, again):
            np.testing.assert_array_equal(np.array(model.forward(step, other)), want)


def test_block_cache_types_refuse_heads_that_are_not_whole_blocks(tmp_path):
    """Heads of 80 values (rows of 160 for 2 kv heads are whole blocks, the heads are not): a q8_0 cache
    is refused with the reason, f16 and bf16 take them."""
    from synth import Shape, write_model

    from ember.backends import get_backend
    from ember.gguf_loader import GGUFFile
    from ember.models import load_model

    path = write_model(tmp_path / "m.gguf", "llama", GGMLType.F16, Shape(n_layer=1, d_model=320, n_head=4,
                                                                           head_dim=80), vocab=True)
    with GGUFFile(path) as f:
        model = load_model(f, get_backend("cpu"))
        with pytest.raises(ValueError, match="heads of 80 values need f16 or bf16"):
            model.new_kv_cache(4, 16, kv_type("q8_0"), kv_type("f16"))
        for t in ("f16", "bf16"):
            assert model.new_kv_cache(4, 16, kv_type(t), kv_type(t)).layers[0].parts == 2
