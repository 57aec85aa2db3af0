"""Saving a cached conversation's KV pages to a file and loading them back (llama-server's slot
save and restore). A file holds the tokens and the pages that hold their keys and values:
    magic (8) | identity (32) | n_tokens (8) | n_pages (8) | blake2b-256 of the rest (32) |
    tokens (n_tokens int32) | pages (n_pages x page bytes)
written to a temporary name and renamed. save_slot and restore_slot run on the engine's thread
(Engine.call: they touch the pool and the prefix tree).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .kvdisk import checksum, write_atomic
from .tiers import place_pages

MAGIC = b"EMBSLOT1"
HEADER = struct.Struct("<8s32sQQ32s")


class SlotFileError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SlotIO:
    n_tokens: int
    n_bytes: int


def save(path: Path, tokens: list[int], pages: list[int], kv, identity: bytes) -> SlotIO:
    """Write tokens and the pages holding them (page table order) to path."""
    body = np.asarray(tokens, np.int32).tobytes() + kv.read_pages(pages).tobytes() if pages else b""
    header = HEADER.pack(MAGIC, identity, len(tokens), len(pages), checksum(body))
    try:
        write_atomic(path, header, body)
    except OSError as e:
        raise SlotFileError(f"cannot write {path.name}: {e.strerror or e}") from None
    return SlotIO(len(tokens), len(header) + len(body))


def restore(path: Path, tree, kv, identity: bytes) -> SlotIO:
    """Load a saved file's pages into the pool as cached prefix; returns the tokens placed."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SlotFileError(f"no saved slot named {path.name}") from None
    except OSError as e:
        raise SlotFileError(f"cannot read {path.name}: {e.strerror or e}") from None
    tokens, pages = _parse(data, identity, kv.page_nbytes, tree.page_size)
    P = tree.page_size
    first = tree.match_length(tokens) // P
    placed = place_pages(tree, kv, tokens, first, list(pages[first:])) if first < len(pages) else 0
    return SlotIO(min(len(tokens), (first + placed) * P), len(data))


def _parse(data: bytes, identity: bytes, page_nbytes: int, page_size: int) -> tuple[list[int], np.ndarray]:
    if len(data) < HEADER.size:
        raise SlotFileError("the file is truncated")
    magic, ident, n_tokens, n_pages, digest = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SlotFileError("the file is not a saved slot")
    if ident != identity:
        raise SlotFileError("the file was saved with another model or KV cache type")
    if n_pages != -(-n_tokens // page_size) or len(data) != HEADER.size + 4 * n_tokens + n_pages * page_nbytes:
        raise SlotFileError("the file is truncated or of another layout")
    body = memoryview(data)[HEADER.size:]
    if checksum(body) != digest:
        raise SlotFileError("the file fails its checksum")
    tokens = np.frombuffer(body, np.int32, n_tokens).tolist()
    pages = np.frombuffer(body, np.uint8, offset=4 * n_tokens).reshape(n_pages, page_nbytes)
    return tokens, pages


def save_slot(engine, slot: int, path: Path) -> SlotIO:
    """Save slot `slot`: the sequence running in it, else the slot - n_running-th most recently used
    cached conversation (slots share one prefix cache)."""
    tokens, pages = slot_tokens(engine, slot)
    if not tokens:
        raise SlotFileError(f"slot {slot} holds no cached tokens")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SlotFileError(f"cannot create the slot folder: {e.strerror or e}") from None
    return save(path, tokens, pages, engine.cache, engine.identity)


def restore_slot(engine, path: Path) -> SlotIO:
    return restore(path, engine.tree, engine.cache, engine.identity)


def slot_tokens(engine, slot: int) -> tuple[list[int], list[int]]:
    """The computed tokens of slot `slot` and the pages holding them (on the engine's thread)."""
    running = engine.scheduler.running
    P = engine.pool.page_size
    if slot < len(running):
        seq = running[slot]
        return list(seq.tokens[:seq.n_computed]), list(seq.pages[:-(-seq.n_computed // P)])
    tree = engine.tree
    leaves = sorted((n for n in tree.nodes() if not n.children), key=lambda n: -n.last_used)
    rank = slot - len(running)
    if rank >= len(leaves):
        return [], []
    return tree.path_tokens(leaves[rank]), tree.page_table(leaves[rank])
