"""ember against llama.cpp on the real models: teacher-forced log-probabilities, greedy
generation and perplexity (bounds explained in tests/data/README.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import DATA, golden

MODELS = ["smollm2", "gemma3-270m"]
MAX_STEP_ERR = 0.3
MAX_MEAN_ERR = 0.05
CLEAR_MARGIN = 0.3


def margin(step: dict) -> float:
    top = step["top"]
    return top[0][1] - top[1][1]


@pytest.fixture(scope="module")
def forced(llm):
    """Per model: every golden case with ember's teacher-forced scores."""
    out = {}
    for name in MODELS:
        m = llm(name)
        cases = golden(name, "greedy")["cases"]
        out[name] = [(c, m.score(c["prompt_ids"] + c["completion_ids"], top=2)) for c in cases]
    return out


@pytest.mark.parametrize("name", MODELS)
def test_teacher_forced_logprobs(forced, name):
    errors = []
    for case, scores in forced[name]:
        n_prompt = len(case["prompt_ids"])
        ours = scores.logprobs[n_prompt - 1:]
        theirs = np.array([s["logprob"] for s in case["steps"]])
        assert len(ours) == len(theirs)
        err = np.abs(ours - theirs)
        worst = int(err.argmax())
        assert err[worst] <= MAX_STEP_ERR, f"{case['name']} step {worst}: ember {ours[worst]:.3f}, llama.cpp {theirs[worst]:.3f}"
        errors.append(err)
    mean = float(np.concatenate(errors).mean())
    assert mean <= MAX_MEAN_ERR, f"mean |logprob error| {mean:.4f}"


@pytest.mark.parametrize("name", MODELS)
def test_top_token_where_margin_is_clear(forced, name):
    for case, scores in forced[name]:
        n_prompt = len(case["prompt_ids"])
        for i, step in enumerate(case["steps"]):
            if margin(step) > CLEAR_MARGIN:
                ours = int(scores.top_ids[n_prompt - 1 + i, 0])
                assert ours == step["top"][0][0], f"{case['name']} step {i}: ember {ours}, llama.cpp {step['top'][0][0]}"


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation(llm, name):
    from ember.sampler import SamplingParams

    m = llm(name)
    for case in golden(name, "greedy")["cases"]:
        expected = case["completion_ids"]
        # compare up to the first step where llama.cpp itself was near a tie
        upto = next((i for i, s in enumerate(case["steps"]) if margin(s) < CLEAR_MARGIN), len(expected))
        out = m.generate(case["prompt_ids"], max_tokens=upto, sampling=SamplingParams.greedy_params())
        assert out.token_ids[:upto] == expected[:upto], case["name"]


@pytest.mark.parametrize("name,filename", [("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                                           ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf")])
def test_perplexity_matches_llama_cpp(llm, name, filename):
    reference = json.loads((DATA / "perplexity.json").read_text())["results"][filename]
    r = llm(name).perplexity((DATA / "GPL-3.txt").read_text(encoding="utf-8"), ctx=512)
    assert r.chunks == reference["chunks"]
    assert abs(r.ppl - reference["ppl"]) / reference["ppl"] < 0.01, f"PPL {r.ppl:.4f} vs llama.cpp {reference['ppl']}"


def test_chat_prompts_render_as_llama_cpp(llm):
    m = llm("smollm2")
    for case in golden("smollm2", "greedy")["cases"]:
        if case["chat"]:
            messages = [{"role": "user", "content": case_prompt(case["name"])}]
            assert m.apply_chat_template(messages) == case["prompt_text"]
            assert m.chat_ids(messages) == case["prompt_ids"]


def case_prompt(name: str) -> str:
    corpus = json.loads((DATA / "corpus.json").read_text())
    return next(p["prompt"] for p in corpus["prompts"] if p["name"] == name)
