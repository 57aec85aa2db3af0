"""Where draft tokens come from without a second model: what followed the current suffix before.

- `PromptLookup`: one sequence's own prompt and output (the n-gram match of prompt lookup).
- `NgramIndex`: every finished sequence's tokens, shared by all requests and bounded in bytes: a
  suffix that some other session wrote before drafts what followed it there.
- `RadixCache.continuation` (radix.py): the prefix cache's own path on past the whole context.

All work on ints and lists. A draft is only a guess: verification keeps the tokens the model
would have chosen anyway, so a hash collision or a stale entry costs speed, never correctness.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict

# suffix lengths tried, longest first: a longer match drafts more reliably (text that repeats a cycle
# of sentences parts from its earlier copies where the cycle branches; 8 tokens back do not tell which
# branch follows, 16 or 32 do)
NGRAM_SIZES = (32, 16, 8, 4, 3)
DRAFT_PER_MATCHED = 2  # tokens drafted per token of the matched suffix, at most (a short match is a weak guess)
# what one indexed token costs: 4 bytes of token, and per n-gram size a dict entry (key, value tuple)
BYTES_PER_TOKEN = 4 + 120 * len(NGRAM_SIZES)


def _key(tokens, end: int, n: int) -> int:
    """The n-gram of `tokens` ending at position `end` (inclusive), as one hash."""
    return hash(tuple(tokens[end - n + 1:end + 1]))


class PromptLookup:
    """A sequence's n-grams, each at its latest position, indexed as tokens come."""

    __slots__ = ("_maps", "_upto")

    def __init__(self):
        self._maps: list[dict[int, int]] = [{} for _ in NGRAM_SIZES]
        self._upto = 0  # n-grams ending before this position are indexed

    def find(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest earlier occurrence of the suffix."""
        self._index(tokens)
        for n, index in zip(NGRAM_SIZES, self._maps):
            if len(tokens) <= n:
                continue
            end = index.get(_key(tokens, len(tokens) - 1, n))
            if end is not None and tokens[end - n + 1:end + 1] == tokens[-n:]:
                return tokens[end + 1:end + 1 + min(limit, DRAFT_PER_MATCHED * n)]
        return []

    def _index(self, tokens: list[int]) -> None:
        """Index the n-grams that have a token after them (the suffix itself is the query)."""
        for end in range(self._upto, len(tokens) - 1):
            for n, index in zip(NGRAM_SIZES, self._maps):
                if end + 1 >= n:
                    index[_key(tokens, end, n)] = end
        self._upto = max(self._upto, len(tokens) - 1)


class NgramIndex:
    """Finished sequences' tokens (docs), each n-gram pointing at its latest doc and position.
    Oldest docs go first when the index would exceed `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_tokens = max_bytes // BYTES_PER_TOKEN
        self._docs: OrderedDict[int, array] = OrderedDict()
        self._maps: list[dict[int, tuple[int, int]]] = [{} for _ in NGRAM_SIZES]
        self._next_id = 0
        self.n_tokens = 0

    def add(self, tokens: list[int], new_from: int = 0) -> None:
        """Index `tokens`; n-grams ending before `new_from` are skipped (already indexed when an
        earlier request wrote them: a multi-turn session's history)."""
        start = max(0, new_from - NGRAM_SIZES[0])
        if len(tokens) - start < 2 or self.max_tokens < len(tokens) - start:
            return
        doc = array("i", tokens[start:])
        while self._docs and self.n_tokens + len(doc) > self.max_tokens:
            self._drop_oldest()
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self._docs[doc_id] = doc
        self.n_tokens += len(doc)
        for end in range(max(0, new_from - start - 1), len(doc) - 1):
            for n, index in zip(NGRAM_SIZES, self._maps):
                if end + 1 >= n:
                    index[_key(doc, end, n)] = (doc_id, end)

    def find(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest indexed occurrence of the suffix."""
        for n, index in zip(NGRAM_SIZES, self._maps):
            if len(tokens) < n:
                continue
            hit = index.get(_key(tokens, len(tokens) - 1, n))
            if hit is None:
                continue
            doc = self._docs[hit[0]]
            end = hit[1]
            if doc[end - n + 1:end + 1].tolist() == tokens[-n:]:
                return doc[end + 1:end + 1 + min(limit, DRAFT_PER_MATCHED * n)].tolist()
        return []

    def _drop_oldest(self) -> None:
        doc_id, doc = self._docs.popitem(last=False)
        self.n_tokens -= len(doc)
        for end in range(len(doc) - 1):
            for n, index in zip(NGRAM_SIZES, self._maps):
                if end + 1 >= n:
                    key = _key(doc, end, n)
                    if index.get(key) == (doc_id, end):
                        del index[key]

    def clear(self) -> None:
        self._docs.clear()
        for index in self._maps:
            index.clear()
        self.n_tokens = 0
