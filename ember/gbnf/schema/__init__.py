"""JSON Schema -> GBNF (llama.cpp's dialect).

A grammar from `schema_to_gbnf` never accepts text that fails the schema; where exactness
needs more than a context-free grammar it accepts a documented subset of the valid texts,
and where even that is impossible it raises SchemaError naming the keyword and its place.
README.md beside this file says what is accepted, keyword by keyword, and how the package
is layered.
"""
from __future__ import annotations

import re

from .convert import Converter
from .errors import SchemaError

__all__ = ["SchemaError", "json_object_gbnf", "json_value_gbnf", "schema_to_gbnf"]


def schema_to_gbnf(schema: dict | bool, *, root: str = "root", strict: bool = True) -> str:
    """GBNF text whose rule `root` accepts JSON texts valid against `schema` (see README.md
    for the accepted subset and `strict`). Raises SchemaError."""
    _check_root(root)
    return Converter(schema, strict, root).convert()


def json_object_gbnf(*, root: str = "root") -> str:
    """Any JSON object (response_format json_object)."""
    _check_root(root)
    return Converter({"type": "object"}, False, root).convert()


def json_value_gbnf(*, root: str = "root") -> str:
    """Any JSON value."""
    _check_root(root)
    return Converter(True, False, root).convert()


def _check_root(root: str):
    if not isinstance(root, str) or not re.fullmatch(r"[A-Za-z0-9-]+", root):
        raise SchemaError(f"root rule name {root!r} must be letters, digits and '-'")
