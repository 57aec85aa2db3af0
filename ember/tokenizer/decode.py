"""Token ids -> bytes -> text, as llama.cpp's token_to_piece renders tokens."""
from __future__ import annotations

import codecs
import re

from .bpe import UNICODE_TO_BYTE
from .spm import SPACE
from .vocab import Attr, Vocab

HIDDEN_UNLESS_SPECIAL = int(Attr.CONTROL | Attr.UNKNOWN)  # a plain int: tested for every token sent (enum & ~0.7 us)
# GPT-2 byte characters -> the Latin-1 character of their byte, so that encode("latin-1") gives the bytes
_TO_LATIN1 = {ord(c): b for c, b in UNICODE_TO_BYTE.items()}
_OUTSIDE_BYTE_TABLE = re.compile("[^" + "".join(re.escape(c) for c in UNICODE_TO_BYTE) + "]")


def token_piece(v: Vocab, token: int) -> bytes:
    """The bytes a token stands for when special tokens are shown.

    Control, unknown and user-defined tokens are their text; byte tokens their byte; normal
    tokens their text with "▁" as space (SentencePiece) or GPT-2's byte characters turned
    back into bytes (byte-level BPE). Anything else (unused, undefined) renders as nothing.
    """
    attr, text = v.attr_list[token], v.tokens[token]
    if attr & (HIDDEN_UNLESS_SPECIAL | Attr.USER_DEFINED):
        return text.encode("utf-8", "surrogateescape")
    if attr & Attr.NORMAL:
        if v.kind in ("spm", "wpm"):
            return text.replace(SPACE, " ").encode("utf-8", "surrogateescape")
        return byte_level_bytes(text)
    if attr & Attr.BYTE:
        return bytes([int(text[3:5], 16)])
    return b""


def all_token_pieces(v: Vocab) -> list[bytes]:
    """token_piece() for every token, with the common cases done in bulk."""
    if v.kind in ("spm", "wpm"):
        pieces = [t.replace(SPACE, " ").encode("utf-8", "surrogateescape") for t in v.tokens]
    else:
        pieces = [byte_level_bytes(t) for t in v.tokens]
    for i in (v.attrs != Attr.NORMAL).nonzero()[0].tolist():
        pieces[i] = token_piece(v, i)
    return pieces


def byte_level_bytes(text: str) -> bytes:
    """GPT-2 byte characters -> bytes; a character outside the table passes through as UTF-8.

    (llama.cpp writes "[UNK_BYTE_0x..]" for such characters; real vocabularies have none.)
    """
    if not _OUTSIDE_BYTE_TABLE.search(text):
        return text.translate(_TO_LATIN1).encode("latin-1")
    return b"".join(bytes([UNICODE_TO_BYTE[c]]) if c in UNICODE_TO_BYTE
                    else c.encode("utf-8", "surrogateescape") for c in text)


class IncrementalDecoder:
    """Token ids in, text out, never splitting a UTF-8 sequence.

    Bytes of an incomplete character are held back until the rest arrives; bytes that can
    never form a character come out as U+FFFD at once, so nothing is held forever.
    flush() ends the stream (a held-back incomplete tail becomes U+FFFD).
    """

    def __init__(self, tokenizer, special: bool = False, shown: frozenset[int] = frozenset()):
        self._piece = tokenizer.token_to_piece  # (token, special) -> bytes
        self._special = special
        self._shown = shown  # special tokens written as text even without `special`
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._utf8.decode(self._piece(token, self._special or token in self._shown))

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
