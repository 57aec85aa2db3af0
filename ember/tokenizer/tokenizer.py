"""Tokenizer: text <-> token ids for the two GGUF tokenizer families, equal to llama.cpp's.

    tok = Tokenizer.from_metadata(gguf.metadata)
    ids = tok.encode("Hello", add_special=True, parse_special=False)
    text = tok.decode(ids)

encode() first cuts special-token text out of the input (user-defined tokens always,
control tokens only with parse_special), then tokenizes the raw pieces with the vocabulary's
algorithm, then adds BOS/EOS when add_special is set and the metadata asks for them.
"""
from __future__ import annotations

import logging
import re
from functools import cached_property
from typing import Any, Iterable

import numpy as np

from .bpe import BpeEngine
from .decode import HIDDEN_UNLESS_SPECIAL, IncrementalDecoder, all_token_pieces, token_piece
from .errors import TokenizerError
from .pretokenize import pre_tokenizer
from .special import SpecialMatcher
from .spm import SpmEngine
from .wpm import WpmEngine
from .vocab import Attr, Vocab, vocab_from_metadata

log = logging.getLogger(__name__)
_SURROGATE = re.compile("[\ud800-\udfff]")
SPECIAL_ATTRS = int(Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN | Attr.UNUSED)


class Tokenizer:
    """One model's vocabulary: encode, decode, and what each token is."""

    def __init__(self, vocab: Vocab, engine: BpeEngine | SpmEngine | WpmEngine):
        self.vocab = vocab
        self._engine = engine
        self._plain_specials = special_matcher(vocab, parse_special=False)
        self._pieces: list[bytes | None] = [None] * vocab.n_vocab  # token_piece(), filled on first use

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata dict; TokenizerError says what is missing or wrong."""
        vocab = vocab_from_metadata(md)
        if vocab.kind == "spm":
            return cls(vocab, SpmEngine(vocab.token_to_id, vocab.scores.tolist(), vocab.ids.get("unk"),
                                        vocab.add_space_prefix))
        if vocab.kind == "wpm":
            return cls(vocab, WpmEngine(vocab.token_to_id, vocab.ids.get("unk"), vocab.lowercase, vocab.strip_accents))
        if not vocab.pre:
            log.warning("tokenizer.ggml.pre is missing: using llama.cpp's default pre-tokenizer "
                        "(tokenization may differ from the model's own)")
        return cls(vocab, BpeEngine(vocab.token_to_id, vocab.merges, pre_tokenizer(vocab.pre)))

    # --- what the vocabulary says

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.vocab.ids.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self.vocab.ids.get("eos")

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @property
    def sep_id(self) -> int | None:
        return self.vocab.ids.get("sep")

    @property
    def add_sep(self) -> bool:
        return self.vocab.add_sep

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.vocab.eog_ids

    def token_text(self, token: int) -> str:
        """The token's string as stored in the vocabulary."""
        return self.vocab.tokens[self._check(token)]

    def token_type(self, token: int) -> int:
        """The GGUF token type as stored: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte."""
        return int(self.vocab.types[self._check(token)])

    def is_special(self, token: int) -> bool:
        """Control, user-defined, unknown or unused (after llama.cpp's by-text adjustments)."""
        return bool(self.vocab.attr_list[self._check(token)] & SPECIAL_ATTRS)

    # --- text -> ids

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        text = valid_text(text)
        parts = self._specials(parse_special).split(text)
        if self.vocab.kind == "wpm":  # llama.cpp: [CLS] text [SEP] whatever the flags say
            return [self.bos_id] * add_special + self._engine.encode_parts(parts) + [self.sep_id] * add_special
        ids = [self.bos_id] if add_special and self.add_bos else []
        ids += self._engine.encode_parts(parts)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def _specials(self, parse_special: bool) -> SpecialMatcher:
        return self._parse_specials if parse_special else self._plain_specials

    @cached_property
    def _parse_specials(self) -> SpecialMatcher:
        return special_matcher(self.vocab, parse_special=True)

    # --- ids -> text

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token; control and unknown tokens are empty unless `special`."""
        if not special and self.vocab.attr_list[self._check(token)] & HIDDEN_UNLESS_SPECIAL:
            return b""
        piece = self._pieces[token]
        if piece is None:
            piece = self._pieces[token] = token_piece(self.vocab, token)
        return piece

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Whole-sequence decode; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.token_to_piece(i, special) for i in ids).decode("utf-8", "replace")

    def stream_decoder(self, special: bool = False, shown: frozenset[int] = frozenset()) -> IncrementalDecoder:
        return IncrementalDecoder(self, special, shown)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The bytes each token stands for (special tokens: their text), for grammar tries."""
        return all_token_pieces(self.vocab)

    def _check(self, token: int) -> int:
        if not 0 <= token < len(self.vocab.tokens):
            raise TokenizerError(f"token id {token} is outside the vocabulary ({self.vocab.n_vocab} tokens)")
        return token


def special_matcher(v: Vocab, parse_special: bool) -> SpecialMatcher:
    """llama.cpp matches user-defined tokens always, control and unknown ones only with parse_special."""
    wanted = int(Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)
    hidden = 0 if parse_special else int(Attr.CONTROL | Attr.UNKNOWN)
    ids = np.flatnonzero((v.attrs & wanted != 0) & (v.attrs & hidden == 0)).tolist()
    return SpecialMatcher([(i, v.tokens[i]) for i in ids])


def valid_text(text: str) -> str:
    """Lone surrogates cannot be UTF-8; like llama.cpp with invalid bytes, they become U+FFFD."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text
