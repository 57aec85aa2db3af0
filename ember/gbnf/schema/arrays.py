"""Array schemas: prefix items by position (prefixItems, or draft 4-2019 `items` lists),
then further items, with minItems/maxItems."""
from __future__ import annotations

from .errors import SchemaError, pointer
from .keywords import ABSENT, count
from .rules import hint
from .sequence import Sequence


def array_rule(conv, schema: dict, path: tuple) -> str | None:
    items = schema.get("items", ABSENT)
    if isinstance(items, list):                         # draft 4-2019 tuple form
        prefix, rest, rest_key = items, schema.get("additionalItems", ABSENT), "additionalItems"
    else:
        prefix, rest, rest_key = schema.get("prefixItems", []), items, "items"
    if not isinstance(prefix, list):
        raise SchemaError("'prefixItems' must be a list", pointer(path))
    if rest is ABSENT:
        rest = not (conv.strict and prefix)
    lo = count(schema, "minItems", path, 0)
    hi = count(schema, "maxItems", path, None)
    _check_unique(schema, hi, path)
    if not prefix and rest is True and lo == 0 and hi is None:
        return conv.prim("array")
    rules = [conv.visit(p, path + ("prefixItems", str(i)), frozenset()) for i, p in enumerate(prefix)]
    extra = conv.visit(rest, path + (rest_key,), frozenset())
    return Sequence(conv.rules, conv.prim("ws"), hint(path), "[", "]").array(rules, extra, lo, hi)


def _check_unique(schema: dict, hi: int | None, path: tuple):
    """uniqueItems is only kept when at most one item can be there."""
    unique = schema.get("uniqueItems", False)
    if not isinstance(unique, bool):
        raise SchemaError("'uniqueItems' must be a boolean", pointer(path))
    if unique and (hi is None or hi > 1):
        raise SchemaError("unsupported keyword 'uniqueItems' (true, with maxItems above 1)",
                          pointer(path + ("uniqueItems",)))
