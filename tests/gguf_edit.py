"""Edited copies of real GGUF files, for tests of what the loader refuses and how bad weights fail.

`EditableCopy` copies a file once and patches bytes in place (a metadata value of the same size,
a tensor's dimensions, bytes of tensor data), restoring them after each edit: cheap enough to try
many mutations of a 250 MB file. `rewrite` writes a new file with the `gguf` package (metadata
replaced or dropped, tensors added or dropped) for changes that move bytes.
"""
from __future__ import annotations

import shutil
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ember.gguf_loader import GGUFFile
from ember.gguf_loader.constants import ValueType
from ember.gguf_loader.cursor import Cursor
from ember.gguf_loader.file import read_counts, read_version
from ember.gguf_loader.metadata import read_metadata
from ember.gguf_loader.tensors import read_tensor_records

SCALAR = {"u8": (ValueType.U8, "B"), "i8": (ValueType.I8, "b"), "u16": (ValueType.U16, "H"),
          "i16": (ValueType.I16, "h"), "u32": (ValueType.U32, "I"), "i32": (ValueType.I32, "i"),
          "f32": (ValueType.F32, "f"), "u64": (ValueType.U64, "Q"), "i64": (ValueType.I64, "q"),
          "f64": (ValueType.F64, "d"), "bool": (ValueType.BOOL, "?")}


class EditableCopy:
    """A copy of a GGUF file whose header values and tensor bytes can be changed in place."""

    def __init__(self, src: Path, dst: Path):
        shutil.copyfile(src, dst)
        self.path = dst
        with GGUFFile(dst) as f:
            self.offsets = {name: (t.offset, t.nbytes) for name, t in f.tensors.items()}
            header_bytes = f.data_offset
        with open(dst, "rb") as fh:
            header = fh.read(header_bytes)
        cur = Cursor(header, len(header))
        read_version(cur)
        n_tensors, n_kv = read_counts(cur)
        _, self.types, key_at = read_metadata(cur, n_kv)
        self.records = {r.name: r for r in read_tensor_records(cur, n_tensors)}
        # where each key's type id is (its value follows): key offset + u64 length + key bytes
        self.type_at = {k: at + 8 + len(k.encode()) for k, at in key_at.items()}

    @contextmanager
    def edit(self):
        """Edits made inside are undone on leaving (close every model of the file first)."""
        saved: list[tuple[int, bytes]] = []

        def write(at: int, data: bytes) -> None:
            with open(self.path, "r+b") as fh:
                fh.seek(at)
                saved.append((at, fh.read(len(data))))
                fh.seek(at)
                fh.write(data)

        try:
            yield _Editor(self, write)
        finally:
            with open(self.path, "r+b") as fh:
                for at, data in reversed(saved):
                    fh.seek(at)
                    fh.write(data)


class _Editor:
    def __init__(self, copy: EditableCopy, write):
        self.copy, self.write = copy, write

    def set(self, key: str, value: Any, type_name: str | None = None) -> None:
        """A scalar metadata value; type_name may change the type to another of the same size."""
        old = self.copy.types[key]
        type_name = type_name or old
        (_, old_fmt), (vtype, fmt) = SCALAR[old], SCALAR[type_name]
        if struct.calcsize(fmt) != struct.calcsize(old_fmt):
            raise ValueError(f"{key}: {type_name} is not the size of {old}")
        at = self.copy.type_at[key]
        self.write(at, struct.pack("<I", int(vtype)) + struct.pack("<" + fmt, value))

    def set_dims(self, tensor: str, ne: tuple[int, ...]) -> None:
        """A tensor's dimensions (ggml order), as many as it has."""
        r = self.copy.records[tensor]
        if len(ne) != len(r.ne):
            raise ValueError(f"{tensor} has {len(r.ne)} dimensions")
        self.write(r.dims_at, struct.pack(f"<{len(ne)}Q", *ne))

    def set_bytes(self, tensor: str, offset: int, data: bytes) -> None:
        """Bytes of a tensor's data, from `offset` within it."""
        start, nbytes = self.copy.offsets[tensor]
        if offset + len(data) > nbytes:
            raise ValueError(f"{tensor} has {nbytes} bytes")
        self.write(start + offset, data)

    def set_raw(self, at: int, data: bytes) -> None:
        """Bytes anywhere in the file."""
        self.write(at, data)


def rewrite(src: Path, dst: Path, metadata: dict[str, tuple[Any, str]] | None = None, drop: tuple[str, ...] = (),
            tensors: dict[str, np.ndarray] | None = None, raw_types: dict[str, int] | None = None) -> Path:
    """A new file: src's metadata with `metadata` entries (value, type name such as "u32" or
    "array[string]") replacing or adding keys and `drop` keys removed; its tensors with `tensors`
    replacing or adding ones (arrays as the gguf writer takes them; quantized ones as uint8 rows
    with their type in `raw_types`)."""
    metadata, tensors, raw_types = metadata or {}, tensors or {}, raw_types or {}
    with GGUFFile(src) as f:
        w = gguf.GGUFWriter(str(dst), f.metadata["general.architecture"])
        kept = {k: (v, f.metadata_types[k]) for k, v in f.metadata.items()
                if k not in drop and k != "general.architecture"}
        for key, (value, type_name) in {**kept, **metadata}.items():
            _add_value(w, key, value, type_name)
        for name, t in f.tensors.items():
            if name not in tensors:
                w.add_tensor(name, t.array(), raw_dtype=gguf.GGMLQuantizationType(int(t.type)))
        for name, array in tensors.items():
            raw = raw_types.get(name)
            w.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType(raw) if raw is not None else None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return dst


def _add_value(w: gguf.GGUFWriter, key: str, value: Any, type_name: str) -> None:
    vt = gguf.GGUFValueType
    if type_name.startswith("array["):
        inner = type_name[len("array["):-1]
        sub = vt.STRING if inner == "string" else vt(int(SCALAR[inner][0]))
        items = list(value) if inner == "string" else np.asarray(value).tolist()
        w.add_key_value(key, items, vt.ARRAY, sub_type=sub)
    elif type_name == "string":
        w.add_key_value(key, value, vt.STRING)
    else:
        w.add_key_value(key, value.item() if hasattr(value, "item") else value, vt(int(SCALAR[type_name][0])))


def requantized(src: Path, dst: Path, qtype: int, only: int | None = None) -> Path:
    """A copy of src whose quantized 2-D weights (those of type `only`, or all) are requantized to
    `qtype` through float32 (ember's quantizers): the same model at another precision, with the
    same vocabulary (a target and draft pair)."""
    from ember.quant import GGMLType
    from ember.quant.codec import dequantize, quantize

    tensors, raw_types = {}, {}
    with GGUFFile(src) as f:
        for name, t in f.tensors.items():
            kind = int(t.type)
            if len(t.shape) != 2 or kind in (int(GGMLType.F32), qtype) or only not in (None, kind):
                continue
            values = dequantize(t.array(), kind, (t.shape[0], t.shape[1]))
            tensors[name], raw_types[name] = quantize(values, qtype), qtype
    return rewrite(src, dst, tensors=tensors, raw_types=raw_types)
