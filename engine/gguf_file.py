"""A GGUF file's header, metadata and tensor table, read from a file that nobody vouches for.

Model files come from strangers on the internet, and loaders of this format have had
integer-overflow advisories on exactly this input (llama.cpp: CVE-2025-53630,
CVE-2026-27940, CVE-2026-33298). So every count, length, dimension, type id, offset and
size is checked against the file's real size and the format's limits before anything is
allocated or read; Python's integers cannot overflow, so a product that a C loader would
wrap is compared against its limit as it is. What is wrong is one `ModelFileError` line
that names the file, the key or tensor, and the fault.

Parsed here rather than by `gguf.GGUFReader`, which builds an object per element of the
tokenizer's arrays (3 s for SmolLM2's): arrays are checked and skipped, their bytes unread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import ModelFileError

SUPPORTED_VERSIONS = (2, 3)  # v1 counted in 32 bits; v2 and v3 (big-endian aside) agree
MAX_DIMS = 4  # GGML_MAX_DIMS: a tensor has 1 to 4 dimensions
MAX_ELEMENTS = 2**63 - 1  # ggml counts elements and bytes in int64
DEFAULT_ALIGNMENT = 32
# The smallest an entry can be: a metadata key-value (key length, 1-byte key, type, u8
# value) and a tensor's entry (name length, 1-byte name, n_dims, one dimension, type,
# offset). A count the rest of the file cannot hold is refused before any loop runs.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8

# GGUF metadata value types -> struct formats (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # rows first, as torch has it (GGUF lists ne0 first)
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array, skipped unread: its element type, length and where its first
    element starts (`GGUFFile.read_array` reads it, already checked against the file)."""

    type: int
    count: int
    offset: int = 0


class _Cursor:
    """Reads forward through the file, every read checked against its end."""

    def __init__(self, data: memoryview, path: Path) -> None:
        self.data, self.path, self.pos, self.size = data, path, 0, len(data)

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {what}")

    def need(self, nbytes: int, what: str, at: int | None = None) -> None:
        at = self.pos if at is None else at
        if nbytes > self.size - at:
            raise self.fail(
                f"truncated: {what} needs {nbytes:,} bytes at offset {at:,}, "
                f"the file ends at {self.size:,}"
            )

    def unpack(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize(fmt)
        self.need(size, what)
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def skip_string(self, what: str) -> None:
        (size,) = self.unpack("<Q", what)
        self.need(size, what)
        self.pos += size

    def string(self, what: str, strict: bool = False) -> str:
        """A length-prefixed string; ``strict``: a name must be UTF-8, not repaired."""
        start = self.pos
        self.skip_string(what)
        raw = bytes(self.data[start + 8 : self.pos])
        try:
            return raw.decode("utf-8", "strict" if strict else "replace")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start:,} is not UTF-8") from None


class GGUFFile:
    """A GGUF file's scalar metadata and tensor table, and the file mapped in memory.

    Construction checks the whole header and table (`ModelFileError` on the first fault);
    afterwards `array(info)` is a view that lies inside the file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            # "c": a private copy-on-write map, so torch gets writable arrays without copying.
            self.data = np.memmap(self.path, dtype=np.uint8, mode="c")
        except (OSError, ValueError) as exc:  # ValueError: numpy cannot map an empty file
            raise ModelFileError(f"{self.path}: cannot be read ({exc})") from None
        cursor = _Cursor(memoryview(self.data), self.path)  # (struct reads it fastest)
        if bytes(self.data[:4]) != b"GGUF":
            raise cursor.fail("not a GGUF file (it does not start with the bytes 'GGUF')")
        cursor.pos = 4
        version, tensors, kvs = cursor.unpack("<IQQ", "the header")
        if version not in SUPPORTED_VERSIONS:
            raise cursor.fail(
                f"GGUF version {version} is not supported (versions 2 and 3, little-endian)"
            )
        self.metadata = _read_metadata(cursor, kvs)
        alignment = _alignment(cursor, self.metadata)
        self.tensors = _read_tensor_table(cursor, tensors, alignment)
        self._arrays: dict[str, list[str] | np.ndarray] = {}

    def array(self, info: TensorInfo) -> np.ndarray:
        return self.data[info.offset : info.offset + info.nbytes]

    def read_array(self, key: str) -> list[str] | np.ndarray | None:
        """Metadata array ``key`` read in full (None if the file has no such array): a list
        of str for strings (UTF-8, repaired), a numpy array of the scalars otherwise.
        Construction checked every length against the file, so this reads within it."""
        info = self.metadata.get(key)
        if not isinstance(info, ArrayInfo):
            return None
        if key in self._arrays:
            return self._arrays[key]
        self._arrays[key] = values = self._read_array(info)
        return values

    def _read_array(self, info: ArrayInfo) -> list[str] | np.ndarray:
        if info.type != _STRING:
            dtype = np.dtype("<" + _SCALARS[info.type]) if info.type != 7 else np.dtype(bool)
            end = info.offset + info.count * dtype.itemsize
            return np.frombuffer(self.data[info.offset : end], dtype=dtype)
        data, pos, values = memoryview(self.data), info.offset, []
        for _ in range(info.count):
            (length,) = _U64.unpack_from(data, pos)
            values.append(bytes(data[pos + 8 : pos + 8 + length]).decode("utf-8", "replace"))
            pos += 8 + length
        return values


def _count(cursor: _Cursor, count: int, min_bytes: int, what: str) -> int:
    room = (cursor.size - cursor.pos) // min_bytes
    if count > room:
        raise cursor.fail(
            f"{what}: {count:,} entries of at least {min_bytes} bytes each cannot fit in the "
            f"{cursor.size - cursor.pos:,} bytes left at offset {cursor.pos:,}"
        )
    return count


def _read_metadata(cursor: _Cursor, kvs: int) -> dict[str, object]:
    metadata: dict[str, object] = {}
    for index in range(_count(cursor, kvs, _MIN_KV_BYTES, "the metadata count")):
        key = cursor.string(f"metadata key {index}", strict=True)
        if key in metadata:
            raise cursor.fail(f"metadata key {key!r} appears twice")
        (vtype,) = cursor.unpack("<I", f"the type of metadata key {key!r}")
        metadata[key] = _value(cursor, vtype, key)
    return metadata


def _value(cursor: _Cursor, vtype: int, key: str) -> object:
    what = f"the value of metadata key {key!r}"
    if vtype in _SCALARS:
        return cursor.unpack("<" + _SCALARS[vtype], what)[0]
    if vtype == _STRING:
        return cursor.string(what)
    if vtype != _ARRAY:
        raise cursor.fail(
            f"metadata key {key!r} has value type {vtype}, which GGUF does not define"
        )
    etype, count = cursor.unpack("<IQ", f"the array header of metadata key {key!r}")
    start = cursor.pos
    if etype in _SCALARS:
        size = struct.calcsize(_SCALARS[etype])
        cursor.need(count * size, what)  # a Python product: it cannot wrap
        cursor.pos += count * size
    elif etype == _STRING:  # strings (the vocabulary, its merges): only their lengths read
        _skip_strings(cursor, _count(cursor, count, 8, f"the array of metadata key {key!r}"), key)
    else:  # llama.cpp's reader takes no nested arrays either
        raise cursor.fail(f"metadata key {key!r} is an array of type {etype}: not supported")
    return ArrayInfo(etype, count, start)


_U64 = struct.Struct("<Q")


def _skip_strings(cursor: _Cursor, count: int, key: str) -> None:
    """Past ``count`` length-prefixed strings, each checked against the file's end; inline
    rather than through `_Cursor.skip_string`, since a vocabulary holds 50-250 thousand."""
    data, pos, size = cursor.data, cursor.pos, cursor.size
    for index in range(count):
        length = _U64.unpack_from(data, pos)[0] if pos + 8 <= size else None
        if length is None or length > size - pos - 8:
            cursor.pos = pos
            cursor.skip_string(f"string {index:,} of metadata key {key!r}")  # raises
        pos += 8 + length
    cursor.pos = pos


def _alignment(cursor: _Cursor, metadata: dict[str, object]) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment is {alignment!r}, not a power of two")
    return alignment


def _read_tensor_table(cursor: _Cursor, count: int, alignment: int) -> list[TensorInfo]:
    entries = []
    names: set[str] = set()
    for index in range(_count(cursor, count, _MIN_TENSOR_INFO_BYTES, "the tensor count")):
        name = cursor.string(f"the name of tensor {index}", strict=True)
        if name in names:
            raise cursor.fail(f"tensor {name!r} appears twice")
        names.add(name)
        (n_dims,) = cursor.unpack("<I", f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name} has {n_dims:,} dimensions (GGUF allows 1 to 4)")
        dims = cursor.unpack(f"<{n_dims}Q", f"the dimensions of tensor {name}")
        type_id, offset = cursor.unpack("<IQ", f"the type and offset of tensor {name}")
        entries.append((name, _tensor_type(cursor, name, type_id), dims, offset))
    start = -(-cursor.pos // alignment) * alignment  # the data section, aligned
    tensors = [_tensor_info(cursor, start, alignment, *entry) for entry in entries]
    _check_no_overlap(cursor, tensors)
    return tensors


def _tensor_type(cursor: _Cursor, name: str, type_id: int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        qtype = None
    if qtype is None or qtype not in GGML_QUANT_SIZES:
        raise cursor.fail(f"tensor {name} has ggml type id {type_id}, which is not a known type")
    return qtype


def _tensor_info(
    cursor: _Cursor, start: int, alignment: int, name: str, qtype: GGMLQuantizationType,
    dims: tuple[int, ...], offset: int,
) -> TensorInfo:  # fmt: skip
    elements = 1
    for dim in dims:
        elements *= dim
    if min(dims) < 1 or elements > MAX_ELEMENTS:
        raise cursor.fail(
            f"tensor {name} has dimensions {list(dims)}: "
            + ("one is 0" if min(dims) < 1 else "their product overflows int64")
        )
    values, block_bytes = GGML_QUANT_SIZES[qtype]
    if dims[0] % values:
        raise cursor.fail(f"tensor {name}: a row of {dims[0]:,} values is not a whole number "
                          f"of {qtype.name} blocks ({values} values each)")  # fmt: skip
    if offset % alignment:
        raise cursor.fail(f"tensor {name}: offset {offset:,} is not a multiple of the "
                          f"alignment {alignment}")  # fmt: skip
    nbytes = elements // values * block_bytes
    cursor.need(nbytes, f"tensor {name}", at=start + offset)
    return TensorInfo(name, qtype, tuple(reversed(dims)), start + offset, nbytes)


def _check_no_overlap(cursor: _Cursor, tensors: list[TensorInfo]) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, after in zip(ordered, ordered[1:], strict=False):
        if before.offset + before.nbytes > after.offset:
            raise cursor.fail(f"tensors {before.name} and {after.name} overlap in the file")
