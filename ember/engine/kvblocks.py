"""The prefix tree seen as blocks: full pages of tokens named by chained hashes.

KV-aware routers (llm-d's precise prefix scorer, NVIDIA Dynamo) track a worker's cache as a
set of blocks: block j of a prompt is its tokens j*P .. (j+1)*P - 1, named by a hash of those
tokens and of block j-1's hash, so one hash names one whole prefix. A block is cached while
the radix tree holds a path through all of its positions; it enters with the leaf that first
reaches its last position and leaves with that leaf (splits move no block from one prefix to
another). `BlockEvents`, the tree's observer, turns leaves into events laid out as vLLM's
KV events are (arrays led by the type's name); a publisher takes them from `drain()`.
"""
from __future__ import annotations

import hashlib
import struct
import threading
from typing import Iterator

from .radix import Node, RadixCache

_ROOT_SEED = b"ember-kv-block"


def block_hash(parent: int | None, tokens: list[int]) -> int:
    """An unsigned 64-bit name for a block: its tokens chained to its parent's name."""
    h = hashlib.blake2b(_ROOT_SEED if parent is None else parent.to_bytes(8, "big"), digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "big")


def chain(tokens: list[int], page_size: int, first: int, last: int) -> tuple[int | None, list[int]]:
    """Hashes of blocks first..last-1 of `tokens`, and the hash of block first-1 (None at 0)."""
    parent, hashes, h = None, [], None
    for j in range(last):
        h = block_hash(h, tokens[j * page_size:(j + 1) * page_size])
        if j == first - 1:
            parent = h
        elif j >= first:
            hashes.append(h)
    return parent, hashes


def leaf_blocks(tree: RadixCache, leaf: Node) -> tuple[int, int]:
    """The blocks whose last position lies in `leaf`: first, last (exclusive)."""
    P = tree.page_size
    return leaf.start // P, leaf.end // P


def tree_blocks(tree: RadixCache) -> dict[int, int | None]:
    """Every block the tree holds: hash -> parent hash (what a subscriber rebuilds)."""
    out: dict[int, int | None] = {}
    for node in _nodes(tree):
        first, last = leaf_blocks(tree, node)
        if first < last:
            parent, hashes = chain(tree.prefix(node), tree.page_size, first, last)
            for h in hashes:
                out[h], parent = parent, h
    return out


def _nodes(tree: RadixCache) -> Iterator[Node]:
    """Every node but the root, each after its parent."""
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


class BlockEvents:
    """A TreeObserver that keeps vLLM-style events until a publisher drains them. Called on
    the engine's thread; drained on the publisher's."""

    def __init__(self, lora_id: int | None = None, medium: str | None = None):
        self.lora_id, self.medium = lora_id, medium
        self._pending: list[list] = []
        self._lock = threading.Lock()
        self.ready = threading.Event()  # set while events wait

    def leaf_added(self, tree: RadixCache, leaf: Node) -> None:
        first, last = leaf_blocks(tree, leaf)
        if first < last:
            tokens = tree.prefix(leaf)
            parent, hashes = chain(tokens, tree.page_size, first, last)
            P = tree.page_size
            self._put(["BlockStored", hashes, parent, tokens[first * P:last * P], P, self.lora_id, self.medium])

    def leaf_removed(self, tree: RadixCache, leaf: Node) -> None:
        first, last = leaf_blocks(tree, leaf)
        if first < last:
            _, hashes = chain(tree.prefix(leaf), tree.page_size, first, last)
            self._put(["BlockRemoved", hashes[::-1], self.medium])  # children before their parents

    def follow(self, tree: RadixCache) -> None:
        """Observe `tree` from now on: subscribers drop what they knew, then hear of the blocks
        it holds already (none for a new engine's tree). Call it where the tree does not change."""
        self.forget()
        for node in _nodes(tree):  # parents before their children
            self.leaf_added(tree, node)
        tree.observer = self

    def forget(self) -> None:
        """Tell subscribers that every block they know of is gone."""
        self._put(["AllBlocksCleared"])

    def _put(self, event: list) -> None:
        with self._lock:
            self._pending.append(event)
        self.ready.set()

    def drain(self) -> list[list]:
        with self._lock:
            events, self._pending = self._pending, []
            self.ready.clear()
        return events
