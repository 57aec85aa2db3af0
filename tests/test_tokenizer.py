"""Tokenizer tests: llama.cpp's golden tokenizations of both real models, llama-tokenize itself
on generated text (when ../shared/llama.cpp is there), decoding, and small made-up vocabularies
for the parts the real models do not reach."""
from __future__ import annotations

import json
import random
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from conftest import DATA, golden
from ember.gguf_loader import GGUFFile
from ember.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError
from ember.tokenizer.pretokenize import PRE_TOKENIZERS
from ember.tokenizer.special import SpecialMatcher
from ember.tokenizer.spm import merge_long, merge_short

MODELS = ["smollm2", "gemma3-270m"]
MODES = {  # golden field -> encode() arguments (llama-server used add_special=False for parse_special)
    "ids": dict(add_special=False, parse_special=False),
    "ids_add_special": dict(add_special=True, parse_special=False),
    "ids_parse_special": dict(add_special=False, parse_special=True),
}
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer  # noqa: E402  (LLAMA_CPP_DIR, or shared/llama.cpp beside the checkout)

LLAMA_CPP = peer.llama_cpp_dir()
needs_llama_cpp = pytest.mark.skipif(not (LLAMA_CPP / "lib" / "llama-tokenize.real").exists(),
                                     reason="no llama.cpp beside the project")


@pytest.fixture(scope="module")
def metadata(model_path):
    cache = {}

    def get(name):
        if name not in cache:
            with GGUFFile(model_path(name)) as f:
                cache[name] = f.metadata
        return cache[name]
    return get


@pytest.fixture(scope="module")
def tok(metadata):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Tokenizer.from_metadata(metadata(name))
        return cache[name]
    return get


# --- golden data from llama-server

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", MODES)
def test_golden_tokenize(tok, model, mode):
    t = tok(model)
    cases = golden(model, "tokenize")["cases"]
    wrong = [c["text"] for c in cases if t.encode(c["text"], **MODES[mode]) != c[mode]]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]!r}"


@pytest.mark.parametrize("model", MODELS)
def test_golden_prompts(tok, model):
    """Rendered prompts -> ids with BOS as llama-server made them (chat text with special tokens parsed)."""
    t = tok(model)
    for case in golden(model, "greedy")["cases"]:
        ids = t.encode(case["prompt_text"], add_special=True, parse_special=case["chat"])
        assert ids == case["prompt_ids"], case["name"]


@pytest.mark.parametrize("model", MODELS)
def test_golden_completions_decode(tok, model):
    t = tok(model)
    for case in golden(model, "greedy")["cases"]:
        ids = case["completion_ids"]
        assert t.decode(ids) == case["completion_text"], case["name"]
        dec = t.stream_decoder()
        assert "".join(dec.feed(i) for i in ids) + dec.flush() == case["completion_text"]


def test_special_ids_and_flags(tok):
    s, g = tok("smollm2"), tok("gemma3-270m")
    assert (s.n_vocab, s.bos_id, s.eos_id, s.add_bos, s.add_eos) == (49152, 1, 2, False, False)
    assert (g.n_vocab, g.bos_id, g.eos_id, g.add_bos, g.add_eos) == (262144, 2, 1, True, False)
    # as llama.cpp finds them: eos, texts such as <|im_end|>, and fill-in-the-middle repo/pad/sep
    assert s.eog_ids == {0, 2, 4}  # <|endoftext|>, <|im_end|>, <reponame>
    assert g.eog_ids == {1, 106, 212}  # <eos>, <end_of_turn>, </s>
    assert [g.token_text(i) for i in sorted(g.eog_ids)] == ["<eos>", "<end_of_turn>", "</s>"]


def test_token_types_and_pieces(tok):
    g = tok("gemma3-270m")
    assert g.token_type(105) == 3 and g.is_special(105)  # <start_of_turn>: control
    assert g.token_to_piece(105) == b"" and g.token_to_piece(105, special=True) == b"<start_of_turn>"
    assert g.token_type(107) == 4 and g.token_to_piece(107) == b"\n"  # user-defined: its text
    assert g.token_type(212) == 4 and g.token_to_piece(212) == b""  # "</s>" ends generation, so control
    assert g.token_type(303) == 6 and g.token_to_piece(303) == b"A"  # <0x41>
    assert g.token_to_piece(26352) == b" Hello"  # "▁Hello"
    assert not g.is_special(26352)
    s = tok("smollm2")
    assert s.token_to_piece(38699) == b" Hello"  # "ĠHello"
    assert s.token_to_piece(198) == b"\n"
    assert s.token_to_piece(2) == b"" and s.token_to_piece(2, special=True) == b"<|im_end|>"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        s.token_to_piece(49152)


@pytest.mark.parametrize("model", MODELS)
def test_token_bytes(tok, model):
    t = tok(model)
    table = t.token_bytes
    assert len(table) == t.n_vocab
    for i in random.Random(0).sample(range(t.n_vocab), 2000) + sorted(t.eog_ids):
        assert table[i] == t.token_to_piece(i, special=True), i


def test_stream_decoder_holds_incomplete_utf8(tok):
    g = tok("gemma3-270m")
    ids = g.encode("𝕳 é", add_special=False)  # 𝕳 comes as four byte tokens
    dec = g.stream_decoder()
    outs = [dec.feed(i) for i in ids]
    assert outs[:4] == ["", "", "", "𝕳"]
    assert "".join(outs) + dec.flush() == "𝕳 é"


def test_stream_decoder_shows_the_special_tokens_it_is_given(tok):
    """A chat format's markers that are control tokens come out as text; other control tokens stay hidden."""
    s = tok("smollm2")
    start, end = (s.encode(t, add_special=False, parse_special=True)[0] for t in ("<|im_start|>", "<|im_end|>"))
    ids = [start, *s.encode("hi", add_special=False), end]
    assert "".join(s.stream_decoder().feed(i) for i in ids) == "hi"
    shown = s.stream_decoder(shown=frozenset({start}))
    assert "".join(shown.feed(i) for i in ids) == "<|im_start|>hi"


def test_stream_decoder_invalid_bytes_are_not_held(tok):
    g = tok("gemma3-270m")
    ff, e4, a = (g.vocab.token_to_id[f"<0x{b:02X}>"] for b in (0xFF, 0xE4, 0x41))
    dec = IncrementalDecoder(g)
    assert dec.feed(ff) == "\ufffd"  # never valid: out at once
    assert dec.feed(e4) == ""  # could start a 3-byte character
    assert dec.feed(a) == "\ufffdA"  # ... but did not
    assert dec.feed(e4) == ""
    assert dec.flush() == "\ufffd"  # end of stream: the incomplete tail
    assert g.decode([e4, a, ff]) == "\ufffdA\ufffd"


# --- llama-tokenize itself, on text made to be hard

def llama_tokenize(model_file: Path, text_file: Path, parse_special: bool) -> list[int]:
    args = ["-m", str(model_file), "-f", str(text_file), "--ids", "--no-bos", "--no-escape", "--log-disable"]
    proc, _ = peer.run("llama-tokenize", args + ([] if parse_special else ["--no-parse-special"]), timeout=120,
                       check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hard_text(t: Tokenizer, seed: int) -> str:
    """Random code points from many scripts, whitespace runs, code, and special-token text.

    Code points unassigned in Python's Unicode tables are left out: their class differs between
    llama.cpp's tables and the regex engine's for characters that newer Unicode versions assigned.
    """
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF), (0x10000, 0x2FFFF),
              (0x2000, 0x206F), (0x0, 0x1F), (0xFE00, 0xFFFD)]
    special_ids = [i for i in range(t.n_vocab) if t.is_special(i)]
    specials = [t.token_text(i) for i in rng.sample(special_ids, min(40, len(special_ids)))]
    pieces = [" ", "  ", "\n", "\n\n\n", "\t", " \n ", "    ", "'s", "'LL", "123456", "<", "</", ">",
              "<start_of", "_turn>", "|im_", "▁", "<0x41>", "Hello", " world", "a> </b", "\r\n",
              "HelloWorld", "\u3000", "\u00a0"]
    out = []
    for _ in range(6000):
        r = rng.random()
        if r < 0.6:
            a, b = rng.choice(ranges)
            c = chr(rng.randint(a, b))
            out.append(c if unicodedata.category(c) not in ("Cn", "Cs") else "x")
        elif r < 0.9:
            out.append(rng.choice(pieces))
        else:
            out.append(rng.choice(specials))
    return "".join(out) + (DATA / "GPL-3.txt").read_text()[:20000]


@needs_llama_cpp
@pytest.mark.parametrize("model", MODELS)
def test_same_as_llama_tokenize(tok, model_path, tmp_path, model):
    t = tok(model)
    text = hard_text(t, seed=len(model))
    text_file = tmp_path / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    for parse_special in (False, True):
        want = llama_tokenize(model_path(model), text_file, parse_special)
        got = t.encode(text, add_special=False, parse_special=parse_special)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert got == want, f"parse_special={parse_special}: first difference at token {first} of {len(want)}"


def write_gguf(path: Path, md: dict) -> None:
    """A tensor-less GGUF with this metadata (llama-tokenize loads the vocabulary only)."""
    import gguf
    w = gguf.GGUFWriter(str(path), md["general.architecture"])
    for k, v in md.items():
        if k == "general.architecture":
            continue
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_array(k, list(v) if isinstance(v, list) else v.tolist())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@needs_llama_cpp
def test_pre_tokenizers_same_as_llama_tokenize(metadata, tmp_path):
    """SmolLM2's vocabulary under every pre-tokenizer we know, against llama.cpp reading the same file."""
    md = {k: v for k, v in metadata("smollm2").items() if k != "tokenizer.ggml.add_bos_token"}
    text = hard_text(Tokenizer.from_metadata(md), seed=5)[:12000] + " I'M 1234567 HelloWorld x\u3000y \u200a!"
    text_file = tmp_path / "text.txt"
    text_file.write_bytes(text.encode())
    failed = []
    for pre in {id(p): name for name, p in sorted(PRE_TOKENIZERS.items())}.values():
        variant = {**md, "tokenizer.ggml.pre": pre}
        write_gguf(tmp_path / "v.gguf", variant)
        t = Tokenizer.from_metadata(variant)
        if t.encode(text, add_special=False) != llama_tokenize(tmp_path / "v.gguf", text_file, False):
            failed.append(pre)
    assert not failed


# --- work (speed itself: bench/tokenizer.py, beside llama-tokenize)

@pytest.mark.parametrize("model", MODELS)
def test_work_grows_with_the_text(metadata, model):
    """Building a tokenizer calls a few functions per vocabulary entry, and encoding a few per
    character (the Python side; the byte-level merges run in `tokenizers`): 100,000 characters of
    prose, and of text without spaces, where SentencePiece merges one long chunk (n log n with
    a queue, not the n squared of rescanning)."""
    import base64

    from work import count_calls

    md = metadata(model)
    t, built = count_calls(lambda: Tokenizer.from_metadata(md))
    assert isinstance(t, Tokenizer) and built <= 4 * len(md["tokenizer.ggml.tokens"]) + 10_000
    prose = ((DATA / "GPL-3.txt").read_text() * 4)[:100_000]
    solid = base64.b64encode(random.Random(0).randbytes(75_000)).decode()
    for text in (prose, solid):
        ids, calls = count_calls(lambda: t.encode(text))
        assert calls <= 10 * len(text), (calls, len(text))
        assert t.decode(ids[1:] if t.add_bos else ids) == text


# --- the SentencePiece merge loop

def test_spm_short_and_long_merge_loops_agree(tok):
    """The rescanning loop (short chunks) and the priority-queue loop (long ones) merge alike."""
    v = tok("gemma3-270m").vocab
    ids, scores = v.token_to_id, v.scores.tolist()
    rng = random.Random(1)
    words = [t for t in v.tokens[1000:60000] if "<" not in t]
    for _ in range(3000):
        chunk = "".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        assert merge_short(chunk, ids, scores) == merge_long(chunk, ids, scores), chunk


def spm_metadata(tokens_scores: list[tuple[str, float]], **extra) -> dict:
    base = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    toks = base + tokens_scores
    types = [2, 3, 3] + [6] * 256 + [1] * len(tokens_scores)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [t for t, _ in toks],
            "tokenizer.ggml.scores": np.array([s for _, s in toks], np.float32),
            "tokenizer.ggml.token_type": np.array(types, np.int32), **extra}


def test_spm_merges_by_score_then_leftmost():
    md = spm_metadata([("▁", -1), ("a", -1), ("b", -1), ("c", -1), ("ab", -5), ("bc", -3), ("abc", -2),
                       ("▁a", -4), ("aa", -1)])
    t = Tokenizer.from_metadata(md)
    ids = {text: i for i, text in enumerate(t.vocab.tokens)}
    # llama.cpp's defaults when the metadata is silent: BOS 1, EOS 2, add BOS, add a space prefix
    assert (t.bos_id, t.eos_id, t.add_bos, t.add_eos, t.vocab.add_space_prefix) == (1, 2, True, False, True)
    # "▁abc": bc (-3) before ▁a (-4) and ab (-5); then a+bc = abc (-2); ▁a is stale by then
    assert t.encode("abc", add_special=False) == [ids["▁"], ids["abc"]]
    assert t.encode("abc") == [1, ids["▁"], ids["abc"]]
    # equal scores: the leftmost pair first ("▁aaa": a+a at 1 and at 2 tie; then ▁+aa is no token)
    assert t.encode("aaa", add_special=False) == [ids["▁"], ids["aa"], ids["a"]]
    # a character outside the vocabulary: its UTF-8 bytes as byte tokens
    assert t.encode("é", add_special=False) == [ids["▁"], ids["<0xC3>"], ids["<0xA9>"]]
    # the space prefix comes back after each special token
    assert t.encode("a</s>a", add_special=False, parse_special=True) == [ids["▁a"], 2, ids["▁a"]]
    assert t.decode(t.encode("abc aé")) == " abc aé"
    assert t.token_to_piece(ids["▁a"]) == b" a"


def test_spm_without_space_prefix():
    md = spm_metadata([("a", -1), ("aa", -1)], **{"tokenizer.ggml.add_space_prefix": False})
    t = Tokenizer.from_metadata(md)
    ids = {text: i for i, text in enumerate(t.vocab.tokens)}
    assert t.encode("aaa", add_special=False) == [ids["aa"], ids["a"]]


# --- special-token text: llama.cpp's longest-first order

def reference_partition(text: str, specials: list[tuple[int, str]]) -> list:
    """llama.cpp's loop, written plainly: per token (longest first), cut it out of every raw fragment."""
    parts: list = [text]
    for token, s in sorted(specials, key=lambda x: (-len(x[1]), x[0])):
        out = []
        for p in parts:
            while isinstance(p, str) and s in p:
                k = p.index(s)
                out += [p[:k], token] if k else [token]
                p = p[k + len(s):]
            if p != "":
                out.append(p)
        parts = out
    return parts


def random_specials(rng: random.Random) -> list[tuple[int, str]]:
    """Short texts over a small alphabet (overlaps are common), plus runs of space and newline."""
    texts = {"".join(rng.choice("ab<>") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 6))}
    texts |= {c * rng.randint(1, 6) for c in " \n" for _ in range(rng.randint(0, 4))}
    return list(enumerate(sorted(texts)))


def test_special_matcher_matches_llamacpp_order():
    rng = random.Random(7)
    for _ in range(1000):
        specials = random_specials(rng)
        text = "".join(rng.choice("ab<> \n") for _ in range(rng.randint(0, 40)))
        assert SpecialMatcher(specials).split(text) == reference_partition(text, specials), (specials, text)


def test_longer_special_wins_over_earlier_overlap():
    m = SpecialMatcher([(1, "ab"), (2, "bcd")])
    assert m.split("xabcd") == ["xa", 2]  # not leftmost-first ("x", 1, "cd")


def test_user_defined_tokens_match_without_parse_special(tok):
    g = tok("gemma3-270m")
    # runs of spaces and newlines are user-defined tokens in Gemma 3: matched even as plain text
    ids = g.vocab.token_to_id
    assert g.encode("a  b\n\n", add_special=False) == [ids["a"], ids["  "], ids["b"], ids["\n\n"]]
    assert g.encode("<start_of_turn>", add_special=False, parse_special=True) == [105]
    assert 105 not in g.encode("<start_of_turn>", add_special=False)


# --- byte-level BPE pre-tokenizers

def test_every_pre_tokenizer_builds_and_round_trips(metadata):
    md = dict(metadata("smollm2"))
    text = "Hello World, I'm 12345 años — 中文! \t\n\n  x\u00a0y 'LL\r\n"
    one_name_each = {id(p): name for name, p in sorted(PRE_TOKENIZERS.items())}.values()
    for pre in one_name_each:
        t = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": pre})
        assert t.decode(t.encode(text)) == text, pre


def pieces(t: Tokenizer, text: str) -> list[str]:
    return [t.decode([i]) for i in t.encode(text, add_special=False)]


def test_pre_tokenizer_digit_rules(metadata):
    md = {k: v for k, v in metadata("smollm2").items() if k != "tokenizer.ggml.add_bos_token"}
    by_pre = {pre: Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": pre})
              for pre in ("smollm", "llama-bpe", "qwen2", "gpt-2")}
    assert pieces(by_pre["smollm"], "1234") == ["1", "2", "3", "4"]  # \p{N} first: digit by digit
    assert pieces(by_pre["qwen2"], "1234") == ["1", "2", "3", "4"]
    llama3 = pieces(by_pre["llama-bpe"], "1234567")  # digits in groups of up to three
    assert "".join(llama3) == "1234567" and all(len(p) <= 3 for p in llama3)
    assert by_pre["llama-bpe"].add_bos and not by_pre["gpt-2"].add_bos  # llama3's default: add BOS


def test_unknown_pre_tokenizer_is_an_error(metadata):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre 'nonesuch' is not supported"):
        Tokenizer.from_metadata({**metadata("smollm2"), "tokenizer.ggml.pre": "nonesuch"})


# --- bad metadata

@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model is missing"),
    ({"tokenizer.ggml.model": "t5"}, "tokenizer.ggml.model 't5' is not supported"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
    ({"tokenizer.ggml.tokens": np.zeros(3)}, "tokenizer.ggml.tokens must be an array of strings"),
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing"),
    ({"tokenizer.ggml.merges": ["nospace"]}, "has no space"),
    ({"tokenizer.ggml.token_type": np.ones(5, np.int32)}, "token_type has 5 entries for 49152 tokens"),
    ({"tokenizer.ggml.eos_token_id": 49152}, "eos_token_id = 49152 is outside the vocabulary"),
    ({"tokenizer.ggml.add_bos_token": "yes"}, "add_bos_token must be a bool"),
    ({"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eos_token_id": None},
     "add_eos_token is true, but tokenizer.ggml.eos_token_id is not set"),
])
def test_bad_metadata(metadata, change, message):
    md = {**metadata("smollm2"), **change}
    md = {k: v for k, v in md.items() if v is not None}
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_metadata(md)


def test_duplicate_token_is_an_error(metadata):
    md = dict(metadata("smollm2"))
    tokens = list(md["tokenizer.ggml.tokens"])
    tokens[100] = tokens[99]
    with pytest.raises(TokenizerError, match=r"duplicate token in vocabulary: .* has ids 99 and 100"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.tokens": tokens})


def test_spm_without_scores_is_an_error():
    md = spm_metadata([("a", -1)])
    del md["tokenizer.ggml.scores"]
    with pytest.raises(TokenizerError, match="without tokenizer.ggml.scores"):
        Tokenizer.from_metadata(md)


def test_lone_surrogates_become_replacement_characters(tok):
    s = tok("smollm2")
    assert s.encode("a\udc80b", add_special=False) == s.encode("a\ufffdb", add_special=False)


def test_merges_of_unknown_tokens_and_repeats_are_handled_like_the_careful_parse(metadata, tok):
    """Plain merge lists go to `tokenizers` as they are; a merge naming a token the vocabulary lacks,
    or a repeated merge (the first occurrence ranks), takes the careful parse: same tokens either way."""
    md = metadata("smollm2")
    merges = md["tokenizer.ggml.merges"]
    text = " ".join(c["text"] for c in golden("smollm2", "tokenize")["cases"][:20])
    want = tok("smollm2").encode(text)
    for extra in (["Ġqqzzqq Ġxxyyxx"], [merges[5]]):  # unknown tokens; a repeat of an early merge
        variant = Tokenizer.from_metadata({**md, "tokenizer.ggml.merges": merges + extra})
        assert variant.encode(text) == want
