"""The prefix cache: a radix tree over token ids, shared by every request.

Each node is an edge of tokens starting at depth `start`; it references the KV pages
that hold its positions (page indices start // P .. (end - 1) // P). A node that starts
in the middle of a page has its own copy of that boundary page (lower slots copied
from its parent), so sequences that diverge mid-page never overwrite each other.

Running sequences pin the path they use (lock counts up to the root); unpinned leaves
are evicted least-recently-used first when pages run out (each shown to `on_evict`, where
set, before its pages go: a slower tier may keep them). The tree works on ints and
lists only; the memory behind the pages is someone else's. An observer, where one is set,
hears of every leaf added and removed (what KV-event publishers turn into block events).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from .pages import PagePool


class Node:
    __slots__ = ("parent", "children", "tokens", "start", "pages", "lock", "last_used")

    def __init__(self, parent: "Node | None", tokens: list[int], start: int, pages: list[int]):
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.tokens, self.start, self.pages = tokens, start, pages
        self.lock = 0
        self.last_used = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(slots=True)
class Match:
    node: Node  # deepest node of the matched path (the match ends at its end)
    length: int  # tokens matched
    pages: list[int]  # page table of the matched prefix


class TreeObserver(Protocol):
    """Told of the tree's changes, on the thread that makes them. Splits change nothing a
    prefix can tell apart, so only leaves coming and going are reported."""

    def leaf_added(self, tree: "RadixCache", leaf: Node) -> None: ...

    def leaf_removed(self, tree: "RadixCache", leaf: Node) -> None: ...


class RadixCache:
    def __init__(self, pool: PagePool):
        self.pool, self.page_size = pool, pool.page_size
        self.root = Node(None, [], 0, [])
        self.root.lock = 1  # never evicted
        self._clock = itertools.count(1)
        self.n_tokens = 0  # tokens held by the tree
        self.version = 0  # changes whenever tokens are added or evicted
        self.on_evict = None  # called with each leaf about to be evicted (its pages still valid)
        self.observer: TreeObserver | None = None

    # ---- lookup ----
    def match_length(self, tokens: list[int]) -> int:
        """How many leading tokens are cached (read-only)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.tokens, tokens, pos)
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return pos

    def match(self, tokens: list[int]) -> Match:
        """The longest cached prefix of `tokens`, split so that it ends at a node boundary."""
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.tokens, tokens, pos)
            if k < len(child.tokens):
                child = self._split(child, k)
            child.last_used = now
            node, pos = child, pos + k
        return Match(node, pos, self.page_table(node))

    def continuation(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` cached tokens that follow the whole of `tokens` (the most recently used
        branch where paths part); empty where `tokens` is not all cached (read-only)."""
        node, pos, out = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                return []
            k = _common(child.tokens, tokens, pos)
            pos += k
            if k < len(child.tokens):
                if pos < len(tokens):
                    return []
                out = child.tokens[k:k + limit]  # the match ends inside this edge
            node = child
        while len(out) < limit and node.children:
            node = max(node.children.values(), key=_last_used)
            out = out + node.tokens[:limit - len(out)]
        return out

    def path(self, node: Node) -> list[Node]:
        """The nodes from the root's child down to `node` (empty for the root)."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def prefix(self, node: Node) -> list[int]:
        """The tokens of the path root..node (positions 0 .. node.end - 1)."""
        return [t for n in self.path(node) for t in n.tokens]

    def page_table(self, node: Node) -> list[int]:
        """Pages of the path root..node: a later node's boundary page replaces its parent's."""
        table: list[int] = []
        for n in self.path(node):
            first = n.start // self.page_size
            del table[first:]
            table.extend(n.pages)
        return table

    # ---- insertion ----
    def insert(self, tokens: list[int], pages: list[int]) -> Node:
        """Cache tokens whose KV lives in `pages` (a sequence's page table); shared parts are
        kept, the rest is added. Returns the node that ends at len(tokens)."""
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = self._add_leaf(node, tokens[pos:], pos, pages)
            else:
                k = _common(child.tokens, tokens, pos)
                if k < len(child.tokens):
                    child = self._split(child, k)
            child.last_used = now
            node, pos = child, child.end
        return node

    def _add_leaf(self, parent: Node, tokens: list[int], start: int, table: list[int]) -> Node:
        P = self.page_size
        pages = table[start // P:(start + len(tokens) - 1) // P + 1]
        self.pool.retain(pages)
        leaf = Node(parent, list(tokens), start, pages)
        parent.children[tokens[0]] = leaf
        self.n_tokens += len(tokens)
        self.version += 1
        if self.observer is not None:
            self.observer.leaf_added(self, leaf)
        return leaf

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k tokens; returns the new upper part."""
        P = self.page_size
        cut = node.start + k
        first = node.start // P
        top = Node(node.parent, node.tokens[:k], node.start, node.pages[:(cut - 1) // P - first + 1])
        top.lock, top.last_used = node.lock, node.last_used
        node.parent.children[top.tokens[0]] = top
        node.pages = node.pages[cut // P - first:]
        if cut % P:
            self.pool.retain([node.pages[0]])  # the page of the cut is now listed by both halves
        node.tokens, node.start, node.parent = node.tokens[k:], cut, top
        top.children[node.tokens[0]] = node
        return top

    # ---- pinning ----
    def pin(self, node: Node) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent

    def unpin(self, node: Node) -> None:
        while node is not None:
            if node.lock <= 0:
                raise ValueError("unpin of a node that is not pinned")
            node.lock -= 1
            node = node.parent

    # ---- eviction ----
    def evict(self, n_pages: int, keep: bool = True) -> int:
        """Drop unpinned leaves, least recently used first, until n_pages pages are free
        (or nothing more can go); keep=False: without showing them to on_evict. Returns the
        number of pages freed."""
        freed = 0
        leaves = sorted(self._evictable_leaves(), key=lambda n: n.last_used, reverse=True)
        while freed < n_pages and leaves:
            leaf = leaves.pop()
            parent = leaf.parent
            if keep and self.on_evict is not None:
                self.on_evict(leaf)
            freed += self._remove_leaf(leaf)
            if parent is not self.root and not parent.children and parent.lock == 0:
                _insert_sorted(leaves, parent)
        return freed

    def _evictable_leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node.lock == 0:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def _remove_leaf(self, leaf: Node) -> int:
        if self.observer is not None:
            self.observer.leaf_removed(self, leaf)
        del leaf.parent.children[leaf.tokens[0]]
        self.n_tokens -= len(leaf.tokens)
        self.version += 1
        return self.pool.release(leaf.pages)

    def evictable_tokens(self) -> int:
        """Tokens in subtrees no running sequence pins (what eviction could reclaim)."""
        total, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.lock == 0:
                total += len(node.tokens)
            stack.extend(node.children.values())
        return total

    def clear(self) -> None:
        """Evict everything that is not pinned (dropped, not handed to on_evict)."""
        self.evict(self.pool.n_pages + 1, keep=False)

    def nodes(self):
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_tokens(self, node: Node) -> list[int]:
        """The tokens of the path root..node (node.end of them)."""
        out: list[int] = []
        for n in self.path(node):
            out += n.tokens
        return out


def _common(edge: list[int], tokens: list[int], pos: int) -> int:
    """Length of the common prefix of edge and tokens[pos:]."""
    n = min(len(edge), len(tokens) - pos)
    if edge[:n] == tokens[pos:pos + n]:  # the usual case, at C speed
        return n
    i = 0
    while edge[i] == tokens[pos + i]:
        i += 1
    return i


def common_prefix(a: list[int], b: list[int]) -> int:
    return _common(a, b, 0)


def _last_used(node: Node) -> int:
    return node.last_used


def _insert_sorted(leaves: list[Node], node: Node) -> None:
    """Keep `leaves` ordered by last_used, most recent first (pop() takes the oldest)."""
    i = len(leaves)
    while i > 0 and leaves[i - 1].last_used < node.last_used:
        i -= 1
    leaves.insert(i, node)
