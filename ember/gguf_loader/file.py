"""GGUFFile: open a GGUF file read-only through mmap and parse its header."""
from __future__ import annotations

import mmap
import os
import stat
from typing import Any

from .constants import (ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MIN_KV_BYTES,
                        SUPPORTED_VERSIONS)
from .cursor import Cursor
from .errors import GGUFError
from .metadata import read_metadata
from .tensors import (Mapping, TensorInfo, Truncation, check_tensor_count, place_tensors,
                      read_tensor_records)


class GGUFFile:
    """A parsed GGUF file. Metadata is read at open; tensor data is only mapped, never read.

    A missing or unreadable path raises the usual OSError (FileNotFoundError,
    PermissionError); a directory, a non-regular file, an empty file or any malformed
    content raises GGUFError. See the package docstring for close() semantics.
    """

    path: str
    size: int  # bytes
    version: int
    alignment: int
    data_offset: int  # absolute offset of the tensor data section
    metadata: dict[str, Any]  # file order
    metadata_types: dict[str, str]  # "u32", "string", "array[string]", "array[array[i32]]"
    tensors: dict[str, TensorInfo]  # file order
    truncation: Truncation | None  # partial=True: a file cut short, whose whole tensors alone are in `tensors`

    def __init__(self, path: str | os.PathLike, partial: bool = False):
        self.path = os.fspath(path)
        self.partial = partial
        mm, self.size = map_file(self.path)
        self._mapping = Mapping(mm)
        try:
            self._parse(Cursor(mm, self.size))
        except GGUFError as e:
            self._mapping.close()
            raise e.at_path(self.path) from None
        except BaseException:
            self._mapping.close()
            raise

    def _parse(self, cur: Cursor) -> None:
        self.version = read_version(cur)
        n_tensors, n_kv = read_counts(cur)
        self.metadata, self.metadata_types, key_offsets = read_metadata(cur, n_kv)
        self.alignment = read_alignment(self.metadata, self.metadata_types, key_offsets)
        records = read_tensor_records(cur, n_tensors)
        self.data_offset = align_up(cur.pos, self.alignment)
        if records and self.data_offset > self.size:
            raise cur.error(f"data section starts at {self.data_offset}, past end of file "
                            f"(size {self.size})")
        self.tensors, self.truncation = place_tensors(
            records, self.data_offset, self.alignment, self.size, self._mapping, self.partial)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def closed(self) -> bool:
        return self._mapping.closed

    def close(self) -> None:
        """Release the mapping; safe to call twice and while numpy views still exist."""
        self._mapping.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


def map_file(path: str) -> tuple[mmap.mmap, int]:
    """Map a regular, non-empty file read-only -> (mmap, size)."""
    if os.path.isdir(path):
        raise GGUFError("is a directory, not a GGUF file", path=path)
    # O_NONBLOCK so that a FIFO given by mistake is refused instead of blocking the open.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GGUFError("not a regular file", path=path)
        if st.st_size == 0:
            raise GGUFError("file is empty", offset=0, path=path)
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), st.st_size
    finally:
        os.close(fd)


def read_version(cur: Cursor) -> int:
    magic = cur.raw(4, "magic")
    if magic != MAGIC:
        raise cur.error(f"bad magic {magic!r}, expected {MAGIC!r}: not a GGUF file", 0)
    version = cur.u32("version")
    if version in SUPPORTED_VERSIONS:
        return version
    if version == 1:
        raise cur.error("GGUF v1 is not supported (only v2 and v3); re-convert the model", 4)
    if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
        raise cur.error("big-endian GGUF files are not supported", 4)
    raise cur.error(f"unsupported GGUF version {version} (only v2 and v3)", 4)


def read_counts(cur: Cursor) -> tuple[int, int]:
    """Tensor count and key/value count, each checked against the bytes left."""
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata key/value count")
    check_tensor_count(cur, n_tensors, at=8)
    cur.check_count(n_kv, MIN_KV_BYTES, "metadata key/value count", at=16)
    return n_tensors, n_kv


def read_alignment(metadata: dict[str, Any], types: dict[str, str], offsets: dict[str, int]) -> int:
    """`general.alignment` if present (a u32 power of two), else 32."""
    if ALIGNMENT_KEY not in metadata:
        return DEFAULT_ALIGNMENT
    value, at = metadata[ALIGNMENT_KEY], offsets[ALIGNMENT_KEY]
    if types[ALIGNMENT_KEY] != "u32":
        raise GGUFError(f"{ALIGNMENT_KEY} has type {types[ALIGNMENT_KEY]}, expected u32", offset=at)
    if value <= 0 or value & (value - 1):
        raise GGUFError(f"{ALIGNMENT_KEY} {value} is not a power of two", offset=at)
    return value


def align_up(pos: int, alignment: int) -> int:
    return -(-pos // alignment) * alignment
