"""Output constraints a request asks for: response_format (json_object, json_schema) and
llama-server's `json_schema` and `grammar` fields, each turned into a GBNF grammar."""
from __future__ import annotations

import json
from functools import lru_cache

from ..engine.engine import GrammarSpec
from ..gbnf.schema import SchemaError, json_object_gbnf, schema_to_gbnf
from .errors import invalid
from .fields import Fields


def requested_grammar(body: Fields) -> tuple[GrammarSpec | None, str | None]:
    """The grammar the body asks for and the field it came from; at most one source."""
    found = []
    fmt = body.object("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    if body.has("json_schema"):
        found.append((schema_grammar(body.raw("json_schema"), "json_schema"), "json_schema"))
    if body.has("grammar"):
        found.append((GrammarSpec(body.str("grammar")), "grammar"))
    if len(found) > 1:
        raise invalid(found[1][1], f"give only one of {', '.join(p for _, p in found)}", "conflicting_fields")
    return found[0] if found else (None, None)


def _response_format(fmt: Fields) -> GrammarSpec | None:
    kind = fmt.choice("type", ("text", "json_object", "json_schema"))
    if kind in (None, "text"):
        return None
    if kind == "json_object":  # llama-server also takes a "schema" here
        return schema_grammar(fmt.raw("schema"), fmt.name("schema")) if fmt.has("schema") else \
            GrammarSpec(_json_object())
    spec = fmt.object("json_schema")
    if spec is None or not spec.has("schema"):
        raise invalid(fmt.name("json_schema.schema"), "response_format json_schema needs json_schema.schema",
                      "missing_field")
    return schema_grammar(spec.raw("schema"), spec.name("schema"))


def schema_grammar(schema, param: str) -> GrammarSpec:
    if not isinstance(schema, (dict, bool)):
        raise invalid(param, f"{param} must be a JSON Schema object", "invalid_type")
    try:
        return GrammarSpec(_schema_gbnf(json.dumps(schema)))
    except SchemaError as e:
        raise invalid(param, f"{param}: {e}", "invalid_json_schema") from None
    except RecursionError:
        raise invalid(param, f"{param}: the schema nests too deeply", "invalid_json_schema") from None


@lru_cache(maxsize=128)
def _schema_gbnf(schema_json: str) -> str:
    return schema_to_gbnf(json.loads(schema_json))


@lru_cache(maxsize=1)
def _json_object() -> str:
    return json_object_gbnf()
