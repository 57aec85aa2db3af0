"""The disk tier of the prefix cache: one file a KV page, named by its key (the hash chain of the
page's token prefix, seeded with the model's identity), least recently used files removed first
beyond a byte budget.

A file is a header, then the page's bytes:
    magic (8) | identity (32) | payload length (8, little endian) | blake2b-256 of payload (32) | payload
It is written to a temporary name in the same folder and renamed (readers never see half a file).
A file whose magic, identity, length or checksum does not hold is skipped with a warning and
removed; nothing is ever written outside the folder.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np

log = logging.getLogger("ember.engine")

MAGIC = b"EMBKV\x00\x01\x00"
HEADER = struct.Struct("<8s32sQ32s")
_NAME = re.compile(r"^[0-9a-f]{32}\.kv$")


class DiskTier:
    def __init__(self, folder: str | os.PathLike, capacity: int, identity: bytes):
        if capacity < 1:
            raise ValueError(f"a disk cache needs a positive size, got {capacity}")
        self.folder, self.capacity, self.identity = Path(folder), capacity, identity.ljust(32, b"\0")[:32]
        _check_writable(self.folder)
        self._files: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self.nbytes = 0
        self._scan()

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: bytes) -> bool:
        return key in self._files

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.kv"

    def _scan(self) -> None:
        """Index the folder's page files, oldest use first (a file's mtime is its last use)."""
        found = []
        for entry in os.scandir(self.folder):
            if _NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, bytes.fromhex(entry.name[:32]), st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self.nbytes += size
        self._trim(0)

    def put(self, key: bytes, page: np.ndarray) -> bool:
        """Store a page (uint8); False where it could not be written (a warning says why)."""
        if key in self._files:
            self._touch(key)
            return True
        payload = page.tobytes()
        size = HEADER.size + len(payload)
        if size > self.capacity:
            return False
        self._trim(size)
        header = HEADER.pack(MAGIC, self.identity, len(payload), checksum(payload))
        final = self.path(key)
        try:
            write_atomic(final, header, payload)
        except OSError as e:
            log.warning("KV disk cache: cannot write %s (%s); the page is dropped", final.name, e.strerror or e)
            return False
        self._files[key] = size
        self.nbytes += size
        return True

    def get(self, key: bytes, nbytes: int) -> np.ndarray | None:
        """The page stored under key (nbytes long), or None: missing, or unreadable (warned, removed)."""
        if key not in self._files:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError as e:
            log.warning("KV disk cache: cannot read %s (%s); skipped", path.name, e.strerror or e)
            self._forget(key)
            return None
        problem = _check(data, self.identity, nbytes)
        if problem:
            log.warning("KV disk cache: %s %s; skipped and removed", path.name, problem)
            self._remove(key)
            return None
        self._touch(key)
        return np.frombuffer(data, np.uint8, offset=HEADER.size).copy()

    def _touch(self, key: bytes) -> None:
        self._files.move_to_end(key)
        try:
            os.utime(self.path(key))
        except OSError:
            pass

    def _trim(self, room: int) -> None:
        """Remove least recently used files until `room` more bytes fit."""
        while self._files and self.nbytes + room > self.capacity:
            self._remove(next(iter(self._files)))

    def _remove(self, key: bytes) -> None:
        _unlink(self.path(key))
        self._forget(key)

    def _forget(self, key: bytes) -> None:
        self.nbytes -= self._files.pop(key, 0)


def _check(data: bytes, identity: bytes, nbytes: int) -> str:
    """What is wrong with a page file's bytes ("" when nothing is)."""
    if len(data) < HEADER.size:
        return "is truncated"
    magic, ident, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "is not a KV page file"
    if ident != identity:
        return "belongs to another model or KV cache type"
    if length != nbytes or len(data) != HEADER.size + length:
        return "is truncated or of another layout"
    if checksum(memoryview(data)[HEADER.size:]) != digest:
        return "fails its checksum"
    return ""


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"the KV disk cache folder {str(folder)!r} is not writable: {e.strerror or e}") from None


def checksum(body) -> bytes:
    """The blake2b-256 a file of pages carries of its body."""
    return hashlib.blake2b(body, digest_size=32).digest()


def write_atomic(path: Path, header: bytes, body: bytes) -> None:
    """path = header + body, written beside it and renamed over it (readers never see half a file);
    on OSError nothing is left behind and the error propagates."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(header)
            fh.write(body)
        os.replace(tmp, path)
    except OSError:
        _unlink(tmp)
        raise


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
