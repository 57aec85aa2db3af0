"""Tokenizers built from GGUF metadata (byte-level BPE and SentencePiece), equal to llama.cpp's;
an incremental detokenizer; chat templates in `ember.tokenizer.chat`."""
from .decode import IncrementalDecoder
from .errors import TokenizerError
from .tokenizer import Tokenizer

__all__ = ["Tokenizer", "IncrementalDecoder", "TokenizerError"]
