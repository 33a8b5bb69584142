"""Units of the memory bill: bytes per cached value for each dtype, GB vs GiB, and printing both."""

from __future__ import annotations

from typing import Any

from ..checks import check_float

__all__ = ["DTYPE_BYTES", "GB", "GiB", "dtype_bytes", "dtype_key", "format_bytes"]

GB = 10**9
GiB = 2**30

# Bytes per cached value. int4 is half a byte: two values share one byte.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "torch.float8_e4m3fn": "fp8",
    "torch.float8_e5m2": "fp8",
}


def dtype_key(dtype: Any) -> str:
    name = str(dtype).lower() if dtype is not None else ""
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (or a torch dtype of those), got {dtype!r}")
    return name


def dtype_bytes(dtype: Any) -> float:
    """Bytes per stored value: 4 (fp32), 2 (bf16/fp16), 1 (fp8/int8), 0.5 (int4)."""
    return DTYPE_BYTES[dtype_key(dtype)]


def format_bytes(n: float) -> str:
    """``n`` bytes in both decimal and binary units, e.g. ``'68.72 GB (64.00 GiB)'``."""
    check_float("n (a number of bytes)", n, min=0)
    for dec, bin_, p in (("TB", "TiB", 4), ("GB", "GiB", 3), ("MB", "MiB", 2), ("kB", "KiB", 1)):
        if n >= 1000**p:
            return f"{n / 1000**p:.2f} {dec} ({n / 1024**p:.2f} {bin_})"
    return f"{int(n)} B"
