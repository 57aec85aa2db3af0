"""Tensor infos: reading them, checking where their data lies, and viewing that data."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field, replace

import numpy as np

from ..quant.types import GGMLType, layout
from .constants import INT64_MAX, MAX_DIMS, MAX_TENSOR_NAME_BYTES, MIN_TENSOR_INFO_BYTES
from .cursor import Cursor
from .errors import GGUFError, quoted

# Types that numpy can view directly. BF16 has no numpy dtype: it is viewed as its raw
# uint16 bit patterns (shift left by 16 and view as float32 to convert).
PLAIN_DTYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype("<f4"),
    GGMLType.F16: np.dtype("<f2"),
    GGMLType.BF16: np.dtype("<u2"),
    GGMLType.F64: np.dtype("<f8"),
    GGMLType.I8: np.dtype("i1"),
    GGMLType.I16: np.dtype("<i2"),
    GGMLType.I32: np.dtype("<i4"),
    GGMLType.I64: np.dtype("<i8"),
}


class Mapping:
    """The read-only mmap of one file, shared by a GGUFFile and its TensorInfos."""

    def __init__(self, mm: mmap.mmap):
        self._mm: mmap.mmap | None = mm

    @property
    def closed(self) -> bool:
        return self._mm is None

    def view(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        if self._mm is None:
            raise GGUFError("file is closed")
        return np.frombuffer(self._mm, dtype, count, offset)

    def whole(self) -> np.ndarray:
        """The whole mapping as read-only bytes."""
        if self._mm is None:
            raise GGUFError("file is closed")
        return np.frombuffer(self._mm, np.uint8)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            # numpy views still point into the map: unmapping now would leave them dangling.
            # They hold the mmap object, which unmaps itself when the last one is collected.
            pass


@dataclass(frozen=True, slots=True, eq=False)
class TensorInfo:
    """One tensor: its place in the file and zero-copy views of its bytes."""

    name: str
    type: GGMLType
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous (innermost) dimension
    offset: int  # absolute byte offset in the file
    nbytes: int
    _mapping: Mapping = field(repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (outermost first): reversed `ne`."""
        return self.ne[::-1]

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes: 1-D read-only uint8 view into the file's mmap."""
        return self._mapping.view(np.dtype(np.uint8), self.nbytes, self.offset)

    def mapped_file(self) -> np.ndarray:
        """The whole file's mapping as bytes; this tensor's lie at `offset`."""
        return self._mapping.whole()

    def rows(self, lo: int, hi: int) -> "TensorInfo":
        """Rows lo..hi of a matrix as a tensor of its own (the parts of a fused projection):
        the same bytes, no copy."""
        if len(self.ne) != 2 or not 0 <= lo < hi <= self.ne[1]:
            raise ValueError(f"rows {lo}..{hi} of '{self.name}' {self.shape}")
        size = row_bytes(self.type, self.ne)
        return replace(self, name=f"{self.name}[{lo}:{hi}]", ne=(self.ne[0], hi - lo),
                       offset=self.offset + lo * size, nbytes=(hi - lo) * size)

    def array(self) -> np.ndarray:
        """Typed read-only view with `shape` for plain types (BF16 as uint16 bits);
        for quantized types a uint8 view of shape (*shape[:-1], bytes per row)."""
        dtype = PLAIN_DTYPES.get(self.type)
        if dtype is not None:
            return self._mapping.view(dtype, self.n_elements, self.offset).reshape(self.shape)
        return self.data.reshape(*self.shape[:-1], row_bytes(self.type, self.ne))


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """A tensor info as read, with the offsets of its fields for error messages."""

    name: str
    ne: tuple[int, ...]
    type_id: int
    rel_offset: int  # relative to the start of the data section
    at: int  # offset of the name
    dims_at: int
    type_at: int
    offset_at: int

    @property
    def label(self) -> str:
        return f"tensor {quoted(self.name)}"


def row_bytes(t: GGMLType, ne: tuple[int, ...]) -> int:
    return layout(t).row_bytes(ne[0] if ne else 1)


def read_tensor_records(cur: Cursor, count: int) -> list[TensorRecord]:
    """`count` tensor infos: name, u32 n_dims, u64 dims, u32 type, u64 offset."""
    records, seen = [], set()
    for _ in range(count):
        record = read_tensor_record(cur)
        if record.name in seen:
            raise cur.error(f"duplicate tensor name {quoted(record.name)}", record.at)
        seen.add(record.name)
        records.append(record)
    return records


def read_tensor_record(cur: Cursor) -> TensorRecord:
    at = cur.pos
    name = cur.string("tensor name", MAX_TENSOR_NAME_BYTES)
    label = f"tensor {quoted(name)}"  # for messages while the record is being read
    n_dims_at = cur.pos
    n_dims = cur.u32(f"n_dims of {label}")
    if n_dims > MAX_DIMS:
        raise cur.error(f"{label} has {n_dims} dimensions (at most {MAX_DIMS})", n_dims_at)
    dims_at = cur.pos
    ne = tuple(cur.u64(f"dimension {i} of {label}") for i in range(n_dims))
    type_at = cur.pos
    type_id = cur.u32(f"type of {label}")
    offset_at = cur.pos
    rel_offset = cur.u64(f"data offset of {label}")
    return TensorRecord(name, ne, type_id, rel_offset, at, dims_at, type_at, offset_at)


def check_tensor_count(cur: Cursor, count: int, at: int) -> None:
    cur.check_count(count, MIN_TENSOR_INFO_BYTES, "tensor count", at)


@dataclass(frozen=True, slots=True)
class Truncation:
    """A file cut short: how many bytes its tensors need beyond its end, and which tensors are not
    wholly in it."""

    missing: int
    cut: tuple[TensorRecord, ...]
    n_tensors: int

    def __str__(self) -> str:
        return (f"the file is cut short, {self.missing} bytes missing ({len(self.cut)} of {self.n_tensors} "
                f"tensors not wholly present, the first '{self.cut[0].name}')")


def place_tensors(records: list[TensorRecord], data_offset: int, alignment: int, size: int, mapping: Mapping,
                  partial: bool = False) -> tuple[dict[str, TensorInfo], Truncation | None]:
    """Validate every record against the file and build TensorInfos, in file order. A file cut
    short is refused, naming the missing bytes; with `partial` its whole tensors are placed and
    the Truncation returned beside them (enough to show or tokenize with a file's first part)."""
    ends = [data_offset + r.rel_offset + tensor_nbytes(r, tensor_type(r)) for r in records]
    cut = tuple(r for r, end in zip(records, ends) if end > size)
    truncation = Truncation(max(ends) - size, cut, len(records)) if cut else None
    if truncation and partial:
        records = [r for r, end in zip(records, ends) if end <= size]
    missing = f": {truncation}" if truncation else ""
    tensors = {r.name: place_tensor(r, data_offset, alignment, size, mapping, missing) for r in records}
    check_no_overlap(records, tensors)
    return tensors, truncation


def place_tensor(r: TensorRecord, data_offset: int, alignment: int, size: int,
                 mapping: Mapping, missing: str = "") -> TensorInfo:
    ggml_type = tensor_type(r)
    nbytes = tensor_nbytes(r, ggml_type)
    if r.rel_offset % alignment:
        raise GGUFError(f"{r.label} data offset {r.rel_offset} is not a multiple of the "
                        f"alignment {alignment}", offset=r.offset_at)
    start = data_offset + r.rel_offset
    if start + nbytes > size:
        raise GGUFError(f"{r.label} data [{start}, {start + nbytes}) runs past end of file "
                        f"(size {size}){missing}", offset=r.offset_at)
    return TensorInfo(r.name, ggml_type, r.ne, start, nbytes, mapping)


def tensor_type(r: TensorRecord) -> GGMLType:
    try:
        ggml_type = GGMLType(r.type_id)
        layout(ggml_type)
    except (ValueError, KeyError):
        raise GGUFError(f"unknown tensor type {r.type_id} for {r.label}",
                        offset=r.type_at) from None
    return ggml_type


def tensor_nbytes(r: TensorRecord, ggml_type: GGMLType) -> int:
    """Bytes of the tensor's data, after checking its dimensions make sense for its type."""
    if any(n == 0 for n in r.ne):
        raise GGUFError(f"{r.label} has a zero dimension {list(r.ne)}", offset=r.dims_at)
    if math.prod(r.ne) > INT64_MAX:
        raise GGUFError(f"{r.label} dimensions {list(r.ne)} overflow int64", offset=r.dims_at)
    block = layout(ggml_type)
    row = r.ne[0] if r.ne else 1
    if row % block.block_size:
        raise GGUFError(f"{r.label} row of {row} values is not a multiple of the "
                        f"{ggml_type.name} block size {block.block_size}", offset=r.dims_at)
    return block.row_bytes(row) * math.prod(r.ne[1:])


def check_no_overlap(records: list[TensorRecord], tensors: dict[str, TensorInfo]) -> None:
    """Tensors sorted by offset must each end before the next one starts."""
    by_start = sorted(records, key=lambda r: tensors[r.name].offset)
    for before, after in zip(by_start, by_start[1:]):
        a, b = tensors[before.name], tensors[after.name]
        if b.offset < a.offset + a.nbytes:
            raise GGUFError(f"{after.label} data [{b.offset}, {b.offset + b.nbytes}) overlaps "
                            f"{before.label} [{a.offset}, {a.offset + a.nbytes})",
                            offset=after.offset_at)
