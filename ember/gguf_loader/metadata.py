"""Reading the key/value metadata section.

Values come back as Python scalars, str, read-only numpy views (numeric and bool arrays),
list[str] (string arrays) or lists of those (nested arrays), with a type name for each.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .constants import (FIXED_DTYPES, MAX_ARRAY_DEPTH, MAX_KEY_BYTES, MIN_ELEMENT_BYTES,
                        TYPE_NAMES, ValueType)
from .cursor import Cursor
from .errors import quoted

_SCALAR_FORMATS = {t: struct.Struct("<" + c) for t, c in zip(
    (ValueType.U8, ValueType.I8, ValueType.U16, ValueType.I16, ValueType.U32, ValueType.I32,
     ValueType.F32, ValueType.U64, ValueType.I64, ValueType.F64), "BbHhIifQqd")}


def read_metadata(cur: Cursor, count: int) -> tuple[dict[str, Any], dict[str, str], dict[str, int]]:
    """`count` key/value pairs -> (values, type names, offset of each key), in file order."""
    values: dict[str, Any] = {}
    types: dict[str, str] = {}
    offsets: dict[str, int] = {}
    for _ in range(count):
        at = cur.pos
        key = cur.string("metadata key", MAX_KEY_BYTES)
        if key in values:
            raise cur.error(f"duplicate metadata key {quoted(key)}", at)
        vtype = read_type(cur, f"type of {quoted(key)}")
        values[key], types[key] = read_value(cur, vtype, f"value of {quoted(key)}")
        offsets[key] = at
    return values, types, offsets


def read_type(cur: Cursor, what: str) -> ValueType:
    at = cur.pos
    type_id = cur.u32(what)
    try:
        return ValueType(type_id)
    except ValueError:
        raise cur.error(f"unknown value type {type_id} ({what})", at) from None


def read_value(cur: Cursor, vtype: ValueType, context: str) -> tuple[Any, str]:
    """One value of type `vtype` -> (value, type name)."""
    if vtype == ValueType.STRING:
        return cur.string(context), "string"
    if vtype == ValueType.ARRAY:
        return read_array(cur, context, depth=1)
    if vtype == ValueType.BOOL:
        return read_bool(cur, context), "bool"
    return cur.unpack(_SCALAR_FORMATS[vtype], context), TYPE_NAMES[vtype]


def read_bool(cur: Cursor, context: str) -> bool:
    at = cur.pos
    byte = cur.raw(1, context)[0]
    if byte > 1:
        raise cur.error(f"bool value {byte} is neither 0 nor 1, in {context}", at)
    return bool(byte)


def read_array(cur: Cursor, context: str, depth: int) -> tuple[Any, str]:
    """An array: u32 element type, u64 count, the elements."""
    if depth > MAX_ARRAY_DEPTH:
        raise cur.error(f"arrays nested more than {MAX_ARRAY_DEPTH} deep, in {context}")
    etype = read_type(cur, f"array element type, in {context}")
    count_at = cur.pos
    count = cur.u64(f"array length of {context}")
    cur.check_count(count, MIN_ELEMENT_BYTES[etype], "array length", count_at, context)
    if etype == ValueType.STRING:
        return cur.strings(count, context), "array[string]"
    if etype == ValueType.ARRAY:
        return read_nested(cur, count, context, depth)
    values = cur.array(FIXED_DTYPES[etype], count, context)
    if etype == ValueType.BOOL:
        check_bools(cur, values, context, count_at + 8)
    return values, f"array[{TYPE_NAMES[etype]}]"


def read_nested(cur: Cursor, count: int, context: str, depth: int) -> tuple[list, str]:
    """Arrays of arrays; inner arrays may differ in type: "array[array[i32]|array[string]]"."""
    items, names = [], {}
    for i in range(count):
        value, name = read_array(cur, f"{context}[{i}]", depth + 1)
        items.append(value)
        names.setdefault(name, None)
    return items, f"array[{'|'.join(names) or 'array'}]"


def check_bools(cur: Cursor, values: np.ndarray, context: str, start: int) -> None:
    raw = values.view(np.uint8)
    bad = np.flatnonzero(raw > 1)
    if bad.size:
        i = int(bad[0])
        raise cur.error(f"bool value {raw[i]} is neither 0 nor 1, in {context}[{i}]", start + i)
