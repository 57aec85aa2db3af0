"""allOf (and $ref with siblings) merged into one schema, keyword by keyword; anyOf/oneOf
inside are distributed over the branches."""
from __future__ import annotations

import itertools

from .errors import SchemaError, pointer
from .keywords import (ABSENT, FORMATS, OBJECT_KEYWORDS, PATTERNS, TYPE_NAMES, canonical, checked,
                       constraints, json_equal, resolve)
from .patterns import pattern_matches

MAX_ANYOF_PRODUCT = 64       # branches produced by distributing anyOf through allOf
_LOWER_BOUNDS = frozenset({"minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum"})
_UPPER_BOUNDS = frozenset({"maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum"})
_SHAPES = (OBJECT_KEYWORDS - {"minProperties", "maxProperties", "required"}) \
    | {"items", "prefixItems", "additionalItems"}           # merged by _merge_objects/_arrays


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_list_of_str(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_COUNTS = frozenset({"minLength", "minItems", "minProperties", "maxLength", "maxItems", "maxProperties"})
# What a value must be for merging to read it, and the error if it is not.
_MERGEABLE = {
    **{k: (_is_number, "must be a non-negative integer" if k in _COUNTS else "must be a number")
       for k in _LOWER_BOUNDS | _UPPER_BOUNDS},
    "type": (lambda v: isinstance(v, str) or _is_list_of_str(v), "must be a type name or a non-empty list of them"),
    "required": (_is_list_of_str, "must be a list of strings"),
    "enum": (lambda v: isinstance(v, list), "must be a list"),
    PATTERNS: (lambda v: isinstance(v, list), "must be a list"),
    FORMATS: (lambda v: isinstance(v, list), "must be a list"),
}


def all_of(*schemas):
    """The conjunction of schemas, `true` left out."""
    schemas = [s for s in schemas if s is not True]
    if not schemas:
        return True
    return schemas[0] if len(schemas) == 1 else {"allOf": list(schemas)}


def property_schema(name: str, props: dict, patterns: dict, additional):
    """What the value of key `name` must satisfy (properties + matching patternProperties,
    else additionalProperties)."""
    parts = [props[name]] if name in props else []
    parts += [s for p, s in patterns.items() if pattern_matches(p, name)]
    if not parts:
        parts = [additional]
    return parts[0] if len(parts) == 1 else {"allOf": parts}


class Merger:
    """Flattens allOf/$ref into one schema (False: no value fits); `root` resolves $refs."""

    def __init__(self, root, path: tuple):
        self.root, self.path = root, path

    def merge(self, schemas: list):
        parts, choices = [], []
        for s in schemas:
            if self._flatten(s, parts, choices, ()) is False:
                return False
        if choices:
            combos = list(itertools.islice(itertools.product(*choices), MAX_ANYOF_PRODUCT + 1))
            if len(combos) > MAX_ANYOF_PRODUCT:
                raise SchemaError(f"allOf of anyOf/oneOf expands to more than {MAX_ANYOF_PRODUCT} branches",
                                  pointer(self.path))
            return {"anyOf": [{"allOf": parts + list(c)} for c in combos]}
        return self._combine(parts)

    def _flatten(self, schema, parts: list, choices: list, refs: tuple):
        """Appends the constraints of `schema` to parts, its anyOf/oneOf lists to choices."""
        if schema is True or schema is False:
            return schema
        if not isinstance(schema, dict):
            raise SchemaError("allOf entries must be schemas", pointer(self.path))
        rest = constraints(checked(schema, self.path))
        if "$ref" in rest and self._flatten_ref(rest.pop("$ref"), parts, choices, refs) is False:
            return False
        subs = rest.pop("allOf", [])
        if not isinstance(subs, list):
            raise SchemaError("'allOf' must be a list", pointer(self.path))
        for sub in subs:
            if self._flatten(sub, parts, choices, refs) is False:
                return False
        for key in ("anyOf", "oneOf"):
            if key in rest:
                branches = rest.pop(key)
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(f"'{key}' must be a non-empty list", pointer(self.path))
                choices.append(branches)
        if rest:
            parts.append(rest)
        return True

    def _flatten_ref(self, ref, parts: list, choices: list, refs: tuple):
        if ref in refs:
            raise SchemaError(f"$ref {ref!r} includes itself through allOf", pointer(self.path))
        target, _ = resolve(self.root, ref, self.path)
        return self._flatten(target, parts, choices, refs + (ref,))

    def _combine(self, parts: list):
        out: dict = {}
        for part in parts:
            for key, value in part.items():
                if key in _SHAPES:
                    continue
                if key not in out:
                    out[key] = value
                elif self._merge_value(out, key, value) is False:
                    return False
        self._merge_objects(parts, out)
        self._merge_arrays(parts, out)
        for key in ("enum", PATTERNS, FORMATS):
            if key in out:
                self._check(key, out[key])
        return _fold_lists(out)

    def _check(self, key: str, value):
        """SchemaError (where the merged schema's own check would point) for a value that
        merging cannot read."""
        test, what = _MERGEABLE.get(key, (None, ""))
        if test is not None and not test(value):
            raise SchemaError(f"'{key}' {what}", pointer(self.path + ("allOf", key)))

    def _merge_value(self, out: dict, key: str, value):
        """Merges a keyword met twice into out[key]; False when the two cannot both hold."""
        old = out[key]
        self._check(key, old)
        self._check(key, value)
        if key in _LOWER_BOUNDS:
            out[key] = max(old, value)
        elif key in _UPPER_BOUNDS:
            out[key] = min(old, value)
        elif key == "type":
            return _merge_types(out, old, value)
        elif key == "required":
            out[key] = list(dict.fromkeys(list(old) + list(value)))
        elif key == "enum":
            out[key] = [v for v in old if any(json_equal(v, w) for w in value)]
        elif key == "const":
            return json_equal(old, value)
        elif key == "uniqueItems":
            out[key] = bool(old or value)
        elif key in ("pattern", "format"):
            if old != value:
                out.setdefault(PATTERNS if key == "pattern" else FORMATS, []).append(value)
        elif key in (PATTERNS, FORMATS):
            out[key] = list(old) + list(value)
        else:
            raise SchemaError(f"cannot merge '{key}' in allOf", pointer(self.path))
        return True

    def _merge_objects(self, parts: list, out: dict):
        shaped = [p for p in parts if {"properties", "patternProperties", "additionalProperties"} & set(p)]
        if not shaped:
            return
        for p in shaped:
            for key in ("properties", "patternProperties"):
                if not isinstance(p.get(key, {}), dict):
                    raise SchemaError(f"'{key}' must be an object", pointer(self.path + ("allOf", key)))
        with_patterns = [p for p in shaped if p.get("patternProperties")]
        if len({canonical(p["patternProperties"]) for p in with_patterns}) > 1:
            raise SchemaError("allOf with different patternProperties in more than one branch",
                              pointer(self.path))
        names = list(dict.fromkeys(n for p in shaped for n in p.get("properties", {})))
        out["properties"] = {name: _merged_property(name, shaped) for name in names}
        extras = [p["additionalProperties"] for p in shaped
                  if "additionalProperties" in p and not p.get("patternProperties")]
        if with_patterns:
            own = with_patterns[0].get("additionalProperties", ABSENT)
            out["patternProperties"] = {pat: all_of(s, *extras) for pat, s in
                                        with_patterns[0]["patternProperties"].items()}
            if own is not ABSENT:
                extras.append(own)
        if extras:
            out["additionalProperties"] = all_of(*extras)

    def _merge_arrays(self, parts: list, out: dict):
        shaped = []
        for p in parts:
            items = p.get("items", ABSENT)
            if isinstance(items, list):
                shaped.append((items, p.get("additionalItems", ABSENT)))
            elif "prefixItems" in p or "items" in p:
                if not isinstance(p.get("prefixItems", []), list):
                    raise SchemaError("'prefixItems' must be a list", pointer(self.path + ("allOf",)))
                shaped.append((p.get("prefixItems", []), items))
        if not shaped:
            return
        length = max(len(prefix) for prefix, _ in shaped)
        prefix = []
        for i in range(length):
            needs = [pre[i] if i < len(pre) else rest for pre, rest in shaped
                     if i < len(pre) or rest is not ABSENT]
            prefix.append(all_of(*needs))
        rests = [rest for _, rest in shaped if rest is not ABSENT]
        if prefix:
            out["prefixItems"] = prefix
        if rests:
            out["items"] = all_of(*rests)


def _merged_property(name: str, shaped: list):
    """The value schema of property `name` under every object-shaping part that speaks of it."""
    needs = []
    for p in shaped:
        if name in p.get("properties", {}) or p.get("patternProperties") or "additionalProperties" in p:
            needs.append(property_schema(name, p.get("properties", {}), p.get("patternProperties", {}),
                                         p.get("additionalProperties", True)))
    return needs[0] if len(needs) == 1 else {"allOf": needs}


def _merge_types(out: dict, old, value):
    a = {old} if isinstance(old, str) else set(old)
    b = {value} if isinstance(value, str) else set(value)
    both = (a & b) | ({"integer"} if ("integer" in a and "number" in b)
                      or ("number" in a and "integer" in b) else set())
    if not both:
        return False
    out["type"] = [t for t in TYPE_NAMES if t in both]
    return True


def _fold_lists(out: dict) -> dict:
    """Drops merged patterns/formats equal to the schema's own; const becomes a one-value enum."""
    if "pattern" in out and PATTERNS in out:
        out[PATTERNS] = [p for p in out[PATTERNS] if p != out["pattern"]]
    if "format" in out and FORMATS in out:
        out[FORMATS] = [f for f in out[FORMATS] if f != out["format"]]
    if "const" in out:
        out["enum"] = [v for v in out.get("enum", [out["const"]]) if json_equal(v, out["const"])]
        del out["const"]
    return out
