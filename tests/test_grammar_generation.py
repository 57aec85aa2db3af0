"""Constrained generation on the real models: at temperature 1, every output produced under a
JSON schema's grammar is a prefix the grammar accepts, and JSON (checked apart from the grammar
engine) that validates against the schema once complete."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest

from ember.engine import FinishEvent, Request, TokenEvent
from ember.engine import GrammarSpec
from ember.gbnf import Grammar, TokenVocab, schema_to_gbnf
from ember.sampler import SamplingParams

SCHEMAS = Path(__file__).resolve().parent.parent / "bench" / "schemas"
ALL = sorted(p for p in SCHEMAS.glob("*.json") if not p.name.endswith((".examples.json", ".invalid.json")))


def generate(llm, schemas: list[dict], seeds: list[int], max_tokens: int) -> list[tuple[dict, str, str]]:
    """(schema, text, finish reason) per schema and seed, all submitted at once so that the
    engine batches them."""
    jobs = []
    for schema in schemas:
        grammar = GrammarSpec(schema_to_gbnf(schema))
        prompt = llm.chat_ids([{"role": "user", "content": "Reply with a JSON value for this schema: "
                                + json.dumps(schema)[:400]}])
        jobs += [(schema, grammar, llm.engine.submit(Request(
            prompt, max_tokens, SamplingParams(temperature=1.0, seed=s), grammar=grammar))) for s in seeds]
    out = []
    for schema, grammar, h in jobs:
        text, reason = "", None
        for ev in h:
            if isinstance(ev, TokenEvent):
                text += ev.text
            elif isinstance(ev, FinishEvent):
                text += ev.text
                reason = ev.reason
                assert ev.error is None, ev.error
        out.append((schema, grammar, text, reason))
    return out


@lru_cache(maxsize=2)
def vocab_of(llm) -> TokenVocab:
    return TokenVocab.for_tokenizer(llm.tokenizer)


def check_outputs(llm, paths: list[Path], seeds: list[int], max_tokens: int) -> None:
    finished = 0
    outputs = generate(llm, [json.loads(p.read_text()) for p in paths], seeds, max_tokens)
    for schema, grammar, text, reason in outputs:
        # the text as a whole, fed byte by byte to a fresh matcher (the engine masked token by token)
        matcher = Grammar.parse(grammar.gbnf).compile(vocab_of(llm)).matcher()
        assert matcher.accept_text(text), text
        if reason == "stop":
            finished += 1
            assert matcher.can_end, text
            jsonschema.validate(json.loads(text), schema)
        else:  # cut by max_tokens: still the start of a JSON document
            assert reason == "length" and json_prefix(text), text
    assert finished >= len(outputs) // 3, f"only {finished} of {len(outputs)} outputs completed"


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_schema_outputs_validate(llm, name):
    check_outputs(llm(name), ALL, seeds=[1], max_tokens=128)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_schema_outputs_validate_many_seeds(llm, name):
    check_outputs(llm(name), ALL, seeds=[1, 2, 3, 4], max_tokens=256)


class _End(Exception):
    """The text ends inside the value."""


def json_prefix(text: str) -> bool:
    """Whether `text` can be continued into a JSON document (a small parser of its own, apart
    from the grammar engine)."""
    reader = _Prefix(text)
    try:
        reader.value()
        reader.ws()
        return reader.i == len(text)
    except _End:
        return True
    except ValueError:
        return False


class _Prefix:
    def __init__(self, text: str):
        self.s, self.i = text, 0

    def peek(self) -> str:
        if self.i >= len(self.s):
            raise _End
        return self.s[self.i]

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\n\r":
            self.i += 1

    def expect(self, word: str) -> None:
        for ch in word:
            if self.peek() != ch:
                raise ValueError(f"expected {word!r}")
            self.i += 1

    def value(self) -> None:
        self.ws()
        ch = self.peek()
        if ch in "{[":
            self.container("}" if ch == "{" else "]", ch == "{")
        elif ch == '"':
            self.string()
        elif ch in "-0123456789":
            self.number()
        else:
            self.expect({"t": "true", "f": "false", "n": "null"}.get(ch, "?"))

    def container(self, close: str, keyed: bool) -> None:
        self.i += 1
        self.ws()
        if self.peek() == close:
            self.i += 1
            return
        while True:
            if keyed:
                self.ws()
                if self.peek() != '"':
                    raise ValueError("expected a key")
                self.string()
                self.ws()
                self.expect(":")
            self.value()
            self.ws()
            ch = self.peek()
            self.i += 1
            if ch == close:
                return
            if ch != ",":
                raise ValueError(f"unexpected {ch!r}")

    def string(self) -> None:
        self.i += 1
        while (ch := self.peek()) != '"':
            self.i += 1
            if ch == "\\":
                esc = self.peek()
                self.i += 1
                if esc == "u":
                    for _ in range(4):
                        if self.peek() not in "0123456789abcdefABCDEF":
                            raise ValueError("bad \\u escape")
                        self.i += 1
                elif esc not in '"\\/bfnrt':
                    raise ValueError("bad escape")
            elif ch < " ":
                raise ValueError("control character in a string")
        self.i += 1

    def number(self) -> None:
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in "+-0123456789.eE":
            self.i += 1
        number = self.s[start:self.i]
        if self.i == len(self.s):
            return  # may still grow
        try:
            json.loads(number)
        except ValueError:
            raise ValueError(f"bad number {number!r}") from None


def run_tokens(llm, grammar: GrammarSpec, logprobs: int | None) -> list[int]:
    prompt = llm.tokenize("A list of numbers:")
    h = llm.engine.submit(Request(prompt, 12, SamplingParams(temperature=0.0), grammar=grammar, logprobs=logprobs))
    tokens = []
    for ev in h:
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token)
        elif isinstance(ev, FinishEvent):
            assert ev.error is None, ev.error
    return tokens


def test_forced_tokens_are_appended_without_sampling(llm):
    """Where the grammar allows a single token, the engine appends it unsampled and computes the
    stretch in one step; the output is the one token-by-token sampling gives (with logprobs on,
    which turns the shortcut off)."""
    m = llm("smollm2")
    ids = m.tokenize(" one two three", add_special=False)
    grammar = GrammarSpec("root ::= " + " ".join(f"<[{i}]>" for i in ids) + ' [0-9] [0-9] "."')
    before_forced, before_steps = m.engine.metrics.forced_tokens, m.engine.metrics.steps
    fast = run_tokens(m, grammar, logprobs=None)
    forced, steps = m.engine.metrics.forced_tokens - before_forced, m.engine.metrics.steps - before_steps
    slow = run_tokens(m, grammar, logprobs=1)
    assert fast[:len(ids)] == ids and fast == slow
    assert forced == len(ids)  # all but the first (sampled from the prompt's logits), and the final "."
    assert steps <= len(fast) - forced + 1
