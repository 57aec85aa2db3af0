"""Tiers below the KV pool: pages the prefix tree evicts go to host memory (`--cache-ram`) and
from there, or directly, to files (`--cache-disk`), instead of being dropped; a prompt whose
prefix reaches them gets them back into the pool before it is admitted.

A page is found by its key: the hash chain of the tokens of every full page up to and including
it, seeded with the model's identity (its file's hash, the KV types, the page size), so a key
names the same keys and values in any process that loads the same model the same way. Only full
pages move between tiers; the partial last page of a prefix is computed again.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .kvdisk import DiskTier
from .pages import PagePool
from .radix import Node, RadixCache

KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class TierConfig:
    ram_bytes: int = 0  # host memory for evicted pages (0: none)
    disk_dir: str | None = None  # folder of page files (None: no disk tier)
    disk_bytes: int = 0  # the folder's budget

    def __post_init__(self):
        if self.ram_bytes < 0:
            raise ValueError(f"cache_ram must be >= 0 bytes, got {self.ram_bytes}")
        if self.disk_dir is not None and self.disk_bytes < 1:
            raise ValueError("a disk cache needs a positive size (--cache-disk-size)")

    @property
    def enabled(self) -> bool:
        return self.ram_bytes > 0 or self.disk_dir is not None


@dataclass
class TierStats:
    """What the tiers hold and what moved (read by /metrics)."""

    hits: dict = field(default_factory=lambda: {"ram": 0, "disk": 0})  # pages brought back, per tier
    bytes_in: dict = field(default_factory=lambda: {"ram": 0, "disk": 0})  # written to the tier
    bytes_out: dict = field(default_factory=lambda: {"ram": 0, "disk": 0})  # read back into the pool
    restores: int = 0  # prompts that got pages back
    restore_seconds: float = 0.0  # time spent getting them


def chain_keys(seed: bytes, tokens: list[int], page_size: int) -> list[bytes]:
    """The key of every full page of tokens: key_i = H(key_{i-1} | tokens of page i)."""
    keys, prev = [], seed
    ids = np.asarray(tokens[:len(tokens) // page_size * page_size], np.int64)
    for i in range(len(ids) // page_size):
        prev = hashlib.blake2b(prev + ids[i * page_size:(i + 1) * page_size].tobytes(), digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def file_digest(path, chunk: int = 1 << 22) -> bytes:
    """blake2b of a file's bytes (a model's identity for the pages it made)."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.digest()


def identity(model_digest: bytes, k_type: str, v_type: str, page_size: int, page_nbytes: int) -> bytes:
    """What a stored page must match to be used: the model file, the KV layout."""
    text = f"{k_type}/{v_type}/{page_size}/{page_nbytes}".encode()
    return hashlib.blake2b(model_digest + text, digest_size=32).digest()


def place_pages(tree: RadixCache, kv, tokens: list[int], first: int, found) -> int:
    """Pages found[i] (host bytes) hold page first + i of tokens (the last may be partial): into free
    pool pages (evicting cache where needed), then into the tree as unpinned cache. Returns the
    number of pages placed (fewer where the pool has no room)."""
    P, pool = tree.page_size, tree.pool
    match = tree.match(tokens[:first * P])
    tree.pin(match.node)  # what we extend must not be evicted to make room for it
    try:
        if pool.n_free < len(found):
            tree.evict(len(found) - pool.n_free)
        n = min(len(found), pool.n_free)
        new = [pool.allocate() for _ in range(n)]
        if not new:
            return 0
        kv.write_pages(new, np.stack(found[:n]))
        tree.insert(tokens[:(first + n) * P], match.pages[:first] + new)
        pool.release(new)  # the tree holds them now
    finally:
        tree.unpin(match.node)
    return n


class RamTier:
    """Pages in host memory, least recently used first out beyond a byte budget."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.pages: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    def put(self, key: bytes, page: np.ndarray) -> list[tuple[bytes, np.ndarray]]:
        """Store a page; returns the pages pushed out to make room (oldest first)."""
        if key in self.pages:
            self.pages.move_to_end(key)
            return []
        if page.nbytes > self.capacity:
            return [(key, page)]
        out = []
        while self.nbytes + page.nbytes > self.capacity:
            old, data = self.pages.popitem(last=False)
            self.nbytes -= data.nbytes
            out.append((old, data))
        self.pages[key] = page
        self.nbytes += page.nbytes
        return out

    def get(self, key: bytes) -> np.ndarray | None:
        page = self.pages.get(key)
        if page is not None:
            self.pages.move_to_end(key)
        return page


class TieredCache:
    """The tiers of one engine: `spill` is the prefix tree's on_evict; `restore` runs for a
    prompt before admission; `persist` writes what the pool and RAM hold to disk (at shutdown)."""

    def __init__(self, config: TierConfig, tree: RadixCache, pool: PagePool, kv, seed: bytes):
        self.tree, self.pool, self.kv, self.seed = tree, pool, kv, seed
        self.page_size, self.page_nbytes = pool.page_size, kv.page_nbytes
        self.ram = RamTier(config.ram_bytes) if config.ram_bytes else None
        self.disk = DiskTier(config.disk_dir, config.disk_bytes, seed) if config.disk_dir else None
        self.stats = TierStats()
        tree.on_evict = self.spill

    # ---- down ----
    def spill(self, leaf: Node) -> None:
        """Keep the full pages of an evicted leaf in the tier below."""
        P = self.page_size
        first, last = leaf.start // P, leaf.end // P  # full pages first .. last-1
        if first >= last:
            return
        keys = chain_keys(self.seed, self.tree.path_tokens(leaf), P)
        todo = [(keys[j], leaf.pages[j - first]) for j in range(first, last) if not self._held(keys[j])]
        if todo:
            data = self.kv.read_pages([p for _, p in todo])
            for (key, _), page in zip(todo, data):
                self._store(key, page)

    def _held(self, key: bytes) -> bool:
        return (self.ram is not None and key in self.ram) or (self.disk is not None and key in self.disk)

    def _store(self, key: bytes, page: np.ndarray) -> None:
        if self.ram is None:
            self._to_disk(key, page)
            return
        self.stats.bytes_in["ram"] += page.nbytes
        for old, data in self.ram.put(key, page):
            self._to_disk(old, data)

    def _to_disk(self, key: bytes, page: np.ndarray) -> None:
        if self.disk is not None and key not in self.disk and self.disk.put(key, page):
            self.stats.bytes_in["disk"] += page.nbytes

    # ---- up ----
    def restore(self, tokens: list[int]) -> int:
        """Bring back into the pool the pages of tokens' prefix that the tiers hold beyond what the
        tree has (as unpinned cache); returns how many came back."""
        P = self.page_size
        cached = self.tree.match_length(tokens)
        keys = chain_keys(self.seed, tokens, P)
        first = cached // P
        if first >= len(keys):
            return 0
        t0 = time.perf_counter()
        pages = self._found(keys[first:])
        if not pages:
            return 0
        n = place_pages(self.tree, self.kv, tokens[:len(keys) * P], first, pages)
        self.stats.restores += n > 0
        self.stats.restore_seconds += time.perf_counter() - t0
        return n

    def _found(self, keys: list[bytes]) -> list[np.ndarray]:
        """The consecutive pages of keys found in the tiers, from the first on."""
        out = []
        for key in keys:
            page, tier = self._lookup(key)
            if page is None:
                break
            self.stats.hits[tier] += 1
            self.stats.bytes_out[tier] += page.nbytes
            out.append(page)
        return out

    def _lookup(self, key: bytes) -> tuple[np.ndarray | None, str]:
        page = self.ram.get(key) if self.ram is not None else None
        if page is not None:
            return page, "ram"
        page = self.disk.get(key, self.page_nbytes) if self.disk is not None else None
        return page, "disk"

    # ---- at shutdown ----
    def persist(self) -> int:
        """Write every full page the tree and the RAM tier hold to disk; returns pages written."""
        if self.disk is None:
            return 0
        before = len(self.disk)
        if self.ram is not None:
            for key, page in list(self.ram.pages.items()):
                self._to_disk(key, page)
        for node in self.tree.nodes():
            self._persist_node(node)
        return len(self.disk) - before

    def _persist_node(self, node: Node) -> None:
        P = self.page_size
        first, last = node.start // P, node.end // P
        if first >= last:
            return
        keys = chain_keys(self.seed, self.tree.path_tokens(node), P)
        todo = [(keys[j], node.pages[j - first]) for j in range(first, last) if keys[j] not in self.disk]
        if todo:
            for (key, _), page in zip(todo, self.kv.read_pages([p for _, p in todo])):
                self._to_disk(key, page)
