r"""Pre-tokenizer regexes for byte-level BPE, chosen by tokenizer.ggml.pre as llama.cpp chooses them.

Each entry is a list of patterns applied in turn: every pattern splits the pieces left by
the previous one, and text a pattern does not match stays a piece of its own. The patterns
are llama.cpp's (the facts our tokenization must reproduce), written for the Oniguruma
engine behind Hugging Face `tokenizers`; two adaptations keep the meaning:
- llama.cpp's `$` only ever sees the end of a piece, Oniguruma's also matches before "\n": `\z`.
- Patterns without \p{..} run in llama.cpp on text whose non-ASCII spaces became "\v", so
  literal ranges there (U+0800-U+4E00 spans U+3000, U+200A, ...) never match a space: `&&[^\s]`.
- llama.cpp's std::regex sees every non-ASCII letter as one stand-in character that is neither
  [a-z] nor [A-Z]; Oniguruma agrees for the `(?=[\p{L}])([^a-z])` forms used below.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import TokenizerError

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER = r"(?:(?=[\p{L}])[^a-z])"   # llama.cpp's stand-in for [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
_LOWER = r"(?:(?=[\p{L}])[^A-Z])"   # ... and for [\p{Ll}\p{Lm}\p{Lo}\p{M}]
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
         rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

DEFAULT_PATTERNS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
STARCODER_PATTERNS = (r"\p{N}", GPT2)

_DEEPSEEK_LETTERS = (  # cased letters, as escapes: Unicode normalisation would change some of them
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]]+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
DEEPSEEK_LLM_PATTERNS = ("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+",
                         "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002&&[^\\s]]+",
                         r"\s+\z", _CJK_HANGUL, r"\p{N}+")
DEEPSEEK_CODER_PATTERNS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
DEEPSEEK3_PATTERNS = (r"\p{N}{1,3}", _CJK_KANA,
                      r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                      r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FALCON_PATTERNS = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    patterns: tuple[str, ...]
    ignore_merges: bool = False   # a piece that is a whole token is taken as is
    add_bos: bool = False         # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_LLAMA3 = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2,))
_GPT2 = PreTokenizer((GPT2,))
_STARCODER = PreTokenizer(STARCODER_PATTERNS)
_GPT4O = PreTokenizer((GPT4O,))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(DEFAULT_PATTERNS),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), PreTokenizer((LLAMA3,))),
    "deepseek-llm": PreTokenizer(DEEPSEEK_LLM_PATTERNS),
    "deepseek-coder": PreTokenizer(DEEPSEEK_CODER_PATTERNS),
    "deepseek-v3": PreTokenizer(DEEPSEEK3_PATTERNS),
    "falcon": PreTokenizer(FALCON_PATTERNS),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4", "trillion",
                     "granite-docling"), _GPT2),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
                     "mellum2"), _STARCODER),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open"), _QWEN2),
    "qwen35": PreTokenizer((QWEN35,)),
    "seed-coder": PreTokenizer((SEED_CODER,)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((BLOOM,))),
    "viking": PreTokenizer((BLOOM, r"\p{N}")),
}


def pre_tokenizer(pre: str) -> PreTokenizer:
    """The pre-tokenizer for a tokenizer.ggml.pre value ("" when the file has none: llama.cpp's default)."""
    found = PRE_TOKENIZERS.get(pre or "default")
    if found is None:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise TokenizerError(f"tokenizer.ggml.pre '{pre}' is not supported; known: {known}")
    return found
