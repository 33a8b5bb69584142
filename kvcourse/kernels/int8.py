"""int8 K/V with one scale per token and head: the torch references the int8 kernels must equal.

A vector ``x`` of ``D`` values (one token's key or value in one head) is stored as ``D`` int8 values
and one fp32 scale:

    scale = max|x| / 127            q = clamp(floor(x / scale + 1/2), -127, 127)            x ~ q * scale

The rounding is written out (``floor(y + 1/2)``, halves rounded up) so a kernel can reproduce it bit
for bit; a vector of zeros gets scale 0 and stores zeros. Each value is off by at most ``scale / 2``.
Bytes per token and head: ``D + 4`` instead of ``2 D`` in fp16, 1.94x fewer at ``D = 128``.

The pool keeps the int8 values where the float pool kept floats, ``[num_blocks, block_size, Hkv, D]``,
and the scales beside them, ``[num_blocks, block_size, Hkv]`` fp32.
"""

from __future__ import annotations

import torch

from .reference import (
    _check_float,
    _check_int,
    _default_scale,
    check_block_tables,
    check_paged,
    check_reshape_and_cache,
    paged_attention,
)

__all__ = [
    "absmax_scales",
    "check_int8_pool",
    "dequantize_int8",
    "empty_int8_pool",
    "paged_decode_attention_int8_ref",
    "quantize_int8",
    "quantized_decode_ref",
    "reshape_and_cache_int8_ref",
    "reshape_and_cache_quantized_ref",
]

QMAX = 127  # symmetric: -127 .. 127 (-128 unused, so q and -q are both representable)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension of ``x [..., D]``: int8 values ``[..., D]`` and fp32 scales ``[...]``."""
    x, scale, safe = absmax_scales(x, QMAX)
    q = torch.floor(x / safe[..., None] + 0.5).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def absmax_scales(x: object, qmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` checked and in fp32, its per-vector scales ``max|x| / qmax``, and those scales with 1 for 0 (to
    divide by: an all-zero vector stores zeros). Shared by int8 and fp8 (:mod:`.fp8`)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"x must be a floating-point torch.Tensor [..., D], got {getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension [..., D]")
    x = x.to(torch.float32)
    if not bool(torch.isfinite(x).all()):  # an inf makes the scale inf: all D values would decode to NaN
        raise ValueError(
            f"x has {int((~torch.isfinite(x)).sum())} non-finite values (inf or NaN): a vector's scale "
            "would be inf or NaN and all D of its values would decode to NaN"
        )
    amax = x.abs().amax(dim=-1)
    # Divided by a tensor, not the number: CUDA torch turns division by a number into a multiply by
    # its reciprocal, one rounding off IEEE division (what the CPU and the Triton kernel's div_rn do).
    scale = amax / torch.full_like(amax, qmax)
    return x, scale, torch.where(scale > 0, scale, torch.ones_like(scale))


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., D] int8``, ``scale [...]`` -> ``q * scale`` in ``dtype``."""
    _check_int("q", q, q.ndim, "[..., D]", dtypes=(torch.int8,))
    return scaled(q, scale, dtype)


def scaled(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``, one scale per vector of ``q [..., D]`` (int8 or fp8, checked by the caller)."""
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"scale must have shape {list(q.shape[:-1])} (q's without D), got {list(scale.shape)}")
    return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)


def empty_int8_pool(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's int8 pool, zero-filled: ``(k_cache, v_cache, k_scale, v_scale)``."""
    cache = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.zeros(cache, dtype=torch.int8, device=device),
        torch.zeros(cache, dtype=torch.int8, device=device),
        torch.zeros(cache[:3], dtype=torch.float32, device=device),
        torch.zeros(cache[:3], dtype=torch.float32, device=device),
    )


def check_int8_pool(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    dtype: torch.dtype = torch.int8,
) -> None:
    """Validate an int8 pool: int8 ``[num_blocks, block_size, Hkv, D]`` and fp32 scales ``[num_blocks, block_size, Hkv]``.

    ``dtype``: the values' type; an fp8 pool (:mod:`.fp8`) has the same layout with ``torch.float8_e4m3fn``."""
    doc = "[num_blocks, block_size, Hkv, D]"
    _check_int("k_cache", k_cache, 4, doc, dtypes=(dtype,))
    _check_int("v_cache", v_cache, 4, doc, dtypes=(dtype,))
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_float(name, t, 3, "[num_blocks, block_size, Hkv]")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.shape != k_cache.shape[:3]:
            raise ValueError(
                f"{name} must have shape {list(k_cache.shape[:3])} (the cache's without D), got {list(t.shape)}"
            )
    for name, t in (("v_cache", v_cache), ("k_scale", k_scale), ("v_scale", v_scale)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {k_cache.device}")


def _float_view(cache: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A zero-memory float tensor with ``cache``'s shape and ``like``'s dtype and device, for the shared checks."""
    return like.new_empty(()).expand(cache.shape)


def reshape_and_cache_int8_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize new tokens' ``key, value [N, Hkv, D]`` and write them at ``slot_mapping [N]`` (-1: skip)."""
    reshape_and_cache_quantized_ref(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping, quantize_int8)


def reshape_and_cache_quantized_ref(
    key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping, quantize, dtype: torch.dtype = torch.int8
) -> None:
    """The cache write of a quantized pool, with ``quantize`` (:func:`quantize_int8`, or fp8's for ``dtype`` e4m3)."""
    check_int8_pool(key_cache, value_cache, k_scale, v_scale, dtype)
    check_reshape_and_cache(key, value, _float_view(key_cache, key), _float_view(value_cache, key), slot_mapping)
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].to(torch.int64)
    hkv, d = key_cache.shape[2:]
    for x, cache, scales in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        q, s = quantize(x[keep])
        cache.view(-1, hkv, d)[idx] = q
        scales.view(-1, hkv)[idx] = s


def check_paged_int8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    dtype: torch.dtype = torch.int8,
) -> list[int]:
    """The checks of a paged decode on an int8 pool (or fp8: ``dtype``); returns ``seq_lens`` as ints."""
    check_int8_pool(k_cache, v_cache, k_scale, v_scale, dtype)
    check_paged(q, _float_view(k_cache, q), _float_view(v_cache, q), "[B, Hq, D]")
    if k_cache.device != q.device:
        raise ValueError(f"k_cache is on {k_cache.device} but q is on {q.device}; they must be on one device")
    lens = check_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1], q.device)
    if len(lens) != q.shape[0]:
        raise ValueError(f"block_tables and seq_lens have {len(lens)} rows but q has batch size {q.shape[0]}")
    return lens


def paged_decode_attention_int8_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Paged decode attention on an int8 pool: dequantize to fp32, then the float reference; ``[B, Hq, D]``."""
    return quantized_decode_ref(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale)


def quantized_decode_ref(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale, dtype: torch.dtype = torch.int8
) -> torch.Tensor:
    """Paged decode attention on a quantized pool of ``dtype`` (int8 or fp8): dequantized to fp32, then the float
    reference; ``[B, Hq, D]`` in q's dtype."""
    lens = check_paged_int8(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, dtype)
    k, v = scaled(k_cache, k_scale), scaled(v_cache, v_scale)
    scale = _default_scale(scale, q.shape[-1])
    q_pos = (seq_lens.to(torch.int64) - 1)[:, None]
    out = paged_attention(q.float()[:, None], q_pos, k, v, block_tables, seq_lens, scale, max(lens))[:, 0]
    return out.to(q.dtype)
