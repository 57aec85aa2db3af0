"""The grammar engine on the real vocabularies (SmolLM2 49,152 tokens, Gemma 3 262,144 tokens).

Random walks under a JSON grammar end in text json.loads reads; walks under JSON schemas (via
ember.gbnf.schema) validate against the schema; the schema corpus' examples are accepted
token by token and its invalid instances are refused; masks agree with accept_token; special
tokens never come through text rules.
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from ember.gbnf import Grammar, TokenVocab
from ember.gguf_loader import GGUFFile
from ember.tokenizer import Tokenizer

SCHEMAS = Path(__file__).resolve().parent.parent / "bench" / "schemas"
MODELS = ["smollm2", "gemma3-270m"]

JSON_GBNF = r'''
root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= "-"? ([0-9] | [1-9] [0-9]{0,15}) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,3})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
'''


@pytest.fixture(scope="module", params=MODELS)
def tv(request, model_path):
    tok = Tokenizer.from_metadata(GGUFFile(model_path(request.param)).metadata)
    return tok, TokenVocab.for_tokenizer(tok)


class Walker:
    """Random valid tokens; after `patience` steps it prefers closing tokens so walks end."""

    def __init__(self, vocab: TokenVocab, seed: int, patience: int = 40):
        self.vocab, self.rng, self.patience = vocab, np.random.default_rng(seed), patience
        self.words = np.empty(vocab.n_words, np.uint32)
        closers = {b'"', b"}", b"]", b"0", b"1", b"true", b"null", b'"}', b'"]', b"}]", b"]}"}
        self.prefer = np.zeros(vocab.n_vocab, bool)
        self.prefer[[i for i, b in enumerate(vocab.token_bytes) if b in closers and vocab.is_text[i]]] = True
        self.eog = np.zeros(vocab.n_vocab, bool)
        self.eog[list(vocab.eog_ids)] = True

    def step(self, m, i: int) -> int | None:
        """A token to accept next, or None to end."""
        m.fill_mask(self.words)
        ok = np.unpackbits(self.words.view(np.uint8), bitorder="little")[:self.vocab.n_vocab].astype(bool)
        if (ok & self.eog).any() and (i > self.patience or not (ok & ~self.eog).any()):
            return None
        late = i > self.patience or self.rng.random() < 0.1
        pick = ok & ~self.eog & (self.prefer if late and (ok & self.prefer).any() else True)
        return int(self.rng.choice(np.flatnonzero(pick)))

    def walk(self, m, limit: int = 600) -> bytes | None:
        out = []
        for i in range(limit):
            t = self.step(m, i)
            if t is None:
                assert m.accept_token(next(iter(self.vocab.eog_ids))) and m.is_done
                return b"".join(self.vocab.token_bytes[t] for t in out)
            assert m.accept_token(t), (t, b"".join(self.vocab.token_bytes[t] for t in out))
            out.append(t)
        return None


def test_json_walks_give_json(tv):
    tok, vocab = tv
    compiled = Grammar.parse(JSON_GBNF).compile(vocab)
    finished = 0
    for seed in range(6):
        text = Walker(vocab, seed).walk(compiled.matcher())
        if text is not None:
            json.loads(text.decode("utf-8"))
            finished += 1
    assert finished >= 4


def test_special_tokens_never_come_from_text(tv):
    tok, vocab = tv
    special = {i for i in range(vocab.n_vocab) if tok.vocab.attr_list[i] & (1 | 2 | 8)} - vocab.eog_ids
    m = Grammar.parse("root ::= .*").compile(vocab).matcher()
    mask = m.allowed_mask()
    assert special and not mask[sorted(special)].any()
    assert mask[sorted(vocab.eog_ids)].all()  # ".*" may end here
    text = [i for i in range(vocab.n_vocab) if i not in special and i not in vocab.eog_ids]
    assert mask[text].tolist() == [utf8_prefix(vocab.token_bytes[i]) for i in text]


def utf8_prefix(b: bytes) -> bool:
    """Whether b can start a UTF-8 text (it may end inside a character)."""
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data" and e.end == len(b)


def test_masks_agree_with_accept_on_real_tokens(tv):
    tok, vocab = tv
    compiled = Grammar.parse(JSON_GBNF).compile(vocab)
    m, rng = compiled.matcher(), np.random.default_rng(7)
    for text in ['{"name": "Ada", "tags": [1, 2.5e3, ', '{"x": {"y": [true, null, "a\\"b']:
        m = compiled.matcher()
        for t in tok.encode(text, add_special=False):
            mask = m.allowed_mask()
            sample = np.concatenate([rng.choice(vocab.n_vocab, 150, replace=False),
                                     rng.choice(np.flatnonzero(mask), min(150, int(mask.sum())), replace=False)])
            for s in sample:
                assert m.is_allowed(int(s)) == mask[s], (text, vocab.token_bytes[s])
            assert m.accept_token(t)


def schema_grammar(name: str) -> str:
    converter = pytest.importorskip("ember.gbnf.schema")
    return converter.schema_to_gbnf(json.loads((SCHEMAS / f"{name}.json").read_text()))


def schema_names() -> list[str]:
    return sorted(p.name[:-5] for p in SCHEMAS.glob("*.json") if p.name.count(".") == 1)


@pytest.mark.skipif(not SCHEMAS.is_dir(), reason="no schema corpus")
def test_schema_examples_accepted_and_invalid_instances_refused(tv):
    tok, vocab = tv
    eos = next(iter(vocab.eog_ids))
    for name in schema_names():
        compiled = Grammar.parse(schema_grammar(name)).compile(vocab)
        for kind in ("examples", "invalid"):
            path = SCHEMAS / f"{name}.{kind}.json"
            for instance in json.loads(path.read_text()) if path.exists() else []:
                for indent in (None, 2):
                    text = json.dumps(instance, indent=indent, ensure_ascii=False)
                    m = compiled.matcher()
                    ok = all(m.accept_token(t) for t in tok.encode(text, add_special=False)) and m.accept_token(eos)
                    assert ok == (kind == "examples"), (name, kind, text)


WALK_SCHEMAS = ["get_weather", "calculator", "book_flight", "todo_list", "geometry", "file_tree", "expression_ast",
                "place_order"]


@pytest.mark.skipif(not SCHEMAS.is_dir(), reason="no schema corpus")
@pytest.mark.parametrize("name", WALK_SCHEMAS)
def test_schema_walks_validate(tv, name):
    tok, vocab = tv
    if not (SCHEMAS / f"{name}.json").exists():
        pytest.skip(f"{name} is not in the corpus")
    schema = json.loads((SCHEMAS / f"{name}.json").read_text())
    compiled = Grammar.parse(schema_grammar(name)).compile(vocab)
    finished = 0
    for seed in range(4):
        text = Walker(vocab, seed, patience=30).walk(compiled.matcher())
        if text is not None:
            jsonschema.validate(json.loads(text.decode("utf-8")), schema)
            finished += 1
    assert finished >= 2
