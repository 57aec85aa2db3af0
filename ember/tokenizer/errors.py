"""The error the tokenizer raises for unusable tokenizer metadata or input."""
from __future__ import annotations


class TokenizerError(ValueError):
    """Missing, malformed or inconsistent tokenizer metadata, or a token id out of range."""
