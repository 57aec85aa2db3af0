"""What the samplers need to know about a vocabulary: the bytes of each token (for DRY's
sequence breakers), the end-of-generation tokens (for ignore_eos) and a way to tokenize
text (for text logit biases and breakers that span tokens).

Build one per model and share it: it caches the breakers' token sequences, which take a
scan of the whole vocabulary to find.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

MAX_BREAKER_BYTES = 40  # llama.cpp truncates longer breakers
MAX_TAIL_TOKENS = 20  # and their tokenized tails


@dataclass(frozen=True, slots=True)
class DryBreakers:
    """Sequence breakers as tokens: a head token and the tails (possibly empty) that must follow it."""
    tails: dict[int, tuple[tuple[int, ...], ...]]
    single: np.ndarray  # ascending ids of tokens that break a sequence on their own

    def is_single(self, tokens: np.ndarray) -> np.ndarray:
        return np.isin(tokens, self.single)


class SamplerVocab:
    def __init__(self, pieces: Sequence[bytes] | Callable[[], Sequence[bytes]], eog_ids: Iterable[int] = (),
                 encode: Callable[[str], list[int]] | None = None, n_vocab: int | None = None):
        """`pieces`: the bytes of every token, or a function that returns them (called only
        when DRY first needs them); then `n_vocab` must be given."""
        if callable(pieces):
            if n_vocab is None:
                raise ValueError("n_vocab is needed when pieces are given as a function")
            self._pieces, self._get_pieces, self.n_vocab = None, pieces, n_vocab
        else:
            self._pieces, self._get_pieces, self.n_vocab = _as_bytes(pieces), None, len(pieces)
        self.eog_ids = np.array(sorted(set(eog_ids)), np.int64)
        self._encode = encode
        self._breakers: dict[tuple[str, ...], DryBreakers] = {}
        self._lock = threading.Lock()
        self._layout: tuple[bytes, np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer) -> SamplerVocab:
        """From anything with `token_bytes`, `eog_ids`, `n_vocab` and `encode(text, add_special=...)`
        (ember's Tokenizer). Cheap: the token bytes are fetched only when DRY needs them."""
        return cls(lambda: tokenizer.token_bytes, tokenizer.eog_ids,
                   lambda text: tokenizer.encode(text, add_special=False), n_vocab=tokenizer.n_vocab)

    @classmethod
    def of(cls, vocab) -> SamplerVocab:
        return vocab if isinstance(vocab, SamplerVocab) else cls.from_tokenizer(vocab)

    @property
    def pieces(self) -> list[bytes]:
        if self._pieces is None:
            pieces = _as_bytes(self._get_pieces())
            if len(pieces) != self.n_vocab:
                raise ValueError(f"the vocabulary has {len(pieces)} token pieces, expected {self.n_vocab}")
            self._pieces = pieces
        return self._pieces

    def encode(self, text: str) -> list[int]:
        if self._encode is None:
            raise ValueError(f"tokenizing {text!r} needs a vocabulary built with an encode function")
        return list(self._encode(text))

    def dry_breakers(self, breakers: tuple[str, ...]) -> DryBreakers:
        with self._lock:
            if breakers not in self._breakers:
                self._breakers[breakers] = self._find_breakers(breakers)
            return self._breakers[breakers]

    # ---- finding breakers: llama.cpp's rule, done with a few scans of the joined pieces ----

    def _find_breakers(self, breakers: tuple[str, ...]) -> DryBreakers:
        seqs: set[tuple[int, tuple[int, ...]]] = set()
        for text in breakers:
            seqs |= self._breaker_sequences(text.encode("utf-8")[:MAX_BREAKER_BYTES])
        tails: dict[int, list[tuple[int, ...]]] = {}
        for head, tail in sorted(seqs):
            tails.setdefault(head, []).append(tail)
        single = np.array(sorted(h for h, t in seqs if not t), np.int64)
        return DryBreakers({h: tuple(ts) for h, ts in tails.items()}, single)

    def _breaker_sequences(self, b: bytes) -> set[tuple[int, tuple[int, ...]]]:
        """A token containing the breaker breaks alone; a token ending with the breaker's first m
        bytes breaks when followed by the tokens of the rest."""
        inside = set(self._tokens_containing(b))
        seqs = {(t, ()) for t in inside}
        for m in range(1, len(b)):
            heads = [t for t in self._tokens_ending_with(b[:m]) if t not in inside]
            if heads:
                tail = tuple(self.encode(b[m:].decode("utf-8", "ignore")))[:MAX_TAIL_TOKENS]
                seqs |= {(t, tail) for t in heads}
        return seqs

    def _joined(self) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
        """(all pieces joined, end offset of each, length of each, last byte of each or -1)."""
        if self._layout is None:
            lens = np.fromiter((len(p) for p in self.pieces), np.int64, len(self.pieces))
            joined = b"".join(self.pieces)
            ends = np.cumsum(lens)
            raw = np.frombuffer(joined, np.uint8)
            last = np.where(lens > 0, raw[np.maximum(ends - 1, 0)] if raw.size else 0, -1)
            self._layout = (joined, ends, lens, last)
        return self._layout

    def _tokens_containing(self, b: bytes) -> list[int]:
        joined, ends, _, _ = self._joined()
        starts = np.array([m.start() for m in re.finditer(b"(?=" + re.escape(b) + b")", joined)], np.int64)
        if starts.size == 0:
            return []
        tok = np.searchsorted(ends, starts, side="right")
        whole = starts + len(b) <= ends[np.minimum(tok, ends.size - 1)]
        return np.unique(tok[whole & (tok < ends.size)]).tolist()

    def _tokens_ending_with(self, suffix: bytes) -> list[int]:
        _, _, lens, last = self._joined()
        maybe = np.flatnonzero((last == suffix[-1]) & (lens >= len(suffix)))
        return [t for t in maybe.tolist() if self.pieces[t].endswith(suffix)]


def _as_bytes(pieces: Sequence[bytes | str]) -> list[bytes]:
    return [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in pieces]
