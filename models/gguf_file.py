"""The GGUF container read directly: header, metadata, tensor table, and memory-mapped tensor bytes.

Why not ``gguf.GGUFReader``: it builds numpy views for every part of every field, so a 151k-token vocabulary
and its merges cost seconds of a model's load; this reader decodes the metadata in one pass over a
``memoryview`` and maps each tensor's bytes as a numpy view (no copy). The ``gguf`` package stays the oracle
for the block formats (``gguf.quants``) and their type numbers.

Everything read is validated before it is used, so a truncated, corrupt or hostile file raises one
ValueError that says what is wrong (never a struct or numpy error, never an allocation sized by the file):
string and array lengths within the bytes left, at most 4 dimensions, every dimension positive, known types,
whole blocks, offsets aligned and inside the file, no duplicate keys or tensor names.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFTensor", "GGUFFile", "read_gguf"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32

# metadata value types: (struct format, size) of the scalar ones; 8 is a string, 9 an array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_MAX_NESTING = 4  # arrays of arrays: deeper than any real file


@dataclass
class GGUFTensor:
    """One tensor of the table: ``shape`` in GGUF order (ne0, the contiguous dimension, first), as the gguf
    package gives it; ``data`` a read-only numpy view of its bytes (float32 / float16 / ints with the reversed
    shape for the plain types, uint8 ``[..., row_bytes]`` for the block formats)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass
class GGUFFile:
    path: Path
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_start: int
    file_size: int


class _Cursor:
    """Little-endian reads from a buffer, each checked against its end (``what`` names the part for errors)."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def fail(self, what: str, detail: str) -> ValueError:
        return ValueError(f"{self.path} is truncated or corrupt: {what} {detail} (byte {self.pos} of {self.end}); "
                          f"download or export the file again")

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.end - self.pos:
            raise self.fail(what, f"needs {n} bytes, {self.end - self.pos} are left")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, size: int, what: str):
        return struct.unpack(fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(what + "'s length")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail(what, "is not UTF-8") from None

    def strings(self, count: int, what: str) -> list[str]:
        # a loop with few calls per item: a vocabulary holds 10^5 of them
        buf, pos, end, out = self.buf, self.pos, self.end, []
        unpack = struct.Struct("<Q").unpack_from
        try:
            for i in range(count):
                if end - pos < 8:
                    raise IndexError
                (n,) = unpack(buf, pos)
                pos += 8
                if n > end - pos:
                    raise IndexError
                out.append(str(buf[pos:pos + n], "utf-8"))
                pos += n
        except IndexError:
            self.pos = pos
            raise self.fail(f"{what} item {len(out)}", "runs past the end") from None
        except UnicodeDecodeError:
            self.pos = pos
            raise self.fail(f"{what} item {len(out)}", "is not UTF-8") from None
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            v = self.scalar(*_SCALARS[vtype], what)
            return bool(v) if vtype == _BOOL else v
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(what, f"has value type {vtype}, which GGUF does not define (0-12)")
        if depth >= _MAX_NESTING:
            raise self.fail(what, f"nests arrays deeper than {_MAX_NESTING}")
        etype = self.u32(what + "'s element type")
        count = self.u64(what + "'s length")
        if etype in _NUMPY:
            size = _SCALARS[etype][1]
            if count > (self.end - self.pos) // size:
                raise self.fail(what, f"declares {count} elements of {size} bytes, more than the file holds")
            return np.frombuffer(self.take(count * size, what), dtype=_NUMPY[etype]).tolist()
        if etype == _BOOL:
            if count > self.end - self.pos:
                raise self.fail(what, f"declares {count} elements, more than the file holds")
            return [b != 0 for b in self.take(count, what)]
        if etype == _STRING:
            if count > (self.end - self.pos) // 8:
                raise self.fail(what, f"declares {count} strings, more than the file holds")
            return self.strings(count, what)
        if etype == _ARRAY:
            if count > (self.end - self.pos) // 12:  # an empty array is 12 bytes
                raise self.fail(what, f"declares {count} arrays, more than the file holds")
            return [self.value(_ARRAY, f"{what}[{i}]", depth + 1) for i in range(count)]
        raise self.fail(what, f"has element type {etype}, which GGUF does not define (0-12)")


def _plain_dtype(qtype) -> str | None:
    """The numpy dtype of a tensor type stored as plain values, None for a block format."""
    return {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4",
            "I64": "<i8"}.get(qtype.name)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read and validate ``path``'s header, metadata and tensor table; map its tensors' bytes (read-only).

    Raises ValueError for a file that is not GGUF, a version other than 2 or 3, a big-endian file, or any
    truncated or inconsistent part (see the module docstring)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is not a file; pass the path of a .gguf file")
    file_size = path.stat().st_size
    if file_size < 24:
        raise ValueError(f"{path} is {file_size} bytes, too short for a GGUF header (24 bytes); it is not a GGUF "
                         f"file or it is truncated")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mapped)
    if bytes(buf[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {bytes(buf[:4])!r}, a GGUF file starts with "
                         f"{MAGIC!r}")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.u32("the version")
    if version not in VERSIONS:
        if struct.unpack(">I", struct.pack("<I", version))[0] in VERSIONS:
            raise ValueError(f"{path} is a big-endian GGUF file; graphspec reads little-endian GGUF files only")
        raise ValueError(f"{path} is GGUF version {version}, which is not supported (supported: {list(VERSIONS)}); "
                         f"re-export it with a recent llama.cpp")
    n_tensors = cur.u64("the tensor count")
    n_fields = cur.u64("the metadata count")
    if n_fields > (file_size - cur.pos) // 13:  # the smallest key/value: 8 + 0 + 4 + 1 bytes
        raise cur.fail("the metadata count", f"{n_fields} is more than the file could hold")
    if n_tensors > (file_size - cur.pos) // 32:  # the smallest table entry: 8 + 0 + 4 + 8 + 4 + 8 bytes
        raise cur.fail("the tensor count", f"{n_tensors} is more than the file could hold")

    fields: dict[str, Any] = {}
    for i in range(n_fields):
        key = cur.string(f"metadata key {i}")
        if key in fields:
            raise cur.fail(f"metadata key {key!r}", "appears twice")
        fields[key] = cur.value(cur.u32(f"the type of {key!r}"), f"metadata {key!r}")

    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path} has general.alignment={alignment!r}; expected a positive power of two")

    table = []
    for i in range(n_tensors):
        name = cur.string(f"tensor {i}'s name")
        n_dims = cur.u32(f"tensor {name!r}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r}", f"has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        dims = tuple(cur.u64(f"tensor {name!r}'s shape") for _ in range(n_dims))
        if any(d == 0 or d >= 1 << 40 for d in dims):
            raise cur.fail(f"tensor {name!r}", f"has shape {list(dims)}; every dimension must be in [1, 2^40)")
        raw_type = cur.u32(f"tensor {name!r}'s type")
        offset = cur.u64(f"tensor {name!r}'s offset")
        table.append((name, dims, raw_type, offset))
    data_start = -(-cur.pos // alignment) * alignment

    tensors: list[GGUFTensor] = []
    names: set[str] = set()
    for name, dims, raw_type, offset in table:
        if name in names:
            raise ValueError(f"{path} is corrupt: tensor {name!r} appears twice in its tensor table")
        names.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name!r} has type number {raw_type}, which the gguf package does not "
                             f"know; the file is corrupt or newer than this graphspec") from None
        n_elements = math.prod(dims)
        if dims[0] % block:
            raise ValueError(f"{path} is corrupt: tensor {name!r} ({qtype.name}, shape {list(dims)}) has rows of "
                             f"{dims[0]} values, not whole blocks of {block}")
        n_bytes = n_elements // block * type_size
        if offset % alignment:
            raise ValueError(f"{path} is corrupt: tensor {name!r} starts at data offset {offset}, not a multiple of "
                             f"the alignment {alignment}")
        start = data_start + offset
        if start + n_bytes > file_size:
            raise ValueError(f"{path} is truncated: tensor {name!r} needs bytes {start} to {start + n_bytes} but the "
                             f"file has {file_size}; download or export the file again")
        np_shape = tuple(reversed(dims))
        plain = _plain_dtype(qtype)
        if plain is not None:
            data = mapped[start:start + n_bytes].view(plain).reshape(np_shape)
        else:
            data = mapped[start:start + n_bytes].reshape(*np_shape[:-1], dims[0] // block * type_size)
        tensors.append(GGUFTensor(name, qtype, dims, n_elements, n_bytes, start, data))
    return GGUFFile(path, version, fields, tensors, alignment, data_start, file_size)
