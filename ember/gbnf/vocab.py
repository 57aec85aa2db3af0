"""TokenVocab: the vocabulary as the grammar engine sees it, built once per tokenizer.

Text rules read the bytes of *text tokens* only: normal, byte and user-defined tokens (the
tokenizer emits user-defined tokens for their text, e.g. Gemma's runs of newlines). Control,
unknown and unused tokens are reachable only through token references (`<[id]>`, `<text>`,
`!<...>`), and end-of-generation tokens only end the grammar.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np

from .errors import GrammarError
from .syntax import normalize_ranges
from .utf8 import class_fragment

# Slices: classes whose tokens masks accept or reject wholesale (see csrc/mask.c). The JSON
# string character comes first: string contents are most of what constrained outputs hold.
# Largest first: a state uses the first class all of whose characters it reads alike.
SLICE_CLASSES = (
    normalize_ranges([(0x22, 0x22), (0x5C, 0x5C), (0x00, 0x1F), (0x7F, 0x7F)], negated=True),
    normalize_ranges([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]),   # [0-9A-Z_a-z]
    normalize_ranges([(0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A)]),                 # [0-9A-Za-z]
    normalize_ranges([(0x61, 0x7A)]),                                             # [a-z]
    normalize_ranges([(0x30, 0x39)]),                                             # [0-9]
)
_CACHE_SIZE = 64
_NONTEXT_ATTRS = 1 | 2 | 8  # unknown, unused, control (llama_token_attr bits)


class TokenVocab:
    """Token bytes, which tokens text rules may read, end-of-generation ids, and the native trie.

    `lookup(text)` gives the ids a `<text>` token reference may mean (it must be exactly one).
    Compiled grammars are cached here by grammar, so a schema seen again costs nothing.
    """

    def __init__(self, token_bytes: list[bytes], special_ids: Iterable[int] = (), eog_ids: Iterable[int] = (),
                 lookup: Callable[[str], list[int]] | None = None):
        from ._native import ffi, lib
        self.token_bytes = list(token_bytes)
        self.n_vocab = len(self.token_bytes)
        if self.n_vocab == 0:
            raise ValueError("empty vocabulary")
        self.eog_ids = frozenset(int(i) for i in eog_ids)
        self.special_ids = frozenset(int(i) for i in special_ids)
        self._lookup = lookup or self._lookup_by_bytes
        self._by_bytes: dict[bytes, list[int]] | None = None
        is_text = np.ones(self.n_vocab, np.uint8)
        for i in self.special_ids | self.eog_ids:
            if 0 <= i < self.n_vocab:
                is_text[i] = 0
        self.is_text = is_text
        self._ptr = self._build(ffi, lib)
        self._compiled: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def _build(self, ffi, lib):
        offsets = np.zeros(self.n_vocab + 1, np.int64)
        np.cumsum([len(b) for b in self.token_bytes], out=offsets[1:])
        blob = b"".join(self.token_bytes) or b"\0"
        eog = np.asarray(sorted(self.eog_ids), np.int32)
        classes, keep = _native_classes(ffi)
        ptr = lib.eg_vocab_new(self.n_vocab, ffi.from_buffer("uint8_t[]", blob), ffi.from_buffer("int64_t[]", offsets),
                               ffi.from_buffer("uint8_t[]", self.is_text),
                               ffi.from_buffer("int32_t[]", eog) if len(eog) else ffi.NULL,
                               len(eog), classes, len(SLICE_CLASSES))
        del keep
        if ptr == ffi.NULL:
            raise MemoryError("could not build the grammar engine's vocabulary trie")
        return ffi.gc(ptr, lib.eg_vocab_free)

    @classmethod
    def for_tokenizer(cls, tok) -> TokenVocab:
        """The TokenVocab of an ember Tokenizer, built on first use and kept while tok lives."""
        with _for_tokenizer_lock:
            vocab = _by_tokenizer.get(tok)
            if vocab is None:
                attrs = tok.vocab.attr_list
                special = [i for i, a in enumerate(attrs) if a & _NONTEXT_ATTRS]
                vocab = cls(tok.token_bytes, special, tok.eog_ids, lookup=_tokenizer_lookup(tok))
                _by_tokenizer[tok] = vocab
            return vocab

    def lookup(self, text: str) -> list[int]:
        return self._lookup(text)

    def _lookup_by_bytes(self, text: str) -> list[int]:
        if self._by_bytes is None:
            self._by_bytes = {}
            for i, b in enumerate(self.token_bytes):
                self._by_bytes.setdefault(b, []).append(i)
        return list(self._by_bytes.get(text.encode("utf-8"), []))

    @property
    def n_words(self) -> int:
        return (self.n_vocab + 31) // 32

    @property
    def trie_nodes(self) -> int:
        from ._native import lib
        return lib.eg_vocab_trie_nodes(self._ptr)

    def cached(self, key, build):
        """The compiled grammar for key, built by build() on a miss (LRU of _CACHE_SIZE)."""
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        compiled = build()
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def resolve_token(self, item, where: Callable[[str], GrammarError]) -> int:
        """The id a token reference means in this vocabulary."""
        if isinstance(item, int):
            if not 0 <= item < self.n_vocab:
                raise where(f"token id {item} is outside the vocabulary ({self.n_vocab} tokens)")
            return item
        ids = self.lookup(item)
        if len(ids) != 1:
            raise where(f"token reference {item} is not exactly one token in this vocabulary "
                        f"({'no token' if not ids else f'{len(ids)} tokens'})")
        return ids[0]


_by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_for_tokenizer_lock = threading.Lock()


def _tokenizer_lookup(tok) -> Callable[[str], list[int]]:
    def lookup(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=True)
    return lookup


def _native_classes(ffi):
    """eg_char_class structs for SLICE_CLASSES, plus the buffers they point into."""
    classes = ffi.new("eg_char_class[]", len(SLICE_CLASSES))
    keep = []
    for i, ranges in enumerate(SLICE_CLASSES):
        n, edges = class_fragment(ranges)
        src = np.asarray([e[0] for e in edges], np.int32)
        dst = np.asarray([e[2] for e in edges], np.int32)
        bits = np.concatenate([np.frombuffer(e[1].to_bytes(32, "little"), np.uint8) for e in edges])
        keep += [src, dst, bits]
        c = classes[i]
        c.n_nodes, c.n_edges = n, len(edges)
        c.src, c.dst, c.bits = ffi.from_buffer("int32_t[]", src), ffi.from_buffer("int32_t[]", dst), ffi.from_buffer("uint8_t[]", bits)
    return classes, keep
