"""A minimal GGUF reader: metadata as plain Python values, tensors as memory-mapped NumPy arrays.

The ``gguf`` package's ``GGUFReader`` builds a NumPy view for every element of
every metadata array, which takes seconds for SmolLM2's 98k vocabulary and merge
strings. The format itself is simple (llama.cpp's ``docs/gguf.md``):

    magic "GGUF", version u32, tensor_count u64, kv_count u64
    kv_count x  (key: string, value_type: u32, value)
    tensor_count x  (name: string, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64)
    padding to `general.alignment` (32), then the tensor data

Strings are a u64 length plus UTF-8 bytes; arrays are an element type (u32), a
count (u64) and the elements.

:func:`dequantize` turns a tensor into fp32 torch weights. The two block formats SmolLM2's file
uses are done here in torch, bit for bit what ``gguf.dequantize`` computes but several times
faster, so the weights can be read from the 98 MB GGUF at every load instead of being kept on
disk dequantized (540 MB):

* ``Q8_0``: blocks of 32 values, an fp16 scale ``d`` then 32 int8 ``q``: ``value = q * d``;
* ``Q4_1``: blocks of 32 values, fp16 ``d`` and ``m``, then 16 bytes holding 32 4-bit ``q``
  (low nibbles are values 0-15, high nibbles 16-31): ``value = d * q + m``.

Other types fall back to ``gguf.dequantize``.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["GGUFTensor", "dequantize", "header_digest", "read_gguf"]

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
    metadata, tensors, _ = _read(path)
    return metadata, tensors


def header_digest(path: str | Path) -> str:
    """SHA-256 of everything before the tensor data: the metadata (tokenizer included) and the tensor index."""
    _, _, data_start = _read(path)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(data_start)).hexdigest()


def _read(path: str | Path) -> tuple[dict, list[GGUFTensor], int]:
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
    return metadata, tensors, data_start


def _blocks(data: np.ndarray, block_bytes: int) -> torch.Tensor:
    """A tensor's raw bytes as ``[num_blocks, block_bytes]`` uint8, without copying the memory map."""
    with warnings.catch_warnings():  # read-only memory map: we only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(np.ascontiguousarray(data)).cast("B"), dtype=torch.uint8).view(
            -1, block_bytes
        )


def _fp16(column: torch.Tensor) -> torch.Tensor:
    """Two bytes per row -> that row's fp16 number as fp32, ``[num_blocks, 1]``."""
    return column.contiguous().view(torch.float16).float()


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's values as fp32, shaped slowest dimension first (as ``tensor.data``, unpacked)."""
    import gguf

    kind = tensor.tensor_type
    shape = tuple(reversed(tensor.shape))
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(tensor.data, dtype=np.float32)).view(shape)
    if kind == gguf.GGMLQuantizationType.Q8_0:  # [d: fp16][q: 32 x int8]
        b = _blocks(tensor.data, 34)
        q = b[:, 2:].contiguous().view(torch.int8).float()
        return q.mul_(_fp16(b[:, 0:2])).view(shape)
    if kind == gguf.GGMLQuantizationType.Q4_1:  # [d: fp16][m: fp16][q: 16 bytes, two 4-bit values each]
        b = _blocks(tensor.data, 20)
        packed = b[:, 4:]
        q = torch.empty(b.shape[0], 32, dtype=torch.uint8)
        torch.bitwise_and(packed, 0x0F, out=q[:, :16])
        torch.bitwise_right_shift(packed, 4, out=q[:, 16:])
        # (d * q) + m, rounded after the product and after the sum, exactly as gguf computes it.
        return q.float().mul_(_fp16(b[:, 0:2])).add_(_fp16(b[:, 2:4])).view(shape)
    values = gguf.dequantize(tensor.data, kind)
    return torch.from_numpy(np.array(values, dtype=np.float32)).view(shape)
