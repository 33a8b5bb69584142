"""fp8 (e4m3) K/V with one scale per token and head: the torch references the fp8 kernel must equal.

The int8 pool's layout (:mod:`.int8`) with ``torch.float8_e4m3fn`` values, for GPUs that convert fp8 in hardware
(compute capability 8.9 and later: Ada, Hopper). A vector ``x`` of ``D`` values is stored as

    scale = max|x| / 448            q = x / scale, rounded to the nearest e4m3 number            x ~ q * scale

448 is e4m3's largest finite value. Unlike int8's even steps, e4m3 keeps about two significant digits at every
magnitude (3 mantissa bits: each value is off by at most 1/16 of itself, below 2**-6 * scale by at most
2**-10 * scale). The bytes are int8's: ``D + 4`` per token and head. Chapter 8 measures the quality of an fp8
cache on the real model (:mod:`kvcourse.compression`); here is the kernel's side.
"""

from __future__ import annotations

import torch

from .int8 import absmax_scales, check_int8_pool, quantized_decode_ref, reshape_and_cache_quantized_ref, scaled

__all__ = [
    "FP8",
    "FP8_MAX",
    "check_fp8_pool",
    "dequantize_fp8",
    "paged_decode_attention_fp8_ref",
    "quantize_fp8",
    "reshape_and_cache_fp8_ref",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension of ``x [..., D]``: e4m3 values ``[..., D]`` and fp32 scales ``[...]``."""
    x, scale, safe = absmax_scales(x, FP8_MAX)
    return (x / safe[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., D] float8_e4m3fn``, ``scale [...]`` -> ``q * scale`` in ``dtype``."""
    if not isinstance(q, torch.Tensor) or q.dtype != FP8:
        raise TypeError(f"q must be a torch.float8_e4m3fn tensor [..., D], got {getattr(q, 'dtype', type(q).__name__)}")
    return scaled(q, scale, dtype)


def check_fp8_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Validate an fp8 pool: e4m3 ``[num_blocks, block_size, Hkv, D]``, fp32 scales ``[num_blocks, block_size, Hkv]``."""
    check_int8_pool(k_cache, v_cache, k_scale, v_scale, FP8)


def reshape_and_cache_fp8_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize new tokens' ``key, value [N, Hkv, D]`` to e4m3 (:func:`quantize_fp8`) and write them and their scales
    at ``slot_mapping [N]`` (-1: skip): the fp8 pool's cache write, what
    :func:`~kvcourse.kernels.triton_cache.reshape_and_cache_fp8` must equal bit for bit."""
    reshape_and_cache_quantized_ref(
        key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping, quantize_fp8, FP8
    )


def paged_decode_attention_fp8_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Paged decode attention on an fp8 pool: dequantize to fp32, then the float reference; ``[B, Hq, D]``."""
    return quantized_decode_ref(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale, FP8)
