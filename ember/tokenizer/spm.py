"""SentencePiece-style BPE (tokenizer.ggml.model "llama"), merging as llama.cpp does.

llama.cpp's algorithm: the text (spaces already shown as "▁") starts as one symbol per
character; repeatedly, of all adjacent pairs whose concatenation is a token, the one whose
token has the highest score is merged, the leftmost on ties; at the end a symbol that is
not a token is written as byte tokens <0xNN>.

Two facts make this fast enough in Python:
- A merge never joins two characters that appear next to each other in no token. Every
  "▁" that follows another character starts such a boundary (in practice all tokens hold
  "▁" only at their start), so the text splits into word-sized chunks that merge
  independently; the few characters some token does show before a "▁" are read from the
  vocabulary and keep their chunk together.
- Words repeat: each distinct chunk is merged once and remembered.
Hugging Face `tokenizers` could run the same merges from pairs derived from the scores,
but deriving ~500k pairs and building its model takes over 2 s for Gemma's 262k tokens.
"""
from __future__ import annotations

import heapq
import re

from .errors import TokenizerError

SPACE = "\u2581"  # ▁, SentencePiece's visible space
_CACHE_LIMIT = 1 << 17  # distinct chunks remembered (about 30 MB at most)
_CACHED_LENGTH = 64     # longer chunks (no spaces: CJK, base64) rarely repeat and are not kept
_SHORT = 6              # up to this many characters, rescanning beats a priority queue


class SpmEngine:
    """Raw text -> token ids, for SentencePiece vocabularies with scores."""

    def __init__(self, token_to_id: dict[str, int], scores: list[float], unk_id: int | None,
                 add_space_prefix: bool):
        self._add_space_prefix = add_space_prefix
        self._ids = token_to_id
        self._scores = scores  # (n_vocab,) merge priority of each token
        self._byte_ids = byte_token_ids(token_to_id, unk_id)
        self._chunker = chunk_pattern(token_to_id)
        self._cache: dict[str, list[int]] = {}

    def encode_parts(self, parts: list[str | int]) -> list[int]:
        """Raw text pieces and special token ids (in text order) -> ids.

        With add_space_prefix, llama.cpp puts a space in front of raw text at the start and
        after every special token.
        """
        ids: list[int] = []
        after_special = True
        for p in parts:
            if isinstance(p, str):
                if self._add_space_prefix and after_special:
                    p = " " + p
                ids += self.encode(p.replace(" ", SPACE))
                after_special = False
            else:
                ids.append(p)
                after_special = True
        return ids

    def encode(self, text: str) -> list[int]:
        """`text` with spaces already escaped as "▁"."""
        out: list[int] = []
        cache = self._cache
        for chunk in self._chunker.split(text):
            ids = cache.get(chunk)
            if ids is None:
                ids = self._merge(chunk)
                if len(chunk) <= _CACHED_LENGTH:
                    if len(cache) >= _CACHE_LIMIT:
                        cache.clear()
                    cache[chunk] = ids
            out += ids
        return out

    def _merge(self, chunk: str) -> list[int]:
        if not chunk:
            return []
        merge = merge_short if len(chunk) <= _SHORT else merge_long
        pieces = merge(chunk, self._ids, self._scores)
        out: list[int] = []
        for piece in pieces:
            i = self._ids.get(piece)
            if i is not None:
                out.append(i)
            else:
                out += self._bytes_of(piece)
        return out

    def _bytes_of(self, piece: str) -> list[int]:
        ids = [self._byte_ids[b] for b in piece.encode("utf-8", "surrogatepass")]
        if None in ids:
            raise TokenizerError(f"cannot tokenize {piece!r}: no byte token for it and no unknown token")
        return ids


def merge_short(chunk: str, ids: dict[str, int], scores: list[float]) -> list[str]:
    """The merge loop by rescanning all pairs: fastest for the few characters of a word."""
    syms = list(chunk)
    while len(syms) > 1:
        best, best_score = -1, 0.0
        for k in range(len(syms) - 1):
            i = ids.get(syms[k] + syms[k + 1])
            if i is not None and (best < 0 or scores[i] > best_score):
                best, best_score = k, scores[i]
        if best < 0:
            break
        syms[best:best + 2] = [syms[best] + syms[best + 1]]
    return syms


def merge_long(chunk: str, ids: dict[str, int], scores: list[float]) -> list[str]:
    """The same merges with a priority queue over a linked list of symbols (n log n)."""
    text = list(chunk)
    n = len(text)
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, length of the pair)

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            pair = text[left] + text[right]
            i = ids.get(pair)
            if i is not None:
                heapq.heappush(heap, (-scores[i], left, right, len(pair)))

    for k in range(n - 1):
        push(k, k + 1)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        a, b = text[left], text[right]
        if not a or not b or len(a) + len(b) != size:
            continue  # one side has changed since this pair was queued
        text[left], text[right] = a + b, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    return [t for t in text if t]


def byte_token_ids(token_to_id: dict[str, int], unk_id: int | None) -> list[int | None]:
    """Byte -> its fallback token: "<0xNN>", else the byte as a one-character token, else unk."""
    out = []
    for b in range(256):
        i = token_to_id.get(f"<0x{b:02X}>")
        if i is None:
            i = token_to_id.get(chr(b), unk_id)
        out.append(i)
    return out


def chunk_pattern(token_to_id: dict[str, int]) -> re.Pattern:
    """Split before each "▁" that follows a character no token shows in front of a "▁"."""
    joined = "\x00".join(token_to_id)
    glued = {c for c in re.findall(f"([^{SPACE}]){SPACE}", joined)} - {"\x00"}
    keep = "".join(re.escape(c) for c in sorted(glued))
    return re.compile(f"(?<=[^{SPACE}{keep}])(?={SPACE})")
