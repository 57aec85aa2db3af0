"""Reading request bodies: JSON parsing and typed field access that names the field on failure.

Small explicit checks instead of a schema framework: each getter takes the field name, a
default for absent (or null) values and bounds, and raises a 400 `APIError` whose `param`
is the field's path.
"""
from __future__ import annotations

import json
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
    return value


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
