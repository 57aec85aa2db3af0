"""The CUDA backend's KV cache in BF16, Q8_0 and Q4_0 (kernels/kv_quant.cu): the write against the
numpy quantizers, the attention reading quantized rows against a float64 attention over the values
they stand for, page copies and host round trips of such caches, and engine runs against the CPU
backend's with the same cache types. Skipped where CuPy or an NVIDIA GPU is missing."""
from __future__ import annotations

import math

import numpy as np
import pytest
from kv_cases import CASES, Ref, attention_ref, quantized_batch, step_logits
from synth import Shape, write_model
from test_cuda import REASON, cpu_or_reference

from ember.backends import AttentionBatch, get_backend
from ember.quant import GGMLType, quantize

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

QUANTIZED = [GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0]


@pytest.fixture(scope="module")
def cuda():
    return get_backend("cuda")


@pytest.mark.parametrize("t", QUANTIZED, ids=lambda t: t.name)
def test_kv_store_matches_the_numpy_quantizer(cuda, t):
    rng = np.random.default_rng(int(t))
    n_tok, k_dim, v_dim, n_slots = 37, 256, 64, 80
    k = (rng.standard_normal((n_tok, k_dim)) * 3).astype(np.float32)
    v = rng.standard_normal((n_tok, v_dim)).astype(np.float32)
    k[0, :32] = 0
    v[1, :32] = -v[1, :32].max()
    v[2, :32] = 1.0  # equal magnitudes: the first is Q4_0's extreme
    v[2, 5] = -1.0
    slots = rng.permutation(n_slots)[:n_tok].astype(np.int64)
    cache = cuda.kv_cache(n_slots, k_dim, v_dim, t, t)
    batch = AttentionBatch(np.zeros(n_tok, np.int32), np.zeros(n_tok, np.int32), np.zeros((1, 1), np.int32), slots, 16)
    cuda.kv_store(cache, cuda.from_numpy(k), cuda.from_numpy(v), batch)
    cuda.synchronize()
    np.testing.assert_array_equal(cuda.to_numpy(cache.k)[slots], quantize(k, t))
    np.testing.assert_array_equal(cuda.to_numpy(cache.v)[slots], quantize(v, t))


@pytest.mark.parametrize("name", ["gqa3_prefill_chunk", "hd256_long_decode", "gqa3_long_decode_window",
                                  "gqa4_softcap"])
@pytest.mark.parametrize("types", [(GGMLType.Q8_0, GGMLType.Q8_0), (GGMLType.Q4_0, GGMLType.Q4_0),
                                   (GGMLType.F16, GGMLType.Q8_0), (GGMLType.BF16, GGMLType.Q4_0)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_attention_reads_quantized_rows(cuda, name, types):
    case = CASES[name]
    q, k_rows, v_rows, keys, values, pos, seq, tables = quantized_batch(case, np.random.default_rng(7), *types)
    cache = cuda.kv_cache(k_rows.shape[0], case.n_kv_head * case.hd_k, case.n_kv_head * case.hd_v, *types)
    cache.k[...] = cuda.cp.asarray(k_rows.view(np.float16) if types[0] == GGMLType.F16 else k_rows)
    cache.v[...] = cuda.cp.asarray(v_rows.view(np.float16) if types[1] == GGMLType.F16 else v_rows)
    scale = 1.0 / math.sqrt(case.hd_k)
    out = cuda.from_numpy(np.full((len(pos), case.n_head * case.hd_v), np.nan, np.float32))
    batch = AttentionBatch(pos, seq, tables, np.zeros(len(pos), np.int64), case.page_size)
    cuda.attention(cuda.from_numpy(q.reshape(len(pos), -1)), cache, out, batch, case.n_head, case.n_kv_head,
                   case.window, scale, case.softcap)
    got = cuda.to_numpy(out).reshape(len(pos), case.n_head, case.hd_v)
    want = attention_ref(case, Ref(q, keys, values, pos, seq), scale)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=3e-6)


@pytest.mark.parametrize("name", ["gqa3_prefill_chunk", "hd256_long_decode", "gqa4_softcap"])
def test_attention_over_quantized_rows_takes_sinks(cuda, name):
    """Attention sinks (a logit per head in the softmax's denominator) in attn_q."""
    from ember.backends import Weight

    case = CASES[name]
    types = (GGMLType.Q8_0, GGMLType.Q4_0)
    rng = np.random.default_rng(9)
    q, k_rows, v_rows, keys, values, pos, seq, tables = quantized_batch(case, rng, *types)
    sinks = rng.normal(0, 1.5, case.n_head).astype(np.float32)
    sinks[0] = 12.0
    cache = cuda.kv_cache(k_rows.shape[0], case.n_kv_head * case.hd_k, case.n_kv_head * case.hd_v, *types)
    cache.k[...], cache.v[...] = cuda.cp.asarray(k_rows), cuda.cp.asarray(v_rows)
    scale = 1.0 / math.sqrt(case.hd_k)
    out = cuda.from_numpy(np.full((len(pos), case.n_head * case.hd_v), np.nan, np.float32))
    batch = AttentionBatch(pos, seq, tables, np.zeros(len(pos), np.int64), case.page_size)
    cuda.attention(cuda.from_numpy(q.reshape(len(pos), -1)), cache, out, batch, case.n_head, case.n_kv_head,
                   case.window, scale, case.softcap,
                   sinks=Weight("sinks", GGMLType.F32, (case.n_head,), cuda.from_numpy(sinks)))
    got = cuda.to_numpy(out).reshape(len(pos), case.n_head, case.hd_v)
    want = attention_ref(case, Ref(q, keys, values, pos, seq), scale, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=3e-6)


@pytest.mark.parametrize("block", [64, 256])
def test_hadamard_rotation_matches_numpy(cuda, block):
    from ember.backends.cuda.ops.kvquant import Hadamard
    from ember.backends.reference import hadamard

    x = np.random.default_rng(block).standard_normal((5, 512)).astype(np.float32)
    out = cuda.from_numpy(np.full_like(x, np.nan))
    cuda._run(Hadamard(cuda.from_numpy(x), out, block))
    np.testing.assert_allclose(cuda.to_numpy(out), hadamard(x, block), rtol=1e-5, atol=1e-5)
    cuda._run(Hadamard(out, out, block))  # in place; H H = I
    np.testing.assert_allclose(cuda.to_numpy(out), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_model_logits_with_a_quantized_cache_match_the_reference(tmp_path, kv):
    """As test_kv_types' test of the CPU: prompt and decode logits of a small model on the GPU with a
    rotated, quantized cache against the float64 reference with the same cache."""
    from ember.backends import kv_type
    from ember.gguf_loader import GGUFFile
    from ember.models import load_model

    path = write_model(tmp_path / "m.gguf", "llama", GGMLType.F16, Shape(n_layer=2, head_dim=64), vocab=True)
    tokens = np.random.default_rng(1).integers(3, 300, 44).tolist()
    logits = {}
    for device in ("cuda", "reference"):
        with GGUFFile(path) as f:
            model = load_model(f, get_backend(device))
            cache = model.new_kv_cache(8, 16, kv_type(kv), kv_type(kv))
            logits[device] = step_logits(model, cache, tokens, 40)
    # looser than the CPU's 2e-3: the GPU's prompt steps round activations to f16 before the cache
    # quantizes them, so a value near a rounding boundary may take the neighbouring level
    for got, want in zip(logits["cuda"], logits["reference"]):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_engine_greedy_matches_cpu_with_a_quantized_cache(tmp_path, kv):
    """Greedy runs on the GPU and on the CPU with the same cache type: the same tokens, but for a
    run that parts at a near-tie (the random model's logits are close), as test_cuda's engine test
    allows; page copies (a shared prompt), and the pages' host round trip through the RAM tier."""
    from concurrent.futures import ThreadPoolExecutor

    from ember.engine import LLM
    from ember.sampler import SamplingParams

    path = write_model(tmp_path / "v.gguf", "llama", GGMLType.F16, Shape(n_layer=2), vocab=True, tied=False)
    rng = np.random.default_rng(3)
    shared = [1] + rng.integers(3, 300, 40).tolist()
    prompts = [shared + rng.integers(3, 300, 3 + i).tolist() for i in range(6)]

    def runs(device: str) -> list[list[int]]:
        with LLM(str(path), device=device, slots=6, ctx=128, cache_type_k=kv, cache_type_v=kv,
                 cache_ram=1 << 24) as llm:
            with ThreadPoolExecutor(6) as pool:
                out = list(pool.map(lambda p: llm.generate(p, 10, SamplingParams.greedy_params()).token_ids, prompts))
            llm.engine.call(lambda: llm.engine.tree.evict(llm.engine.pool.n_pages + 1)).result()
            again = llm.generate(prompts[0], 10, SamplingParams.greedy_params()).token_ids
            assert again == out[0] and llm.engine.tiers.stats.hits["ram"] > 0
            return out

    got, want = runs("cuda"), runs(cpu_or_reference())
    parted = [i for i in range(len(prompts)) if got[i] != want[i]]
    assert len(parted) <= 1, f"runs {parted} differ from the CPU's"
