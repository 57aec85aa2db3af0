"""Merging a split GGUF (llama.cpp's gguf-split output, NAME-00001-of-0000N.gguf ...) into one file.

Every part is a GGUF file of its own: the first carries the model's metadata, each carries the
split.* keys and a run of the tensors. The merged file keeps the first part's metadata entries
byte for byte (without split.*), lists every part's tensor records in order with new data
offsets, and copies the tensor data; it is then an ordinary single-file GGUF.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from .constants import MAGIC
from .cursor import Cursor
from .errors import GGUFError
from .file import GGUFFile, align_up, read_counts, read_version
from .metadata import read_metadata
from .tensors import read_tensor_records

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


@dataclass(frozen=True, slots=True)
class _Part:
    version: int
    alignment: int
    metadata: dict
    entries: list[tuple[str, bytes]]  # each metadata entry's bytes, in file order
    records: list[tuple[bytes, int, int]]  # (record bytes without its data offset, data start, nbytes)
    mapped: mmap.mmap


def merge_split(paths: list[Path], out: BinaryIO, on_bytes: Callable[[int], None] = lambda n: None) -> None:
    """Write the model split over `paths` (in part order) to `out` as one GGUF file."""
    parts = [_read_part(p) for p in paths]
    try:
        _check_parts(parts, paths)
        first = parts[0]
        entries = [raw for key, raw in first.entries if key not in SPLIT_KEYS]
        records = [r for part in parts for r in part.records]
        out.write(MAGIC + struct.pack("<IQQ", first.version, len(records), len(entries)))
        out.writelines(entries)
        offset = 0
        for raw, _, nbytes in records:
            offset = align_up(offset, first.alignment)
            out.write(raw + struct.pack("<Q", offset))
            offset += nbytes
        _pad(out, first.alignment)
        for part in parts:
            for _, start, nbytes in part.records:
                _pad(out, first.alignment)
                for at in range(start, start + nbytes, 1 << 22):
                    chunk = part.mapped[at:min(at + (1 << 22), start + nbytes)]
                    out.write(chunk)
                    on_bytes(len(chunk))
    finally:
        for part in parts:
            part.mapped.close()


def _read_part(path: Path) -> _Part:
    with GGUFFile(path) as f:  # every check of a single file, the tensors' extents included
        nbytes = {name: t.nbytes for name, t in f.tensors.items()}
        alignment, metadata = f.alignment, dict(f.metadata)
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    cur = Cursor(mm, len(mm))
    version = read_version(cur)
    n_tensors, n_kv = read_counts(cur)
    _, _, starts = read_metadata(cur, n_kv)
    bounds = list(starts.values()) + [cur.pos]
    entries = [(key, mm[bounds[i]:bounds[i + 1]]) for i, key in enumerate(starts)]
    records = read_tensor_records(cur, n_tensors)
    data = align_up(cur.pos, alignment)
    return _Part(version, alignment, metadata, entries,
                 [(mm[r.at:r.offset_at], data + r.rel_offset, nbytes[r.name]) for r in records], mm)


def _check_parts(parts: list[_Part], paths: list[Path]) -> None:
    for i, (part, path) in enumerate(zip(parts, paths)):
        no, count = part.metadata.get("split.no"), part.metadata.get("split.count")
        if (no, count) != (i, len(parts)):
            raise GGUFError(f"holds split.no {no} of {count}; expected split.no {i} of {len(parts)}",
                            path=str(path))


def _pad(out: BinaryIO, alignment: int) -> None:
    pos = out.tell()
    out.write(b"\0" * (align_up(pos, alignment) - pos))
