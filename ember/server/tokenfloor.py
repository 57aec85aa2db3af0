"""A lower bound on a text's token count that costs no tokenizing, so that a prompt far too
long for the context is refused at once (tokenizing 10 MB takes seconds).

Every token stands for at most `longest` bytes of text (the longest piece in the vocabulary,
special-token text included), and every character yields at least one byte that some token
must cover, except characters the tokenizer drops: a byte-level vocabulary without a token for
some byte drops that byte, as llama.cpp does (SmolLM2 has none for \\x04, for instance). A
multi-byte character always keeps a continuation byte, so only single-byte characters can
vanish; a vocabulary missing a continuation byte gets no bound at all.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenFloor:
    longest: int  # most bytes one token stands for
    vanishing: str  # single-byte characters that yield no token

    @classmethod
    def of(cls, tokenizer) -> TokenFloor | None:
        pieces = tokenizer.token_bytes
        singles = {p[0] for p in pieces if len(p) == 1}
        if any(b not in singles for b in range(0x80, 0xC0)):
            return None
        return cls(max(map(len, pieces)), "".join(chr(b) for b in range(0x80) if b not in singles))

    def tokens(self, text: str) -> int:
        """At most as many tokens as the tokenizer gives `text` (special tokens parsed or not)."""
        kept = len(text) - sum(text.count(c) for c in self.vanishing)
        return -(-kept // self.longest)
