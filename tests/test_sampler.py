"""The sampler chain: each sampler's exact effect on small hand-made distributions (expected
values computed here from the samplers' formulas), the per-sequence state (penalty windows,
DRY, mirostat mu, the seeded stream), chain order, logprobs, grammar masks and request
validation."""
from __future__ import annotations

import math

from dataclasses import replace

import numpy as np
import pytest

from ember.sampler import (
    DEFAULT_SAMPLERS,
    Sampler,
    SamplerVocab,
    SamplingParams,
    filters,
)
from ember.sampler.candidates import Candidates, mask_logits, top_positions
from ember.sampler.history import dry_penalties, suffix_matches
from ember.sampler.mirostat import draw_discrete
from ember.sampler.rng import Mt19937


def cands(logits) -> Candidates:
    x = np.asarray(logits, np.float32)
    return Candidates(np.arange(x.size), x, full=True, owned=False)


def from_probs(probs) -> np.ndarray:
    return np.log(np.asarray(probs, np.float64)).astype(np.float32)


def ids(c: Candidates) -> list[int]:
    return c.ids.tolist()


def drawn(params: SamplingParams, logits, history=(), vocab=None) -> dict[int, float]:
    """token -> probability of the candidates left after the chain (post-sampling probabilities)."""
    s = Sampler(params, vocab=vocab)
    s.accept_many(history)
    s.sample(np.asarray(logits, np.float32))
    lp = s.logprobs(n=len(logits))
    return dict(zip(lp.top_ids.tolist(), np.exp(lp.top_logprobs).tolist()))


def post(**kw) -> SamplingParams:
    kw.setdefault("seed", 7)
    return SamplingParams(post_sampling_probs=True, **kw)


P4 = [0.5, 0.3, 0.15, 0.05]


# ---- defaults and request parsing ----

def test_defaults_are_llama_cpp_defaults():
    p = SamplingParams()
    assert p.samplers == ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                          "temperature") == DEFAULT_SAMPLERS
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p, p.min_keep) == (0.8, 40, 0.95, 0.05, 1.0, 0)
    assert (p.repeat_last_n, p.repeat_penalty, p.presence_penalty, p.frequency_penalty) == (64, 1.0, 0.0, 0.0)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.0, 1.75, 2, 64)
    assert p.dry_sequence_breakers == ("\n", ":", "\"", "*")
    assert (p.xtc_probability, p.xtc_threshold, p.top_n_sigma) == (0.0, 0.1, -1.0)
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta, p.dynatemp_range, p.dynatemp_exponent) == (0, 5.0, 0.1, 0.0, 1.0)
    assert SamplingParams.greedy_params().greedy and not p.greedy


def test_from_dict_llama_server_fields():
    p = SamplingParams.from_dict({
        "temp": 0.5, "top_k": 10.0, "typ_p": 0.9, "repeat_last_n": -1, "seed": None,
        "logit_bias": {"15": -1.5, "hello": False, "7": 2}, "samplers": "top_k;temp",
        "dry_sequence_breakers": ["\n"], "n_probs": 3, "post_sampling_probs": True})
    assert (p.temperature, p.top_k, p.typical_p, p.repeat_last_n, p.seed) == (0.5, 10, 0.9, -1, None)
    assert p.logit_bias == ((15, -1.5), ("hello", -math.inf), (7, 2.0))
    assert p.samplers == ("top_k", "temperature")
    assert SamplingParams.from_dict({"samplers": "kpt"}).samplers == ("top_k", "top_p", "temperature")
    assert SamplingParams.from_dict({"samplers": ["min_p", "xtc"]}).samplers == ("min_p", "xtc")
    assert SamplingParams.from_dict({"logit_bias": [[3, 1], ["ab", -2]]}).logit_bias == ((3, 1.0), ("ab", -2.0))


@pytest.mark.parametrize("request_json, message", [
    ({"topk": 3}, "unknown sampling field 'topk'"),
    ({"top_k": "40"}, "top_k must be an integer"),
    ({"top_k": 4.5}, "top_k must be an integer"),
    ({"temperature": True}, "temperature must be a number"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"top_p": 1.5}, "top_p must be in [0, 1]"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"repeat_last_n": -2}, "repeat_last_n must be >= -1"),
    ({"repeat_penalty": 0}, "repeat_penalty must be > 0"),
    ({"dry_base": 0.5}, "dry_base must be in [1, inf]"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers must be a non-empty list"),
    ({"dry_sequence_breakers": ["\n", ""]}, "dry_sequence_breakers entries must be non-empty"),
    ({"mirostat": 3}, "mirostat must be 0 (off), 1 or 2"),
    ({"seed": 2 ** 32}, "seed must be -1 (random) or in [0, 4294967295]"),
    ({"samplers": ["top_k", "tfs_z"]}, "'tfs_z' is not a known sampler"),
    ({"samplers": ["infill"]}, "'infill' is not supported by ember"),
    ({"samplers": "kz"}, "letter 'z' is not a sampler code"),
    ({"samplers": 5}, "samplers must be a list of sampler names or a string"),
    ({"logit_bias": {"5": True}}, "logit_bias['5'] must be a number or false"),
    ({"logit_bias": [[5]]}, "logit_bias entries must be [token, bias] pairs"),
    ({"logit_bias": {"": 1}}, "token text must not be empty"),
    ({"logit_bias": [[-3, 1]]}, "token id must be >= 0"),
    ({"logit_bias": "5:1"}, "logit_bias must be an object or a list"),
    ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ({"n_probs": -1}, "n_probs must be >= 0"),
    ({"temp": 0.5, "temperature": 0.7}, "conflicts with another spelling"),
])
def test_from_dict_rejects_bad_values_naming_the_field(request_json, message):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict(request_json)
    assert message in str(err.value)


def test_from_dict_needs_an_object():
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams.from_dict([("top_k", 3)])


# ---- each sampler on a hand-made distribution ----

def test_top_k_keeps_the_k_largest_sorted():
    c = cands([1.0, 5.0, 3.0, 4.0, 2.0])
    assert ids(filters.top_k(c, 2)) == [1, 3]
    assert ids(filters.top_k(c, 9)) == [1, 3, 2, 4, 0]
    assert filters.top_k(c, 0) is c


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    c = cands(from_probs(P4))  # cumulative 0.5, 0.8, 0.95, 1.0
    assert ids(filters.top_p(c, 0.75, 0)) == [0, 1]
    assert ids(filters.top_p(c, 0.85, 0)) == [0, 1, 2]
    assert ids(filters.top_p(c, 0.4, 0)) == [0]
    assert ids(filters.top_p(c, 0.4, 3)) == [0, 1, 2]  # min_keep
    assert filters.top_p(c, 1.0, 0) is c


@pytest.mark.parametrize("p", [0.5, 0.95, 0.999])
def test_top_p_on_a_flat_large_vocabulary_matches_a_full_sort(p):
    # flat logits: the top 256 hold far less than p, so the bucket path runs
    x = (np.random.default_rng(3).standard_normal(200_000) * 1.5).astype(np.float32)
    x[::7] = -np.inf
    probs = np.exp(x.astype(np.float64) - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    n = int(np.searchsorted(np.cumsum(probs[order]), p)) + 1
    kept = filters.top_p(cands(x), p, 0)
    assert sorted(ids(kept)) == sorted(order[:n].tolist())


def test_min_p_threshold_is_relative_to_the_top_token():
    c = cands(from_probs(P4))
    assert ids(filters.min_p(c, 0.2, 0)) == [0, 1, 2]  # keeps p >= 0.1
    assert ids(filters.min_p(c, 0.35, 0)) == [0, 1]  # keeps p >= 0.175
    assert ids(filters.min_p(c, 0.9, 3)) == [0, 1, 2]  # min_keep


def test_typical_p_keeps_tokens_closest_to_the_entropy():
    probs = [0.4, 0.3, 0.2, 0.1]
    entropy = -sum(q * math.log(q) for q in probs)
    by_closeness = sorted(range(4), key=lambda i: abs(-math.log(probs[i]) - entropy))
    assert by_closeness == [1, 2, 0, 3]  # cumulative 0.3, 0.5, 0.9, 1.0
    c = cands(from_probs(probs))
    assert ids(filters.typical(c, 0.45, 0)) == [1, 2]
    assert ids(filters.typical(c, 0.6, 0)) == [1, 2, 0]
    assert ids(filters.typical(c, 0.2, 0)) == [1]
    assert ids(filters.typical(c, 0.2, 3)) == [1, 2, 0]


def test_top_n_sigma_cuts_n_standard_deviations_below_the_top():
    x = [10.0, 9.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0, -np.inf]  # -inf is left out of the statistics
    finite = np.array(x[:-1])
    std = finite.std()  # 4.3857
    assert 10 - 0.5 * std < 8 and 10 - 0.2 * std > 9
    assert ids(filters.top_n_sigma(cands(x), 0.5)) == [0, 1, 2]
    assert ids(filters.top_n_sigma(cands(x), 0.2)) == [0]
    assert len(ids(filters.top_n_sigma(cands(x), 3.0))) == 8


def test_xtc_drops_all_top_choices_but_the_least_likely():
    c = cands(from_probs([0.4, 0.3, 0.2, 0.1]))
    assert ids(filters.xtc(c, 0.25, 0)) == [1, 2, 3]  # 0.4 and 0.3 are top choices: keep 0.3
    assert ids(filters.xtc(c, 0.15, 0)) == [2, 3]
    assert ids(filters.xtc(c, 0.15, 3)) == [0, 1, 2, 3]  # would leave fewer than min_keep
    assert ids(filters.xtc(c, 0.35, 0)) == [0, 1, 2, 3]  # a single top choice stays


def test_xtc_applies_when_the_seeded_coin_is_below_its_probability():
    coin = Mt19937(11).uniform_f32()
    logits = from_probs([0.4, 0.3, 0.2, 0.1])
    applied = drawn(post(samplers=["xtc"], xtc_probability=coin, xtc_threshold=0.25, seed=11), logits)
    assert sorted(applied) == [1, 2, 3]
    below = np.nextafter(np.float32(coin), np.float32(0))
    skipped = drawn(post(samplers=["xtc"], xtc_probability=float(below), xtc_threshold=0.25, seed=11), logits)
    assert sorted(skipped) == [0, 1, 2, 3]


def test_temperature_divides_and_zero_keeps_the_argmax():
    c = filters.temperature(cands([2.0, 1.0, 4.0]), 0.5)
    assert c.logits.tolist() == [4.0, 2.0, 8.0]
    assert ids(filters.temperature(cands([2.0, 1.0, 4.0, 4.0]), 0.0)) == [2]


def test_dynamic_temperature_follows_the_normalized_entropy():
    logits = np.array([2.0, 1.0, 0.0, -1.0])
    p = np.exp(logits) / np.exp(logits).sum()
    normalized = -(p * np.log(p)).sum() / math.log(4)
    t, spread, exponent = 1.0, 0.5, 2.0
    expected_t = 0.5 + (1.5 - 0.5) * normalized ** exponent
    out = filters.dynamic_temperature(cands(logits), t, spread, exponent)
    assert np.allclose(out.logits, logits / expected_t, rtol=1e-6)
    assert ids(out) == [0, 1, 2, 3]


def test_repetition_frequency_and_presence_penalties():
    logits = [2.0, -1.0, 0.5, 3.0]
    history = [0, 1, 0, 2]  # token 0 twice, 1 and 2 once
    params = post(samplers=["penalties"], repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = np.array([2.0 / 2 - (2 * 0.5 + 0.25), -1.0 * 2 - (0.5 + 0.25), 0.5 / 2 - (0.5 + 0.25), 3.0])
    got = drawn(params, logits, history)
    want = np.exp(expected) / np.exp(expected).sum()
    assert np.allclose([got[i] for i in range(4)], want, rtol=1e-5)
    # repeat_last_n = 2: only the last two tokens (0 and 2, once each) count
    short = drawn(post(samplers=["penalties"], repeat_penalty=2.0, repeat_last_n=2), logits, history)
    expected = np.array([1.0, -1.0, 0.25, 3.0])
    assert np.allclose([short[i] for i in range(4)], np.exp(expected) / np.exp(expected).sum(), rtol=1e-5)


# ---- DRY ----

LETTERS = [bytes([c]) for c in b"abcdefgh"]  # tokens 0..7


def letter_vocab(extra=()) -> SamplerVocab:
    pieces = LETTERS + [b"\n"] + list(extra)  # token 8 is a newline (a default breaker)
    return SamplerVocab(pieces, eog_ids=[8], encode=lambda text: greedy_encode(pieces, text))


def greedy_encode(pieces: list[bytes], text: str) -> list[int]:
    data, out = text.encode(), []
    while data:
        best = max((i for i, p in enumerate(pieces) if p and data.startswith(p)), key=lambda i: len(pieces[i]))
        out.append(best)
        data = data[len(pieces[best]):]
    return out


def test_suffix_matches_is_the_z_function():
    s = [1, 2, 1, 2, 1, 3]
    naive = [0] + [next(n for n in range(len(s) - k + 1) if n == len(s) - k or s[n] != s[k + n])
                   for k in range(1, len(s))]
    assert suffix_matches(s) == naive == [0, 0, 3, 0, 1, 0]


def test_dry_penalizes_the_token_that_extends_a_repeat():
    vocab = letter_vocab()
    breakers = vocab.dry_breakers(("\n",))
    # ... g a b c | d | e g a b c: the suffix "g a b c" (length 4) occurred before, followed by d
    history = [6, 0, 1, 2, 3, 4, 6, 0, 1, 2]
    tokens, amounts = dry_penalties(history, breakers, 0.8, 1.75, 2)
    assert tokens.tolist() == [3]
    assert amounts.tolist() == pytest.approx([0.8 * 1.75 ** (4 - 2)])
    # a newline where the "g" was: the repeat cannot reach back across it, so it is 3 long
    history = [8, 0, 1, 2, 3, 4, 8, 0, 1, 2]
    tokens, amounts = dry_penalties(history, breakers, 0.8, 1.75, 2)
    assert tokens.tolist() == [3] and amounts.tolist() == pytest.approx([0.8 * 1.75 ** (3 - 2)])
    # the penalty starts where the extended repeat would exceed allowed_length
    assert dry_penalties(history, breakers, 0.8, 1.75, 3)[1].tolist() == pytest.approx([0.8])
    assert dry_penalties(history, breakers, 0.8, 1.75, 4)[0].size == 0


def test_dry_never_penalizes_a_breaker_and_caps_the_exponent():
    vocab = letter_vocab()
    breakers = vocab.dry_breakers(("\n",))
    history = [0, 1, 2, 8, 5, 0, 1, 2]  # the token after "a b c" was the newline
    assert dry_penalties(history, breakers, 1.0, 1.75, 2)[0].size == 0
    history = [0, 1] * 12  # a repeat 22 long before the next "a"
    tokens, amounts = dry_penalties(history, breakers, 1.0, 1e10, 2)
    cap = int(88.7228391 / math.log(1e10))  # 3: keeps the penalty inside float32
    assert tokens.tolist() == [0] and amounts.tolist() == pytest.approx([1e10 ** cap])


def test_dry_in_the_chain_subtracts_its_penalty():
    vocab = letter_vocab()
    logits = np.zeros(9)
    history = [6, 0, 1, 2, 3, 4, 6, 0, 1, 2]
    params = post(samplers=["dry"], dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    got = drawn(params, logits, history, vocab)
    expected = np.zeros(9)
    expected[3] -= 0.8 * 1.75 ** 2
    want = np.exp(expected) / np.exp(expected).sum()
    assert np.allclose([got[i] for i in range(9)], want, rtol=1e-5)


def test_dry_breakers_that_span_tokens():
    vocab = letter_vocab(extra=[b"xy", b"zx", b"y", b"x"])  # tokens 9..12
    b = vocab.dry_breakers(("xy",))
    assert b.single.tolist() == [9]  # contains the whole breaker
    assert b.tails[10] == ((11,),) and b.tails[12] == ((11,),)  # end with "x": need "y" after
    # "x y" in the history stops the repeat search there
    history = [0, 1, 2, 3, 12, 11, 0, 1, 2]
    assert dry_penalties(history, b, 1.0, 2.0, 2)[1].tolist() == pytest.approx([2.0 ** (3 - 2)])
    history = [0, 1, 2, 3, 12, 0, 1, 2]  # only "x": no break, and the repeat is 3 long anyway
    assert dry_penalties(history, b, 1.0, 2.0, 2)[1].tolist() == pytest.approx([2.0 ** (3 - 2)])


def test_dry_breakers_on_the_real_smollm2_vocabulary(model_path):
    from ember.gguf_loader import GGUFFile
    from ember.tokenizer import Tokenizer

    with GGUFFile(model_path("smollm2")) as gguf:
        tok = Tokenizer.from_metadata(gguf.metadata)
    b = SamplerVocab.from_tokenizer(tok).dry_breakers(SamplingParams().dry_sequence_breakers)
    newline = tok.encode("\n", add_special=False)
    assert len(newline) == 1 and newline[0] in b.single.tolist()
    for t in b.single.tolist():
        assert any(s in tok.token_to_piece(t, special=True) for s in (b"\n", b":", b"\"", b"*"))


def test_dry_without_a_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="DRY needs the vocabulary"):
        Sampler(SamplingParams(dry_multiplier=0.8))


# ---- logit bias, ignore_eos ----

def test_logit_bias_adds_bans_and_sums_duplicates():
    vocab = letter_vocab()
    logits = np.zeros(9)
    bias = [[2, 1.0], [2, 2.0], ["b", False], ["5", 0.5]]
    got = drawn(post(samplers=[], logit_bias=bias), logits, vocab=vocab)
    expected = np.zeros(9)
    expected[2], expected[5] = 3.0, 0.5
    expected[1] = -np.inf  # "b" is token 1
    want = np.exp(expected) / np.exp(expected).sum()
    assert 1 not in got
    assert np.allclose([got.get(i, 0.0) for i in range(9)], want, rtol=1e-5)


def test_ignore_eos_bans_end_of_generation_tokens():
    logits = np.zeros(9)
    logits[8] = 50.0  # the EOG token would always win
    s = Sampler(SamplingParams(ignore_eos=True, seed=1), vocab=letter_vocab())
    assert all(s(logits) != 8 for _ in range(20))
    with pytest.raises(ValueError, match="ignore_eos needs the vocabulary"):
        Sampler(SamplingParams(ignore_eos=True))


def test_logit_bias_outside_the_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="logit_bias token 9 is outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={9: 1.0}), vocab=letter_vocab())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={9: 1.0}))(np.zeros(4))


# ---- mirostat ----

def test_mirostat_v2_truncates_at_mu_and_updates_it():
    probs = [0.5, 0.25, 0.125, 0.125]  # surprise 1, 2, 3, 3 bits
    tau, eta = 1.0, 0.1  # mu starts at 2 tau = 2: keeps tokens 0 and 1, renormalized to 2/3, 1/3
    u = Mt19937(5).uniform()
    expected = 0 if u <= 2 / 3 else 1
    s = Sampler(SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=eta, temperature=1.0, seed=5))
    assert s(from_probs(probs)) == expected
    kept_p = [2 / 3, 1 / 3][expected]
    assert s.mu == pytest.approx(2.0 - eta * (-math.log2(kept_p) - tau), rel=1e-5)


def test_mirostat_v1_estimates_zipf_and_keeps_k():
    s_true = 1.2
    probs = np.array([(i + 1.0) ** -s_true for i in range(8)])
    probs /= probs.sum()
    tau, eta, n_vocab = 1.0, 0.5, 8
    mu = 2 * tau
    eps = s_true - 1  # the least-squares fit of a pure power law is its exponent
    k = int((eps * 2 ** mu / (1 - n_vocab ** -eps)) ** (1 / s_true))
    assert k == 2
    kept = probs[:k] / probs[:k].sum()
    expected = draw_discrete(kept, Mt19937(9).uniform)
    s = Sampler(SamplingParams(mirostat=1, mirostat_tau=tau, mirostat_eta=eta, temperature=1.0, seed=9))
    assert s(np.log(probs)) == expected
    assert s.mu == pytest.approx(mu - eta * (-math.log2(kept[expected]) - tau), rel=1e-4)


def test_mirostat_replaces_the_chain():
    # top_k=1 would force token 0; under mirostat the chain's filters do not run
    p = {"mirostat": 2, "mirostat_tau": 5.0, "top_k": 1, "temperature": 1.0}
    seen = {Sampler(SamplingParams(seed=seed, **p))(from_probs([0.4, 0.35, 0.25])) for seed in range(40)}
    assert seen == {0, 1, 2}


# ---- the random stream, determinism, forks ----

def test_mt19937_matches_the_standard():
    rng = Mt19937(5489)  # std::mt19937's default seed
    raw = rng._bits.random_raw(10000)
    assert raw[0] == 3499211612 and raw[-1] == 4123659995  # the C++ standard's check value
    rng = Mt19937(1)
    a, b = (int(v) for v in Mt19937(1)._bits.random_raw(2))
    assert rng.uniform() == (a + b * 2.0 ** 32) / 2.0 ** 64


def test_mt19937_copies_continue_the_same_stream():
    """The generator is made on the first draw; a copy taken before or after it draws what the
    original draws next."""
    fresh = Mt19937(7)
    early = fresh.copy()
    first = [fresh.uniform() for _ in range(3)]
    assert [early.uniform() for _ in range(3)] == first
    late = fresh.copy()
    assert late.uniform() == fresh.uniform() and late.uniform_f32() == fresh.uniform_f32()


def flat_logits(n=1000, seed=0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 0.5).astype(np.float32)


ALL_ON = dict(repeat_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.1, dry_multiplier=0.8,
              top_n_sigma=3.0, top_k=100, typical_p=0.98, top_p=0.99, min_p=0.01, xtc_probability=0.5,
              xtc_threshold=0.004, dynatemp_range=0.5, min_keep=2, temperature=1.5)


def run(sampler: Sampler, steps: int) -> list[int]:
    rows = [flat_logits(seed=i) for i in range(4)]
    return [sampler(rows[i % 4]) for i in range(steps)]


def test_same_seed_same_tokens_with_every_sampler_on():
    vocab = SamplerVocab([b"t%d" % i for i in range(999)] + [b"\n"])
    a = run(Sampler(SamplingParams(seed=123, **ALL_ON), vocab=vocab), 40)
    b = run(Sampler(SamplingParams(seed=123, **ALL_ON), vocab=vocab), 40)
    c = run(Sampler(SamplingParams(seed=124, **ALL_ON), vocab=vocab), 40)
    assert a == b and a != c
    assert len(set(a)) > 10


def test_fork_continues_like_the_original_and_reset_restarts():
    s = Sampler(SamplingParams(seed=3, repeat_penalty=1.3, mirostat=0))
    run(s, 10)
    twin = s.fork()
    assert run(twin, 20) == run(s, 20)
    s.reset()
    assert run(s, 10) == run(Sampler(SamplingParams(seed=3, repeat_penalty=1.3)), 10)


def test_random_seed_when_none_or_minus_one():
    assert Sampler(SamplingParams(seed=-1)).seed != Sampler(SamplingParams(seed=-1)).seed or \
        Sampler(SamplingParams()).seed != Sampler(SamplingParams()).seed
    assert Sampler(SamplingParams(seed=77)).seed == 77


def test_draw_follows_the_distribution():
    probs = np.array([0.5, 0.3, 0.2])
    s = Sampler(SamplingParams(samplers=[], seed=2))
    counts = np.bincount([s(np.log(probs)) for _ in range(3000)], minlength=3) / 3000
    assert np.allclose(counts, probs, atol=0.03)


# ---- chain order ----

def test_order_of_the_chain_is_configurable():
    logits, history = [5.0, 4.0, 3.0], [0]
    base = {"top_k": 2, "repeat_penalty": 10.0}
    # penalties first: token 0 drops to 0.5 before top-k picks 1 and 2
    assert sorted(drawn(post(samplers="penalties;top_k", **base), logits, history)) == [1, 2]
    assert sorted(drawn(post(samplers="ek", **base), logits, history)) == [1, 2]
    # top-k first keeps 0 and 1; the penalty then only reweights them
    after = drawn(post(samplers=["top_k", "penalties"], **base), logits, history)
    assert sorted(after) == [0, 1]
    assert after[0] == pytest.approx(math.exp(0.5) / (math.exp(0.5) + math.exp(4.0)), rel=1e-5)


def test_temperature_outside_the_chain_does_not_apply():
    got = drawn(post(samplers=["top_k"], top_k=3, temperature=0.0), [1.0, 2.0, 3.0])
    assert len(got) == 3  # as in llama.cpp: temperature only acts where "temperature" is listed


# ---- greedy ----

def test_greedy_is_the_argmax_after_penalties():
    logits = np.array([1.0, 3.0, 2.0])
    assert Sampler(SamplingParams.greedy_params())(logits) == 1
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0))
    s.accept(1)
    assert s(logits) == 2  # 3 / 2 = 1.5 < 2


def test_greedy_with_typical_p_runs_the_whole_chain():
    # typical-p before temperature can drop the top token; greedy then takes the best survivor
    probs = [0.4, 0.3, 0.2, 0.1]
    s = Sampler(SamplingParams(temperature=0.0, typical_p=0.45, top_k=0, top_p=1.0, min_p=0.0))
    assert s(from_probs(probs)) == 1


# ---- logprobs ----

def test_logprobs_before_sampling_are_the_models():
    x = flat_logits(50, seed=4)
    s = Sampler(SamplingParams(n_probs=5, logit_bias={int(np.argmax(x)): False}, top_k=3, seed=1))
    token = s.sample(x)
    lp = s.logprobs()
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    assert lp.token == token and lp.logprob == pytest.approx(ref[token], abs=1e-5)
    assert lp.top_ids.tolist() == np.argsort(-ref)[:5].tolist()  # the banned token too: before bias
    assert np.allclose(lp.top_logprobs, np.sort(ref)[::-1][:5], atol=1e-5)


def test_logprobs_after_sampling_are_the_candidates():
    x = np.array([3.0, 2.0, 1.0, 0.0])
    s = Sampler(SamplingParams(post_sampling_probs=True, n_probs=4, top_k=2, top_p=1.0, min_p=0.0,
                               temperature=0.5, seed=1))
    token = s.sample(x)
    lp = s.logprobs()
    z = np.array([3.0, 2.0]) / 0.5
    expected = z - np.log(np.exp(z).sum())
    assert lp.top_ids.tolist() == [0, 1]  # only two candidates survive
    assert np.allclose(lp.top_logprobs, expected, atol=1e-6)
    assert lp.logprob == pytest.approx(expected[token], abs=1e-6)
    assert s.logprobs(token=3).logprob == -np.inf


def test_logprobs_before_any_sample_is_an_error():
    with pytest.raises(RuntimeError):
        Sampler().logprobs()


# ---- grammar masks ----

def test_allowed_mask_bool_and_packed_bits_agree():
    x = flat_logits(100, seed=5)
    allowed = np.zeros(100, bool)
    allowed[[3, 40, 41, 99]] = True
    packed = np.packbits(allowed, bitorder="little")
    packed = np.pad(packed, (0, (-packed.size) % 4)).view(np.uint32)
    a = [Sampler(SamplingParams(seed=s))(x, allowed) for s in range(30)]
    b = [Sampler(SamplingParams(seed=s))(x, packed) for s in range(30)]
    assert a == b and set(a) <= {3, 40, 41, 99}
    best = max([3, 40, 41, 99], key=lambda t: x[t])
    assert Sampler(SamplingParams.greedy_params())(x, allowed) == best


def test_allowed_mask_over_most_of_the_vocabulary():
    x = flat_logits(5000, seed=6)
    allowed = np.random.default_rng(0).random(5000) < 0.7  # the in-place (-inf) path
    masked = mask_logits(x, allowed)
    assert np.array_equal(masked[allowed], x[allowed]) and np.all(masked[~allowed] == -np.inf)
    s = Sampler(SamplingParams(seed=4, top_k=0, top_p=0.99, min_p=0.0))
    assert all(allowed[s(x, allowed)] for _ in range(200))
    assert Sampler(SamplingParams.greedy_params())(x, allowed) == int(np.argmax(np.where(allowed, x, -np.inf)))


def test_bad_masks_and_logits_are_clear_errors():
    from ember.sampler import NoTokenAllowed, NonFiniteLogits

    s = Sampler(SamplingParams(seed=1))
    with pytest.raises(NoTokenAllowed, match="no token is allowed: the grammar allows none"):
        s.sample(np.zeros(10), np.zeros(10, bool))
    with pytest.raises(ValueError, match="allowed_mask must be bool"):
        s.sample(np.zeros(10), np.ones(9, bool))
    for row, what in (([0.0, np.nan], "NaN"), ([0.0, np.inf], "inf"), ([-np.inf, -np.inf], "all -inf")):
        for params in (SamplingParams(seed=1), SamplingParams.greedy_params(), SamplingParams(mirostat=2)):
            with pytest.raises(NonFiniteLogits, match=rf"the model produced non-finite logits \({what}\)"):
                Sampler(params).sample(np.array(row))
    with pytest.raises(ValueError, match="1-D"):
        Sampler().sample(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="vocabulary has 10"):
        s.sample(np.zeros(12))
    for params in (SamplingParams(seed=1), SamplingParams.greedy_params(), SamplingParams(presence_penalty=1.0)):
        banned = Sampler(replace(params, logit_bias=((0, -np.inf), (1, -np.inf))))
        assert banned.n_banned == 2
        with pytest.raises(NoTokenAllowed, match="ban every token"):
            banned(np.zeros(2))
    only_one = Sampler(replace(SamplingParams.greedy_params(), logit_bias=((0, -np.inf),)))
    with pytest.raises(NoTokenAllowed, match="ban every token"):  # the grammar allows 0, the bias bans it
        only_one.sample(np.zeros(3), np.array([True, False, False]))


# ---- the selection helper under everything ----

@pytest.mark.parametrize("n, k", [(300_000, 40), (262_144, 256), (49_152, 40), (5000, 7), (100, 1000)])
def test_top_positions_matches_a_full_sort(n, k):
    x = np.round(np.random.default_rng(n).standard_normal(n) * 4, 1).astype(np.float32)  # many ties
    x[::5] = -np.inf
    got = top_positions(x, k)
    finite = np.flatnonzero(x > -np.inf)
    want = finite[np.lexsort((finite, -x[finite]))][:k]  # by value, ties by lower id
    assert x[got].tolist() == x[want].tolist()
    assert got.tolist() == want.tolist()


def test_mass_prefix_walks_like_a_sort():
    from ember.sampler.candidates import mass_prefix

    x = (np.random.default_rng(8).standard_normal(100_000) * 2).astype(np.float32)
    w = np.exp(x.astype(np.float64) - x.max())
    order = np.argsort(-x, kind="stable")
    running = np.cumsum(w[order]) / w.sum()
    for fraction in (0.01, 0.3, 0.77, 0.999):
        stop = int(np.searchsorted(running, fraction))
        got = mass_prefix(x, fraction)
        assert got[-1] == order[stop]
        assert sorted(got.tolist()) == sorted(order[:stop + 1].tolist())


def test_mirostat_v2_with_a_large_mu_draws_as_if_sorted():
    from ember.sampler.mirostat import mirostat_v2

    x = (np.random.default_rng(9).standard_normal(60_000)).astype(np.float32)  # all kept: > SORT_LIMIT
    for u in (0.05, 0.5, 0.93):
        c, _, index, _ = mirostat_v2(cands(x), 5.0, 0.1, 100.0, lambda u=u: u)
        order = np.argsort(-x, kind="stable")
        w = np.exp(x[order].astype(np.float64) - x.max())
        expected = order[int(np.searchsorted(np.cumsum(w / w.sum()), u))]
        assert c.size == 60_000 and int(c.ids[index]) == expected


def test_accepting_a_token_outside_the_vocabulary_is_an_error():
    s = Sampler(SamplingParams(repeat_penalty=1.1, seed=1))
    s(np.zeros(10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.accept(10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.accept_many([1, -2])


def test_copy_is_a_fork():
    import copy

    s = Sampler(SamplingParams(seed=5, repeat_penalty=1.5))
    run(s, 3)
    twin = copy.deepcopy(s)
    assert twin.params is s.params and run(twin, 10) == run(s, 10)


def test_best_needed_counts_the_bans_of_a_greedy_sampler():
    """Greedy rows may be reduced to their best few ids on the device: one more than the banned
    tokens; anything else that changes logits before the argmax needs the whole row."""
    greedy = Sampler(SamplingParams(temperature=0.0, logit_bias=((5, -math.inf), (9, -math.inf))))
    assert greedy.best_needed == 3
    assert greedy.choose_from_best(np.array([9, 5, 2, 7])) == 2  # the first not banned
    assert greedy.choose_from_best([4, 9]) == 4
    with pytest.raises(ValueError, match="banned"):
        greedy.choose_from_best(np.array([5, 9]))
    assert Sampler(SamplingParams(temperature=0.0)).best_needed == 1
    assert Sampler(SamplingParams(temperature=0.0, logit_bias=((5, 2.0),))).best_needed == 0  # a boost
    assert Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=8)).best_needed == 0
    assert Sampler(SamplingParams(temperature=0.8)).best_needed == 0
    # a fork keeps the answer
    assert greedy.fork().best_needed == 3 and greedy.fork().choose_from_best([5, 1]) == 1
