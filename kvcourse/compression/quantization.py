"""Quantizing cached K and V: fewer bits per value, plus what it takes to read them back.

**Integers, asymmetric** (the form KIVI and Hugging Face's quantized cache use). A *group* of values
``x`` becomes ``b``-bit codes and two fp16 numbers::

    scale = (max(x) - min(x)) / (2**b - 1)        zero = min(x)
    q = clamp(round((x - zero) / scale), 0, 2**b - 1)          # stored, b bits per value
    x_hat = q * scale + zero                                    # what attention reads

Every value comes back within ``scale / 2`` of itself (plus the fp16 rounding of ``zero``), so the
error is set by the *range* of its group: one large value in a group coarsens all the others. Which
values share a group is therefore the design decision: ``dim`` names the axis a group runs along
(``-1``: the ``D`` values of one token's vector, *per token*; ``-2``: one channel over the tokens,
*per channel*). Codes are packed ``8 // b`` to a byte.

**fp8 (e4m3)**: each vector is divided by ``absmax / 448`` (one fp16 scale) and rounded to the nearest
e4m3 number (4 exponent bits, 3 mantissa bits): relative precision, no zero point.

**fp16 / bf16**: a plain cast, the baselines a GPU server actually stores.

Scales and zero points are stored, and counted in :attr:`QuantizedTensor.nbytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_finite, check_int

__all__ = [
    "FORMATS",
    "QuantizedTensor",
    "dequantize",
    "fake_quantize",
    "pack_codes",
    "quantize",
    "rounding_mse",
    "unpack_codes",
]

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_DTYPE = torch.float16  # scales and zero points: 2 bytes each
# format name -> bits per value it stores
FORMATS = {"int2": 2, "int4": 4, "int8": 8, "fp8": 8, "fp16": 16, "bf16": 16}


@dataclass
class QuantizedTensor:
    """Stored values (packed codes, fp8 or 16-bit floats) and the per-group numbers that decode them.

    ``scale`` and ``zero`` have the shape of the values with the grouped axis reduced to 1
    (``None`` where a format does not need them).
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    fmt: str

    @property
    def nbytes(self) -> int:
        """Bytes stored: the payload plus every scale and zero point."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes below ``2**bits`` along the last axis, ``8 // bits`` per byte."""
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"the last axis ({codes.shape[-1]}) must be a multiple of {per_byte} to pack {bits}-bit codes")
    if per_byte == 1:
        return codes
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)  # the fields never overlap: sum == bitwise or


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    fields = (packed[..., None] >> shifts) & (2**bits - 1)
    return fields.reshape(*packed.shape[:-1], -1)


def quantize(x: torch.Tensor, fmt: str = "int8", dim: int = -1) -> QuantizedTensor:
    """Quantize ``x`` in groups that run along ``dim`` (each group shares one scale and zero point).

    ``fmt``: ``"int8"``, ``"int4"``, ``"int2"`` (asymmetric integers), ``"fp8"`` (e4m3, one scale per
    group), ``"fp16"`` or ``"bf16"`` (a cast; ``dim`` unused).
    """
    _check_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if fmt in ("fp16", "bf16"):
        return QuantizedTensor(x.to(torch.float16 if fmt == "fp16" else torch.bfloat16), None, None, fmt)
    xf = x.float()
    check_finite("x", xf, "its group's scale would be inf or NaN and every value of the group would decode to NaN")
    if fmt == "fp8":
        scale = (xf.abs().amax(dim, keepdim=True) / FP8_MAX).to(SCALE_DTYPE)
        safe = torch.where(scale > 0, scale.float(), 1.0)  # an all-zero group: any scale decodes to 0
        return QuantizedTensor((xf / safe).to(torch.float8_e4m3fn), scale, None, fmt)
    bits = FORMATS[fmt]
    levels = 2**bits - 1
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    scale, zero = ((hi - lo) / levels).to(SCALE_DTYPE), lo.to(SCALE_DTYPE)
    # Quantize against the scale and zero point as stored (fp16), so that decoding meets the bound.
    safe = torch.where(scale > 0, scale.float(), 1.0)  # a constant group: every code is 0
    codes = torch.clamp(torch.round((xf - zero.float()) / safe), 0, levels).to(torch.uint8)
    return QuantizedTensor(pack_codes(codes, bits), scale, zero, fmt)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``qt`` stands for, in ``dtype``."""
    if qt.fmt in ("fp16", "bf16"):
        return qt.data.to(dtype)
    if qt.fmt == "fp8":
        return (qt.data.float() * qt.scale.float()).to(dtype)
    codes = unpack_codes(qt.data, FORMATS[qt.fmt])
    return (codes.float() * qt.scale.float() + qt.zero.float()).to(dtype)


def rounding_mse(x: torch.Tensor, bits: int, dim: int = -1) -> float:
    """The mean squared error that ``bits``-bit asymmetric quantization of ``x`` in groups along ``dim`` should give.

    The rounding-noise model: a value lands uniformly within half a step of a code, so its squared error averages
    ``step**2 / 12``, with ``step = (max - min) / (2**bits - 1)`` of its group. A prediction from the groups' ranges
    alone, before anything is quantized (chapter 8 compares it with :func:`fake_quantize`'s measured error).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    check_int("bits", bits, min=1, max=16)
    xf = x.float()
    step = (xf.amax(dim, keepdim=True) - xf.amin(dim, keepdim=True)) / (2**bits - 1)
    # every value of a group shares its step: the mean over the values is the mean over the groups
    return float((step**2 / 12).mean())


def fake_quantize(x: torch.Tensor, fmt: str = "int8", dim: int = -1) -> torch.Tensor:
    """``dequantize(quantize(x))``: what a quantized cache hands attention, in ``x``'s dtype."""
    return dequantize(quantize(x, fmt, dim), x.dtype)
