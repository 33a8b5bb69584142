"""A minimal GGUF reader: metadata as plain Python values, tensors as memory-mapped NumPy arrays.

The ``gguf`` package's ``GGUFReader`` builds a NumPy view for every element of
every metadata array, which takes seconds for SmolLM2's 98k vocabulary and merge
strings. The format itself is simple (llama.cpp's ``docs/gguf.md``):

    magic "GGUF", version u32, tensor_count u64, kv_count u64
    kv_count x  (key: string, value_type: u32, value)
    tensor_count x  (name: string, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64)
    padding to `general.alignment` (32), then the tensor data

Strings are a u64 length plus UTF-8 bytes; arrays are an element type (u32), a
count (u64) and the elements. Dequantizing stays with ``gguf.dequantize``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["GGUFTensor", "read_gguf"]

# value type -> struct format of one scalar (8 = string, 9 = array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it: fastest-varying dimension first
    tensor_type: object  # a gguf.GGMLQuantizationType (F32, Q4_1, ...)
    data: np.ndarray  # reversed dims; quantized types as raw uint8 blocks [..., bytes_per_row]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return value

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALARS[vtype])


def read_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """``(metadata, tensors)`` of a GGUF file; tensor data is memory-mapped, not read."""
    import gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(raw[:4])!r})")
    cur.pos = 4
    version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.scalar("<I")
        dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    align = metadata.get("general.alignment", 32)
    data_start = (cur.pos + align - 1) // align * align
    tensors = []
    for name, dims, ttype, offset in infos:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        row_elems, outer = dims[0], tuple(reversed(dims[1:]))  # NumPy order: slowest dimension first
        rows = int(np.prod(outer, dtype=np.int64))
        row_bytes = row_elems // block * type_size
        start = data_start + offset
        chunk = raw[start : start + rows * row_bytes]
        if ttype == gguf.GGMLQuantizationType.F32:
            data = chunk.view(np.float32).reshape(*outer, row_elems)
        elif ttype == gguf.GGMLQuantizationType.F16:
            data = chunk.view(np.float16).reshape(*outer, row_elems)
        else:
            data = chunk.reshape(*outer, row_bytes)
        tensors.append(GGUFTensor(name, dims, gguf.GGMLQuantizationType(ttype), data))
    return metadata, tensors
