"""The K/V cache write in Triton (vLLM's ``reshape_and_cache``): float, int8 and fp8 (e4m3) pools.

Each step, the new tokens' keys and values ``[N, Hkv, D]`` (packed, sequence after sequence) go to
their slots of the pool: token ``i`` to offset ``slot_mapping[i] % block_size`` of block
``slot_mapping[i] // block_size``. Slot ``-1`` marks padding (a token that must not be cached) and is
skipped. The float kernel copies bits, so the pool holds exactly what the model computed; the int8 and fp8
kernels quantize on the way, one scale per token and head (:mod:`.int8`, :mod:`.fp8` give the formulas and the
references they must equal, bit for bit):

    scale = max|x| / QMAX      int8: q = floor(x / scale + 1/2) (QMAX 127)      fp8: q = e4m3(x / scale) (QMAX 448)

One program writes ``BLOCK_T`` tokens, every head and dimension of each: a 3-D tile
``[BLOCK_T, Hkv, D]`` (each padded to a power of two).

**fp8.** ``tl.div_rn`` is IEEE division (Triton's ``/`` on fp32 is an approximate one on NVIDIA GPUs), and the
conversion to e4m3 is done on the bits (:func:`float_to_e4m3_bits`), rounding to nearest even as torch does, so the
bytes equal :func:`~.fp8.reshape_and_cache_fp8_ref`'s. Why not ``x.to(tl.float8e4nv)``: GPUs convert to e4m3 in
hardware only from compute capability 8.9 on (a T4 or an A100 could not compile it), and Triton 3.9's interpreter
converts differently from torch (0.06640625, a tie, became 0.0703125, not the even 0.0625; 0.0032 became 2**-9, not
2**-8), so the kernel could not be tested against torch on a CPU. The kernel stores bytes into a ``uint8`` view of
the pool: it compiles for every GPU.
"""

from __future__ import annotations

import torch

from .fp8 import FP8, FP8_MAX, check_fp8_pool, reshape_and_cache_fp8_ref
from .int8 import QMAX, _float_view, check_int8_pool, reshape_and_cache_int8_ref
from .reference import check_reshape_and_cache, reshape_and_cache_ref
from .triton_runtime import check_kernel_device, launch_or_fallback, tl, triton

__all__ = ["float_to_e4m3_bits", "reshape_and_cache", "reshape_and_cache_fp8", "reshape_and_cache_int8"]

TILE_ELEMENTS = 4096  # values per program: BLOCK_T x Hkv x D, padded


@triton.jit
def float_to_e4m3_bits(x):
    """fp32 ``x`` with ``|x| <= 448`` -> the e4m3 (``float8_e4m3fn``) byte nearest to it, ties to even, as uint8.

    e4m3: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; normal numbers from 2**-6, subnormals ``m * 2**-9``.
    Below 2**-6 the byte is ``|x| * 2**9`` rounded to an integer (0..8; 8 is 2**-6's byte, so the two ranges meet):
    adding and subtracting 2**23 rounds to nearest even in fp32 arithmetic. From 2**-6 up, fp32's 23 mantissa bits are
    rounded to 3 (add 2**19 - 1 plus the lowest kept bit, shift by 20) and the exponent rebased from 127 to 7
    (``(127 - 7) << 3 = 960``). The sign is x's sign bit (-0.0 is 0x80, as in torch).
    """
    bits = x.to(tl.int32, bitcast=True)
    a = tl.abs(x)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    ab = bits & 0x7FFFFFFF
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - 960
    code = tl.where(a < 0.015625, sub, normal) | ((bits >> 24) & 0x80)
    return code.to(tl.uint8)


@triton.jit
def _reshape_and_cache_kernel(
    Key, Value, K_cache, V_cache, K_scale, V_scale, Slots, num_tokens,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_sb, stride_st, stride_sh,
    NUM_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_T: tl.constexpr,  # tokens per program
    FORMAT: tl.constexpr,  # "float" (copy the bits), "int8" or "fp8" (quantize, one scale per token and head)
    QMAX: tl.constexpr,  # the largest code: 127 (int8), 448.0 (e4m3)
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(Slots + t, mask=t < num_tokens, other=-1).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    t3, h3, d3 = t[:, None, None], h[None, :, None], d[None, None, :]
    mask = (slot >= 0)[:, None, None] & (h3 < NUM_HEADS) & (d3 < HEAD_DIM)  # padding slots write nothing
    k = tl.load(Key + t3 * stride_kn + h3 * stride_kh + d3, mask=mask, other=0.0)
    v = tl.load(Value + t3 * stride_vn + h3 * stride_vh + d3, mask=mask, other=0.0)
    k_dst = K_cache + (block * stride_kcb + offset * stride_kct)[:, None, None] + h3 * stride_kch + d3
    v_dst = V_cache + (block * stride_vcb + offset * stride_vct)[:, None, None] + h3 * stride_vch + d3
    if FORMAT == "float":
        tl.store(k_dst, k, mask=mask)
        tl.store(v_dst, v, mask=mask)
    else:
        # scale = max|x| / QMAX, then x / scale: div_rn is IEEE division (Triton's `/` on fp32 is an approximate
        # division on NVIDIA GPUs), so the bits match the torch reference.
        k, v = k.to(tl.float32), v.to(tl.float32)
        k_scale = tl.div_rn(tl.max(tl.abs(k), 2), QMAX * 1.0)
        v_scale = tl.div_rn(tl.max(tl.abs(v), 2), QMAX * 1.0)
        k_q = tl.div_rn(k, tl.where(k_scale > 0, k_scale, 1.0)[:, :, None])
        v_q = tl.div_rn(v, tl.where(v_scale > 0, v_scale, 1.0)[:, :, None])
        if FORMAT == "int8":  # q = floor(x / scale + 1/2)
            tl.store(k_dst, tl.clamp(tl.floor(k_q + 0.5), -QMAX, QMAX).to(tl.int8), mask=mask)
            tl.store(v_dst, tl.clamp(tl.floor(v_q + 0.5), -QMAX, QMAX).to(tl.int8), mask=mask)
        else:  # x / scale is at most 448 in exact arithmetic; the clamp keeps a rounding above it finite
            tl.store(k_dst, float_to_e4m3_bits(tl.clamp(k_q, -QMAX, QMAX)), mask=mask)  # the pool's bytes
            tl.store(v_dst, float_to_e4m3_bits(tl.clamp(v_q, -QMAX, QMAX)), mask=mask)
        s_dst = (block * stride_sb + offset * stride_st)[:, None] + h[None, :] * stride_sh
        s_mask = (slot >= 0)[:, None] & (h[None, :] < NUM_HEADS)
        tl.store(K_scale + s_dst, k_scale, mask=s_mask)
        tl.store(V_scale + s_dst, v_scale, mask=s_mask)


def _launch(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Launch on inputs already checked (no validation, no host-device synchronisation). With scales: quantize to
    the pool's dtype (int8, or e4m3 written as bytes through a ``uint8`` view)."""
    n = key.shape[0]
    if n == 0:
        return
    num_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    block_heads, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    block_t = min(max(1, TILE_ELEMENTS // (block_heads * block_d)), triton.next_power_of_2(n))
    fmt = "float" if k_scale is None else "fp8" if key_cache.dtype == FP8 else "int8"
    if fmt == "fp8":
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    scales = (key, key) if k_scale is None else (k_scale, v_scale)  # unused pointers for a float pool
    # Quantizing keeps the tile and its per-token maxima live: at 4 warps fp32 rows spilled 72 bytes on sm_75/80
    # (blocks of 1, 37 tokens: compile_check's full sweep); 8 warps halve each thread's share (60 registers, no spill).
    _reshape_and_cache_kernel[(triton.cdiv(n, block_t),)](
        key, value, key_cache, value_cache, *scales, slot_mapping, n,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3], *(k_scale.stride() if k_scale is not None else (0, 0, 0)),
        NUM_HEADS=num_heads, BLOCK_HEADS=block_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_T=block_t, FORMAT=fmt, QMAX=FP8_MAX if fmt == "fp8" else QMAX,
        num_warps=4 if fmt == "float" else 8,
    )  # fmt: skip


def _last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (head_dim), got strides {t.stride()}")


def _check_quantized(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping) -> None:
    """What a quantized write needs besides its pool's own check: the float checks on the pool's shape, the device,
    contiguous rows, and one layout for both scales."""
    check_reshape_and_cache(key, value, _float_view(key_cache, key), _float_view(value_cache, key), slot_mapping)
    check_kernel_device("key", key)
    _last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if k_scale.stride() != v_scale.stride():
        raise ValueError(
            f"k_scale and v_scale must have one layout, got strides {k_scale.stride()} and {v_scale.stride()}"
        )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check: bool = True,
) -> None:
    """Write ``key, value [N, Hkv, D]`` into the pool ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping [N]``.

    In place, bit-exact; slot ``-1`` is skipped. ``check=False`` skips the validation (the attention
    backend has validated the whole step once). Equal to :func:`~kvcourse.kernels.reference.reshape_and_cache_ref`.
    """
    if check:
        check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        check_kernel_device("key", key)
        _last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    config = (key.dtype, key_cache.shape[2], key_cache.shape[3], key_cache.shape[1])
    launch_or_fallback(
        "reshape_and_cache",
        key.device,
        config,
        lambda: _launch(key, value, key_cache, value_cache, slot_mapping),
        lambda: reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping),
    )


def reshape_and_cache_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize ``key, value [N, Hkv, D]`` to int8 and write them and their scales at ``slot_mapping [N]``.

    ``key_cache, value_cache`` int8 ``[num_blocks, block_size, Hkv, D]``; ``k_scale, v_scale`` fp32
    ``[num_blocks, block_size, Hkv]``. Equal, bit for bit, to :func:`~kvcourse.kernels.int8.reshape_and_cache_int8_ref`.
    """
    check_int8_pool(key_cache, value_cache, k_scale, v_scale)
    _check_quantized(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping)
    config = (key.dtype, key_cache.shape[2], key_cache.shape[3], key_cache.shape[1])
    launch_or_fallback(
        "reshape_and_cache_int8",
        key.device,
        config,
        lambda: _launch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale),
        lambda: reshape_and_cache_int8_ref(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping),
    )


def reshape_and_cache_fp8(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    check: bool = True,
) -> None:
    """Quantize ``key, value [N, Hkv, D]`` to e4m3 and write them and their scales at ``slot_mapping [N]``.

    ``key_cache, value_cache`` ``torch.float8_e4m3fn [num_blocks, block_size, Hkv, D]``; ``k_scale, v_scale`` fp32
    ``[num_blocks, block_size, Hkv]``; slot ``-1`` is skipped. ``check=False`` skips the validation (an engine
    backend validates its step once). Equal, bit for bit, to :func:`~kvcourse.kernels.fp8.reshape_and_cache_fp8_ref`.
    """
    if check:
        check_fp8_pool(key_cache, value_cache, k_scale, v_scale)
        _check_quantized(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping)
    config = (key.dtype, key_cache.shape[2], key_cache.shape[3], key_cache.shape[1], FP8)
    launch_or_fallback(
        "reshape_and_cache_fp8",
        key.device,
        config,
        lambda: _launch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale),
        lambda: reshape_and_cache_fp8_ref(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping),
    )
