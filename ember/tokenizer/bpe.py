"""Byte-level BPE (tokenizer.ggml.model "gpt2") on Hugging Face `tokenizers`.

llama.cpp splits text with the pre-tokenizer's regexes, maps every byte to a printable
character (GPT-2's byte-to-unicode table) and merges adjacent symbols by merge rank, lowest
first, leftmost first on ties. `tokenizers` does exactly that with a BPE model built from
the GGUF vocabulary and merges, `Split` pre-tokenizers for the regexes and a `ByteLevel`
step without a regex of its own; it is fast (Rust) and is already a dependency.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from .errors import TokenizerError
from .pretokenize import PreTokenizer


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable Latin-1 bytes stand for themselves, the rest map to U+0100 upwards."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = (b for b in range(256) if b not in table)
    table.update((b, chr(0x100 + n)) for n, b in enumerate(extra))
    return table


_MISSING = "\x00ember: byte not in vocabulary\x00"  # not a byte-level string, so never a real token
BYTE_TO_UNICODE = byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def parse_merges(merges: list[str], token_to_id: dict[str, int]) -> list[tuple[str, str]]:
    """Merge strings "left right" -> pairs, first occurrence wins (llama.cpp's rank).

    The separator is the first space after the first character (a left part may be a space).
    A merge whose result is not a token could only produce an unknown symbol; it is left out.
    """
    pairs, seen = [], set()
    for i, m in enumerate(merges):
        cut = m.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {m!r} has no space between its two parts")
        pair = (m[:cut], m[cut + 1:])
        if pair in seen or pair[0] + pair[1] not in token_to_id:
            continue
        if pair[0] not in token_to_id or pair[1] not in token_to_id:
            continue
        seen.add(pair)
        pairs.append(pair)
    return pairs


def plain_pairs(merges: list[str]) -> list[tuple[str, str]] | None:
    """The merges as pairs when every one is plainly "left right" (one space, neither part empty) and
    none repeats; else None (then parse_merges, which also drops merges of unknown tokens, decides)."""
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 or not p[0] or not p[1] for p in pairs) or len(set(pairs)) != len(pairs):
        return None
    return pairs


LONG_TEXT = 1 << 14  # characters; tokenizing longer text lets other threads (a server's event loop) run


def check_byte_level(tokens: list[str]) -> None:
    """Byte-level tokens are text of printable characters: one that is not valid UTF-8 (its bytes
    were read surrogate-escaped) comes from a damaged file."""
    try:
        "".join(tokens).encode("utf-8")
    except UnicodeEncodeError:
        i, bad = next((i, t) for i, t in enumerate(tokens) if not t.isascii() and _surrogates(t))
        raw = bad.encode("utf-8", "surrogateescape")
        raise TokenizerError(f"tokenizer.ggml.tokens[{i}] is not valid UTF-8 ({raw!r}): the file is damaged") from None


def _surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


class BpeEngine:
    """Raw text -> token ids, for byte-level BPE vocabularies."""

    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre: PreTokenizer):
        check_byte_level(list(token_to_id))
        # A byte whose character is not in the vocabulary yields no token in llama.cpp, but it
        # stays a symbol while merging, so its neighbours do not merge across it. A stand-in
        # unknown token (one id past the vocabulary, dropped afterwards) does the same here.
        self._missing = len(token_to_id)
        vocab = {**token_to_id, _MISSING: self._missing}
        options = dict(unk_token=_MISSING, ignore_merges=pre.ignore_merges, fuse_unk=False, byte_fallback=False)
        pairs = plain_pairs(merges)  # the common case, parsed fast; `tokenizers` checks the tokens exist
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, **options) if pairs is not None else None
        except Exception:  # a merge of tokens the vocabulary lacks: keep only the usable ones
            bpe = None
        if bpe is None:
            bpe = models.BPE(vocab=vocab, merges=parse_merges(merges, token_to_id), **options)
        self._tok = Tokenizer(bpe)
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre.patterns]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        self._tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])

    def encode_parts(self, parts: list[str | int]) -> list[int]:
        """Raw text pieces and special token ids (in text order) -> ids."""
        ids: list[int] = []
        for p in parts:
            if isinstance(p, str):
                ids += self.encode(p)
            else:
                ids.append(p)
        return ids

    def encode(self, text: str) -> list[int]:
        if len(text) > LONG_TEXT:  # encode_batch lets go of the interpreter lock while it works, encode does not
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        return [i for i in ids if i != self._missing] if self._missing in ids else ids
