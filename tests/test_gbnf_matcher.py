"""Matcher behaviour on a small vocabulary: masks, end of generation, forks, forced stretches,
token references, special tokens, lazy triggers and run-time limits."""
from __future__ import annotations

import numpy as np
import pytest

from ember.gbnf import Grammar, GrammarError, GrammarLimits, TokenVocab

TOKENS = [b"a", b"b", b"ab", b"ba", b"abc", b"c", b"(", b")", b"()", b"x", b"<think>", b"</s>", b" ",
          b"1", b"12", b"+", b"</think>", b"\xc3", b"\xa9", b"\xc3\xa9", b"<tool_call>{", b"{", b"<|ctl|>", b"a+"]
ID = {t: i for i, t in enumerate(TOKENS)}
THINK, END_THINK, EOS, CTL = ID[b"<think>"], ID[b"</think>"], ID[b"</s>"], ID[b"<|ctl|>"]


@pytest.fixture(scope="module")
def vocab():
    return TokenVocab(TOKENS, special_ids=[THINK, END_THINK, CTL], eog_ids=[EOS])


def matcher(vocab, text, **kw):
    return Grammar.parse(text).compile(vocab).matcher(**kw)


def allowed(m) -> set[bytes]:
    return {TOKENS[i] for i in m.allowed_tokens()}


def test_mask_formats_agree(vocab):
    m = matcher(vocab, 'root ::= "a" [bc]* "x"')
    words = np.zeros(vocab.n_words, np.uint32)
    m.fill_mask(words)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab.n_vocab].astype(bool)
    assert (bits == m.allowed_mask()).all()
    assert allowed(m) == {b"a", b"ab", b"abc"}
    with pytest.raises(ValueError, match="contiguous uint32"):
        m.fill_mask(np.zeros(vocab.n_words, np.int64))


def test_accept_rejects_without_changing_state(vocab):
    m = matcher(vocab, 'root ::= "a" [bc]* "x"')
    assert not m.accept_token(ID[b"b"])
    assert not m.accept_token(-1) and not m.accept_token(10_000)
    assert allowed(m) == {b"a", b"ab", b"abc"}
    assert m.accept_token(ID[b"ab"])
    assert allowed(m) == {b"b", b"c", b"x"}


def test_end_of_generation(vocab):
    m = matcher(vocab, 'root ::= "a"+')
    assert not m.can_end and not m.accept_token(EOS)
    assert m.accept_token(ID[b"a"])
    assert m.can_end and not m.at_end
    assert allowed(m) == {b"a", b"</s>"}  # more, or the end
    assert m.accept_token(EOS) and m.is_done
    assert not m.accept_token(ID[b"a"])
    assert allowed(m) == {b"</s>"}


def test_only_eos_once_the_grammar_is_complete(vocab):
    m = matcher(vocab, 'root ::= "ab"')
    assert m.accept_token(ID[b"ab"])
    assert m.at_end and m.can_end and allowed(m) == {b"</s>"}


def test_special_tokens_only_through_token_references(vocab):
    m = matcher(vocab, "root ::= .*")  # any text, never a control token or the end-of-turn text
    assert b"<think>" not in allowed(m) and b"<|ctl|>" not in allowed(m)
    assert b"<tool_call>{" in allowed(m)
    m = matcher(vocab, 'root ::= "<think>" "x"')  # the text of a special token, as text
    assert allowed(m) == set()  # no text token spells "<think>"
    m = matcher(vocab, 'root ::= <think> [abc]* </think> "x"')
    assert allowed(m) == {b"<think>"}
    assert m.accept_token(THINK) and m.accept_token(ID[b"abc"])
    assert allowed(m) == {b"a", b"b", b"ab", b"ba", b"abc", b"c", b"</think>"}
    assert m.accept_token(END_THINK) and allowed(m) == {b"x"}


def test_token_references_by_id_and_negated(vocab):
    m = matcher(vocab, f"root ::= !<[{THINK}]>* <[{THINK}]>")
    got = allowed(m)
    assert b"<think>" in got and b"</think>" in got and b"<|ctl|>" in got and b"</s>" not in got
    assert m.accept_token(CTL) and m.accept_token(ID[b"a"]) and m.accept_token(THINK)
    assert m.at_end


def test_token_reference_must_be_one_token(vocab):
    with pytest.raises(GrammarError, match="not exactly one token") as e:
        Grammar.parse("root ::= <nothing>").compile(vocab)
    assert (e.value.line, e.value.column) == (1, 10)
    with pytest.raises(GrammarError, match="outside the vocabulary"):
        Grammar.parse("root ::= <[99999]>").compile(vocab)


def test_utf8_split_across_tokens(vocab):
    m = matcher(vocab, 'root ::= "é" "x"')
    assert allowed(m) == {b"\xc3", b"\xc3\xa9"}
    assert m.accept_token(ID[b"\xc3"])
    assert allowed(m) == {b"\xa9"}
    assert m.accept_token(ID[b"\xa9"]) and allowed(m) == {b"x"}


def test_fork_is_independent(vocab):
    m = matcher(vocab, 'root ::= ("a" | "b")* "x"')
    f = m.fork()
    assert f.accept_token(ID[b"ab"]) and f.accept_token(ID[b"x"]) and f.at_end
    assert not m.at_end and allowed(m) == {b"a", b"b", b"ab", b"ba", b"x"}


def test_accept_bytes_and_text(vocab):
    m = matcher(vocab, 'root ::= "a" "bc" "x"')
    assert not m.accept_text("ax")
    assert m.accept_bytes(b"ab")  # ends inside a literal: the next token continues it
    assert allowed(m) == {b"c"}
    assert m.accept_text("cx") and m.at_end


def test_forced_tokens_and_bytes(vocab):
    m = matcher(vocab, 'root ::= "(" ")" "12" [ab]')
    assert m.forced_bytes() == b"()12"
    assert m.forced_tokens() == []  # "(" and "()" both fit
    assert m.accept_token(ID[b"("])
    assert m.forced_tokens() == [ID[b")"]]  # then "1" or "12": a choice
    m = matcher(vocab, 'root ::= "+" "+" "c"')
    assert m.forced_tokens() == [ID[b"+"], ID[b"+"], ID[b"c"]]
    assert allowed(m) == {b"+"}  # forced_tokens leaves the matcher as it was


def test_recursion_and_returns(vocab):
    m = matcher(vocab, 'root ::= e\ne ::= "(" e ")" | "a"')
    for t in [b"(", b"(", b"a"]:
        assert m.accept_token(ID[t])
    assert allowed(m) == {b")"}
    assert m.accept_token(ID[b")"]) and allowed(m) == {b")"}
    assert m.accept_token(ID[b")"]) and m.at_end


def test_tokens_crossing_a_return_are_checked_against_the_stack(vocab):
    # "a+" leaves rule t in the middle of the token: valid only where t is followed by "+"
    m = matcher(vocab, 'root ::= t "+" t | "(" t ")"\nt ::= "a" | "b" t')
    assert allowed(m) == {b"a", b"b", b"ba", b"(", b"a+"}
    m.accept_token(ID[b"("])
    assert allowed(m) == {b"a", b"b", b"ba"}


def test_lazy_trigger_text(vocab):
    m = matcher(vocab, 'root ::= "<tool_call>{" "a"+', lazy_triggers=["<tool_call>"])
    assert not m.triggered and m.can_end
    assert len(allowed(m)) == len(TOKENS)  # everything before the trigger, the end included
    assert m.accept_token(ID[b"x"]) and not m.triggered
    assert m.accept_token(ID[b"<tool_call>{"]) and m.triggered
    assert allowed(m) == {b"a"}
    assert not m.can_end


def test_lazy_trigger_split_across_tokens(vocab):
    m = matcher(vocab, 'root ::= "(" "a"+ ")"', lazy_triggers=["(a"])
    assert m.accept_token(ID[b"b"]) and m.accept_token(ID[b"("]) and not m.triggered
    assert m.accept_token(ID[b"a"]) and m.triggered  # "(" + "a": the grammar gets "(a"
    assert allowed(m) == {b"a", b")"}


def test_lazy_trigger_token_and_end_before_trigger(vocab):
    m = matcher(vocab, f"root ::= <[{THINK}]> \"x\"", lazy_triggers=[THINK])
    assert m.accept_token(ID[b"a"]) and m.accept_token(THINK) and m.triggered
    assert allowed(m) == {b"x"}
    m = matcher(vocab, f"root ::= <[{THINK}]> \"x\"", lazy_triggers=[THINK])
    assert m.accept_token(EOS) and m.is_done  # never triggered: ending is fine


def test_lazy_trigger_that_the_grammar_refuses(vocab):
    m = matcher(vocab, 'root ::= "(b"', lazy_triggers=["("])
    assert not m.accept_token(ID[b"()"])  # "()" starts the grammar with text it cannot read
    assert not m.triggered and m.accept_token(ID[b"("]) and m.triggered


def test_stack_depth_limit_makes_tokens_invalid(vocab):
    limits = GrammarLimits(max_stack_depth=4)
    m = Grammar.parse('root ::= e\ne ::= "(" e ")" | "a"', limits=limits).compile(vocab).matcher()
    depth = 0
    while m.accept_token(ID[b"("]):
        depth += 1
    assert 1 <= depth < 5
    assert m.accept_token(ID[b"a"])


def test_ambiguity_limit_keeps_valid_parses(vocab):
    text = 'root ::= x x x\nx ::= "a" | "a" "a" | "a" "a" "a" | y\ny ::= "a" y?'
    m = Grammar.parse(text, limits=GrammarLimits(max_stacks=2)).compile(vocab).matcher()
    assert m.accept_token(ID[b"a"]) and m.accept_token(ID[b"a"])
    assert m.saturated  # more readings than 2: some were dropped
    for _ in range(20):  # what is kept stays valid: "a"*k with k >= 3 may end
        assert set(m.allowed_tokens()) <= {ID[b"a"], EOS}
        assert m.accept_token(ID[b"a"])
    assert m.can_end
    full = Grammar.parse(text).compile(vocab).matcher()
    assert full.accept_token(ID[b"a"]) and not full.saturated


def test_automaton_limit_is_an_error(vocab):
    limits = GrammarLimits(max_dfa_states=3)
    m = Grammar.parse('root ::= "abcx" | "abcy"', limits=limits).compile(vocab).matcher()
    with pytest.raises(GrammarError, match="max_dfa_states"):
        for t in [b"ab", b"c", b"x"]:
            m.accept_token(ID[t])
            m.allowed_mask()


def test_compiled_grammars_are_cached_per_vocabulary(vocab):
    g = Grammar.parse('root ::= "a"')
    assert g.compile(vocab) is g.compile(vocab)
    assert Grammar.parse('root ::= "a"') is g


def test_long_repetitions_share_masks_exactly():
    # copies far from both ends of x{m,n} share one cached mask; a vocabulary with a token longer
    # than the sharing horizon turns sharing off, and both must give the same masks
    words = ["a", "b", "ab", "abc", "\"", "\"1", "1", "12", "9\"", "a\"", "\"a"]
    words += ["a" * k for k in (5, 10, 20, 40, 60)] + ["1" * k for k in (5, 10, 30, 60)] + ["ab" * 30 + "\""]
    short = TokenVocab([w.encode() for w in words], eog_ids=[])
    long = TokenVocab([w.encode() for w in words] + [b"z" * 200], eog_ids=[])
    text = 'root ::= "\\"" [a-z]{2,150} "\\"" [0-9]{1,100}'
    ma, mb = (Grammar.parse(text).compile(v).matcher() for v in (short, long))
    rng = np.random.default_rng(3)
    for _ in range(60):
        a, b = ma.allowed_mask(), mb.allowed_mask()[:len(words)]
        assert (a == b).all()
        choices = np.flatnonzero(a)
        if not len(choices):
            break
        t = int(rng.choice(choices))
        assert ma.accept_token(t) and mb.accept_token(t)
    assert ma.compiled.stats()["shared_partitions"] > 0
    assert mb.compiled.stats()["shared_partitions"] == 0
