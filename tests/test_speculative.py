"""Speculative decoding: draft sources on their own (device-free), then the engine: greedy output
token for token the same with and without drafts on the real models, the sampled distribution
unchanged (chi-square), KV pages and the prefix tree back to baseline after 1,000 requests with
drafts and cancellations, and the server's fields, timings and counters."""
from __future__ import annotations

import math
import random
import threading

import httpx
import pytest

from test_engine import clean_pool, collect, event_log
from test_server_harness import MODEL_CFG, LiveServer
from ember.app import ServerConfig, create_app, load_model
from ember.engine import LLM, FinishEvent, GrammarSpec, Request, TokenEvent
from ember.engine.drafts import BYTES_PER_TOKEN, NgramIndex, PromptLookup
from ember.engine.pages import PagePool
from ember.engine.radix import RadixCache
from ember.engine.speculate import (Acceptance, DraftParams, DraftState, SpecConfig, StepCosts, draft_lengths,
                                    parse_types)
from ember.quant import GGMLType
from ember.sampler import SamplingParams
from synth import Shape, write_model

GREEDY = SamplingParams.greedy_params()
SPEC = "cache,lookup"
CODE = '''def area(shape, width, height):
    if shape == "square":
        return width * width
    if shape == "rectangle":
        return width * height
    if shape == "triangle":
        return width * height / 2
    raise ValueError(f"unknown shape {shape}")


def perimeter(shape, width, height):
    if shape == "square":
        return 4 * width
    if shape == "rectangle":
        return 2 * (width + height)
    raise ValueError(f"unknown shape {shape}")
'''


# ---- the draft sources (no model) ----

def test_prompt_lookup_drafts_what_followed_the_suffix_last():
    lookup = PromptLookup()
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 9, 2, 3, 4]
    assert lookup.find(tokens, 3) == [5, 6, 7]
    tokens += [5, 6, 8, 2, 3, 4]  # the same suffix again, followed differently: the latest occurrence wins
    assert lookup.find(tokens, 2) == [5, 6]
    assert lookup.find(tokens + [5, 6], 4) == [8, 2, 3, 4]
    assert lookup.find([1, 2, 3], 4) == []  # nothing repeats



def test_prompt_lookup_tells_the_branches_of_a_repeated_cycle_apart():
    # text cycling through two sentences that end alike and branch after: the latest occurrence of
    # the last 8 tokens is followed by the other branch; a 16-token suffix holds the branch before
    sentence = list(range(10, 24))
    cycle = sentence + [100] + sentence + [200]
    tokens = cycle * 3 + sentence + [100] + sentence
    assert PromptLookup().find(tokens, 4) == [200] + sentence[:3]
    assert PromptLookup().find(tokens + [200] + sentence, 2) == [100] + sentence[:1]

def test_ngram_index_is_shared_bounded_and_forgets_whole_documents():
    index = NgramIndex(max_bytes=100 * BYTES_PER_TOKEN)
    cap = index.max_tokens
    index.add(list(range(100, 140)))
    assert index.find([7, 8, 120, 121, 122], 4) == [123, 124, 125, 126]
    rng = random.Random(1)
    for _ in range(50):
        index.add([rng.randrange(1000, 2000) for _ in range(30)])
        assert index.n_tokens <= cap
    assert index.find([120, 121, 122], 4) == []  # the first document was dropped, entries with it
    assert sum(len(m) for m in index._maps) <= cap * len(index._maps)
    index.add(list(range(500, 520)), new_from=10)  # only n-grams reaching past position 10 are new
    assert index.find([508, 509, 510, 511], 3) == [512, 513, 514]


def test_the_prefix_tree_continues_a_cached_path():
    pool = PagePool(16, 4)
    tree = RadixCache(pool)
    for tokens in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9]):
        pages = [pool.allocate() for _ in range(pool.pages_for(len(tokens)))]
        tree.insert(tokens, pages)
        pool.release(pages)
    assert tree.continuation([1, 2, 3], 3) == [9, 9, 9]  # the branch used last
    assert tree.continuation([1, 2, 3, 4], 10) == [5, 6, 7, 8]
    assert tree.continuation([1, 2], 2) == [3, 9]
    assert tree.continuation([1, 2, 7], 2) == [] and tree.continuation([5], 2) == []
    assert tree.continuation([1, 2, 3, 4, 5, 6, 7, 8], 4) == []


def test_draft_length_follows_acceptance():
    st = DraftState(DraftParams(n_max=16))
    assert st.room() == 3
    st.record(3, 3)
    st.record(6, 6)
    assert st.room() == 12
    st.record(12, 5)
    assert st.room() == 11  # twice what was kept, plus one
    st.record(11, 0)
    assert st.room() == 1
    st.record(1, 1)
    assert st.room() == 2
    assert (st.drafted, st.accepted) == (33, 15)


def test_wholly_kept_one_token_drafts_grow_until_later_tokens_are_known():
    # every sequence's first drafts lost their later tokens: the estimate stops drafts at one token,
    # and one-token drafts, however often kept, tell nothing of later tokens
    shared = Acceptance.of_all()
    shared.add(3, 1)
    shared.add(6, 1)
    st = DraftState(DraftParams(n_max=32), shared)
    assert draft_lengths([st.keep_rate()], [21], 1, StepCosts()) == [1]
    st.record(1, 1)
    assert st.stretch(1, 21) == 2  # wholly kept, no evidence of later tokens: one more
    assert st.stretch(0, 21) == 0  # no draft chosen: none forced
    assert st.stretch(1, 1) == 1  # no more found
    st.record(2, 2)
    st.record(3, 3)
    st.record(4, 4)  # 1 + 2 + 3 later tokens kept: the estimate decides again
    assert st.stretch(4, 21) == 4 and st.keep_rate()[1] > 0.75
    st.record(4, 2)
    assert st.stretch(1, 21) == 1  # the last draft was not wholly kept


def test_keep_chances_come_from_first_and_later_tokens_and_fade_when_idle():
    st = DraftState(DraftParams(n_max=16))
    assert st.keep_rate() == (0.5, 0.5) and st.probing()  # the prior; no evidence of its own
    for _ in range(8):
        st.record(8, 8)
    first, later = st.keep_rate()
    assert first > 0.8 and later > 0.95 and not st.probing()
    for _ in range(8):
        st.record(4, 0)  # the first token rejected: the later chance is not touched
    first2, later2 = st.keep_rate()
    assert first2 < 0.6 and later2 == later
    for _ in range(200):
        st.idle()
    assert st.probing()  # the evidence faded: back near every sequence's rate
    assert abs(st.keep_rate()[1] - st.shared.rate((0.5, 0.5))[1]) < 0.01
    fresh = DraftState(DraftParams(n_max=16), st.shared)
    assert fresh.keep_rate()[1] > 0.9  # a new sequence starts from what every sequence's drafts kept


def test_draft_lengths_weigh_expected_tokens_against_the_cost_of_rows():
    costs = StepCosts()
    assert draft_lengths([(0.3, 0.3)], [8], 1, costs) == [0]  # free text: a rejected row costs more than it saves
    assert draft_lengths([(0.6, 0.6)], [8], 1, costs) in ([2], [3])  # 2-4 rows cost 1.2-1.63 one-row steps
    assert draft_lengths([(0.99, 0.99)], [15], 1, costs) == [15]  # a copy: as long as found
    # ... but not into a 17th row: the products' second pass over the weights (16 rows 4.5 one-row
    # steps, 17 rows 5.26)
    assert draft_lengths([(0.99, 0.99)], [16], 1, costs) == [15]
    # 5 found: all 5 (rows in vector lanes: 6 rows cost 2.2 one-row steps)
    assert draft_lengths([(0.99, 0.99)], [5], 1, costs) == [5]
    assert draft_lengths([(0.99, 0.99)], [11], 1, costs) == [11]
    # two sequences: the likelier one's tokens first, the other's at most its likeliest
    two = draft_lengths([(0.99, 0.99), (0.35, 0.35)], [14, 8], 2, costs)
    assert two[0] == 14 and two[1] <= 1
    # measured steps: cheaper rows (a GPU) allow what the prior does not; dearer ones never stop
    # drafting that the prior allows (a loaded machine's slow steps)
    for _ in range(5):
        costs.measured(1, 0, 0.010)
        costs.measured(1, 1, 0.0102)
    assert costs.relative(1, 1) == pytest.approx(1.02)
    assert draft_lengths([(0.3, 0.3)], [1], 1, costs) == [1]
    slow = StepCosts()
    slow.measured(1, 0, 0.010)
    for _ in range(20):
        slow.measured(1, 1, 0.030)
    assert slow.relative(1, 1) == pytest.approx(1.2)
    assert slow.relative(1, 3) == pytest.approx(1.63)  # not measured: the prior
    # a count measured cheap (one slow undrafted step, a loaded machine) does not make the longer
    # drafts never tried look dear: they follow the prior's shape from it, and a copy stays long
    low = StepCosts()
    low.measured(1, 0, 0.010)
    low.measured(1, 3, 0.008)
    assert low.relative(1, 15) == pytest.approx(0.8 * 4.5 / 1.63)
    assert draft_lengths([(0.99, 0.99)], [15], 1, low) == [15]


def test_a_count_measured_slow_once_is_tried_again():
    """A drafted count's first measurement starts from what the measured counts beside it say, and
    moves it a step only: one slow step (another process, a recording) at 11 drafted rows must not
    make 11 and every longer draft look dear for good, or the drafts would stay short (a copy kept
    at 3-10 tokens a step)."""
    costs = StepCosts()
    costs.measured(1, 0, 0.010)
    for _ in range(3):
        costs.measured(1, 3, 0.0134)
        costs.measured(1, 10, 0.0297)
    before = costs.relative(1, 11)
    costs.measured(1, 11, 0.0366)  # once, slow
    assert before < costs.relative(1, 11) < before * 1.06
    assert draft_lengths([(0.95, 0.997)], [31], 1, costs)[0] > 11


def test_a_recording_step_is_not_taken_for_what_drafted_rows_cost(spec_llms):
    """A step shape's first run is recorded (the backend's op list kept for replays), which costs more
    than the step: its time must not be measured as the drafted rows' cost (then a draft length
    whose first step was recorded looked dear and was never verified again)."""
    m = spec_llms("smollm2")
    runner, spec = m.engine.runner, m.engine.spec
    seen = {"measured": 0, "recorded drafted": 0}
    measured, run = spec.measured, runner.run

    def checked(plan, seconds):
        assert not runner.recorded
        seen["measured"] += 1
        return measured(plan, seconds)

    def watched(plan, *a, **kw):
        out = run(plan, *a, **kw)
        seen["recorded drafted"] += runner.recorded and any(c.draft for c in plan.chunks)
        return out

    spec.measured, runner.run = checked, watched
    try:
        collect(m.engine.submit(Request(edit_prompt(m, 99), 160, GREEDY)))
    finally:
        del spec.measured, runner.run
    assert seen["measured"] > 10 and seen["recorded drafted"] > 0


def test_auto_spec_type_is_draftless_where_steps_run_one_at_a_time():
    cfg = SpecConfig(parse_types("auto"), auto=True)
    assert cfg.types == ("cache", "lookup")
    assert cfg.for_engine(decodes_ahead=False).types == ("cache", "lookup")
    assert cfg.for_engine(decodes_ahead=True).types == ()
    assert SpecConfig(("lookup",)).for_engine(decodes_ahead=True).types == ("lookup",)  # asked for: kept


def test_spec_types_take_llama_server_names():
    assert parse_types("none") == ()
    assert parse_types("ngram-simple,ngram-cache") == ("lookup", "cache")
    with pytest.raises(ValueError, match="unknown speculative type"):
        parse_types("eagle")
    with pytest.raises(ValueError):
        DraftParams(n_max=4, n_min=5)


# ---- greedy output: the same, token for token ----

@pytest.fixture(scope="module")
def spec_llms():
    made: dict = {}

    def get(name: str) -> LLM:
        if name not in made:
            made[name] = LLM(name, device="cpu", threads=2, ctx=2048, slots=8, speculative=SPEC)
        return made[name]

    yield get
    for m in made.values():
        m.close()


def edit_prompt(m: LLM, variant: int) -> list[int]:
    ask = f"Rename the function area to area_{variant} and return the whole file unchanged otherwise."
    return m.chat_ids([{"role": "user", "content": f"{ask}\n\n```python\n{CODE}```"}])


def run_all(m: LLM, requests: list[Request]) -> list[list[tuple]]:
    handles = [m.engine.submit(r) for r in requests]
    return [event_log(h) for h in handles]


def near_tie(m: LLM, prompt: list[int], ids: list[int], at: int, margin: float = 0.25) -> bool:
    """Whether the model's two best tokens after prompt + ids[:at] are within `margin` nats: there
    the batch's shape may round either way (the engine's other tests allow for it the same way)."""
    scores = m.score(prompt + ids[:at + 1], top=2)
    gap = scores.top_logprobs[-1, 0] - scores.top_logprobs[-1, 1]
    return gap < margin


def assert_same_up_to_near_ties(m: LLM, requests: list[Request], want: list[list[tuple]], got: list[list[tuple]]):
    n_same = 0
    for r, a, b in zip(requests, want, got):
        if a == b:
            n_same += 1
            continue
        at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert near_tie(m, r.prompt, [e[1] for e in a], at), f"differs at token {at} without a near tie"
    assert n_same >= len(requests) - 2


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_greedy_output_is_the_same_with_drafts(llm, spec_llms, name):
    """Batch 1 and 8 concurrent requests, plain, with stop strings, with a grammar, with penalties and
    log-probabilities: the events (tokens, texts, finish) are those of the engine without
    speculation, and drafts were kept.
    Verification computes several rows of a sequence at once, as a prompt chunk is computed; where
    the two best tokens are within rounding of each other a different shape of step may pick the
    other one, as batching alone does (test_engine), so a difference must start at such a tie."""
    plain, spec = llm(name), spec_llms(name)
    grammar = GrammarSpec('root ::= "```python\\n" [^`]* "```"')
    requests = [Request(edit_prompt(plain, 0), 64, GREEDY)]
    penalized = SamplingParams(temperature=0.0, repeat_penalty=1.1, frequency_penalty=0.2)
    requests += [Request(edit_prompt(plain, i), 28, GREEDY if i % 3 else penalized,
                         stop=("return width * h",) if i % 3 == 1 else (), grammar=grammar if i % 3 == 2 else None,
                         logprobs=2 if i % 3 == 0 else None) for i in range(1, 9)]
    want = run_all(plain, requests[:1]) + run_all(plain, requests[1:])
    before = spec.engine.metrics.draft_tokens_accepted
    got = run_all(spec, requests[:1]) + run_all(spec, requests[1:])  # alone, then 8 at once
    assert_same_up_to_near_ties(plain, requests, want, got)
    # (37 on SmolLM2: with 8 sequences, 8-row steps now cost less than the rows that drafts add to them)
    assert spec.engine.metrics.draft_tokens_accepted - before > 30


# ---- sampled output: the same distribution ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "llama", GGMLType.Q8_0,
                       Shape(n_vocab=384), vocab=True, tied=False)


def chi_square_differs(a: dict, b: dict) -> tuple[float, float]:
    """The two-sample chi-square statistic of two count tables and its 0.1% critical value
    (Wilson-Hilferty's approximation of the quantile)."""
    keys = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) >= 5]
    na, nb = sum(a.get(k, 0) for k in keys), sum(b.get(k, 0) for k in keys)
    stat = 0.0
    for k in keys:
        total = a.get(k, 0) + b.get(k, 0)
        for n, counts in ((na, a), (nb, b)):
            expected = total * n / (na + nb)
            stat += (counts.get(k, 0) - expected) ** 2 / expected
    df = len(keys) - 1
    z = 3.09
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def collect_logprobs(handle) -> dict[int, list]:
    out: dict = {}
    for ev in handle:
        if isinstance(ev, TokenEvent):
            out.setdefault(ev.index, []).append(ev.logprob)
    return out


def test_sampled_tokens_keep_their_distribution(tiny):
    """The first three sampled tokens (top-k 3, temperature 1) over 600 seeds without drafts and 600
    other seeds with them: the same distribution (chi-square), while drafts were both kept and
    rejected (a rule that kept every draft, or too few, would shift the counts)."""
    prompt_text = "a b c d e a b c d e a b c d e a b c"
    counts = []
    for spec in ("", SPEC):
        m = LLM(str(tiny), threads=2, ctx=128, slots=8, speculative=spec)
        prompt = m.tokenize(prompt_text)
        collect(m.engine.submit(Request(prompt, 3, GREEDY)))  # a path for the cache to draft from
        first = 0 if not spec else 10_000
        params = [SamplingParams(seed=first + s, temperature=1.0, top_k=3, top_p=1.0, min_p=0.0) for s in range(600)]
        handles = [m.engine.submit(Request(prompt, 3, p)) for p in params]
        table: dict = {}
        for h in handles:
            (ids, _), = collect(h).values()
            table[tuple(ids)] = table.get(tuple(ids), 0) + 1
        counts.append(table)
        metrics = m.engine.metrics
        if spec:
            assert metrics.draft_tokens > metrics.draft_tokens_accepted > 100
            sampled = SamplingParams(seed=1, temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, ignore_eos=True)
            several = collect_logprobs(m.engine.submit(Request(prompt, 8, sampled, n=3, logprobs=2)))
            assert sorted(several) == [0, 1, 2] and all(len(lps) == 8 and None not in lps for lps in several.values())
        m.close()
    stat, critical = chi_square_differs(*counts)
    assert stat < critical, (stat, critical)


# ---- KV accounting ----

def test_a_thousand_requests_with_drafts_and_cancels_leave_nothing_behind(tiny):
    """Repeated prompts (so the cache and the prompts draft), a KV budget that forces eviction and
    preemption, random cancellations: every request ends, greedy ones as without drafts, and once
    the cache is cleared every page is free."""
    rng = random.Random(3)
    plain = LLM(str(tiny), threads=2, ctx=128, slots=8, kv_tokens=192, batch=64)
    spec = LLM(str(tiny), threads=2, ctx=128, slots=8, kv_tokens=192, batch=64, speculative=SPEC)
    prompts = [[1] + [rng.randrange(3, 40) for _ in range(rng.randrange(4, 40))] for _ in range(30)]
    lengths = [rng.randrange(1, 40) for _ in prompts]
    expected = [collect(plain.engine.submit(Request(p, n, GREEDY)))[0][0] for p, n in zip(prompts, lengths)]
    plain.close()
    handles, cancelled = [], set()
    for i in range(1000):
        k = rng.randrange(len(prompts))
        handles.append((k, spec.engine.submit(Request(prompts[k], lengths[k], GREEDY))))
        if rng.random() < 0.1:
            cancelled.add(i)
            handles[-1][1].cancel()
    n_same = 0
    for i, (k, h) in enumerate(handles):
        (ids, reason), = collect(h).values()
        if reason == "cancelled":
            assert i in cancelled
            continue
        n_same += ids == expected[k]
    eng = spec.engine
    assert eng.metrics.draft_tokens_accepted > 1000 and eng.metrics.preemptions > 0
    assert n_same >= 850 and eng.last_error is None
    clean_pool(spec)
    assert eng.tree.n_tokens == 0
    spec.close()


# ---- the server ----

@pytest.fixture(scope="module")
def spec_server():
    model = load_model(MODEL_CFG.__class__(MODEL_CFG.model, device="cpu", threads=2, ctx=1024, slots=2,
                                           speculative=SpecConfig(parse_types("lookup"))))
    with LiveServer(create_app(ServerConfig(), lambda: model)) as live:
        live.wait_ready()
        yield live


def test_server_reports_drafts_and_takes_llama_server_fields(spec_server):
    url = spec_server.url
    prompt = "Copy the list: 10, 20, 30, 40, 50, 60, 70, 80, 90, 100.\nCopy: 10, 20, 30, 40, 50,"
    body = {"prompt": prompt, "n_predict": 24, "temperature": 0}
    on = httpx.post(url + "/completion", json=body, timeout=60).json()
    off = httpx.post(url + "/completion", json={**body, "speculative.n_max": 0}, timeout=60).json()
    assert on["content"] == off["content"]
    assert on["timings"]["draft_n"] >= on["timings"]["draft_n_accepted"] > 0
    assert "draft_n" not in off["timings"]
    chat = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0,
        "speculative": {"n_max": 4, "n_min": 2}}, timeout=60)
    assert chat.status_code == 200
    bad = httpx.post(url + "/completion", json={**body, "speculative.n_max": 4, "speculative.n_min": 9}, timeout=60)
    assert bad.status_code == 400 and "n_min" in bad.json()["error"]["message"]
    metrics = httpx.get(url + "/metrics", timeout=60).text
    drafted = next(line for line in metrics.splitlines() if line.startswith("llamacpp:n_drafted_total"))
    assert float(drafted.split()[-1]) >= on["timings"]["draft_n"]
    by_source = next(line for line in metrics.splitlines() if line.startswith('ember:draft_tokens_total{source="lookup"}'))
    assert float(by_source.split()[-1]) == float(drafted.split()[-1])  # lookup is this server's only source
