"""Fields of OpenAI's request bodies that llama-server's bodies share: sampling (by llama-server's
names, which include OpenAI's), stop strings, streaming, output constraints (response_format,
and llama-server's json_schema and grammar) and completion prompts (text, token ids, a mix of
both, {"prompt_string": text}, or a list of those). Each reads a `Fields` and names the field
in its errors.
"""
from __future__ import annotations

from dataclasses import fields as dataclass_fields
from dataclasses import replace

from ...engine.speculate import DraftParams

from ...sampler import SamplingParams
from ..core.request import Constraint, Limits, Prompts, is_id
from ..errors import invalid
from ..fields import Fields

# request keys that are sampling parameters (llama-server's names; OpenAI's are a subset)
SAMPLING_KEYS = frozenset(f.name for f in dataclass_fields(SamplingParams)) | {"temp", "typ_p"}
MAX_STOP_CHARS = 1000  # the longest stop string (the count is Limits.max_stop)


def sampling(body: Fields, limits: Limits) -> SamplingParams:
    return limits.sampling_params({k: v for k, v in body.data.items() if k in SAMPLING_KEYS and v is not None})


def speculative(body: Fields, limits: Limits) -> DraftParams | None:
    """llama-server's `speculative.n_max`, `speculative.n_min` and `speculative.p_min` (also as
    one object, `speculative: {n_max, ...}`) over the server's defaults; None where none is given."""
    nested = body.object("speculative")
    given = {}
    for key in ("n_max", "n_min", "p_min"):
        for src, name in ((nested, key), (body, f"speculative.{key}")):
            if src is None or not src.has(name):
                continue
            if key == "p_min":
                value = src.raw(name)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise invalid(src.name(name), f"{src.name(name)} must be a number", "invalid_type")
                given[key] = float(value)
            else:
                given[key] = src.int(name, lo=0, hi=256)
    if not given:
        return None
    try:
        return replace(limits.draft, **given)
    except ValueError as e:
        raise invalid("speculative", str(e)) from None


def stream(body: Fields) -> tuple[bool, bool]:
    """stream and stream_options.include_usage."""
    on = body.bool("stream", False)
    options = body.object("stream_options")
    include_usage = bool(options and options.bool("include_usage", False))
    if options is not None and not on:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    return on, include_usage


def stops(body: Fields, max_items: int) -> tuple[str, ...]:
    """`stop`: a string or up to `max_items` of them; empty ones dropped."""
    found = body.strings("stop", max_items)
    for i, s in enumerate(found):
        if len(s) > MAX_STOP_CHARS:
            name = "stop" if isinstance(body.data.get("stop"), str) else f"stop[{i}]"
            raise invalid(name, f"{name} has {len(s)} characters; a stop string may have at most {MAX_STOP_CHARS}")
    return tuple(s for s in found if s)


# ---- output constraints ----

def constraint(body: Fields) -> Constraint | None:
    """The grammar the body asks for (response_format, json_schema or grammar); at most one."""
    found = []
    fmt = body.object("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(spec)
    if body.has("json_schema"):
        found.append(Constraint.from_schema(body.raw("json_schema"), "json_schema"))
    if body.has("grammar"):
        found.append(Constraint.gbnf(body.str("grammar"), "grammar"))
    if len(found) > 1:
        raise invalid(found[1].param, f"give only one of {', '.join(c.param for c in found)}", "conflicting_fields")
    return found[0] if found else None


def _response_format(fmt: Fields) -> Constraint | None:
    kind = fmt.choice("type", ("text", "json_object", "json_schema"))
    if kind in (None, "text"):
        return None
    if kind == "json_object":  # llama-server also takes a "schema" here
        if fmt.has("schema"):
            return Constraint.from_schema(fmt.raw("schema"), "response_format", fmt.name("schema"))
        return Constraint.json_object("response_format")
    spec = fmt.object("json_schema")
    if spec is None or not spec.has("schema"):
        raise invalid(fmt.name("json_schema.schema"), "response_format json_schema needs json_schema.schema",
                      "missing_field")
    return Constraint.from_schema(spec.raw("schema"), "response_format", spec.name("schema"))


# ---- completion prompts ----

def prompt_items(body: Fields, key: str = "prompt") -> list:
    """`prompt` as the list of its prompts, counted before any is read."""
    raw = body.data.get(key)
    if raw is None:
        raise invalid(key, f"{key} is required", "missing_field")
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list, dict)) for p in raw):
        return raw
    return [raw]


def prompts(items: list, limits: Limits, key: str = "prompt") -> Prompts:
    params = [key] if len(items) == 1 else [f"{key}[{i}]" for i in range(len(items))]
    return Prompts(tuple(_parts(p, param, limits) for p, param in zip(items, params)), tuple(params))


def _parts(p, param: str, limits: Limits) -> tuple[str | int, ...]:
    if isinstance(p, dict):
        p = _prompt_object(Fields(p, param))
    parts = [p] if isinstance(p, str) else p
    if not isinstance(parts, list):
        raise invalid(param, f"{param} must be text, token ids or a mix of both", "invalid_type")
    for j, part in enumerate(parts):
        if not isinstance(part, str) and not is_id(part):
            where = f"{param}[{j}]" if parts is p else param
            raise invalid(where, f"{where} must be a token id or text", "invalid_type")
    return tuple(part if isinstance(part, str) else limits.check_token(int(part), f"{param}[{j}]")
                 for j, part in enumerate(parts))


def _prompt_object(p: Fields) -> str:
    """llama-server's {"prompt_string": text, "multimodal_data": [...]} (text only here)."""
    if p.list("multimodal_data"):
        raise invalid(p.name("multimodal_data"), "multimodal_data is not supported (text models only)", "unsupported")
    text = p.str("prompt_string")
    if text is None:
        raise invalid(p.name("prompt_string"), f"{p.name('prompt_string')} is required", "missing_field")
    return text
