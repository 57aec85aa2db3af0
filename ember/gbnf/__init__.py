"""GBNF grammars: parser, byte-level automaton, token masks and matchers (native engine).

    from ember.gbnf import Grammar, GrammarError, GrammarLimits, TokenVocab
    grammar = Grammar.parse(text, root="root", limits=GrammarLimits())
    vocab = TokenVocab.for_tokenizer(tokenizer)           # built once per tokenizer
    compiled = grammar.compile(vocab)                     # cached per (grammar, vocabulary)
    m = compiled.matcher(lazy_triggers=None)
    m.fill_mask(words)                                    # uint32[(n_vocab + 31) // 32]
    m.accept_token(t) -> bool; m.can_end; m.is_done; m.fork(); m.forced_tokens()
"""
from .errors import GrammarError, GrammarLimits
from .grammar import Grammar
from .matcher import CompiledGrammar, Matcher
from .schema import SchemaError, json_object_gbnf, json_value_gbnf, schema_to_gbnf
from .vocab import TokenVocab

__all__ = ["Grammar", "GrammarError", "GrammarLimits", "TokenVocab", "CompiledGrammar", "Matcher", "SchemaError",
           "json_object_gbnf", "json_value_gbnf", "schema_to_gbnf"]
