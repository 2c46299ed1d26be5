"""A GGUF file's metadata and tensor table, read without reading the tensors or unpacking arrays.

Why not ``gguf.GGUFReader``: it builds a numpy view per element of every metadata array, and
SmolLM2's file carries its tokenizer (49,152 tokens and 48,900 merges as string arrays): 6.5 s on
a 2-core CPU and 6.3 s of the H200's start-up ("machine defaults", 2026-12-06), spent before
``flowrl train`` or ``flowrl plan`` had loaded anything, to learn the parameter count and the
attention shape. Here an array is skipped (its strings' lengths walked, nothing decoded) and
recorded as its element count; the scalars and the tensor table are read as they are. Loading
the weights still goes through transformers and ``gguf`` (``models/loading.py``).

Format (GGUF v2/v3, little-endian; github.com/ggml-org/ggml docs/gguf.md): magic ``GGUF``,
uint32 version, uint64 tensor count, uint64 key-value count; each key-value pair is a string key,
a uint32 value type and the value (strings: uint64 length + UTF-8 bytes; arrays: uint32 element
type, uint64 count, the elements); then per tensor its name, uint32 dimension count, uint64
dimensions (fastest-varying first, as ``gguf`` lists them), uint32 ggml type, uint64 offset.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Union

# value type -> struct format of one element (GGUFValueType of the gguf package)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, not unpacked: its element type (``gguf.GGUFValueType`` value) and
    element count (for ``tokenizer.ggml.tokens``: the vocabulary size)."""

    element_type: int
    count: int


Value = Union[int, float, bool, str, GGUFArray]


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_gguf_header` read.

    Attributes:
        version: the file's GGUF version (2 or 3).
        fields: metadata key -> value (Python int / float / bool / str; arrays as
            :class:`GGUFArray`).
        tensors: tensor name -> dimensions, fastest-varying first (``token_embd.weight`` is
            ``(hidden, vocab)``), as ``gguf.ReaderTensor.shape`` lists them.
    """

    version: int
    fields: dict[str, Value] = field(default_factory=dict)
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def n_elements(self) -> int:
        """Elements of every tensor in the file (tied weights stored once count once)."""
        return sum(math.prod(shape) for shape in self.tensors.values())


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> tuple:
        try:
            out = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: GGUF header ends early (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: GGUF string of {n} bytes runs past the file's end")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (n,) = self.unpack("<Q")
            self.pos += n

    def value(self, vtype: int) -> Value:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[etype])
            elif etype == _STRING:
                self.skip_strings(count)
            elif etype == _ARRAY:  # arrays of arrays: each one walked
                for _ in range(count):
                    self.value(_ARRAY)
            else:
                raise ValueError(f"{self.path}: unknown GGUF array element type {etype}")
            return GGUFArray(etype, count)
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Metadata and tensor table of the GGUF file ``path`` (see the module docstring); reads the
    header bytes through ``mmap`` (the tensor data is never touched). Milliseconds where
    ``gguf.GGUFReader`` takes seconds on a file that carries a tokenizer.

    Raises:
        OSError: the file cannot be opened.
        ValueError: not a GGUF file, a version other than 2 or 3, an unknown value type, or a
            header cut short.
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:  # mmap refuses an empty file with no name in it
            raise ValueError(f"{path} is not a GGUF file (shorter than a GGUF header)")
        return _read(f, path)


def _read(f: BinaryIO, path: str) -> GGUFHeader:
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf, path)
        magic, version = c.unpack("<4sI")
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (magic {magic!r})")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            kind = "a big-endian GGUF (flowrl reads little-endian files)" if swapped in (2, 3) \
                else f"GGUF version {version}; versions 2 and 3 are read"
            raise ValueError(f"{path}: {kind}")
        n_tensors, n_kv = c.unpack("<QQ")
        header = GGUFHeader(version)
        for _ in range(n_kv):
            key = c.string()
            (vtype,) = c.unpack("<I")
            header.fields[key] = c.value(vtype)
        for _ in range(n_tensors):
            name = c.string()
            (n_dims,) = c.unpack("<I")
            dims = c.unpack(f"<{n_dims}Q")
            c.unpack("<IQ")  # ggml type, data offset
            header.tensors[name] = tuple(int(d) for d in dims)
        return header
