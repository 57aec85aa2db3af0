"""Speculative decoding with a draft model: the vocabulary check (llama.cpp's rule), greedy output
token for token the same with the draft model on a real pair (SmolLM2 135M at Q8_0 as the model,
its Q4_1 file as the draft) with a high acceptance rate, the draft's own KV rolled back to what the
model kept for several sequences at once (checked against the draft model run alone), pages back
to baseline after cancels, and the server's flags and counters."""
from __future__ import annotations

import random

import httpx
import pytest

from gguf_edit import requantized
from test_engine import clean_pool, collect, event_log
from test_server_harness import MODEL_CFG, LiveServer
from ember.app import ServerConfig, create_app, load_model
from ember.backends import get_backend
from ember.cli import build_parser, spec_config
from ember.engine import LLM, GrammarSpec, Request
from ember.engine.draftmodel import DraftAsk, DraftModel, check_vocab
from ember.engine.sequence import Sequence
from ember.engine.speculate import DraftParams, DraftState
from ember.gguf_loader import GGUFFile
from ember.models import ModelError, load_model as load_arch
from ember.quant import GGMLType
from ember.sampler import SamplingParams
from synth import Shape, write_model
from test_speculative import edit_prompt

GREEDY = SamplingParams.greedy_params()


# ---- the vocabulary check (no model) ----

def vocab(n: int = 300, kind: str = "gpt2", **extra) -> dict:
    meta = {"tokenizer.ggml.model": kind, "tokenizer.ggml.tokens": [f"t{i}" for i in range(n)],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    return {**meta, **extra}


def test_the_draft_vocabulary_must_be_the_models():
    check_vocab(vocab(), vocab(), 300, 300)
    check_vocab(vocab(), vocab(400), 300, 400)  # sizes within 128 tokens; the common ids agree
    first = vocab()
    first["tokenizer.ggml.tokens"][3] = "<pad>"  # ids below 5 may be named apart
    check_vocab(vocab(), first, 300, 300)
    with pytest.raises(ModelError, match="vocabulary type is 'llama', the model's 'gpt2'"):
        check_vocab(vocab(), vocab(kind="llama"), 300, 300)
    with pytest.raises(ModelError, match="eos_token_id is 7"):
        check_vocab(vocab(), vocab(**{"tokenizer.ggml.eos_token_id": 7}), 300, 300)
    with pytest.raises(ModelError, match="add_bos_token"):
        check_vocab(vocab(), vocab(**{"tokenizer.ggml.add_bos_token": True}), 300, 300)
    with pytest.raises(ModelError, match="429 tokens, the model 300"):
        check_vocab(vocab(), vocab(429), 300, 429)
    other = vocab()
    other["tokenizer.ggml.tokens"][250] = "x"
    with pytest.raises(ModelError, match="token 250 is 'x' in the draft model, 't250' in the model"):
        check_vocab(vocab(), other, 300, 300)


def test_a_draft_model_step_that_drafted_nothing_is_a_miss():
    st = DraftState(DraftParams(n_max=16))
    st.missed()
    assert st.room() == 0 and st.room() == 3  # one step without drafting, at the same length
    st.missed()
    assert [st.room() for _ in range(3)] == [0, 0, 3]  # then two
    st.record(3, 3)
    st.missed()
    assert st.room() == 0 and st.room() == 6  # a kept draft ends the run of misses


# ---- the real pair ----

@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_path):
    """(model, draft): SmolLM2 135M requantized to Q8_0, and its own Q4_1 file."""
    draft = model_path("smollm2")
    target = requantized(draft, tmp_path_factory.mktemp("pair") / "smollm2-q8_0.gguf", int(GGMLType.Q8_0))
    return target, draft


def test_a_draft_model_of_another_vocabulary_is_refused(pair, model_path):
    with pytest.raises(ModelError, match="vocabulary type is 'llama', the model's 'gpt2'"):
        LLM(pair[0], device="cpu", threads=2, ctx=256, model_draft=model_path("gemma3-270m"))


def test_greedy_output_is_the_same_with_a_draft_model(pair):
    """Batch 1 and 8 concurrent requests (plain, stop strings, a grammar, penalties with
    log-probabilities): the same events as without speculation, token for token, and most of the
    draft model's tokens kept."""
    target, draft = pair
    plain = LLM(target, device="cpu", threads=2, ctx=1024, slots=8)
    spec = LLM(target, device="cpu", threads=2, ctx=1024, slots=8, model_draft=draft)
    try:
        grammar = GrammarSpec('root ::= "```python\\n" [^`]* "```"')
        penalized = SamplingParams(temperature=0.0, repeat_penalty=1.1, frequency_penalty=0.2)
        requests = [Request(edit_prompt(plain, 0), 40, GREEDY)]
        requests += [Request(edit_prompt(plain, i), 16, GREEDY if i % 3 else penalized,
                             stop=("return width * h",) if i % 3 == 1 else (), grammar=grammar if i % 3 == 2 else None,
                             logprobs=2 if i % 3 == 0 else None) for i in range(1, 9)]
        want = [event_log(plain.engine.submit(requests[0]))] + [event_log(h) for h in
                                                               [plain.engine.submit(r) for r in requests[1:]]]
        got = [event_log(spec.engine.submit(requests[0]))] + [event_log(h) for h in
                                                             [spec.engine.submit(r) for r in requests[1:]]]
        assert got == want
        by_source = spec.engine.metrics.drafts["draft"]
        # (28 on SmolLM2 at the prior step costs: 5-19-row steps cost less, so the rows drafts add to
        # 8 sequences' steps weigh more; measured costs only ever lower the prior)
        assert by_source.drafted == spec.engine.metrics.draft_tokens > 20
        assert by_source.accepted >= 0.8 * by_source.drafted  # the two precisions agree
        drafter = spec.engine.spec.drafter
        assert not drafter.scheduler.running and not drafter.scheduler.waiting  # every shadow left with its sequence
    finally:
        plain.close()
        spec.close()


# ---- the draft's own state: rolled back to what was kept ----

@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A random tiny model and itself at Q4_0 as its draft: they agree on some tokens only."""
    d = tmp_path_factory.mktemp("tiny_pair")
    target = write_model(d / "model.gguf", "llama", GGMLType.Q8_0, Shape(n_vocab=384), seed=1, vocab=True, tied=False)
    return target, requantized(target, d / "draft.gguf", int(GGMLType.Q4_0))


def greedy_next(m: LLM, tokens: list[int], n: int) -> tuple[list[int], list[float]]:
    """The draft model alone: its n greedy tokens after `tokens`, and the gap between its two best
    logprobs at each (where the gap is within rounding, another shape of step may pick the other)."""
    out, gaps = [], []
    for _ in range(n):
        s = m.score(tokens + out + [0], top=2)
        out.append(int(s.top_ids[-1, 0]))
        gaps.append(float(s.top_logprobs[-1, 0] - s.top_logprobs[-1, 1]))
    return out, gaps


def test_the_draft_models_kv_follows_what_the_model_kept(tiny_pair):
    """Six sequences at once, twelve rounds: after each, a random part of each draft is 'kept'
    and a different token follows (as verification does), sequences end and new ones come; every
    draft is what the draft model alone drafts after the sequence's tokens, and at the end every
    page of the draft's pool is free."""
    rng = random.Random(5)
    alone = LLM(tiny_pair[1], device="cpu", threads=2, ctx=256, slots=1, prefix_cache=False)
    f = GGUFFile(tiny_pair[1])
    drafter = DraftModel(load_arch(f, get_backend("cpu", threads=2)), 256, 6, 16, 64)
    shared = [1] + [rng.randrange(3, 300) for _ in range(20)]  # a common prefix: the draft's tree serves it
    try:
        seqs = [Sequence(shared + [rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))], 100) for _ in range(6)]
        checked = 0
        for _ in range(12):
            asks = [DraftAsk(s, rng.randrange(1, 6), 0.0) for s in seqs]
            drafts = drafter.draft(asks)
            for ask in asks:
                want, gaps = greedy_next(alone, ask.seq.tokens, ask.n)
                got = drafts[ask.seq.id]
                at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
                assert len(got) == ask.n and (at is None or gaps[at] < 1e-3), (want, got, gaps)
                checked += len(got)
                kept = rng.randrange(0, len(got) + 1)
                other = next(t for t in range(3, 300) if kept == len(got) or t != got[kept])
                ask.seq.tokens.extend(got[:kept] + [other])
            done = seqs.pop(rng.randrange(len(seqs)))
            drafter.finished(done)
            seqs.append(Sequence(shared + [rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))], 100))
        assert checked > 150
        assert drafter.tree.n_tokens > 0
        for s in seqs:
            drafter.finished(s)
        drafter.clear()
        assert drafter.pool.n_free == drafter.pool.n_pages and not drafter.scheduler.running
    finally:
        alone.close()
        f.close()


def test_requests_with_a_draft_model_and_cancels_leave_nothing_behind(tiny_pair):
    """Greedy and seeded sampled requests with a draft model that is mostly wrong (p_min 0):
    the outputs without it, random cancellations, a KV budget that preempts, and both pools back
    to baseline."""
    target, draft = tiny_pair
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 300) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    params = [GREEDY if i % 2 else SamplingParams(seed=i, temperature=1.0, top_k=5) for i in range(12)]
    plain = LLM(target, threads=2, ctx=128, slots=6, kv_tokens=160, batch=64)
    expected = [collect(plain.engine.submit(Request(p, 24, s)))[0][0] for p, s in zip(prompts, params)]
    plain.close()
    spec = LLM(target, threads=2, ctx=128, slots=6, kv_tokens=160, batch=64, model_draft=draft,
               speculative="lookup")
    try:
        handles = []
        for i in range(60):
            k = rng.randrange(len(prompts))
            handles.append((k, spec.engine.submit(Request(prompts[k], 24, params[k],
                                                          speculative=DraftParams(n_max=6, p_min=0.0)))))
            if rng.random() < 0.15:
                handles[-1][1].cancel()
        n_same = n_done = 0
        for k, h in handles:
            (ids, reason), = collect(h).values()
            if reason != "cancelled":
                n_done += 1
                n_same += ids == expected[k]
        m = spec.engine.metrics
        assert n_done >= 40 and n_same == n_done and spec.engine.last_error is None
        assert m.drafts["draft"].drafted > m.drafts["draft"].accepted > 0
        clean_pool(spec)
        drafter = spec.engine.spec.drafter
        spec.engine.call(drafter.clear).result(timeout=30)
        assert drafter.pool.n_free == drafter.pool.n_pages and not drafter.scheduler.running
    finally:
        spec.close()


# ---- the command line and the server ----

def test_draft_flags_make_the_speculative_config(pair):
    target, draft = pair
    args = build_parser().parse_args(["serve", str(target), "-md", str(draft), "-cd", "512", "--draft-p-min", "0.6",
                                      "-ngld", "0", "--spec-type", "lookup"])
    spec = spec_config(args)
    assert spec.types == ("draft", "lookup") and spec.draft.p_min == 0.6
    assert (spec.model.path, spec.model.device, spec.model.n_ctx) == (str(draft), "cpu", 512)
    args = build_parser().parse_args(["run", str(target), "-md", str(draft), "--spec-type", "lookup,draft",
                                      "--device-draft", "reference"])
    assert spec_config(args).types == ("lookup", "draft") and spec_config(args).model.device == "reference"
    with pytest.raises(ValueError, match="needs a draft model"):
        spec_config(build_parser().parse_args(["run", str(target), "--spec-type", "draft"]))


def test_server_drafts_with_the_draft_model(pair):
    target, draft = pair
    args = build_parser().parse_args(["serve", str(target), "--model-draft", str(draft), "--ctx-size-draft", "512"])
    model = load_model(MODEL_CFG.__class__(str(target), device="cpu", threads=2, ctx=1024, slots=2,
                                           speculative=spec_config(args)))
    with LiveServer(create_app(ServerConfig(), lambda: model)) as live:
        live.wait_ready()
        body = {"prompt": "Count: one, two, three, four, five, six,", "n_predict": 24, "temperature": 0}
        on = httpx.post(live.url + "/completion", json=body, timeout=120).json()
        off = httpx.post(live.url + "/completion", json={**body, "speculative.n_max": 0}, timeout=120).json()
        assert on["content"] == off["content"]
        assert on["timings"]["draft_n"] >= on["timings"]["draft_n_accepted"] > 0
        metrics = httpx.get(live.url + "/metrics", timeout=60).text
        line = next(x for x in metrics.splitlines() if x.startswith('ember:draft_tokens_total{source="draft"}'))
        assert float(line.split()[-1]) == on["timings"]["draft_n"]  # also where it ended on a draft's row
    model.close()
