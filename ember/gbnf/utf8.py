"""Code point classes -> byte-level automata pieces: the grammar engine runs on UTF-8 bytes.

A class becomes a small automaton from node 0 (start) to node 1 (end) whose paths are exactly
the UTF-8 encodings of its code points; paths that end alike share nodes, so the whole of
Unicode needs 9 nodes.
"""
from __future__ import annotations

from functools import lru_cache

_LENGTH_BOUNDS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF))


def byte_bits(lo: int, hi: int) -> int:
    """A byte set as a 256-bit int: bit b set for lo <= b <= hi."""
    return ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)


def utf8_sequences(ranges) -> list[tuple[tuple[int, int], ...]]:
    """Byte-range sequences whose concatenated choices encode exactly the code points in ranges."""
    out = []
    for lo, hi in ranges:
        for blo, bhi in _LENGTH_BOUNDS:
            a, b = max(lo, blo), min(hi, bhi)
            if a <= b:
                out.extend(_same_length(a, b))
    return out


def _same_length(lo: int, hi: int) -> list:
    # Split until every byte position but the first covers whole continuation ranges,
    # then the encodings of lo and hi bound each byte independently.
    for i in (1, 2, 3):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                return _same_length(lo, lo | m) + _same_length((lo | m) + 1, hi)
            if hi & m != m:
                return _same_length(lo, (hi & ~m) - 1) + _same_length(hi & ~m, hi)
    a, b = chr(lo).encode("utf-8"), chr(hi).encode("utf-8")
    return [tuple(zip(a, b))]


@lru_cache(maxsize=4096)
def class_fragment(ranges: tuple) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """(node count, edges (src, byte bits, dst)) for a class; node 0 is the start, node 1 the end."""
    suffix_node: dict[tuple, int] = {(): 1}
    merged: dict[tuple[int, int], int] = {}
    n = 2
    for seq in utf8_sequences(ranges):
        dst = 1
        for i in range(len(seq) - 1, 0, -1):
            node = suffix_node.get(seq[i:])
            if node is None:
                node, n = n, n + 1
                suffix_node[seq[i:]] = node
                merged[(node, dst)] = merged.get((node, dst), 0) | byte_bits(*seq[i])
            dst = node
        merged[(0, dst)] = merged.get((0, dst), 0) | byte_bits(*seq[0])
    return n, tuple((s, bits, d) for (s, d), bits in merged.items())
