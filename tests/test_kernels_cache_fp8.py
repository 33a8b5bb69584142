"""The fp8 (e4m3) K/V write kernel (issue 50, item 4) against its torch reference, bit for bit.

In Triton's interpreter on a CPU; ``make gpu-check`` runs the same tests compiled (``DEVICE`` follows the kernels).
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.kernels.fp8 import FP8, FP8_MAX, paged_decode_attention_fp8_ref, reshape_and_cache_fp8_ref
from kvcourse.kernels.testing import random_paged_case
from kvcourse.kernels.triton_cache import float_to_e4m3_bits, reshape_and_cache_fp8
from kvcourse.kernels.triton_runtime import fallbacks, kernel_device, reset_fallbacks, tl, triton

DEVICE = kernel_device()


@pytest.fixture(autouse=True)
def no_fallback():
    reset_fallbacks()
    yield
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"


@triton.jit
def _convert(X, Y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, float_to_e4m3_bits(tl.load(X + i, mask=i < n, other=0.0)), mask=i < n)


def test_the_bit_conversion_rounds_as_torch_does():
    """Every e4m3 value, every tie between two neighbours (rounded to even), one fp32 step either side of each tie,
    +-0, and random values over every magnitude: the same byte as torch's conversion."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].unique()  # 0 .. 448, sorted
    ties = (values[:-1] + values[1:]) / 2  # exact in fp32
    up, down = torch.nextafter(ties, torch.tensor(1e9)), torch.nextafter(ties, torch.tensor(0.0))
    g = torch.Generator().manual_seed(0)
    spread = torch.rand(4096, generator=g) * 2.0 ** torch.randint(-12, 9, (4096,), generator=g).float()
    x = torch.cat([values, ties, up, down, spread.clamp(max=FP8_MAX), torch.tensor([0.0, -0.0])])
    x = torch.cat([x, -x])
    got = torch.empty(len(x), dtype=torch.uint8, device=DEVICE)
    _convert[(triton.cdiv(len(x), 1024),)](x.to(DEVICE), got, len(x), BLOCK=1024)
    want = x.to(FP8).view(torch.uint8)
    assert torch.equal(got.cpu(), want), x[got.cpu() != want][:8]


@pytest.mark.parametrize(
    "dtype, num_tokens, block_size, heads, head_dim",
    [(torch.float32, 37, 16, 3, 64), (torch.float16, 5, 1, 8, 128), (torch.bfloat16, 64, 32, 1, 64)],
    ids=["fp32", "fp16-bs1", "bf16-bs32"],
)
def test_reshape_and_cache_fp8_is_bit_exact(dtype, num_tokens, block_size, heads, head_dim):
    g = torch.Generator().manual_seed(num_tokens)
    num_blocks = 160 // block_size + 1
    # Magnitudes from 1e-3 to 30 per vector, one all-zero vector: every exponent range and the zero scale.
    key = torch.randn(num_tokens, heads, head_dim, generator=g) * 30 ** torch.rand(num_tokens, heads, 1, generator=g)
    key[0, 0] = 0.0
    value = torch.randn(num_tokens, heads, head_dim, generator=g) * 1e-3
    key, value = key.to(DEVICE, dtype), value.to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[:: max(1, num_tokens // 3)] = -1  # padding tokens: never written
    slots = slots.to(DEVICE)
    pool = torch.full((num_blocks, block_size, heads, head_dim), 0x7F, dtype=torch.uint8).view(FP8)  # e4m3 NaN
    scales = torch.full(pool.shape[:3], -1.0)
    got = [t.clone().to(DEVICE) for t in (pool, pool, scales, scales)]
    want = [t.clone().to(DEVICE) for t in (pool, pool, scales, scales)]
    reshape_and_cache_fp8(key, value, *got, slots)
    reshape_and_cache_fp8_ref(key, value, *want, slots)
    for a, b in zip(got, want):  # bytes and scales; untouched slots keep their NaN bytes and -1 scales
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
    written = slots[slots >= 0]
    assert int((got[2].view(-1, heads) != -1).all(1).sum()) == len(written)


def test_a_pool_written_by_the_kernel_reads_back_through_the_fp8_reference():
    """The engine's path: every slot written by the kernel, then decode attention on that pool."""
    case = random_paged_case(7, [20, 33], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    n = case.k_cache.shape[0] * 16
    k_new, v_new = (c.nan_to_num().view(n, 3, 64).to(DEVICE) for c in (case.k_cache, case.v_cache))
    pool = [torch.zeros(case.k_cache.shape, dtype=FP8, device=DEVICE) for _ in range(2)]
    scales = [torch.zeros(case.k_cache.shape[:3], device=DEVICE) for _ in range(2)]
    reshape_and_cache_fp8(k_new, v_new, *pool, *scales, torch.arange(n, device=DEVICE))
    got = paged_decode_attention_fp8_ref(case.q, *(t.cpu() for t in pool + scales), case.block_tables, case.seq_lens)
    # fp8 keeps each value within 1/16 of itself: the attention output stays close to full precision's.
    torch.testing.assert_close(got, case.expected(), rtol=0.1, atol=0.1)


def test_reshape_and_cache_fp8_bad_input_names_the_argument():
    key = torch.zeros(2, 3, 64, device=DEVICE)
    pool = torch.zeros(4, 16, 3, 64, dtype=FP8, device=DEVICE)
    scales = torch.zeros(4, 16, 3, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises((TypeError, ValueError), match="k_cache"):
        reshape_and_cache_fp8(key, key, pool.view(torch.int8), pool, scales, scales, slots)
    with pytest.raises((TypeError, ValueError), match="k_scale"):
        reshape_and_cache_fp8(key, key, pool, pool, scales.double(), scales, slots)
    with pytest.raises((TypeError, ValueError), match="slot_mapping"):
        reshape_and_cache_fp8(key, key, pool, pool, scales, scales, slots[:1])
