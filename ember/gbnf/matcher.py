"""CompiledGrammar (a grammar bound to a vocabulary) and Matcher (one sequence's parse state).

    m = compiled.matcher()                     # or matcher(lazy_triggers=["<tool_call>", 151657])
    mask = np.empty(vocab.n_words, np.uint32)
    m.fill_mask(mask)                          # bit t set: token t allowed
    m.accept_token(t)                          # False (state unchanged) if t is not allowed

End of generation: EOG tokens are allowed exactly when the grammar can end; accepting one
finishes the matcher (`is_done`). When the grammar can only end, EOG is all that is allowed.
A lazy matcher allows everything until a trigger appears, then feeds the grammar the text from
the trigger on (a trigger token: that token).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._native import ffi, lib
from .errors import GrammarError

_STATS = ("dfa_states", "rows", "partitions", "mask_walks", "trie_nodes_walked", "uncertain_checked",
          "slice_uses", "uncertain_cache_hits", "shared_partitions")


class CompiledGrammar:
    """A Grammar bound to a TokenVocab: the native automaton and its cached masks (shared by matchers)."""

    def __init__(self, grammar, vocab):
        self.grammar, self.vocab = grammar, vocab
        self._ptr = self._build(grammar, vocab)

    def _build(self, grammar, vocab):
        off, ids, neg = token_sets(grammar, vocab)
        b = ffi.new("eg_binding *")
        b.n_toksets = len(neg)
        b.tokset_off, b.tokset_ids = ffi.from_buffer("int32_t[]", off), ffi.from_buffer("int32_t[]", ids)
        b.tokset_negated = ffi.from_buffer("uint8_t[]", neg) if len(neg) else ffi.NULL
        limits = grammar.limits
        b.max_stack_depth, b.max_stacks, b.max_dfa_states = limits.max_stack_depth, limits.max_stacks, limits.max_dfa_states
        ptr = lib.eg_grammar_new(vocab._ptr, grammar.program.nfa, b)
        if ptr == ffi.NULL:
            raise GrammarError("the grammar engine refused the compiled grammar (out of memory or inconsistent)")
        return ffi.gc(ptr, lib.eg_grammar_free)

    def matcher(self, lazy_triggers=None) -> Matcher:
        return Matcher(self, LazyStart.from_triggers(self.vocab, lazy_triggers))

    def stats(self) -> dict[str, int]:
        out = ffi.new("int64_t[10]")
        lib.eg_grammar_stats(self._ptr, out)
        return dict(zip(_STATS, list(out)))

    def error(self) -> GrammarError:
        msg = ffi.string(lib.eg_grammar_error(self._ptr)).decode() or "out of memory in the grammar engine"
        return GrammarError(msg)


def token_sets(grammar, vocab) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, ids, negated) of the grammar's token references, resolved in the vocabulary."""
    ids, neg = [], []
    for tok in grammar.program.tokens:
        ids.append(vocab.resolve_token(tok.item, lambda msg, at=tok.at: grammar.error_at(at, msg)))
        neg.append(1 if tok.negated else 0)
    return (np.arange(len(ids) + 1, dtype=np.int32), np.asarray(ids or [0], np.int32),
            np.asarray(neg, np.uint8))


@dataclass(slots=True)
class LazyStart:
    """Triggers that start a lazy grammar: token ids, or byte strings searched in the output."""
    token_ids: frozenset
    texts: tuple
    tail: bytes = b""                     # the last bytes seen, for a trigger split across tokens
    keep: int = field(default=0)

    @classmethod
    def from_triggers(cls, vocab, triggers) -> LazyStart | None:
        if not triggers:
            return None
        ids, texts = set(), []
        for t in triggers:
            if isinstance(t, (int, np.integer)):
                if not 0 <= int(t) < vocab.n_vocab:
                    raise ValueError(f"trigger token {t} is outside the vocabulary")
                ids.add(int(t))
            elif isinstance(t, (str, bytes)):
                b = t.encode("utf-8") if isinstance(t, str) else t
                if not b:
                    raise ValueError("empty trigger text")
                texts.append(b)
            else:
                raise TypeError(f"a lazy trigger is a token id or a string, got {type(t).__name__}")
        return cls(frozenset(ids), tuple(texts), b"", max((len(b) for b in texts), default=1) - 1)

    def find(self, piece: bytes) -> int | None:
        """Offset in tail + piece where the earliest trigger text starts, or None."""
        hay = self.tail + piece
        hits = [i for i in (hay.find(t) for t in self.texts) if i >= 0]
        return min(hits) if hits else None

    def remember(self, piece: bytes) -> None:
        self.tail = (self.tail + piece)[-self.keep:] if self.keep else b""


class Matcher:
    """Parse state of one sequence. Cheap to fork (a few small arrays)."""

    def __init__(self, compiled: CompiledGrammar, lazy: LazyStart | None = None, ptr=None):
        self.compiled, self.vocab = compiled, compiled.vocab
        self._lazy = lazy
        self._done = False
        if ptr is None:
            ptr = lib.eg_matcher_new(compiled._ptr)
            if ptr == ffi.NULL:
                raise compiled.error()
            ptr = ffi.gc(ptr, lib.eg_matcher_free)
        self._ptr = ptr

    # --- state

    @property
    def triggered(self) -> bool:
        """False while a lazy grammar waits for its trigger."""
        return self._lazy is None

    @property
    def can_end(self) -> bool:
        return not self.triggered or bool(lib.eg_matcher_can_end(self._ptr))

    @property
    def is_done(self) -> bool:
        """An end-of-generation token was accepted."""
        return self._done

    @property
    def saturated(self) -> bool:
        """Parses were dropped at GrammarLimits.max_stacks (a very ambiguous grammar): what is
        allowed is still valid, but some valid continuations may be missing."""
        return self.triggered and bool(lib.eg_matcher_saturated(self._ptr))

    @property
    def at_end(self) -> bool:
        """Only the end remains: nothing more can be read."""
        return self.triggered and bool(lib.eg_matcher_at_end(self._ptr))

    def fork(self) -> Matcher:
        ptr = lib.eg_matcher_clone(self._ptr)
        if ptr == ffi.NULL:
            raise MemoryError("could not fork the matcher")
        lazy = None if self._lazy is None else LazyStart(self._lazy.token_ids, self._lazy.texts,
                                                         self._lazy.tail, self._lazy.keep)
        m = Matcher(self.compiled, lazy, ffi.gc(ptr, lib.eg_matcher_free))
        m._done = self._done
        return m

    # --- masks

    def fill_mask(self, out: np.ndarray) -> None:
        """Writes the allowed tokens into out, a uint32 array of (n_vocab + 31) // 32 words."""
        if out.dtype != np.uint32 or out.shape != (self.vocab.n_words,) or not out.flags.c_contiguous:
            raise ValueError(f"mask must be a contiguous uint32 array of shape ({self.vocab.n_words},)")
        if not self.triggered and not self._done:
            out.fill(0xFFFFFFFF)
            if self.vocab.n_vocab % 32:
                out[-1] = (1 << (self.vocab.n_vocab % 32)) - 1
            return
        if self._done:
            out.fill(0)
            for t in self.vocab.eog_ids:
                out[t >> 5] |= np.uint32(1 << (t & 31))
            return
        if lib.eg_matcher_fill_mask(self._ptr, ffi.from_buffer("uint32_t[]", out)) < 0:
            raise self.compiled.error()

    def allowed_mask(self) -> np.ndarray:
        """Allowed tokens as a bool array of n_vocab."""
        words = np.empty(self.vocab.n_words, np.uint32)
        self.fill_mask(words)
        return np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab.n_vocab].astype(bool)

    def allowed_tokens(self) -> np.ndarray:
        return np.flatnonzero(self.allowed_mask())

    # --- advancing

    def accept_token(self, token: int) -> bool:
        """Advances past token and returns True, or returns False and changes nothing."""
        token = int(token)
        if self._done or not 0 <= token < self.vocab.n_vocab:
            return False
        if not self.triggered:
            return self._accept_lazy(token)
        if token in self.vocab.eog_ids:
            if not lib.eg_matcher_can_end(self._ptr):
                return False
            self._done = True
            return True
        return self._check(lib.eg_matcher_accept_token(self._ptr, token))

    def accept_bytes(self, data: bytes) -> bool:
        """Forces bytes into the grammar (any split across tokens); False and no change if invalid."""
        if self._done:
            return False
        if not self.triggered:
            return self._feed_lazy(bytes(data))
        return self._check(lib.eg_matcher_accept_bytes(self._ptr, ffi.from_buffer("uint8_t[]", bytes(data)), len(data)))

    def accept_text(self, text: str) -> bool:
        return self.accept_bytes(text.encode("utf-8"))

    def is_allowed(self, token: int) -> bool:
        """Whether accept_token(token) would succeed, without changing this matcher."""
        return self.fork().accept_token(token)

    def forced_tokens(self, limit: int = 64) -> list[int]:
        """Tokens the grammar leaves no choice about from here (each the only allowed token)."""
        if not self.triggered or self._done:
            return []
        m, out, words = self.fork(), [], np.empty(self.vocab.n_words, np.uint32)
        while len(out) < limit:
            m.fill_mask(words)
            nz = np.flatnonzero(words)
            if len(nz) != 1 or words[nz[0]] & (words[nz[0]] - np.uint32(1)):
                break
            token = int(nz[0]) * 32 + int(words[nz[0]]).bit_length() - 1
            if token in self.vocab.eog_ids or not m.accept_token(token):
                break
            out.append(token)
        return out

    def forced_bytes(self, limit: int = 256) -> bytes:
        """Bytes every continuation must start with (empty when there is a choice or the end may come)."""
        if not self.triggered or self._done:
            return b""
        buf = ffi.new("uint8_t[]", limit)
        n = lib.eg_matcher_forced_bytes(self._ptr, buf, limit)
        if n < 0:
            raise self.compiled.error()
        return bytes(ffi.buffer(buf, n))

    def _check(self, rc: int) -> bool:
        if rc < 0:
            raise self.compiled.error()
        return rc == 1

    # --- lazy start

    def _accept_lazy(self, token: int) -> bool:
        if token in self.vocab.eog_ids:
            self._done = True
            return True
        if token in self._lazy.token_ids:
            return self._start(lambda: lib.eg_matcher_accept_token(self._ptr, token))
        return self._feed_lazy(self.vocab.token_bytes[token])

    def _feed_lazy(self, piece: bytes) -> bool:
        at = self._lazy.find(piece)
        if at is None:
            self._lazy.remember(piece)
            return True
        rest = (self._lazy.tail + piece)[at:]
        return self._start(lambda: lib.eg_matcher_accept_bytes(self._ptr, ffi.from_buffer("uint8_t[]", rest), len(rest)))

    def _start(self, feed) -> bool:
        """Runs feed() on the grammar; on success the grammar is live from now on."""
        if not self._check(feed()):
            return False
        self._lazy = None
        return True
