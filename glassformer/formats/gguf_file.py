"""A GGUF file's header read in one pass over a memory map: metadata and tensor directory.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, which
takes seconds for a 49k-token vocabulary; this reader walks the same layout with `struct`
and bounds-checks every read, so a truncated or corrupt file raises ValueError instead of
allocating or reading past the end. Types, quantization block sizes and dequantization come
from the `gguf` package.

Layout (little endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count;
metadata entries (string key, u32 value type, value); tensor infos (string name, u32 n_dims,
u64 dims (innermost first), u32 ggml type, u64 offset); padding to `general.alignment`; data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import InputError

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): (rows, columns) for a matrix
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int


class GGUFFile:
    """Metadata (`.metadata`, plain Python values) and tensors (`.tensors`, by name) of a GGUF
    file, with `raw(name, rows)` returning a tensor's bytes as a numpy view of the map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise InputError(self.path, "not a GGUF file (empty)") from None
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError) as error:
            raise InputError(self.path, f"corrupt GGUF header ({error})") from None

    def _parse(self) -> None:
        if self._map[:4] != b"GGUF":
            raise InputError(self.path, f"not a GGUF file (bad magic {self._map[:4]!r})")
        self._pos = 4
        version = self._scalar(GGUFValueType.UINT32)
        if version not in (2, 3):
            raise InputError(self.path, f"unsupported GGUF version {version}")
        n_tensors = self._scalar(GGUFValueType.UINT64)
        n_meta = self._scalar(GGUFValueType.UINT64)
        self._check_count(n_tensors + n_meta, 8)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_meta):
            key = self._string()
            self.metadata[key] = self._value(self._type())
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise InputError(self.path, f"bad general.alignment {alignment}")
        start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            block, type_bytes = GGML_QUANT_SIZES[qtype]
            if shape[-1] % block:
                raise InputError(self.path, f"tensor {name} row of {shape[-1]} is not a "
                                 f"whole number of {qtype.name} blocks")
            n_bytes = int(np.prod(shape, dtype=object)) // block * type_bytes
            info = TensorInfo(name, shape, qtype, start + offset, n_bytes)
            if info.offset + n_bytes > len(self._map):
                raise InputError(self.path, f"truncated file (tensor {name} ends at byte "
                                 f"{info.offset + n_bytes}, the file has {len(self._map)})")
            self.tensors[name] = info

    def raw(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """Rows of a tensor as stored (uint8 blocks, or the float type itself) without copying."""
        info = self.tensors[name]
        block, type_bytes = GGML_QUANT_SIZES[info.qtype]
        row_bytes = info.shape[-1] // block * type_bytes
        n_rows = info.n_bytes // row_bytes
        data = np.frombuffer(self._map, np.uint8, info.n_bytes, info.offset)
        data = data.reshape(n_rows, row_bytes)[rows]
        if info.qtype == GGMLQuantizationType.F32:
            return data.view(np.float32)
        if info.qtype == GGMLQuantizationType.F16:
            return data.view(np.float16)
        return data

    def release(self, name: str) -> None:
        """Drop a tensor's pages from memory once read (they are re-read from disk if needed)."""
        info = self.tensors[name]
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, info.offset + info.n_bytes - start)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # arrays still view the map (e.g. held by a traceback): it closes
            pass  # when the last of them is freed

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the parser: each read checks that the bytes exist
    def _take(self, n: int) -> bytes:
        if n < 0 or self._pos + n > len(self._map):
            raise InputError(self.path, f"truncated or corrupt GGUF header at byte {self._pos}")
        out = self._map[self._pos:self._pos + n]
        self._pos += n
        return out

    def _check_count(self, count: int, item_bytes: int) -> None:
        if count * item_bytes > len(self._map) - self._pos:
            raise InputError(self.path, f"truncated or corrupt GGUF header ({count} items at "
                             f"byte {self._pos} run past the end of the {len(self._map)}-byte file)")

    def _type(self) -> GGUFValueType:
        raw = self._scalar(GGUFValueType.UINT32)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise InputError(self.path, f"corrupt GGUF header (value type {raw})") from None

    def _scalar(self, kind: GGUFValueType) -> Any:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._scalar(GGUFValueType.UINT64)).decode("utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._scalar(kind)
        item = self._type()
        count = self._scalar(GGUFValueType.UINT64)
        if item in _SCALARS:  # numeric arrays in one read
            fmt = _SCALARS[item]
            self._check_count(count, struct.calcsize(fmt))
            return np.frombuffer(self._take(count * struct.calcsize(fmt)), fmt).tolist()
        self._check_count(count, 8)
        if item == GGUFValueType.STRING:
            return self._strings(count)
        return [self._value(item) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """`count` strings in one tight loop (a vocabulary holds tens of thousands), each
        length and body bounds-checked as `_take` checks them."""
        data, pos, end, strings = self._map, self._pos, len(self._map), []
        for _ in range(count):
            if pos + 8 > end:
                break
            (length,) = _U64.unpack_from(data, pos)
            if pos + 8 + length > end:
                break
            strings.append(data[pos + 8:pos + 8 + length].decode("utf-8"))
            pos += 8 + length
        self._pos = pos
        if len(strings) < count:
            self._string()  # the read that runs past the end raises, naming the byte
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar(GGUFValueType.UINT32)
        if not 1 <= n_dims <= 4:
            raise InputError(self.path, f"tensor {name} has {n_dims} dimensions")
        dims = [self._scalar(GGUFValueType.UINT64) for _ in range(n_dims)]
        raw_type = self._scalar(GGUFValueType.UINT32)
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise InputError(self.path, f"tensor {name} has unknown type {raw_type}") from None
        offset = self._scalar(GGUFValueType.UINT64)
        return name, tuple(reversed(dims)), qtype, offset
