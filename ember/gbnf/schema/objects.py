"""Object schemas: declared members in schema order, then pairs for the other keys
(patternProperties, additionalProperties), with their keys kept apart from the declared ones."""
from __future__ import annotations

import json

from .charset import ENCODABLE, contains, minus
from .errors import SchemaError, pointer
from .keywords import ABSENT, count, dict_of_schemas, string_list
from .merging import property_schema
from .patterns import check_pattern
from .rules import hint
from .sequence import Sequence
from .strings import dfa_string, pattern_string
from .text import QUOTE, encode_in_string, gbnf_literal, group

_MAX_TRIE_DEPTH = 64         # excluded key names longer than this go through the automaton


def object_rule(conv, schema: dict, path: tuple) -> str | None:
    props = dict_of_schemas(schema, "properties", path)
    patterns = dict_of_schemas(schema, "patternProperties", path)
    for p in patterns:
        check_pattern(p, path + ("patternProperties", p))
    required = string_list(schema, "required", path)
    additional = schema.get("additionalProperties", ABSENT)
    closed_by_default = additional is ABSENT and conv.strict and bool(props or patterns)
    if additional is ABSENT:
        additional = not closed_by_default
    elif not isinstance(additional, (bool, dict)):
        raise SchemaError("'additionalProperties' must be a schema", pointer(path))
    lo = count(schema, "minProperties", path, 0)
    hi = count(schema, "maxProperties", path, None)
    if not (props or patterns or required) and additional is True and lo == 0 and hi is None:
        return conv.prim("object")
    declared = list(props) + [r for r in required if r not in props]
    # keys named only by `required` are declared too: strict mode leaves their values open
    members = _members(conv, declared, props, patterns, True if closed_by_default else additional,
                       required, path)
    if members is None:
        return None
    extra = _extra_members(conv, declared, patterns, additional, path)
    return Sequence(conv.rules, conv.prim("ws"), hint(path), "{", "}").object(members, extra, lo, hi)


def _members(conv, declared: list, props: dict, patterns: dict, additional, required: list, path: tuple):
    """(rule, required) per declared key that allows a value; None if a required one allows none."""
    members = []
    for name in declared:
        sub = property_schema(name, props, patterns, additional)
        where = path + (("properties", name) if name in props else ("required",))
        value = conv.visit(sub, where, frozenset())
        if value is None:
            if name in required:
                return None
            continue
        key = gbnf_literal(json.dumps(name, ensure_ascii=False))
        members.append((conv.rules.add(hint(where) + "-kv", f'{key} ":" {conv.prim("ws")} {value}'),
                        name in required))
    return members


def _extra_members(conv, declared: list, patterns: dict, additional, path: tuple) -> str | None:
    """One rule for any key/value pair beyond the declared keys."""
    ws = conv.prim("ws")
    alternatives = []
    for pattern, value_schema in patterns.items():
        others = tuple(p for p in patterns if p != pattern)
        where = path + ("patternProperties", pattern)
        key = _key_rule(conv, (pattern,), tuple(declared), others, where)
        value = conv.visit(value_schema, where, frozenset())
        if key is not None and value is not None:
            alternatives.append(f'{key} ":" {ws} {value}')
    if additional is not False:
        value = conv.visit(additional, path + ("additionalProperties",), frozenset())
        key = _key_rule(conv, (), tuple(declared), tuple(patterns), path)
        if key is not None and value is not None:
            alternatives.append(f'{key} ":" {ws} {value}')
    if not alternatives:
        return None
    return conv.rules.add(hint(path) + "-extra", " | ".join(alternatives))


def _key_rule(conv, patterns: tuple, excluded: tuple, excluded_patterns: tuple, path: tuple):
    """A key (quoted) matching the patterns but none of the excluded names or patterns."""
    if not excluded_patterns and not patterns:
        if not excluded:
            return conv.prim("string")
        if max(map(len, excluded)) <= _MAX_TRIE_DEPTH:
            return conv.rules.add(hint(path) + "-key", _key_not_in(conv, excluded))
    if len(patterns) == 1 and not excluded and not excluded_patterns:
        body = pattern_string(conv, patterns[0], 0, None)
        return None if body is None else conv.rules.add(hint(path) + "-key", body)
    return dfa_string(conv, patterns, tuple(sorted(excluded)), excluded_patterns, 0, None,
                      hint(path) + "-key", path)


def _key_not_in(conv, names) -> str:
    """Any key but `names`, as a trie of the names with an exit at every node (each
    character written one way, so an escaped spelling of a name cannot get through)."""
    trie: dict = {}
    for name in names:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = {}
    return f"{QUOTE} {_trie_rest(conv, trie)}"


def _trie_rest(conv, node: dict) -> str:
    """The rest of a key from a trie node: the closing quote unless a name ends here, each
    child's character, or any other character followed by anything."""
    options = [] if "" in node else [QUOTE]
    children = sorted(c for c in node if c and contains(ENCODABLE, ord(c)))
    for c in children:
        options.append(f"{encode_in_string(((ord(c), ord(c)),))} {_trie_rest(conv, node[c])}")
    others = minus(ENCODABLE, [(ord(c), ord(c)) for c in children])
    options.append(f'{encode_in_string(others)} {conv.prim("text-char")}* {QUOTE}')
    return group(options)
