"""Reading request bodies: JSON parsing and typed field access that names the field on failure.

Small explicit checks instead of a schema framework: each getter takes the field name, a
default for absent (or null) values and bounds, and raises a 400 `APIError` whose `param`
is the field's path.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .errors import APIError, invalid

_ABSENT = object()


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object; 400 for anything else."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                       code="invalid_json") from None
    except (RecursionError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(value)}", code="invalid_json")
    check_unicode(value)
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(body: dict) -> None:
    """400 naming the first string that holds a lone surrogate: JSON's \\ud800 escapes decode to
    text that has no UTF-8 form, so it could reach neither the tokenizer nor a reply."""
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if _bad(key):
                    raise _surrogate_error(path, key, "a key")
                if isinstance(item, (str, dict, list)):
                    stack.append((item, path + (key,)))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((item, path + (i,)))
        elif _bad(value):
            raise _surrogate_error(path, value, "")


def _bad(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _surrogate_error(path: tuple, text: str, what: str) -> APIError:
    param = field_path(path) or None
    where = (f"{what} in {param}" if param else f"{what} of the body") if what else param
    at = _SURROGATE.search(text)
    return APIError(400, f"{where or 'the body'} holds a lone surrogate (\\u{ord(at.group()):04x}) at character "
                    f"{at.start()}; text must be valid Unicode (a surrogate pair must be complete)",
                    param=param, code="invalid_unicode")


def field_path(parts: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


class Fields:
    """Typed reads of one JSON object; `path` prefixes the names in errors ("tools[0].function")."""

    def __init__(self, data: Any, path: str = ""):
        if not isinstance(data, dict):
            raise invalid(path or None, f"{path or 'the body'} must be an object, got {_kind(data)}", "invalid_type")
        self.data, self.path = data, path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def _get(self, key: str, ok, what: str) -> Any:
        """The value, _ABSENT when missing or null, or 400 when `ok` rejects it."""
        value = self.data.get(key)
        if value is None:
            return _ABSENT
        if not ok(value):
            raise invalid(self.name(key), f"{self.name(key)} must be {what}, got {_kind(value)}", "invalid_type")
        return value

    def _typed(self, key: str, default: Any, ok, what: str) -> Any:
        value = self._get(key, ok, what)
        return default if value is _ABSENT else value

    def bool(self, key: str, default: bool | None = False) -> bool | None:
        return self._typed(key, default, lambda v: isinstance(v, bool), "true or false")

    def str(self, key: str, default: str | None = None) -> str | None:
        return self._typed(key, default, lambda v: isinstance(v, str), "a string")

    def int(self, key: str, default: int | None = None, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self._get(key, _is_integer, "an integer")
        if value is _ABSENT:
            return default
        _check_range(self.name(key), int(value), lo, hi)
        return int(value)

    def object(self, key: str) -> Fields | None:
        value = self._typed(key, None, lambda v: isinstance(v, dict), "an object")
        return None if value is None else Fields(value, self.name(key))

    def list(self, key: str, default: list | None = None) -> list | None:
        return self._typed(key, default, lambda v: isinstance(v, list), "an array")

    def strings(self, key: str, max_items: int | None = None) -> tuple[str, ...]:
        """A string or an array of strings (OpenAI's `stop`)."""
        value = self._typed(key, (), lambda v: isinstance(v, (str, list)), "a string or an array of strings")
        items = (value,) if isinstance(value, str) else tuple(value)
        for i, s in enumerate(items):
            if not isinstance(s, str):
                raise invalid(f"{self.name(key)}[{i}]", f"{self.name(key)} entries must be strings, got {_kind(s)}",
                              "invalid_type")
        if max_items is not None and len(items) > max_items:
            raise invalid(self.name(key), f"{self.name(key)} takes at most {max_items} entries, got {len(items)}")
        return items

    def choice(self, key: str, options: tuple[str, ...], default: str | None = None) -> str | None:
        value = self.str(key, default)
        if value is not None and value not in options:
            raise invalid(self.name(key), f"{self.name(key)} must be one of {', '.join(options)}; got {value!r}")
        return value


def _is_integer(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and v.is_integer())


def _check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise invalid(name, f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise invalid(name, f"{name} must be <= {hi}, got {value}")
