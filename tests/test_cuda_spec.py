"""Speculative decoding on the CUDA backend: a drafted sequence's rows go through the same forward
as a prompt chunk (causal within the chunk), and greedy rows come back as best ids reduced on the
device. Greedy streams with drafts give the tokens of streams without them (up to near-ties of the
random model, checked against the float64 reference as in test_cuda.py), and the KV pool returns
to empty afterwards.

Skipped without CuPy or an NVIDIA GPU; on the GPU machine:
    python -m pytest -q -p no:cacheprovider tests/test_cuda_spec.py
"""
from __future__ import annotations

import numpy as np
import pytest
from synth import Shape, write_model
from test_cuda import REASON, last_logits

from ember.quant import GGMLType

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def streams(path, prompts, spec: str, repeat: int = 2):
    """Each prompt `repeat` times (the later runs draft from the earlier ones' cached tokens), all
    at once per round; the token lists of the last round and the engine's draft counters."""
    from test_engine import clean_pool

    from ember.engine import LLM, Request, TokenEvent
    from ember.sampler import SamplingParams

    no_eos = SamplingParams(temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cuda", slots=8, ctx=256, speculative=spec) as llm:
        eng = llm.engine
        for _ in range(repeat):
            handles = [eng.submit(Request(p, 24 + 4 * i, no_eos)) for i, p in enumerate(prompts)]
            got = [[ev.token for ev in h if isinstance(ev, TokenEvent)] for h in handles]
        clean_pool(llm)  # every page free again once the cache is cleared
        return got, eng.metrics.draft_tokens, eng.metrics.draft_tokens_accepted


def test_greedy_streams_with_drafts_match_streams_without(tmp_path):
    path = write_model(tmp_path / "s.gguf", "llama", GGMLType.F16, Shape(n_layer=2), vocab=True, tied=False)
    rng = np.random.default_rng(11)
    prompts = [[1] + (rng.integers(3, 300, 4).tolist() * 3) for _ in range(8)]
    plain, _, _ = streams(path, prompts, "none")
    drafted, n_draft, n_kept = streams(path, prompts, "cache,lookup")
    # drafts join steps only while their rows pay for themselves (measured as steps run): on the
    # H200 a drafted step of this 2-layer model costs 1.1-4x a plain one, so drafting stays sparse
    # (71 of 77 kept there, 189 of 195 on the CPU), still enough rows to check verification by
    assert n_kept >= 40 and n_draft >= n_kept
    parted = [(p, a, b) for p, a, b in zip(prompts, drafted, plain) if a != b]
    assert len(parted) <= 1, f"{len(parted)} streams differ"
    for prompt, a, b in parted:
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        logits = last_logits(path, prompt + b[:j])
        for tok in (a[j], b[j]):
            assert (logits.max() - logits[tok]) / np.abs(logits).max() < 1e-3, f"token {tok} at {j} is not a tie"


def test_a_draft_model_on_the_gpu_keeps_greedy_streams(tmp_path):
    """The model F16, itself at Q8_0 as its draft model, both on the GPU: 8 greedy streams at once
    give the tokens of streams without drafts (up to ties), most drafts are kept, and the draft
    model's pool returns to empty."""
    from gguf_edit import requantized
    from test_engine import clean_pool

    from ember.engine import LLM, DraftParams, Request, TokenEvent
    from ember.sampler import SamplingParams

    path = write_model(tmp_path / "s.gguf", "llama", GGMLType.F16, Shape(n_layer=2), vocab=True, tied=False)
    draft = requantized(path, tmp_path / "d.gguf", int(GGMLType.Q8_0))
    rng = np.random.default_rng(12)
    prompts = [[1] + rng.integers(3, 300, 6).tolist() for _ in range(8)]
    plain, _, _ = streams(path, prompts, "none", repeat=1)
    no_eos = SamplingParams(temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cuda", slots=8, ctx=256, model_draft=str(draft), speculative="draft") as llm:
        eng = llm.engine
        handles = [eng.submit(Request(p, 24 + 4 * i, no_eos, speculative=DraftParams(n_max=8, p_min=0.0)))
                   for i, p in enumerate(prompts)]
        got = [[ev.token for ev in h if isinstance(ev, TokenEvent)] for h in handles]
        stats = eng.metrics.drafts["draft"]
        assert stats.accepted > 0.5 * stats.drafted > 20
        clean_pool(llm)
        drafter = eng.spec.drafter
        eng.call(drafter.clear).result(timeout=60)
        assert drafter.pool.n_free == drafter.pool.n_pages and not drafter.scheduler.running
    parted = [(p, a, b) for p, a, b in zip(prompts, got, plain) if a != b]
    assert len(parted) <= 1, f"{len(parted)} streams differ"
    for prompt, a, b in parted:
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        logits = last_logits(path, prompt + b[:j])
        for tok in (a[j], b[j]):
            assert (logits.max() - logits[tok]) / np.abs(logits).max() < 1e-3, f"token {tok} at {j} is not a tie"
