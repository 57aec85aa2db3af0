"""Grammar: a parsed and checked GBNF grammar, independent of any vocabulary.

    g = Grammar.parse(text, root="root")        # GrammarError on any problem, with line/column
    compiled = g.compile(TokenVocab.for_tokenizer(tok))
    m = compiled.matcher()

Parsing builds the byte automaton too (repetitions expanded, small rules inlined), so every
size limit is checked before a vocabulary is involved. Parses are cached by text.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from .errors import GrammarError, GrammarLimits, error_at
from .nfa import Program, build_program
from .parser import decode_text, parse_rules
from .syntax import Rule

_PARSE_CACHE_SIZE = 128
_parse_cache: OrderedDict = OrderedDict()
_parse_lock = threading.Lock()


class Grammar:
    """Rules as written (`rules`) and the automaton built from them (`program`)."""

    def __init__(self, text: str, root: str, limits: GrammarLimits, rules: dict[str, Rule], program: Program):
        self.text, self.root, self.limits = text, root, limits
        self.rules, self.program = rules, program

    @classmethod
    def parse(cls, text: str | bytes, root: str = "root", limits: GrammarLimits | None = None,
              cache: bool = True) -> Grammar:
        """Parse and check a grammar; GrammarError says what is wrong and where."""
        limits = limits or GrammarLimits()
        if not cache:
            return cls._parse(text, root, limits)
        key = (text, root, limits)
        with _parse_lock:
            hit = _parse_cache.get(key)
            if hit is not None:
                _parse_cache.move_to_end(key)
                return hit
        grammar = cls._parse(text, root, limits)
        with _parse_lock:
            _parse_cache[key] = grammar
            while len(_parse_cache) > _PARSE_CACHE_SIZE:
                _parse_cache.popitem(last=False)
        return grammar

    @classmethod
    def _parse(cls, text, root: str, limits: GrammarLimits) -> Grammar:
        size = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else len(text)
        if size > limits.max_text_bytes:
            raise GrammarError(f"grammar text is {size} bytes, over the limit of {limits.max_text_bytes}")
        text = decode_text(text)
        rules = parse_rules(text, limits)
        if not rules:
            raise GrammarError("empty grammar: no rules")
        if root not in rules:
            raise GrammarError(f"grammar has no rule '{root}' (rules: {', '.join(list(rules)[:10])})")
        return cls(text, root, limits, rules, build_program(text, rules, root, limits))

    def compile(self, vocab, cache: bool = True):
        """This grammar bound to a TokenVocab (cached in the vocabulary unless cache=False)."""
        from .matcher import CompiledGrammar
        if not cache:
            return CompiledGrammar(self, vocab)
        return vocab.cached((self.text, self.root, self.limits), lambda: CompiledGrammar(self, vocab))

    def error_at(self, offset: int, message: str) -> GrammarError:
        return error_at(self.text, offset, message)

    def __repr__(self) -> str:
        return f"Grammar({len(self.rules)} rules, root={self.root!r}, {self.program.n_nodes} automaton states)"
