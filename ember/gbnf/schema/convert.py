"""The converter: walks the schema, one rule per distinct subschema (recursion through
$ref becomes rule recursion), dispatching on JSON type to objects, arrays, strings and
numbers; $ref, allOf, anyOf/oneOf and enum/const are handled here."""
from __future__ import annotations

import json

from .arrays import array_rule
from .errors import SchemaError, pointer
from .formats import NUMERIC_FORMATS, STRING_FORMATS, schema_formats
from .keywords import (ARRAY_KEYWORDS, NUMBER_KEYWORDS, OBJECT_KEYWORDS, STRING_KEYWORDS, TYPE_NAMES,
                       canonical, checked, constraints, json_equal, json_type_matches, resolve)
from .merging import Merger
from .numbers import integer_rule, number_rule
from .objects import object_rule
from .rules import PRIMITIVE_REF, PRIMITIVES, Rules, hint
from .strings import string_rule
from .text import gbnf_literal

MAX_SCHEMA_DEPTH = 128
_BUILDERS = {"object": object_rule, "array": array_rule, "string": string_rule,
             "integer": integer_rule, "number": number_rule}


class Converter:
    """One schema's grammar. `visit` gives the rule of a subschema; the type modules call
    back into it for nested schemas, `prim` for the fixed rules, and `rules` to add theirs."""

    def __init__(self, schema, strict: bool, root: str):
        self.schema, self.strict, self.root = schema, strict, root
        self.rules = Rules()
        self.rules.reserve(root)
        self.done: dict = {}            # canonical schema -> rule name or None
        self.building: dict = {}        # canonical schema -> reserved name, while converting
        self.used_early: set = set()    # reserved names referenced before their body existed
        self.prims: dict = {}
        self.dfas: dict = {}            # string automata already written, by what they accept

    def convert(self) -> str:
        name = self.visit(self.schema, (), frozenset(), force_name=self.root)
        if name is None:
            raise SchemaError("the schema allows no value", "#")
        if name != self.root:
            self.rules.define(self.root, name)
        return self.rules.text()

    def prim(self, name: str) -> str:
        """A fixed rule (ws, string, value, ...), with the fixed rules it uses."""
        if name not in self.prims:
            self.prims[name] = self.rules.reserve(name)
            body = PRIMITIVE_REF.sub(lambda m: self.prim(m.group(1)), PRIMITIVES[name])
            self.rules.define(self.prims[name], body)
        return self.prims[name]

    def visit(self, schema, path: tuple, head: frozenset, force_name: str | None = None):
        """Rule name for `schema` (None: it allows nothing). `head` holds the schemas being
        converted since the last object/array: meeting one again is a cycle that consumes nothing."""
        if len(path) > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"schema nested deeper than {MAX_SCHEMA_DEPTH}", pointer(path))
        key = canonical(schema)
        if key in self.done:
            return self.done[key]
        if key in self.building:
            if key in head:
                raise SchemaError("$ref/allOf/anyOf cycle that never enters an object or array", pointer(path))
            self.used_early.add(self.building[key])
            return self.building[key]
        name = force_name or self.rules.reserve(hint(path))
        self.building[key] = name
        try:
            body = self._convert(schema, path, head | {key})
        finally:
            del self.building[key]
        self.done[key] = self._finish(name, body, forced=force_name is not None, path=path)
        return self.done[key]

    def _finish(self, name: str, body: str | None, forced: bool, path: tuple):
        """Defines rule `name`, unless its body is nothing or another rule's (then that)."""
        if body is None:
            if name in self.used_early:
                raise SchemaError("recursive schema allows no value", pointer(path))
            if not forced:
                self.rules.release(name)
            return None
        if not forced and name not in self.used_early:
            if self.rules.is_rule(body):
                self.rules.release(name)            # plain alias of an existing rule
                return body
            if body in self.rules.by_body:
                self.rules.release(name)
                return self.rules.by_body[body]
        self.rules.define(name, body)
        return name

    def _convert(self, schema, path: tuple, head: frozenset) -> str | None:
        if schema is True:
            return self.prim("value")
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object or a boolean, not {type(schema).__name__}",
                              pointer(path))
        schema = checked(schema, path)
        if "$ref" in schema:
            return self._ref(schema, path, head)
        if "allOf" in schema:
            return self._all_of(schema, path, head)
        if "anyOf" in schema or "oneOf" in schema:
            return self._any_of(schema, path, head)
        if "enum" in schema or "const" in schema:
            return self._enum(schema, path)
        if not constraints(schema):
            return self.prim("value")
        return self._typed(schema, path)

    def _typed(self, schema: dict, path: tuple) -> str | None:
        """One alternative per JSON type the schema allows."""
        bodies = {t: self._type_rule(t, schema, path) for t in self._types(schema, path)}
        bodies = {t: b for t, b in bodies.items() if b is not None}
        if len(bodies) <= 1:
            return next(iter(bodies.values()), None)
        names = [b if b in self.rules.bodies else self.rules.add(f"{hint(path)}-{t}", b)
                 for t, b in bodies.items()]
        return " | ".join(dict.fromkeys(names))

    def _type_rule(self, t: str, schema: dict, path: tuple) -> str | None:
        if t in ("null", "boolean"):
            return self.prim(t)
        return _BUILDERS[t](self, schema, path)

    def _types(self, schema: dict, path: tuple) -> list[str]:
        declared = schema.get("type")
        if declared is None:
            return _inferred_types(schema, path)
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names:
            raise SchemaError("'type' must be a type name or a non-empty list of them", pointer(path + ("type",)))
        out = []
        for t in names:
            if t not in TYPE_NAMES:
                raise SchemaError(f"unknown type {t!r}", pointer(path + ("type",)))
            if t not in out:
                out.append(t)
        if "number" in out and "integer" in out:
            out.remove("integer")
        return out

    # -- references and combinators

    def _ref(self, schema: dict, path: tuple, head: frozenset):
        rest = constraints(schema)
        del rest["$ref"]
        if rest:                                  # siblings of $ref apply too (2019-09+)
            return self._all_of({"allOf": [{"$ref": schema["$ref"]}, rest]}, path, head)
        target, where = resolve(self.schema, schema["$ref"], path)
        return self.visit(target, where, head)

    def _all_of(self, schema: dict, path: tuple, head: frozenset):
        merged = Merger(self.schema, path).merge([schema])
        return self.visit(merged, path + ("allOf",), head)

    def _any_of(self, schema: dict, path: tuple, head: frozenset):
        rest = constraints(schema)
        if "anyOf" in rest and "oneOf" in rest:
            return self._all_of({"allOf": [{"anyOf": rest.pop("anyOf")}, rest]}, path, head)
        key = "anyOf" if "anyOf" in rest else "oneOf"   # oneOf is treated as anyOf
        branches = rest.pop(key)
        if not isinstance(branches, list) or not branches:
            raise SchemaError(f"'{key}' must be a non-empty list", pointer(path + (key,)))
        alternatives = []
        for i, branch in enumerate(branches):
            sub = {"allOf": [rest, branch]} if rest else branch
            rule = self.visit(sub, path + (key, str(i)), head)
            if rule is not None and rule not in alternatives:
                alternatives.append(rule)
        return " | ".join(alternatives) if alternatives else None

    # -- fixed values

    def _enum(self, schema: dict, path: tuple):
        values = _enum_values(schema, path)
        others = set(constraints(schema)) - {"enum", "const", "type"}
        if others:
            raise SchemaError(f"'{min(others)}' next to enum/const is not supported", pointer(path))
        if "type" in schema:
            types = self._types(schema, path)
            values = [v for v in values if any(json_type_matches(v, t) for t in types)]
        literals = dict.fromkeys(self._value_gbnf(v) for v in values)
        return " | ".join(literals) if literals else None

    def _value_gbnf(self, value) -> str:
        """One fixed JSON value: scalars as compact json.dumps, containers with `ws` layout."""
        if not isinstance(value, (list, dict)):
            return gbnf_literal(json.dumps(value, ensure_ascii=False))
        ws = self.prim("ws")
        if not value:
            open_, close = ("[", "]") if isinstance(value, list) else ("{", "}")
            return f'"{open_}" {ws} "{close}"'
        if isinstance(value, list):
            inner = f' "," {ws} '.join(self._value_gbnf(v) for v in value)
            return f'"[" {ws} {inner} {ws} "]"'
        inner = f' "," {ws} '.join(
            f'{gbnf_literal(json.dumps(k, ensure_ascii=False))} ":" {ws} {self._value_gbnf(v)}'
            for k, v in value.items())
        return f'"{{" {ws} {inner} {ws} "}}"'


def _inferred_types(schema: dict, path: tuple) -> list[str]:
    """Without 'type', keep only the types whose keywords appear (a subset of what is
    valid: {"properties": ...} yields objects only); no typed keyword: any value."""
    keys = set(schema)
    formats = schema_formats(schema, path)
    out = []
    if keys & OBJECT_KEYWORDS:
        out.append("object")
    if keys & ARRAY_KEYWORDS:
        out.append("array")
    if keys & STRING_KEYWORDS or any(f in STRING_FORMATS for f in formats):
        out.append("string")
    if keys & NUMBER_KEYWORDS or any(f in NUMERIC_FORMATS for f in formats):
        out.append("number")
    return out or ["object", "array", "string", "number", "boolean", "null"]


def _enum_values(schema: dict, path: tuple) -> list:
    values = None
    if "enum" in schema:
        if not isinstance(schema["enum"], list):
            raise SchemaError("'enum' must be a list", pointer(path + ("enum",)))
        values = list(schema["enum"])
    if "const" in schema:
        c = schema["const"]
        values = [c] if values is None else [v for v in values if json_equal(v, c)]
    for v in values:
        canonical(v)                                   # rejects NaN/inf and non-JSON
    return values
