"""A GGUF file's metadata and tensors, read straight from a memory map.

The layout (llama.cpp's docs/gguf.md): "GGUF", a version, the tensor and key-value counts, the key-value
pairs, one record per tensor (name, dims in ggml order, type, offset), then the data section at the next
multiple of general.alignment (32 by default). gguf-py's reader builds a numpy view for every part of every
field, which takes 4-5 s for the 100,000 strings of a Llama 3 vocabulary; here each value is decoded once
with struct, in milliseconds. Tensors come out as gguf-py gives them (tests/backend/test_gguf_file.py
checks the two agree): numpy views of the map, float types typed, the rest as rows of bytes.
"""

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# value type code -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class StringArray(Sequence):
    """An array of strings, decoded on first use: a vocabulary's 100,000 strings take half a second to decode
    and a load reads none of them (the tokenizer comes from its converted, cached form)."""

    def __init__(self, buf: mmap.mmap, order: str, start: int, count: int):
        self._buf, self._order, self._start, self._count = buf, order, start, count
        self._decoded: list[str] | None = None

    def _values(self) -> list[str]:
        if self._decoded is None:
            length, pos, out = struct.Struct(self._order + "Q").unpack_from, self._start, []
            for _ in range(self._count):
                (n,) = length(self._buf, pos)
                out.append(self._buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
                pos += 8 + n
            self._decoded = out
        return self._decoded

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self._values()[index]

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, Sequence)) else NotImplemented

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order: the fastest-varying (columns) first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # numpy order (rows first); quantized and bf16 tensors as bytes per row


class GGUFFile:
    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.path = Path(path)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic at the start of the file")
        self._order = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # a big-endian file reads as a huge little-endian version
            self._order, version = ">", struct.unpack_from(">I", buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        self.version = version
        n_tensors, n_fields = struct.unpack_from(self._order + "QQ", buf, 8)
        self._pos = 24
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("I")
            self.fields[key] = self._value(kind)
        records = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("I")
            dims = self._unpack("Q" * n_dims)
            kind, offset = self._unpack("IQ")
            records.append((name, dims, kind, offset))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *record) for record in records]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("two tensors have the same name")

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(self._order + fmt, self._map, self._pos)
        self._pos += struct.calcsize(self._order + fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        text = self._map[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, kind: int):
        if kind == 8:
            return self._string()
        if kind == 9:
            item, count = self._unpack("IQ")
            if item in _SCALARS:  # one unpack for the whole array
                return list(self._unpack(_SCALARS[item] * count)) if count else []
            if item == 8:  # only the lengths are read now
                start, length = self._pos, struct.Struct(self._order + "Q").unpack_from
                for _ in range(count):
                    self._pos += 8 + length(self._map, self._pos)[0]
                return StringArray(self._map, self._order, start, count)
            return [self._value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack(_SCALARS[kind])[0]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        ggml_type = GGMLQuantizationType(kind)
        n_elements = int(np.prod(dims)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block
        shape = tuple(reversed(dims))
        if ggml_type in _TYPED:
            dtype = np.dtype(_TYPED[ggml_type]).newbyteorder(self._order)
        else:
            if shape[-1] % block:
                raise ValueError(f"tensor {name}: a row of {shape[-1]} is not whole {ggml_type.name} blocks of {block}")
            dtype, shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * type_size)
        begin = start + offset
        if begin + n_bytes > len(self._map):
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        data = np.frombuffer(self._map, dtype=dtype, count=n_bytes // dtype.itemsize, offset=begin).reshape(shape)
        return GGUFTensor(name, ggml_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes, begin, data)
