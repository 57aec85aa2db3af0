"""The grammar being written: named rule bodies (identical bodies share one name), the
fixed rules every schema may use (ws, string, number, value, ...), and readable names."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import GrammarLimits
from .charset import ENCODABLE, RAW_IN_STRING, chars
from .errors import SchemaError
from .numbers import EXP_DIGITS, FREE_FRAC_DIGITS, INT_DIGITS
from .text import encode_in_string, gbnf_class

MAX_RULES = GrammarLimits().max_rules
WS_INDENT = 32

PRIMITIVES = {            # fixed rules; <name> is a reference to another fixed rule
    "ws": '( " " | "\\n" ' + gbnf_class(chars(" \t")) + f'{{0,{WS_INDENT}}} )?',
    "hex": "[0-9a-fA-F]",
    "char": (gbnf_class(RAW_IN_STRING) + ' | "\\\\" ( ' + gbnf_class(chars('"\\/bfnrt'))
             + ' | "u" ( [0-9a-cA-CefEF] <hex>{3} | [dD] [0-7] <hex>{2}'
             + ' | [dD] [89abAB] <hex>{2} "\\\\u" [dD] [c-fC-F] <hex>{2} ) )'),
    "string": '"\\"" <char>* "\\""',
    "text-char": encode_in_string(ENCODABLE),       # one character, one way to write it
    "integer": f'"-"? ( "0" | [1-9] [0-9]{{0,{INT_DIGITS - 1}}} )',
    "number": (f'"-"? ( "0" | [1-9] [0-9]{{0,{INT_DIGITS - 1}}} ) ( "." [0-9]{{1,{FREE_FRAC_DIGITS}}} )?'
               f' ( [eE] {gbnf_class(chars("+-"))}? [0-9]{{1,{EXP_DIGITS}}} )?'),
    "boolean": '"true" | "false"',
    "null": '"null"',
    "value": "<object> | <array> | <string> | <number> | <boolean> | <null>",
    "object": '"{" <ws> ( <member> ( "," <ws> <member> )* <ws> )? "}"',
    "member": '<string> ":" <ws> <value>',
    "array": '"[" <ws> ( <value> ( "," <ws> <value> )* <ws> )? "]"',
}
PRIMITIVE_REF = re.compile(r"<([a-z]+)>")


@dataclass(slots=True)
class Rules:
    """Named rule bodies in creation order; identical finished bodies share one name."""
    bodies: dict = field(default_factory=dict)       # name -> body (None while reserved)
    by_body: dict = field(default_factory=dict)

    def reserve(self, hint: str) -> str:
        base = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-") or "r"
        name, k = base, 1
        while name in self.bodies:
            name, k = f"{base}-{k}", k + 1
        if len(self.bodies) >= MAX_RULES:
            raise SchemaError(f"grammar needs more than {MAX_RULES} rules")
        self.bodies[name] = None
        return name

    def define(self, name: str, body: str):
        self.bodies[name] = body
        self.by_body.setdefault(body, name)

    def add(self, hint: str, body: str) -> str:
        """The name of a rule with this body, made under `hint` unless one exists."""
        if body in self.by_body:
            return self.by_body[body]
        name = self.reserve(hint)
        self.define(name, body)
        return name

    def release(self, name: str):
        del self.bodies[name]

    def is_rule(self, text: str) -> bool:
        """Whether `text` is the name of a finished rule."""
        return self.bodies.get(text) is not None

    def text(self) -> str:
        return "".join(f"{name} ::= {body}\n" for name, body in self.bodies.items())


_SKIP_IN_HINT = {"properties", "$defs", "definitions", "allOf", "required", "patternProperties"}
_HINT_WORDS = {"items": "item", "prefixItems": "tuple", "additionalProperties": "extra",
               "additionalItems": "item"}


def hint(path: tuple) -> str:
    """A readable rule name from the last meaningful parts of a schema path."""
    words = []
    for i, part in enumerate(path):
        if part in _SKIP_IN_HINT and (i + 1 < len(path) or part == "required"):
            continue
        words.append(_HINT_WORDS.get(part, part))
    text = "-".join(words[-2:]) or "root"
    return re.sub(r"[^A-Za-z0-9-]+", "-", text).strip("-").lower()[:40] or "r"
