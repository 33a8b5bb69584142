"""The K/V write kernels (vLLM's reshape_and_cache), float and int8, against the torch references."""

from __future__ import annotations

import pytest
import torch

from kvcourse.kernels import reshape_and_cache, reshape_and_cache_int8
from kvcourse.kernels.int8 import (
    dequantize_int8,
    empty_int8_pool,
    quantize_int8,
    reshape_and_cache_int8_ref,
)
from kvcourse.kernels.reference import reshape_and_cache_ref
from kvcourse.kernels.triton_runtime import fallbacks, kernel_device, reset_fallbacks

BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# Where the kernels take their tensors: the CPU in Triton's interpreter, the GPU when Triton compiles
# (``python -m kvcourse.gpu_check`` runs these tests there). Cases are drawn on the CPU, then moved.
DEVICE = kernel_device()


@pytest.fixture(autouse=True)
def no_fallback():
    reset_fallbacks()
    yield
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"


def _problem(seed: int, dtype: torch.dtype, num_tokens: int, num_blocks=9, block_size=16, heads=3, head_dim=64):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, heads, head_dim, generator=g).to(DEVICE, dtype)
    value = torch.randn(num_tokens, heads, head_dim, generator=g).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[:: max(1, num_tokens // 3)] = -1  # padding tokens: never written
    pool = torch.full((num_blocks, block_size, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    return key, value, slots.to(DEVICE), pool


@pytest.mark.parametrize(
    "dtype, num_tokens, block_size, heads, head_dim",
    [
        (torch.float32, 37, 16, 3, 64),
        (torch.float16, 5, 1, 8, 128),
        (torch.bfloat16, 64, 32, 1, 64),
        (torch.float32, 1, 16, 4, 128),
    ],
    ids=["fp32", "fp16-bs1", "bf16-bs32", "one-token"],
)
def test_reshape_and_cache_is_bit_exact(dtype, num_tokens, block_size, heads, head_dim):
    key, value, slots, pool = _problem(
        num_tokens, dtype, num_tokens, 160 // block_size + 1, block_size, heads, head_dim
    )
    k_cache, v_cache = pool.clone(), pool.clone()
    k_want, v_want = pool.clone(), pool.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_want, v_want, slots)
    # Bits, NaN included: written slots hold exactly the inputs, every other slot is untouched.
    assert torch.equal(k_cache.view(BITS[dtype]), k_want.view(BITS[dtype]))
    assert torch.equal(v_cache.view(BITS[dtype]), v_want.view(BITS[dtype]))
    written = slots[slots >= 0]
    assert torch.equal(k_cache.view(-1, heads, head_dim)[written].view(BITS[dtype]), key[slots >= 0].view(BITS[dtype]))
    assert int(torch.isnan(k_cache).flatten(1).all(1).sum()) >= k_cache.shape[0] - len(written)  # untouched blocks


def test_reshape_and_cache_takes_strided_inputs():
    key, value, slots, pool = _problem(3, torch.float32, 12)
    packed = torch.stack([key, value], dim=1)  # [N, 2, H, D]: key and value are strided views
    k_cache, v_cache, k_want, v_want = pool.clone(), pool.clone(), pool.clone(), pool.clone()
    reshape_and_cache(packed[:, 0], packed[:, 1], k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_want, v_want, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), k_want.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_want.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_reshape_and_cache_int8_is_bit_exact(dtype):
    key, value, slots, _ = _problem(7, dtype, 40)
    key[3] = 0.0  # an all-zero vector: scale 0, values 0
    key[4, 1, 5] = 1e4  # one outlier in a head: a large scale for that head only
    pools = [empty_int8_pool(9, 16, 3, 64, device=DEVICE) for _ in range(2)]
    for p in pools:
        for t in p:
            t.fill_(99)  # untouched slots keep this
    reshape_and_cache_int8(key, value, *pools[0], slots)
    reshape_and_cache_int8_ref(key, value, *pools[1], slots)
    for got, want in zip(pools[0], pools[1]):
        assert torch.equal(got, want)
    k_cache, _, k_scale, _ = pools[0]
    assert int((k_cache.flatten(0, 1)[slots[slots >= 0]] != 99).sum()) > 0
    assert int((k_cache == 99).all(-1).sum()) == (9 * 16 - int((slots >= 0).sum())) * 3


def test_quantize_int8_round_trip_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (50, 3) and int(q.abs().max()) == 127
    err = (dequantize_int8(q, scale) - x).abs()
    assert bool((err <= scale[..., None] / 2 * (1 + 1e-5)).all())
    z, zs = quantize_int8(torch.zeros(2, 8))
    assert torch.equal(z, torch.zeros(2, 8, dtype=torch.int8)) and torch.equal(zs, torch.zeros(2))
    # Halves round up: 0.5 * scale -> 1, -0.5 * scale -> 0 (floor(y + 1/2)), whatever the scale.
    h, hs = quantize_int8(torch.tensor([[127.0, 0.5, -0.5, 1.5, -1.5]]))
    assert hs.item() == 1.0 and h.tolist() == [[127, 1, 0, 2, -1]]


def test_cache_write_bad_input_names_the_argument():
    key, value, slots, pool = _problem(1, torch.float32, 6)
    k_cache, v_cache = pool.clone(), pool.clone()
    with pytest.raises(ValueError, match="slot_mapping names one slot twice"):
        reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([5, 5, 6, 7, 8, 9], device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping entries must lie in"):
        reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 4, 9 * 16], device=DEVICE))
    with pytest.raises(TypeError, match="key has dtype torch.float16"):
        reshape_and_cache(key.half(), value, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="key must have shape"):
        reshape_and_cache(key[:, :2], value[:, :2], k_cache, v_cache, slots)
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        reshape_and_cache(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="key_cache must be contiguous in its last dimension"):
        reshape_and_cache(key, value, k_cache.transpose(2, 3).contiguous().transpose(2, 3), v_cache, slots)
    pool8 = empty_int8_pool(9, 16, 3, 64, device=DEVICE)
    with pytest.raises(TypeError, match="k_scale must be float32"):
        reshape_and_cache_int8(key, value, pool8[0], pool8[1], pool8[2].half(), pool8[3], slots)
    with pytest.raises(TypeError, match="key_cache must have dtype torch.int8|k_cache must have dtype torch.int8"):
        reshape_and_cache_int8(key, value, k_cache, pool8[1], pool8[2], pool8[3], slots)
    with pytest.raises(ValueError, match="v_scale must have shape"):
        reshape_and_cache_int8(key, value, *pool8[:3], pool8[3][:, :8], slots)
