"""Bounds-checked sequential reads from a buffer; every failure names its byte offset.

`context` arguments say what is being read ("metadata key", "value of 'k'", ...); they
only go into error messages.
"""
from __future__ import annotations

import struct

import numpy as np

from .errors import GGUFError

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Cursor:
    """A read position in `buf` (the file's mmap). Reads never run past `size`."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def error(self, problem: str, at: int | None = None) -> GGUFError:
        return GGUFError(problem, offset=self.pos if at is None else at)

    def past_end(self, what: str, at: int | None = None, context: str = "") -> GGUFError:
        where = f", in {context}" if context else ""
        return self.error(f"{what} runs past end of file (size {self.size}){where}", at)

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.remaining:
            raise self.past_end(f"{what} ({nbytes} bytes)")

    def check_count(self, count: int, min_bytes: int, what: str, at: int,
                    context: str = "") -> None:
        """Reject a count whose elements cannot fit in the bytes left, before allocating."""
        if count * min_bytes > self.remaining:
            where = f", in {context}" if context else ""
            raise self.error(f"{what} {count} cannot fit in the {self.remaining} bytes left "
                             f"(size {self.size}){where}", at)

    def unpack(self, fmt: struct.Struct, what: str):
        self.need(fmt.size, what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def u32(self, what: str) -> int:
        return self.unpack(_U32, what)

    def u64(self, what: str) -> int:
        return self.unpack(_U64, what)

    def raw(self, nbytes: int, what: str) -> bytes:
        self.need(nbytes, what)
        start, self.pos = self.pos, self.pos + nbytes
        return self.buf[start:self.pos]

    def string(self, context: str, limit: int | None = None) -> str:
        """A u64-length-prefixed string of at most `limit` bytes; undecodable bytes
        survive as surrogates."""
        at = self.pos
        n = self.u64(f"string length of {context}")
        if n > self.remaining:
            raise self.past_end(f"string length {n}", at, context)
        if limit is not None and n > limit:
            raise self.error(f"string length {n} exceeds the limit of {limit} bytes, in {context}",
                             at)
        start, self.pos = self.pos, self.pos + n
        return str(self.buf[start:self.pos], "utf-8", "surrogateescape")

    def strings(self, count: int, context: str) -> list[str]:
        """`count` strings in a row: the vocabulary's hot loop, so it is written flat."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = [""] * count
        i = 0
        try:
            for i in range(count):
                (n,) = unpack(buf, pos)
                start = pos + 8
                end = start + n
                if end > size:
                    raise self.past_end(f"string length {n}", pos, f"{context}[{i}]")
                out[i] = str(buf[start:end], "utf-8", "surrogateescape")
                pos = end
        except struct.error:
            raise self.past_end("string length (8 bytes)", pos, f"{context}[{i}]") from None
        self.pos = pos
        return out

    def array(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        """A zero-copy, read-only numpy view of `count` values at the cursor."""
        self.need(count * dtype.itemsize, what)
        view = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += count * dtype.itemsize
        return view
