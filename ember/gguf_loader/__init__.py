"""ember's read-only GGUF parser (GGUF v2 and v3, little-endian), over mmap.

    with GGUFFile(path) as f:
        f.metadata["general.architecture"], f.tensors["token_embd.weight"].array()

Checked at open, before anything is allocated for it: magic and version, every count and
length against the bytes left, value and tensor type ids, bool bytes, duplicate keys and
tensor names, `general.alignment` (u32 power of two, default 32), tensor dimensions (at
most 4, none zero, element count within int64, rows a whole number of blocks), and tensor
data inside the file, aligned and not overlapping another tensor.

Decisions worth knowing:
- Strings (keys, values, tensor names, token texts) are decoded as UTF-8 with
  errors="surrogateescape": invalid bytes survive, and `s.encode("utf-8", "surrogateescape")`
  gives back the exact bytes of the file (tokenizers need them).
- Numeric metadata arrays and tensor views are zero-copy, read-only numpy views of the
  mmap; string arrays are lists of str; nested arrays are lists of those.
- BF16 tensors have no numpy dtype: `TensorInfo.array()` returns their uint16 bit patterns.
- Every malformed input raises GGUFError (a ValueError) whose message reads
  "<path>: offset <n>: <problem>". A missing or unreadable path raises the usual OSError
  (FileNotFoundError, PermissionError); a directory, a FIFO or device, or an empty file
  raises GGUFError.
- close() unmaps at once when nothing else points into the mapping. While numpy views
  exist (the file's own numeric metadata arrays count too) unmapping would leave them
  dangling, so close() only drops the file's reference and the map goes away when the last
  view is garbage-collected. After close(), `TensorInfo.data`/`array()` raise GGUFError;
  views taken before stay valid.
- The file must not be truncated while mapped (the OS would signal on access).
"""
from .errors import GGUFError
from .file import GGUFFile
from .tensors import TensorInfo

__all__ = ["GGUFFile", "GGUFError", "TensorInfo"]
