"""Schema keywords: which are known, which only annotate, how their values are read, and
how a local $ref resolves."""
from __future__ import annotations

import json
from urllib.parse import unquote

from .errors import SchemaError, pointer

ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "default", "$comment", "$schema", "$id",
    "$anchor", "$dynamicAnchor", "$vocabulary", "readOnly", "writeOnly", "deprecated",
    "contentEncoding", "contentMediaType", "contentSchema", "discriminator", "externalDocs",
    "$defs", "definitions"})
TYPE_NAMES = ("null", "boolean", "object", "array", "number", "integer", "string")
PATTERNS = "ember:patterns"           # merged allOf patterns (internal)
FORMATS = "ember:formats"             # merged allOf formats (internal)
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", PATTERNS})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "patternProperties",
                             "minProperties", "maxProperties"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems",
                            "uniqueItems"})
COMBINATORS = frozenset({"$ref", "allOf", "anyOf", "oneOf"})
VALUE_KEYWORDS = frozenset({"type", "enum", "const", "format", FORMATS})
SUPPORTED = (STRING_KEYWORDS | NUMBER_KEYWORDS | OBJECT_KEYWORDS | ARRAY_KEYWORDS
             | COMBINATORS | VALUE_KEYWORDS)
ABSENT = object()                     # a keyword that is not there (None is JSON null)

_TYPE_CHECKS = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def is_annotation(key: str) -> bool:
    return key in ANNOTATIONS or key.startswith("x-")


def constraints(schema: dict) -> dict:
    """The schema without its annotations."""
    return {k: v for k, v in schema.items() if not is_annotation(k)}


def checked(schema: dict, path: tuple) -> dict:
    """The schema with draft-4 bounds in today's form; SchemaError on an unknown keyword."""
    for key in schema:
        if not isinstance(key, str):
            raise SchemaError("schema keys must be strings", pointer(path))
        if key not in SUPPORTED and not is_annotation(key):
            raise SchemaError(f"unsupported keyword '{key}'", pointer(path + (key,)))
    try:
        return _normalize_draft4(schema)
    except SchemaError as e:
        raise SchemaError(e.message, pointer(path)) from None


def _normalize_draft4(schema: dict) -> dict:
    """Draft-4 boolean exclusiveMinimum/Maximum -> the numeric form."""
    out = schema
    for key, base in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        flag = out.get(key)
        if isinstance(flag, bool):
            out = dict(out)
            del out[key]
            if flag:
                if base not in out:
                    raise SchemaError(f"'{key}': true needs '{base}'")
                out[key] = out.pop(base)
    return out


def canonical(schema) -> str:
    """One text per JSON value (keys sorted); SchemaError for what JSON cannot hold."""
    try:
        return json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"schema is not JSON: {e}") from None


def json_equal(a, b) -> bool:
    """JSON equality: 1 == 1.0, but true != 1; objects by keys, arrays in order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def json_type_matches(value, type_name: str) -> bool:
    return _TYPE_CHECKS[type_name](value)


def count(schema: dict, key: str, path: tuple, default):
    """A non-negative integer keyword (minLength, maxItems, ...); `default` when absent."""
    if key not in schema:
        return default
    v = schema[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SchemaError(f"'{key}' must be a non-negative integer", pointer(path + (key,)))
    return v


def dict_of_schemas(schema: dict, key: str, path: tuple) -> dict:
    value = schema.get(key, {})
    if not isinstance(value, dict):
        raise SchemaError(f"'{key}' must be an object", pointer(path + (key,)))
    return value


def string_list(schema: dict, key: str, path: tuple) -> list:
    """A list of strings, duplicates dropped."""
    value = schema.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SchemaError(f"'{key}' must be a list of strings", pointer(path + (key,)))
    return list(dict.fromkeys(value))


def resolve(root, ref, path: tuple):
    """The schema a local $ref points to inside `root`, and its path."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"only local $ref ('#...') is supported, not {ref!r}", pointer(path + ("$ref",)))
    target, where = root, ()
    fragment = ref[1:]
    if fragment and not fragment.startswith("/"):
        raise SchemaError(f"$ref {ref!r}: anchors are not supported", pointer(path + ("$ref",)))
    for raw in fragment.split("/")[1:]:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise SchemaError(f"$ref {ref!r} does not resolve", pointer(path + ("$ref",)))
        where += (part,)
    return target, where
