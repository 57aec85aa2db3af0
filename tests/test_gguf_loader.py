"""ember.gguf_loader: the GGUF parser against gguf-py's writer and reader, hand-built
malformed files, and cut or corrupted copies of the two real models."""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import random
import shutil
import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from work import count_calls
from ember.gguf_loader import GGUFError, GGUFFile, TensorInfo
from ember.quant.types import GGMLType, layout

gguf = pytest.importorskip("gguf")
VT, QT = gguf.GGUFValueType, gguf.GGMLQuantizationType

MODELS = Path(os.environ.get("EMBER_MODELS", "~/.cache/ember/models")).expanduser()
SMOLLM = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"


def model_path(name: str) -> Path:
    path = MODELS / name
    if not path.is_file():
        pytest.skip(f"real model {name} not found in {MODELS} (set EMBER_MODELS)")
    return path


# ---------------------------------------------------------------------------------------
# Hand-built GGUF bytes, for cases no writer produces.

def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def arr(etype: int, items: list[bytes]) -> bytes:
    return u32(etype) + u64(len(items)) + b"".join(items)


def tinfo(name: str | bytes, ne: tuple[int, ...], ttype: int, offset: int) -> bytes:
    return gstr(name) + u32(len(ne)) + b"".join(map(u64, ne)) + u32(ttype) + u64(offset)


def gguf_bytes(kvs=(), infos=(), data=b"", version=3, alignment=32, pad=True) -> bytes:
    counts = u64(len(infos)) + u64(len(kvs))
    head = b"GGUF" + u32(version) + counts + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % alignment if pad else 0) + data


def write(tmp_path: Path, blob: bytes, name: str = "t.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def open_error(path: Path) -> GGUFError:
    with pytest.raises(GGUFError) as info:
        GGUFFile(path)
    return info.value


# ---------------------------------------------------------------------------------------
# Files written by gguf-py's GGUFWriter, compared with gguf-py's GGUFReader.

SCALARS = [  # (key, writer method, value)
    ("t.u8", "add_uint8", 255), ("t.i8", "add_int8", -128), ("t.u16", "add_uint16", 65535),
    ("t.i16", "add_int16", -32768), ("t.u32", "add_uint32", 2**32 - 1),
    ("t.i32", "add_int32", -(2**31)), ("t.f32", "add_float32", 1.25),
    ("t.u64", "add_uint64", 2**64 - 1), ("t.i64", "add_int64", -(2**63)),
    ("t.f64", "add_float64", math.pi), ("t.bool_t", "add_bool", True),
    ("t.bool_f", "add_bool", False), ("t.str", "add_string", "héllo ✓ 🚀"),
]  # (GGUFWriter skips empty strings; test_scalar_tensor_and_mixed_nested_array has one)
TYPED_ARRAYS = [  # (key, sub type, values, expected dtype)
    ("a.u8", VT.UINT8, [0, 7, 255], np.uint8), ("a.i8", VT.INT8, [-128, 0, 127], np.int8),
    ("a.u16", VT.UINT16, [1, 65535], np.uint16), ("a.i16", VT.INT16, [-32768, 5], np.int16),
    ("a.u32", VT.UINT32, [1, 2**32 - 1], np.uint32), ("a.i32", VT.INT32, [-1, 2, 3], np.int32),
    ("a.u64", VT.UINT64, [2**64 - 1, 0], np.uint64), ("a.i64", VT.INT64, [-(2**63), 9], np.int64),
    ("a.f32", VT.FLOAT32, [0.5, -2.0], np.float32),
    ("a.f64", VT.FLOAT64, [math.e, 1e300], np.float64),
    ("a.bool", VT.BOOL, [True, False, True], np.bool_),
]
STRINGS = ["", "a", "Ġthe", "▁token", "日本語", "<0x0A>", "x" * 1000]
NESTED_INTS = [[1, 2], [3, 4, 5]]
NESTED_STRS = [["a", "b"], ["ü"]]
NESTED_DEEP = [[[1.5], [2.5, 3.5]], [[4.5]]]
RAW_BYTES = [b"\xff\xfe", b"ok", b"\xe2\x82", b"\x80tail", b"\xf0\x9f\x9a\x80"]  # mostly not UTF-8


def writer_tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, QT | None]]:
    """name -> (array as handed to GGUFWriter, raw ggml type or None), several ggml types."""
    def raw(t: QT, rows: int, cols: int) -> tuple[np.ndarray, QT]:
        row_bytes = layout(GGMLType(int(t))).row_bytes(cols)
        return rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8), t
    return {
        "f32": (rng.standard_normal((3, 5)).astype(np.float32), None),
        "f16": (rng.standard_normal((2, 2, 4)).astype(np.float16), None),
        "f64": (rng.standard_normal(7), None),
        "i8": (rng.integers(-128, 128, (4, 3), dtype=np.int8), None),
        "i16": (rng.integers(-5, 5, (2, 3), dtype=np.int16), None),
        "i32": (rng.integers(-9, 9, (1, 2, 3, 4), dtype=np.int32), None),
        "i64": (rng.integers(-9, 9, (5,), dtype=np.int64), None),
        "bf16": raw(QT.BF16, 2, 6),
        "q4_0": raw(QT.Q4_0, 3, 64),
        "q8_0": raw(QT.Q8_0, 2, 32),
        "q4_k": raw(QT.Q4_K, 2, 512),
        "q6_k": raw(QT.Q6_K, 1, 256),
        "q5_0": raw(QT.Q5_0, 4, 32),
        "big": (rng.standard_normal((64, 1024)).astype(np.float32), None),  # a 256 KiB file
    }


def write_with_gguf_py(path: Path, alignment: int | None, seed: int = 0) -> dict:
    w = gguf.GGUFWriter(str(path), "test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, method, value in SCALARS:
        getattr(w, method)(key, value)
    for key, sub, values, _ in TYPED_ARRAYS:
        w.add_key_value(key, values, VT.ARRAY, sub_type=sub)
    w.add_array("a.strings", STRINGS)
    w.add_array("a.raw", RAW_BYTES)
    w.add_array("n.ints", NESTED_INTS)
    w.add_array("n.strs", NESTED_STRS)
    w.add_array("n.deep", NESTED_DEEP)
    tensors = writer_tensors(np.random.default_rng(seed))
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.mark.parametrize("alignment", [None, 1, 64, 4096])
def test_matches_gguf_py_reader(tmp_path, alignment):
    path = tmp_path / "w.gguf"
    written = write_with_gguf_py(path, alignment)
    ref = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        assert f.version == 3
        assert f.alignment == (alignment or 32) == ref.alignment
        assert f.data_offset == ref.data_offset and f.data_offset % f.alignment == 0
        assert f.size == path.stat().st_size
        ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == ref_keys == list(f.metadata_types)
        for key in ref_keys:
            if key.startswith("n.") or key == "a.raw":
                continue  # gguf-py reads neither nested arrays nor invalid UTF-8: checked below
            expected, ours = ref.fields[key].contents(), f.metadata[key]
            assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == expected, key
            assert type(ours) is not np.ndarray or not ours.flags.writeable
        check_writer_metadata(f)
        assert list(f.tensors) == [t.name for t in ref.tensors] == list(written)
        for rt in ref.tensors:
            check_tensor_against_reader(f.tensors[rt.name], rt, *written[rt.name])


def check_writer_metadata(f: GGUFFile) -> None:
    for key, method, value in SCALARS:
        got = f.metadata[key]
        assert got == (np.float32(value) if key == "t.f32" else value) and type(got) is type(value)
    for key, _, values, dtype in TYPED_ARRAYS:
        got = f.metadata[key]
        assert got.dtype == dtype and got.tolist() == values
        assert f.metadata_types[key] == f"array[{key[2:]}]"
        assert isinstance(got.base, memoryview) and isinstance(got.base.obj, mmap.mmap)  # zero copy
    assert f.metadata_types["t.u64"] == "u64" and f.metadata_types["t.str"] == "string"
    assert f.metadata["a.strings"] == STRINGS and f.metadata_types["a.strings"] == "array[string]"
    assert [s.encode("utf-8", "surrogateescape") for s in f.metadata["a.raw"]] == RAW_BYTES
    assert [a.tolist() for a in f.metadata["n.ints"]] == NESTED_INTS
    assert f.metadata_types["n.ints"] == "array[array[i32]]"
    assert f.metadata["n.strs"] == NESTED_STRS
    assert f.metadata_types["n.strs"] == "array[array[string]]"
    assert [[a.tolist() for a in inner] for inner in f.metadata["n.deep"]] == NESTED_DEEP
    assert f.metadata_types["n.deep"] == "array[array[array[f32]]]"
    assert f.get("t.u8") == 255 and f.get("missing") is None and f.get("missing", 7) == 7


def check_tensor_against_reader(t: TensorInfo, rt, written: np.ndarray, raw_dtype) -> None:
    assert t.type == GGMLType(int(rt.tensor_type))
    assert t.ne == tuple(int(n) for n in rt.shape) and t.shape == t.ne[::-1]
    assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes and t.n_elements == rt.n_elements
    assert t.data.dtype == np.uint8 and t.data.shape == (t.nbytes,) and not t.data.flags.writeable
    assert t.data.tobytes() == written.tobytes()
    view = t.array()
    assert not view.flags.writeable and np.shares_memory(view, t.data)
    if t.type == GGMLType.BF16:  # no numpy bf16: raw uint16 bits, same bytes as gguf-py's uint8
        assert view.dtype == np.uint16 and view.shape == t.shape
        np.testing.assert_array_equal(view.view(np.uint8), rt.data)
    elif raw_dtype is not None:  # quantized: uint8 rows of blocks
        assert view.dtype == np.uint8 and view.shape == (*t.shape[:-1], written.shape[-1])
        np.testing.assert_array_equal(view, rt.data)
    else:
        assert view.dtype == written.dtype and view.shape == written.shape
        np.testing.assert_array_equal(view, rt.data)
        np.testing.assert_array_equal(view, written)


def test_v2_reads_like_v3(tmp_path):
    """v2 and v3 share the little-endian layout; only the version field differs."""
    path = tmp_path / "v3.gguf"
    write_with_gguf_py(path, 64)
    blob = bytearray(path.read_bytes())
    blob[4:8] = u32(2)
    v2 = write(tmp_path, bytes(blob), "v2.gguf")
    with GGUFFile(path) as a, GGUFFile(v2) as b:
        assert (a.version, b.version) == (3, 2)
        assert list(a.metadata) == list(b.metadata) and a.metadata_types == b.metadata_types
        assert [(t.name, t.type, t.ne, t.offset) for t in a.tensors.values()] == \
               [(t.name, t.type, t.ne, t.offset) for t in b.tensors.values()]


# ---------------------------------------------------------------------------------------
# Valid edge cases built by hand.

def test_empty_arrays_of_every_type(tmp_path):
    fixed = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
             6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
    kvs = [kv(f"e{t}", 9, arr(t, [])) for t in fixed] + [kv("es", 9, arr(8, [])),
                                                          kv("ea", 9, arr(9, []))]
    with GGUFFile(write(tmp_path, gguf_bytes(kvs))) as f:
        for t, dtype in fixed.items():
            assert f.metadata[f"e{t}"].dtype == dtype and f.metadata[f"e{t}"].size == 0
        assert f.metadata["es"] == [] and f.metadata_types["es"] == "array[string]"
        assert f.metadata["ea"] == [] and f.metadata_types["ea"] == "array[array]"
        assert f.tensors == {}


def test_invalid_utf8_round_trips_to_the_exact_bytes(tmp_path):
    key, value, name = b"k\xff", b"v\xc3(\x80", b"t\xfe"
    blob = gguf_bytes([kv(key, 8, gstr(value))], [tinfo(name, (4,), 0, 0)], b"\0" * 16)
    with GGUFFile(write(tmp_path, blob)) as f:
        (k,), (t,) = f.metadata, f.tensors
        assert k.encode("utf-8", "surrogateescape") == key
        assert f.metadata[k].encode("utf-8", "surrogateescape") == value
        assert t.encode("utf-8", "surrogateescape") == name


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=12), max_size=40))
def test_token_bytes_round_trip(tokens):
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), gguf_bytes([kv("tokens", 9, arr(8, [gstr(b) for b in tokens]))]))
        with GGUFFile(path) as f:
            assert [s.encode("utf-8", "surrogateescape") for s in f.metadata["tokens"]] == tokens


def test_scalar_tensor_and_mixed_nested_array(tmp_path):
    nested = arr(9, [arr(5, [u32(7)]), arr(8, [gstr("x")])])
    blob = gguf_bytes([kv("mixed", 9, nested), kv("empty", 8, gstr(""))], [tinfo("s", (), 0, 0)],
                      struct.pack("<f", 2.5))
    with GGUFFile(write(tmp_path, blob)) as f:
        assert f.metadata["empty"] == "" and f.metadata_types["empty"] == "string"
        assert f.metadata_types["mixed"] == "array[array[i32]|array[string]]"
        assert f.metadata["mixed"][0].tolist() == [7] and f.metadata["mixed"][1] == ["x"]
        t = f.tensors["s"]
        assert t.shape == () and t.n_elements == 1 and t.array() == np.float32(2.5)


def test_file_without_tensors_needs_no_padding(tmp_path):
    blob = gguf_bytes([kv("k", 4, u32(1))], pad=False)
    with GGUFFile(write(tmp_path, blob)) as f:
        assert f.metadata == {"k": 1} and f.tensors == {} and f.data_offset % 32 == 0


# ---------------------------------------------------------------------------------------
# Malformed files: every problem is a GGUFError naming the offset.

def k1(vtype: int, payload: bytes, key: str = "k") -> bytes:
    return kv(key, vtype, payload)


F32_16 = b"\0" * 64  # data for one F32 tensor of 16 values
KV0 = 24  # offset of the first key/value pair
MALFORMED = {  # name: (file bytes, message fragment, error offset)
    "bad magic": (b"GGML" + u32(3) + u64(0) * 2, "bad magic", 0),
    "v1": (gguf_bytes(version=1), "v1 is not supported", 4),
    "v4": (gguf_bytes(version=4), "unsupported GGUF version 4", 4),
    "big-endian": (b"GGUF" + struct.pack(">I", 3) + u64(0) * 2, "big-endian", 4),
    "truncated in magic": (b"GG", "magic (4 bytes) runs past end of file (size 2)", 0),
    "truncated in counts": (b"GGUF" + u32(3) + b"\1\0", "tensor count (8 bytes) runs past", 8),
    "tensor count": (b"GGUF" + u32(3) + u64(2**40) + u64(0), "tensor count 1099511627776", 8),
    "kv count": (b"GGUF" + u32(3) + u64(0) + u64(5) + b"\0" * 60, "key/value count 5 cannot fit",
                 16),
    "key length": (b"GGUF" + u32(3) + u64(0) + u64(1) + u64(99999999) + b"\0" * 8,
                   "string length 99999999 runs past end of file (size 40), in metadata key",
                   KV0),
    "string length": (gguf_bytes([k1(8, u64(2**63))]),
                      "string length 9223372036854775808 runs past end", 37),
    "value type": (gguf_bytes([k1(13, u32(0))]), "unknown value type 13", 33),
    "array element type": (gguf_bytes([k1(9, u32(99) + u64(0))]), "unknown value type 99", 37),
    "array length": (gguf_bytes([k1(9, u32(6) + u64(2**61))]),
                     "array length 2305843009213693952 cannot fit", 41),
    "array length off by one": (gguf_bytes([k1(9, u32(4) + u64(3) + u32(1) * 2)], pad=False),
                                "array length 3 cannot fit in the 8 bytes left", 41),
    "string element length": (gguf_bytes([k1(9, arr(8, [gstr("ab"), u64(1000)]))]),
                              "string length 1000 runs past end of file (size 96), "
                              "in value of 'k'[1]", 59),
    "string element cut": (gguf_bytes([k1(9, u32(8) + u64(2) + gstr("ab") + b"\1" * 6)],
                                      pad=False),
                           "string length (8 bytes) runs past end", 59),
    "bool": (gguf_bytes([k1(7, b"\2")]), "bool value 2", 37),
    "bool array": (gguf_bytes([k1(9, arr(7, [b"\1", b"\0", b"\3"]))]), "bool value 3", 51),
    "nesting": (gguf_bytes([k1(9, (u32(9) + u64(1)) * 17 + u32(4) + u64(0))]),
                "nested more than 16 deep", 37 + 12 * 16),
    "duplicate key": (gguf_bytes([k1(4, u32(1)), k1(4, u32(2))]), "duplicate metadata key 'k'",
                      KV0 + 17),
    "duplicate tensor": (gguf_bytes([], [tinfo("x", (16,), 0, 0), tinfo("x", (16,), 0, 64)],
                                    F32_16 * 2), "duplicate tensor name 'x'", KV0 + 33),
    "n_dims": (gguf_bytes([], [tinfo("x", (1,) * 5, 0, 0)], F32_16), "5 dimensions", KV0 + 9),
    "zero dim": (gguf_bytes([], [tinfo("x", (16, 0), 0, 0)], F32_16), "zero dimension", KV0 + 13),
    "overflow": (gguf_bytes([], [tinfo("x", (2**62, 4), 0, 0)], F32_16), "overflow int64",
                 KV0 + 13),
    "unknown tensor type": (gguf_bytes([], [tinfo("x", (16,), 99, 0)], F32_16),
                            "unknown tensor type 99 for tensor 'x'", KV0 + 21),
    "removed tensor type": (gguf_bytes([], [tinfo("x", (32,), 4, 0)], F32_16),
                            "unknown tensor type 4", KV0 + 21),
    "block size": (gguf_bytes([], [tinfo("x", (33, 2), int(GGMLType.Q4_0), 0)], F32_16),
                   "row of 33 values is not a multiple of the Q4_0 block size 32", KV0 + 13),
    "misaligned": (gguf_bytes([], [tinfo("x", (4,), 0, 16)], F32_16),
                   "offset 16 is not a multiple of the alignment 32", KV0 + 25),
    "outside file": (gguf_bytes([], [tinfo("x", (32,), 0, 0)], F32_16),
                     "data [64, 192) runs past end of file (size 128)", KV0 + 25),
    "overlap": (gguf_bytes([], [tinfo("a", (16,), 0, 0), tinfo("b", (16,), 0, 32)], F32_16 * 2),
                "'b' data [128, 192) overlaps tensor 'a' [96, 160)", KV0 + 33 + 25),
    "data section past end": (gguf_bytes([], [tinfo("x", (1,), 0, 0)], pad=False),
                              "data section starts at 64, past end of file", 57),
    "key too long": (gguf_bytes([k1(4, u32(1), key="k" * 65536)]),
                     "string length 65536 exceeds the limit of 65535 bytes, in metadata key", KV0),
    "tensor name too long": (gguf_bytes([], [tinfo("t" * 65, (16,), 0, 0)], F32_16),
                             "string length 65 exceeds the limit of 64 bytes, in tensor name",
                             KV0),
    "alignment 48": (gguf_bytes([kv("general.alignment", 4, u32(48))]), "48 is not a power", KV0),
    "alignment 0": (gguf_bytes([kv("general.alignment", 4, u32(0))]), "0 is not a power", KV0),
    "alignment type": (gguf_bytes([kv("general.alignment", 10, u64(32))]),
                       "general.alignment has type u64, expected u32", KV0),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_file_raises_with_offset(tmp_path, case):
    blob, fragment, offset = MALFORMED[case]
    path = write(tmp_path, blob)
    err = open_error(path)
    assert fragment in str(err)
    assert err.offset == offset and f"offset {offset}: " in str(err)
    assert str(err).startswith(str(path)) and isinstance(err, ValueError)


def test_long_names_are_shortened_in_messages(tmp_path):
    key = "k" * 5000
    err = open_error(write(tmp_path, gguf_bytes([k1(4, u32(1), key), k1(4, u32(2), key)])))
    assert "duplicate metadata key 'kkk" in str(err) and "(5000 chars)" in str(err)
    assert len(str(err)) < len(str(tmp_path)) + 200


def test_path_problems(tmp_path):
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "missing.gguf")
    assert "is a directory" in str(open_error(tmp_path))
    assert "file is empty" in str(open_error(write(tmp_path, b"")))
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")  # must be refused, not block waiting for a writer
        assert "not a regular file" in str(open_error(tmp_path / "fifo"))
    if os.path.exists("/dev/null"):
        assert "not a regular file" in str(open_error(Path("/dev/null")))


def test_close_is_safe_while_views_exist(tmp_path):
    path = tmp_path / "w.gguf"
    write_with_gguf_py(path, 64)
    f = GGUFFile(path)
    t = f.tensors["f32"]
    kept, scores = t.array(), f.metadata["a.f32"]
    expected = kept.copy()
    with pytest.raises(ValueError):
        kept[0, 0] = 1.0  # read-only mapping
    f.close()
    f.close()
    assert f.closed
    np.testing.assert_array_equal(kept, expected)  # views taken before close stay valid
    assert scores.tolist() == [0.5, -2.0]
    with pytest.raises(GGUFError, match="closed"):
        t.data
    with GGUFFile(path) as g:
        assert not g.closed
    assert g.closed


# ---------------------------------------------------------------------------------------
# The real models.

EXPECTED = {  # tensor count, vocabulary size, tensor types present
    SMOLLM: (272, 49152, {"Q4_1", "Q8_0", "F32"}),
    GEMMA: (236, 262144, {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}),
}


@pytest.mark.parametrize("name", [SMOLLM, GEMMA])
def test_real_model_header(name):
    n_tensors, n_vocab, types = EXPECTED[name]
    with GGUFFile(model_path(name)) as f:
        assert f.version == 3 and f.alignment == 32 and f.data_offset % 32 == 0
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert len(tokens) == n_vocab and all(type(s) is str for s in tokens)
        assert f.metadata_types["tokenizer.ggml.tokens"] == "array[string]"
        token_type = f.metadata["tokenizer.ggml.token_type"]
        assert token_type.dtype == np.int32 and token_type.shape == (n_vocab,)
        assert len(f.tensors) == n_tensors and {t.type.name for t in f.tensors.values()} == types
        spans = sorted((t.offset, t.offset + t.nbytes) for t in f.tensors.values())
        assert spans[0][0] == f.data_offset and spans[-1][1] == f.size
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        for t in f.tensors.values():
            view = t.array()
            if t.type == GGMLType.F32:
                assert view.dtype == np.float32 and view.shape == t.shape
            else:
                assert view.shape == (*t.shape[:-1], layout(t.type).row_bytes(t.ne[0]))
        a, b = f.tensors["token_embd.weight"], f.tensors["output_norm.weight"]
        assert address(b.data) - address(a.data) == b.offset - a.offset  # one mapping, no copies


def address(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


def test_gemma_vocabulary():
    with GGUFFile(model_path(GEMMA)) as f:
        assert f.metadata["general.architecture"] == "gemma3"
        scores = f.metadata["tokenizer.ggml.scores"]
        assert scores.dtype == np.float32 and scores.shape == (262144,)
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert len(set(tokens)) == len(tokens)  # a vocabulary has no duplicate entries
        assert tokens[f.metadata["tokenizer.ggml.bos_token_id"]] == "<bos>"


def test_smollm_matches_gguf_py_reader():
    """The whole SmolLM2 header against gguf-py (about 2 s of GGUFReader)."""
    path = model_path(SMOLLM)
    ref = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == keys
        for key in keys:
            ours = f.metadata[key]
            assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == \
                ref.fields[key].contents(), key
        assert f.data_offset == ref.data_offset
        for rt in ref.tensors:
            t = f.tensors[rt.name]
            assert (t.type, t.ne, t.offset, t.nbytes) == \
                (GGMLType(int(rt.tensor_type)), tuple(int(n) for n in rt.shape), rt.data_offset,
                 rt.n_bytes)
            assert t.data[:64].tobytes() == rt.data.reshape(-1).view(np.uint8)[:64].tobytes()


@pytest.mark.slow
def test_gemma_matches_gguf_py_reader():
    """Same as the SmolLM2 comparison; GGUFReader needs 12-24 s on this vocabulary."""
    path = model_path(GEMMA)
    ref = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        for key, field in ref.fields.items():
            if not key.startswith("GGUF."):
                ours = f.metadata[key]
                assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == field.contents()
        assert [(t.name, t.offset, t.nbytes) for t in f.tensors.values()] == \
               [(rt.name, rt.data_offset, rt.n_bytes) for rt in ref.tensors]


# ---------------------------------------------------------------------------------------
# Cut and corrupted copies of the real models.

_FIXED_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def header_fields(buf, keep_tensors=None) -> list[tuple[int, str]]:
    """(offset, kind) of the count, length and type fields of a GGUF header.

    An independent walk, for the tests: of large string arrays only the first and last
    three entries are listed; of the tensor infos, those whose index is in keep_tensors.
    """
    fields: list[tuple[int, str]] = [(8, "count"), (16, "count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)

    def string(pos: int, keep: bool) -> int:
        if keep:
            fields.append((pos, "length"))
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]

    def value(pos: int, vtype: int, keep: bool) -> int:
        if vtype == 8:
            return string(pos, keep)
        if vtype != 9:
            return pos + _FIXED_SIZE[vtype]
        etype, count = struct.unpack_from("<IQ", buf, pos)
        if keep:
            fields.extend([(pos, "type"), (pos + 4, "count")])
        pos += 12
        if etype in _FIXED_SIZE:
            return pos + count * _FIXED_SIZE[etype]
        for i in range(count):
            pos = value(pos, etype, keep and (i < 3 or i >= count - 3))
        return pos

    pos = 24
    for _ in range(n_kv):
        pos = string(pos, True)
        fields.append((pos, "type"))
        pos = value(pos + 4, struct.unpack_from("<I", buf, pos)[0], True)
    for i in range(n_tensors):
        keep = keep_tensors is None or i in keep_tensors
        pos = string(pos, keep)
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        if keep:
            fields.extend([(pos, "n_dims"), *((pos + 4 + 8 * d, "dim") for d in range(n_dims)),
                           (pos + 4 + 8 * n_dims, "tensor type"),
                           (pos + 8 + 8 * n_dims, "tensor offset")])
        pos += 4 + 8 * n_dims + 4 + 8
    return fields


# Bad values for each kind of field, each certain to make the file invalid.
BAD_VALUES = {
    "count": ("<Q", [2**64 - 1, 2**40]),
    "length": ("<Q", [2**64 - 1, 2**33]),
    "type": ("<I", [13, 2**32 - 1]),
    "n_dims": ("<I", [5]),
    "dim": ("<Q", [0, 2**64 - 1]),
    "tensor type": ("<I", [99]),
    "tensor offset": ("<Q", [None, 2**64 - 32]),  # None: one past the stored (aligned) offset
}
FIELD_OFFSET_REPORTED = {"count", "length", "type", "n_dims", "tensor type", "tensor offset"}


@pytest.fixture(scope="module")
def model_copies(tmp_path_factory):
    """Full writable copies of both models (corruptions are written and undone in place)."""
    made = {}

    def copy(name: str) -> Path:
        if name not in made:
            src = model_path(name)
            made[name] = tmp_path_factory.mktemp("models") / name
            shutil.copyfile(src, made[name])
        return made[name]
    yield copy
    for path in made.values():
        path.unlink()  # 350 MB: do not leave it in pytest's kept temp dirs


def open_or_error(path: Path, clean_calls: int) -> str:
    """Open a possibly broken file: 'ok' or 'error'; anything but GGUFError fails the test, and so
    does a blow-up (a corrupted count looping over the file): at most a few times the calls of
    opening the intact file."""
    def attempt():
        with GGUFFile(path) as f:
            assert all(t.offset + t.nbytes <= f.size for t in f.tensors.values())

    result, calls = count_calls(attempt)
    if result is not None and not isinstance(result, GGUFError):
        raise result
    assert calls <= 3 * clean_calls + 10_000, f"open of {path}: {calls} calls (intact: {clean_calls})"
    return "ok" if result is None else "error"


@contextlib.contextmanager
def patched(fd: int, at: int, new: bytes):
    """Bytes `new` written at `at` in the open file `fd` for the duration of the block."""
    old = os.pread(fd, len(new), at)
    os.pwrite(fd, new, at)
    try:
        yield
    finally:
        os.pwrite(fd, old, at)


# Per model, how many of the costly cases to run (each parses up to the whole header,
# 0.05 s for SmolLM2, 0.1 s for Gemma): fields after the vocabulary, random corruptions,
# and cut points other than the first 48 bytes and the data-section boundaries.
SAMPLES = {SMOLLM: {"late_fields": 30, "random": 80, "cuts": 20},
           GEMMA: {"late_fields": 16, "random": 20, "cuts": 8}}


def sampled_fields(header: bytes, n_tensors: int, n_late: int, rng: random.Random):
    """Every field up to the first entries of the vocabulary, and n_late of those after it
    (among them the fields of four tensor infos)."""
    fields = header_fields(header, {0, n_tensors // 2, n_tensors - 1, rng.randrange(n_tensors)})
    vocab = header.index(b"tokenizer.ggml.tokens") + 100
    late = [f for f in fields if f[0] >= vocab]
    return [f for f in fields if f[0] < vocab] + rng.sample(late, min(n_late, len(late)))


@pytest.mark.parametrize("name", [SMOLLM, GEMMA])
def test_corrupted_real_model(model_copies, name):
    """Targeted bad values in count/length/type fields always fail, at that field; random
    bytes in the header either still parse or fail with GGUFError, never anything else."""
    path, samples, rng = model_copies(name), SAMPLES[name], random.Random(1234)
    with GGUFFile(path) as f:
        data_offset, n_tensors = f.data_offset, len(f.tensors)
    with open(path, "rb") as fh:
        header = fh.read(data_offset)
    _, clean_calls = count_calls(lambda: GGUFFile(path).close())
    fields = sampled_fields(header, n_tensors, samples["late_fields"], rng)
    outcomes = {"ok": 0, "error": 0}
    fd = os.open(path, os.O_RDWR)
    try:
        for i, (at, kind) in enumerate(fields):  # each field gets its kind's bad values in turn
            fmt, values = BAD_VALUES[kind]
            value = values[i % len(values)]
            value = struct.unpack_from(fmt, header, at)[0] + 1 if value is None else value
            with patched(fd, at, struct.pack(fmt, value)), pytest.raises(GGUFError) as info:
                GGUFFile(path)
            if kind in FIELD_OFFSET_REPORTED:
                assert info.value.offset == at, (kind, value, str(info.value))
        for _ in range(samples["random"]):  # random bytes, half of them near structural fields
            near_field = rng.random() < 0.5
            at = rng.choice(fields)[0] + rng.randrange(8) if near_field \
                else rng.randrange(data_offset)
            with patched(fd, at, rng.randbytes(rng.randint(1, 4))):
                outcomes[open_or_error(path, clean_calls)] += 1
    finally:
        os.close(fd)
    assert outcomes["error"] > 0, outcomes


@pytest.mark.parametrize("name", [SMOLLM, GEMMA])
def test_cut_real_model(tmp_path, name):
    """Every proper prefix is invalid: the last tensor ends at the end of both files.

    The cut file holds the real header; past it the file is extended sparsely (the loader
    never reads tensor data), then truncated further for each cut, longest first.
    """
    src, n_cuts, rng = model_path(name), SAMPLES[name]["cuts"], random.Random(99)
    with GGUFFile(src) as f:
        size, data_offset = f.size, f.data_offset
        assert max(t.offset + t.nbytes for t in f.tensors.values()) == size
    with open(src, "rb") as fh:
        header = fh.read(data_offset)
    _, clean_calls = count_calls(lambda: GGUFFile(src).close())
    fields = [at for at, _ in header_fields(header, {0, 1})]
    cuts = {*range(48), *(at + 3 for at in rng.sample(fields, n_cuts)),
            *(rng.randrange(48, data_offset) for _ in range(n_cuts)),
            data_offset - 1, data_offset, data_offset + 1, size - 1,
            *(rng.randrange(data_offset, size) for _ in range(3))}
    path = tmp_path / "cut.gguf"
    with open(path, "wb") as out:
        out.write(header)
    for cut in sorted(cuts, reverse=True):
        os.truncate(path, cut)
        assert open_or_error(path, clean_calls) == "error", cut


# ---------------------------------------------------------------------------------------
# Bogus counts must be rejected before anything of their size is allocated.

def traced_peak_of_failed_open(path: Path) -> int:
    tracemalloc.start()
    try:
        GGUFFile(path)
    except GGUFError:
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    raise AssertionError(f"{path} opened although corrupted")


def test_bogus_counts_allocate_less_than_the_file(tmp_path):
    """Every count/length/type field of a gguf-py file and of SmolLM2's header up to its
    vocabulary, set to each bad value, under tracemalloc: peak stays below the file size."""
    cases = []
    small = tmp_path / "w.gguf"
    write_with_gguf_py(small, 64)
    cases.append((small, header_fields(small.read_bytes())))
    if (MODELS / SMOLLM).is_file():
        with open(MODELS / SMOLLM, "rb") as fh:
            head = fh.read(2 << 20)
        vocab = head.index(b"tokenizer.ggml.tokens")
        real = tmp_path / "smollm-head.gguf"
        with open(real, "wb") as out:
            out.write(head)  # the first 2 MiB: the header and a little tensor data
        cases.append((real, [(at, k) for at, k in header_fields(head, set())
                             if at < vocab + 100]))
    for path, fields in cases:
        size = path.stat().st_size
        blob = path.read_bytes()
        for at, kind in fields:
            fmt, values = BAD_VALUES[kind]
            for value in values:
                value = struct.unpack_from(fmt, blob, at)[0] + 1 if value is None else value
                end = at + struct.calcsize(fmt)
                path.write_bytes(blob[:at] + struct.pack(fmt, value) + blob[end:])
                assert traced_peak_of_failed_open(path) < size, (path.name, at, kind, value)
