"""A GGUF file's header, metadata and tensor table, read and checked before anything of the size it claims exists.

GGUF (llama.cpp's format, version 2 or 3, little-endian): the magic `GGUF`, a u32 version, u64 tensor and
key/value counts, the key/value pairs (typed scalars, strings, arrays), one info record per tensor (name, dims,
ggml type, offset into the data section), padding to `general.alignment`, then the tensor data. Every count,
length, dimension and offset is checked against the bytes that remain in the file before it is used, so a
truncated or malformed file fails with one `GGUFError` line naming the file and the fault, and nothing is
allocated from a number the file merely claims. The tensor bytes stay memory-mapped; `tensor(name)` dequantises
one tensor to f32 with the `gguf` package (every ggml type it implements: F32, F16, BF16, Q4_0 ... Q8_0, the
K-quants, the IQ types).

Limits: big-endian files and GGUF version 1 are refused.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct

import numpy as np

from kvjax.errors import InputError

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# value type -> (struct format, bytes) for fixed-size scalars; 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
               12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFError(InputError):
    """A GGUF file is malformed, truncated, or holds something kvjax cannot read: names the file and the fault."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's record: `shape` in NumPy order (GGUF lists dims innermost first), ggml `type`, byte range."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return _type_name(self.type)


def gguf_package():
    """The `gguf` package (an optional dependency: the `gguf` extra), or one error line saying how to install it."""
    try:
        import gguf  # noqa: PLC0415 - needed only for GGUF files
    except ImportError:
        raise GGUFError("reading GGUF files needs the gguf package: pip install 'kvjax[gguf]' (or gguf==0.19.0)") from None
    return gguf


def _type_name(t: int) -> str:
    gguf = gguf_package()

    try:
        return gguf.GGMLQuantizationType(t).name
    except ValueError:
        return f"unknown ggml type {t}"


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; every fault names the file and the offset."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str):
        raise GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos}, the file has {self.size - self.pos} left")

    def scalar(self, vtype: int, what: str):
        fmt, n = _SCALARS[vtype]
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at offset {self.pos - n} is not UTF-8")

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            self.fail(f"{what} has unknown value type {vtype}")
        etype = self.u32(f"{what} element type")
        n = self.u64(f"{what} element count")
        if etype in _SCALARS:
            size = _SCALARS[etype][1]
            self.need(n * size, f"{what} ({n} elements)")  # before allocating n of anything
            a = np.frombuffer(self.buf, dtype=_NP_SCALARS[etype], count=n, offset=self.pos)
            self.pos += n * size
            return a.astype(bool) if etype == 7 else a.copy()
        if etype == _STRING:
            self.need(n * 8, f"{what} ({n} strings)")  # each string has at least its 8-byte length
            return [self.string(f"{what}[{i}]") for i in range(n)]
        self.fail(f"{what} is an array of {'arrays' if etype == _ARRAY else f'unknown type {etype}'}, not supported")


class GGUFFile:
    """A checked GGUF file: `metadata` (key -> value), `tensors` (name -> TensorInfo), `tensor(name)` as f32.

    Args:
        path: the .gguf file.

    Raises:
        GGUFError: bad magic or version, a count, length or dimension the file cannot hold, an offset past the end,
            duplicate names — naming the file and the fault.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        gguf_package()
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{self.path}: truncated: {size} bytes, a GGUF header alone takes 24")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size
        c = _Cursor(self._map, self.path)
        magic = bytes(self._map[:4])
        if magic != MAGIC:
            c.fail(f"not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in (2, 3):
            hint = " (a big-endian file?)" if self.version > 0xFFFF else ""
            c.fail(f"GGUF version {self.version} is not supported (2 or 3){hint}")
        n_tensors, n_kv = c.u64("tensor count"), c.u64("metadata count")
        # the smallest key/value pair is 13 bytes, the smallest tensor record 24 (empty name, 1 dim): a count the
        # rest of the file cannot hold fails here, not after a loop or an allocation of that size
        if n_kv * 13 + n_tensors * 24 > size - c.pos:
            c.fail(f"truncated or absurd counts: {n_tensors} tensors and {n_kv} metadata entries do not fit in {size} bytes")
        self.metadata: dict = {}
        for i in range(n_kv):
            key = c.string(f"metadata key {i}")
            if key in self.metadata:
                c.fail(f"duplicate metadata key {key!r}")
            self.metadata[key] = c.value(c.u32(f"{key} type"), key)
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            c.fail(f"general.alignment={align!r} is not a power of two")
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor {i} name")
            nd = c.u32(f"{name} dimension count")
            if not 1 <= nd <= MAX_DIMS:
                c.fail(f"tensor {name!r} has {nd} dimensions (1..{MAX_DIMS})")
            dims = [c.u64(f"{name} dimension {j}") for j in range(nd)]
            infos.append((name, dims, c.u32(f"{name} type"), c.u64(f"{name} offset")))
        self.data_start = -(-c.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, t, off in infos:
            if name in self.tensors:
                c.fail(f"duplicate tensor {name!r}")
            self.tensors[name] = self._check_tensor(c, name, dims, t, off, align)

    def _check_tensor(self, c: _Cursor, name: str, dims: list[int], t: int, off: int, align: int) -> TensorInfo:
        gguf = gguf_package()

        if t not in gguf.GGML_QUANT_SIZES:
            c.fail(f"tensor {name!r} has {_type_name(t)}, which the gguf package does not know")
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]
        if any(d == 0 or d > self.size * block for d in dims):
            c.fail(f"tensor {name!r} has absurd dimensions {dims}")
        if dims[0] % block:
            c.fail(f"tensor {name!r}: row length {dims[0]} is not a multiple of {_type_name(t)}'s block of {block}")
        count = int(np.prod(dims, dtype=object))
        nbytes = count // block * type_size
        if off % align:
            c.fail(f"tensor {name!r}: offset {off} is not a multiple of the alignment {align}")
        start = self.data_start + off
        if start + nbytes > self.size:
            c.fail(f"truncated or corrupt: tensor {name!r}: bytes {start}..{start + nbytes} run past the end of the "
                   f"file ({self.size} bytes)")
        return TensorInfo(name, tuple(int(d) for d in reversed(dims)), t, start, nbytes)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name` dequantised to f32, in NumPy order (for a matrix: [rows, row length]).

        Raises:
            GGUFError: no such tensor, or a ggml type the gguf package cannot dequantise (naming it).
        """
        gguf = gguf_package()
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: missing tensor {name!r}")
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(rows, -1)
        qtype = gguf.GGMLQuantizationType(info.type)
        try:
            out = gguf.quants.dequantize(raw, qtype)
        except NotImplementedError:
            raise GGUFError(f"{self.path}: tensor {name!r} has type {qtype.name}, which the gguf package cannot "
                            f"dequantise") from None
        if out.dtype.kind != "f":
            raise GGUFError(f"{self.path}: tensor {name!r} has integer type {qtype.name}, not weights")
        return np.asarray(out, np.float32).reshape(info.shape)

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, version={self.version}, tensors={len(self.tensors)})"
