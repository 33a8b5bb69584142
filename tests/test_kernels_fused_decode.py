"""One launch for a decode layer's attention (issue 49, item 2): RoPE of q and k, the cache write, paged attention and
the merge of split sequences in :func:`~kvcourse.kernels.triton_fused_decode.rope_cache_decode`.

In Triton's interpreter (compiled on a GPU by ``make gpu-check``, and for sm_75/80/90 by the native sweep): the
kernel equals the unfused launches it replaces (rotary embedding, reshape_and_cache, the planned paged kernel) bit for
bit in fp32 when no sequence is split, and the torch reference within the dtype's tolerance, split or not.
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.kernels.fused import rope_tables_signed
from kvcourse.kernels.split_plan import SplitPlan, plan_capacity
from kvcourse.kernels.testing import random_paged_case, tolerance
from kvcourse.kernels.triton_cache import reshape_and_cache
from kvcourse.kernels.triton_fused import rotary_embedding
from kvcourse.kernels.triton_fused_decode import arrival_counters, rope_cache_decode, rope_cache_decode_ref
from kvcourse.kernels.triton_paged import paged_decode_planned
from kvcourse.kernels.triton_runtime import fallbacks, interpreting, reset_fallbacks
from kvcourse.model import rope_cos_sin

DEVICE = "cpu" if interpreting() else "cuda"
H200_SMS = 132


@pytest.fixture(autouse=True)
def no_fallback():
    reset_fallbacks()
    yield
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"


def _step(seq_lens, dtype, hq=6, hkv=2, d=32, block_size=16, seed=0, num_sms=None, min_chunk=256):
    """A decode step: a pool holding every sequence's context but its new token, the packed QKV of the new tokens,
    RoPE tables and a plan filled from the lengths (``num_sms``: split as on that GPU)."""
    case = random_paged_case(seed, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size,
                             dtype=dtype, device=DEVICE)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(len(seq_lens), hq + 2 * hkv, d, generator=gen).to(dtype).to(DEVICE)
    cos, sin = rope_cos_sin(torch.arange(max(seq_lens) + 8), d, 10000.0)
    cos, sin = rope_tables_signed(cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE))
    plan = SplitPlan(plan_capacity(len(seq_lens), hkv, num_sms), len(seq_lens), DEVICE)
    plan.fill(list(seq_lens), hkv, num_sms, min_chunk=min_chunk)
    return case, qkv, cos, sin, plan


def _unfused(case, qkv, cos, sin, plan, hq):
    """The launches the kernel replaces: rotary embedding of q and k, the cache write, the planned paged kernel."""
    hkv = case.k_cache.shape[2]
    rows = case.positions
    qk = rotary_embedding(qkv[:, : hq + hkv], cos[rows][:, None], sin[rows][:, None])
    reshape_and_cache(qk[:, hq:], qkv[:, hq + hkv :], case.k_cache, case.v_cache, case.slot_mapping)
    return paged_decode_planned(qk[:, :hq].contiguous(), case.k_cache, case.v_cache, case.block_tables, plan, 0.125)


def _clone_pool(case):
    return case.k_cache.clone(), case.v_cache.clone()


@pytest.mark.parametrize("seq_lens", [[1], [5, 17, 33], [16, 1, 40, 9]])
def test_equals_the_unfused_launches_bit_for_bit_in_fp32(seq_lens):
    """What the engine's fp32 tests rely on: the step's tokens cannot change when its attention is fused."""
    case, qkv, cos, sin, plan = _step(seq_lens, torch.float32)
    k_pool, v_pool = _clone_pool(case)
    expected = _unfused(case, qkv, cos, sin, plan, 6)
    out = rope_cache_decode(qkv, cos, sin, case.positions, case.slot_mapping, k_pool, v_pool, case.block_tables,
                            plan, 0.125)  # fmt: skip
    if interpreting():  # the same arithmetic in the same order; compiled, two kernels may contract it differently
        assert torch.equal(out, expected)
        assert torch.equal(k_pool.nan_to_num(7.0), case.k_cache.nan_to_num(7.0))  # spare blocks hold NaN: untouched
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_pool.nan_to_num(7.0), case.k_cache.nan_to_num(7.0), rtol=1e-6, atol=1e-6)
    assert torch.equal(v_pool.nan_to_num(7.0), case.v_cache.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_sms", [None, H200_SMS])  # H200: long sequences split into chunks, merged in-kernel
def test_matches_the_torch_reference(dtype, num_sms):
    seq_lens = [70, 3, 129, 48]
    case, qkv, cos, sin, plan = _step(seq_lens, dtype, num_sms=num_sms, min_chunk=16)
    if num_sms is not None:
        assert int(plan.seqs[:, 1].max()) > 1  # some sequence is split: the in-kernel merge runs
    k_ref, v_ref = _clone_pool(case)
    expected = rope_cache_decode_ref(qkv, cos, sin, case.positions, case.slot_mapping, k_ref, v_ref,
                                     case.block_tables, 0.125)  # fmt: skip
    for _ in range(2):  # twice: the merge's counters are back at zero after a launch
        k_pool, v_pool = _clone_pool(case)
        out = rope_cache_decode(qkv, cos, sin, case.positions, case.slot_mapping, k_pool, v_pool, case.block_tables,
                                plan, 0.125)  # fmt: skip
        torch.testing.assert_close(out, expected, **tolerance(dtype))
        torch.testing.assert_close(k_pool.nan_to_num(7.0), k_ref.nan_to_num(7.0), **tolerance(dtype))
        assert torch.equal(v_pool.nan_to_num(7.0), v_ref.nan_to_num(7.0))  # values are copied, never rounded
        assert not arrival_counters(plan.lanes, 2, qkv.device).any()


def test_padding_slots_write_nothing():
    """A graph's padding lanes (slot -1, no work in the plan) leave the pool as it was."""
    case, qkv, cos, sin, plan = _step([9, 20], torch.float32)
    slots = case.slot_mapping.clone()
    slots[1] = -1
    k_pool, v_pool = _clone_pool(case)
    rope_cache_decode(qkv, cos, sin, case.positions, slots, k_pool, v_pool, case.block_tables, plan, 0.125)
    block, offset = divmod(int(case.slot_mapping[1]), 16)
    assert torch.equal(k_pool[block, offset], case.k_cache[block, offset])
    assert not torch.equal(k_pool, case.k_cache)  # lane 0's key was written
