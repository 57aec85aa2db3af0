"""WordPiece (BERT's tokenizer) as llama.cpp runs it on a GGUF vocabulary.

The GGUF vocabulary writes a word-initial piece with a leading "▁" and a continuation piece bare
(BERT's "##" dropped). Text is split into words (BERT's basic tokenizer: whitespace ends a word,
punctuation, ASCII symbols and CJK ideographs are words of their own, control characters dropped;
lowercased and accents stripped where the vocabulary says so), each word prefixed with "▁" and
cut greedily into the longest pieces the vocabulary has; a word with a part no piece matches
becomes the unknown token.
"""
from __future__ import annotations

import unicodedata

SPACE = "\u2581"
CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
       (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in CJK)


def lower(ch: str) -> str:
    """One code point's simple lowercase (a special-case expansion such as "İ" -> "i̇" keeps its first)."""
    low = ch.lower()
    return low[0] if low else ch


def words(text: str, lowercase: bool = True, strip_accents: bool = True) -> list[str]:
    """BERT's basic tokenizer, in llama.cpp's reading of the Unicode categories."""
    if strip_accents:
        text = unicodedata.normalize("NFD", text)
    out, word = [], []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch.isspace():
            if word:
                out.append("".join(word))
                word = []
            continue
        if ch in ("\0", "\ufffd") or cat[0] == "C" or (strip_accents and cat[0] == "M"):
            continue
        s = lower(ch) if lowercase else ch
        if cat[0] == "P" or (ord(ch) < 0x7F and cat[0] == "S") or is_cjk(ord(ch)):
            if word:
                out.append("".join(word))
                word = []
            out.append(s)
        else:
            word.append(s)
    if word:
        out.append("".join(word))
    return out


class WpmEngine:
    def __init__(self, token_to_id: dict[str, int], unk_id: int | None, lowercase: bool = True,
                 strip_accents: bool = True):
        self.token_to_id, self.unk_id = token_to_id, unk_id
        self.lowercase, self.strip_accents = lowercase, strip_accents
        self.max_len = max(len(t) for t in token_to_id)

    def encode_word(self, word: str) -> list[int]:
        """The longest-match pieces of "▁" + word, or [unk] where some part matches no piece."""
        w, ids, i = SPACE + word, [], 0
        while i < len(w):
            for j in range(min(len(w), i + self.max_len), i, -1):
                found = self.token_to_id.get(w[i:j])
                if found is not None:
                    ids.append(found)
                    i = j
                    break
            else:
                return [self.unk_id] if self.unk_id is not None else []
        return ids

    def encode(self, text: str) -> list[int]:
        return [i for word in words(text, self.lowercase, self.strip_accents) for i in self.encode_word(word)]

    def encode_parts(self, parts: list[str | int]) -> list[int]:
        """Raw text pieces and special token ids (in text order) -> ids."""
        ids: list[int] = []
        for p in parts:
            ids += self.encode(p) if isinstance(p, str) else [p]
        return ids
