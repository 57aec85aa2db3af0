"""The vocabulary as GGUF metadata describes it, with llama.cpp's reading of it.

GGUF token types (tokenizer.ggml.token_type): 1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte. llama.cpp turns them into attribute bits and then
adjusts a few by token text (end-of-generation tokens become control, control tokens
named "unused" become unused, ...); tokenization and decoding follow the adjusted bits,
so we keep both: `types` as the file says, `attrs` as llama.cpp uses them.
"""
from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import TokenizerError
from .pretokenize import pre_tokenizer

log = logging.getLogger(__name__)

# tokenizer.ggml.model -> the algorithm
MODEL_KINDS = {"gpt2": "bpe", "llama": "spm", "bert": "wpm"}


class Attr(enum.IntFlag):
    """llama.cpp's token attribute bits (llama_token_attr)."""
    UNDEFINED = 0
    UNKNOWN = 1
    UNUSED = 2
    NORMAL = 4
    CONTROL = 8
    USER_DEFINED = 16
    BYTE = 32


# index = GGUF token type (0 undefined .. 6 byte)
_TYPE_TO_ATTR = np.array([Attr.UNDEFINED, Attr.NORMAL, Attr.UNKNOWN, Attr.CONTROL,
                          Attr.USER_DEFINED, Attr.UNUSED, Attr.BYTE], np.uint8)

_BYTE_TOKEN = re.compile("<0x[0-9A-Fa-f]{2}>")

# Token texts that end generation, as llama.cpp recognises them; they also become control tokens.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
# Fill-in-the-middle tokens, found by text when the metadata does not name them: all become
# control tokens; pad, repo and file-separator also end generation.
FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
FIM_EOG = ("fim_pad", "fim_rep", "fim_sep")
# gpt-oss channel markers: llama.cpp always renders them (user-defined).
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

SPECIAL_KEYS = {  # role -> metadata key
    "bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id", "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id", "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id", "mask": "tokenizer.ggml.mask_token_id",
    "fim_pre": "tokenizer.ggml.fim_pre_token_id", "fim_suf": "tokenizer.ggml.fim_suf_token_id",
    "fim_mid": "tokenizer.ggml.fim_mid_token_id", "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id", "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}
# SentencePiece files follow LLaMA's numbering when the metadata is silent (llama.cpp does the same).
SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unk": 0}
# ...and WordPiece files BERT's ([CLS] is BOS, [SEP] the separator).
WPM_DEFAULT_IDS = {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103}


@dataclass(slots=True)
class Vocab:
    kind: str                      # "bpe", "spm" or "wpm"
    pre: str                       # tokenizer.ggml.pre ("" when absent)
    tokens: list[str]              # token texts (surrogate-escaped where not UTF-8)
    types: np.ndarray              # (n_vocab,) int32, GGUF token types as stored
    attrs: np.ndarray              # (n_vocab,) uint8, Attr bits after llama.cpp's adjustments
    scores: np.ndarray | None      # (n_vocab,) float32, SPM merge priorities
    merges: list[str] | None       # BPE merges "left right", in rank order
    token_to_id: dict[str, int]
    ids: dict[str, int]            # special roles present: bos, eos, unk, eot, ...
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    add_sep: bool = False          # the separator after a text (and between a rerank query and document)
    lowercase: bool = True         # WordPiece: lowercase the text, and strip accents (strip_accents)
    strip_accents: bool = True
    eog_ids: frozenset[int] = field(default_factory=frozenset)
    attr_list: list[int] = field(default_factory=list)  # attrs as Python ints, for fast lookups

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


def vocab_from_metadata(md: dict[str, Any]) -> Vocab:
    """Read and check the tokenizer.* keys."""
    kind = model_kind(md)
    tokens = string_list(md, "tokenizer.ggml.tokens")
    n = len(tokens)
    types = numeric_array(md, "tokenizer.ggml.token_type", n, np.int32)
    scores = numeric_array(md, "tokenizer.ggml.scores", n, np.float32)
    if kind == "spm" and scores is None:
        raise TokenizerError("SentencePiece tokenizer without tokenizer.ggml.scores")
    merges = string_list(md, "tokenizer.ggml.merges") if kind == "bpe" else None
    if not all(tokens):
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for empty tokens
    token_to_id = index_tokens(tokens)
    if types is None:
        types = np.ones(n, np.int32)
    attrs = _TYPE_TO_ATTR[np.where((types >= 0) & (types < len(_TYPE_TO_ATTR)), types, 0)]
    check_byte_tokens(tokens, attrs)
    ids = special_ids(md, kind, n)
    add_bos, add_eos = add_bos_eos(md)
    add_space_prefix = kind == "spm" and flag(md, "tokenizer.ggml.add_space_prefix", True)
    for role, wanted in (("bos", add_bos), ("eos", add_eos)):
        if wanted and role not in ids:
            raise TokenizerError(f"tokenizer.ggml.add_{role}_token is true, "
                                 f"but {SPECIAL_KEYS[role]} is not set")
    vocab = Vocab(kind, md.get("tokenizer.ggml.pre", "") or "", tokens, types, attrs, scores, merges,
                  token_to_id, ids, add_bos, add_eos, add_space_prefix, flag(md, "tokenizer.ggml.add_sep_token", kind == "wpm"))
    if kind == "wpm":
        vocab.lowercase = flag(md, "tokenizer.ggml.normalizer.lowercase", True)
        vocab.strip_accents = flag(md, "tokenizer.ggml.normalizer.strip_accents", vocab.lowercase)
    adjust_by_text(vocab)
    vocab.attr_list = vocab.attrs.tolist()
    return vocab


def check_byte_tokens(tokens: list[str], attrs: np.ndarray) -> None:
    """Byte tokens must read "<0xNN>": decoding takes their byte from the text."""
    for i in np.flatnonzero(attrs == int(Attr.BYTE)).tolist():
        if not _BYTE_TOKEN.fullmatch(tokens[i]):
            raise TokenizerError(f"token {i} {tokens[i]!r} has type byte but is not written <0xNN>")


def add_bos_eos(md: dict[str, Any]) -> tuple[bool, bool]:
    """Whether BOS/EOS are added: the metadata's flags, else llama.cpp's defaults
    (BOS for SentencePiece and for some BPE pre-tokenizers such as llama3, never EOS)."""
    kind = model_kind(md)
    default_bos = kind in ("spm", "wpm") or (kind == "bpe" and pre_tokenizer(md.get("tokenizer.ggml.pre", "")).add_bos)
    return (flag(md, "tokenizer.ggml.add_bos_token", default_bos),
            flag(md, "tokenizer.ggml.add_eos_token", False))


def model_kind(md: dict[str, Any]) -> str:
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("no tokenizer in this file: tokenizer.ggml.model is missing")
    if model not in MODEL_KINDS:
        raise TokenizerError(f"tokenizer.ggml.model '{model}' is not supported "
                             f"(supported: {', '.join(MODEL_KINDS)})")
    return MODEL_KINDS[model]


def string_list(md: dict[str, Any], key: str) -> list[str]:
    value = md.get(key)
    if value is None:
        raise TokenizerError(f"{key} is missing")
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value[:16]):
        raise TokenizerError(f"{key} must be an array of strings, got {type(value).__name__}")
    if not value:
        raise TokenizerError(f"{key} is empty")
    return value


def numeric_array(md: dict[str, Any], key: str, n: int, dtype) -> np.ndarray | None:
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind not in "iuf":
        raise TokenizerError(f"{key} must be a numeric array, got {type(value).__name__}")
    if len(value) != n:
        raise TokenizerError(f"{key} has {len(value)} entries for {n} tokens")
    return value.astype(dtype, copy=False)


def index_tokens(tokens: list[str]) -> dict[str, int]:
    token_to_id = dict(zip(tokens, range(len(tokens))))
    if len(token_to_id) != len(tokens):
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise TokenizerError(f"duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}")
            seen[t] = i
    return token_to_id


def flag(md: dict[str, Any], key: str, default: bool) -> bool:
    value = md.get(key, default)
    if not isinstance(value, (bool, np.bool_)):
        raise TokenizerError(f"{key} must be a bool, got {value!r}")
    return bool(value)


def special_ids(md: dict[str, Any], kind: str, n: int) -> dict[str, int]:
    """Ids of the special roles; BOS/EOS outside the vocabulary are an error, others are dropped."""
    ids = dict(SPM_DEFAULT_IDS) if kind == "spm" else dict(WPM_DEFAULT_IDS) if kind == "wpm" else {}
    ids = {role: i for role, i in ids.items() if i < n}
    for role, key in SPECIAL_KEYS.items():
        value = md.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TokenizerError(f"{key} must be an integer, got {value!r}")
        if 0 <= value < n:
            ids[role] = int(value)
        elif role in ("bos", "eos"):
            raise TokenizerError(f"{key} = {value} is outside the vocabulary ({n} tokens)")
        else:
            log.warning("%s = %d is outside the vocabulary (%d tokens); ignored", key, value, n)
    return ids


def adjust_by_text(v: Vocab) -> None:
    """llama.cpp's by-text corrections to token attributes, and the end-of-generation set."""
    attrs, find = v.attrs, v.token_to_id.get
    for role, texts in FIM_TEXTS.items():
        if role not in v.ids:
            found = next((find(t) for t in texts if t in v.token_to_id), None)
            if found is not None:
                v.ids[role] = found
                attrs[found] |= Attr.CONTROL
    mark_unused(v)
    eog = {v.ids[r] for r in FIM_EOG if r in v.ids}
    for text in EOG_TEXTS:
        i = find(text)
        if i is not None:
            eog.add(i)
            attrs[i] |= Attr.CONTROL
    for text in ALWAYS_RENDERED:
        i = find(text)
        if i is not None:
            attrs[i] = Attr.USER_DEFINED
    eog.update(v.ids[r] for r in ("eos", "eot", "eom") if r in v.ids)
    v.eog_ids = frozenset(drop_conflicting_eog(v, eog))


def mark_unused(v: Vocab) -> None:
    """Control tokens named "...unused..." are unused ones."""
    control = np.flatnonzero(v.attrs & int(Attr.CONTROL)).tolist()
    unused = [i for i in control if "unused" in v.tokens[i]]
    v.attrs[unused] |= int(Attr.UNUSED)


def drop_conflicting_eog(v: Vocab, eog: set[int]) -> set[int]:
    """Two llama.cpp workarounds: "<|end|>" does not end a harmony turn, "</s>" not a Gemma 4 one."""
    texts = {v.tokens[i]: i for i in eog}
    harmony = {"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()
    if harmony and "<|end|>" in texts:
        eog.discard(texts["<|end|>"])
        v.attrs[texts["<|end|>"]] = Attr.USER_DEFINED
    if "<|tool_response>" in texts and "</s>" in texts:
        eog.discard(texts["</s>"])
        v.attrs[texts["</s>"]] = Attr.NORMAL
    return eog
