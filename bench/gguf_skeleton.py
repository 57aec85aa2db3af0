"""A GGUF file as a small skeleton, and back: for benchmarks on a machine the model cannot reach.

    python bench/gguf_skeleton.py pack   MODEL.gguf MODEL.skel [--rows 16]
    python bench/gguf_skeleton.py unpack MODEL.skel MODEL.gguf

A skeleton keeps the file's header, metadata (the tokenizer with it) and tensor table byte for
byte, every 1-D tensor (norm weights, biases) whole, and the first `rows` rows of each matrix.
Unpacking writes a file of the original size and layout whose matrices repeat those rows: real
blocks of the real types, so kernels, shapes and launch counts are the model's own, while the
generated text is not. Speed figures from it match the real file's; quality figures do not.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

MAGIC = b"EMBSKEL1"


def pack(src: Path, dst: Path, rows: int = 16) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ember.gguf_loader import GGUFFile
    from ember.quant import layout

    with GGUFFile(src) as f:
        raw = np.memmap(src, np.uint8, mode="r")
        table, parts = [], []
        for t in sorted(f.tensors.values(), key=lambda t: t.offset):
            keep = t.nbytes
            if len(t.shape) > 1:
                keep = min(t.nbytes, rows * layout(t.type).row_bytes(t.shape[-1]))
            table.append([t.offset, t.nbytes, keep])
            parts.append(raw[t.offset:t.offset + keep])
        header = json.dumps({"size": int(raw.size), "prefix": f.data_offset, "tensors": table}).encode()
        with open(dst, "wb") as out:
            out.write(MAGIC + struct.pack("<Q", len(header)) + header)
            out.write(raw[:f.data_offset].tobytes())
            for part in parts:
                out.write(part.tobytes())


def unpack(src: Path, dst: Path) -> None:
    data = np.fromfile(src, np.uint8)
    if data[:8].tobytes() != MAGIC:
        raise SystemExit(f"{src}: not a skeleton")
    (n,) = struct.unpack("<Q", data[8:16].tobytes())
    header = json.loads(data[16:16 + n].tobytes())
    at = 16 + n
    out = np.memmap(dst, np.uint8, mode="w+", shape=(header["size"],))
    out[:header["prefix"]] = data[at:at + header["prefix"]]
    at += header["prefix"]
    for offset, nbytes, keep in header["tensors"]:
        out[offset:offset + nbytes] = np.resize(data[at:at + keep], nbytes)  # the kept rows, repeated
        at += keep
    out.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["pack", "unpack"])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--rows", type=int, default=16, help="rows of each matrix kept (pack)")
    args = ap.parse_args()
    if args.action == "pack":
        pack(args.src, args.dst, args.rows)
    else:
        unpack(args.src, args.dst)


if __name__ == "__main__":
    main()
