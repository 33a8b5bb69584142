"""Split-KV planned on the host from a step's real lengths (issue 50, item 3): the plan, and the kernel that reads it.

Under CUDA graphs the paged kernel's grid is frozen at recording, so its split count followed the graph's lengths
(the model's whole context), never the step's. :mod:`kvcourse.kernels.split_plan` plans each step's work (which
sequence, which range of positions) on the host into one buffer; :func:`~kvcourse.kernels.triton_paged.paged_decode_planned`
reads it with a grid fixed by the buffer's capacity. Here, in Triton's interpreter (compiled, on a GPU, by
``make gpu-check``): the plan's arithmetic, and outputs equal to the unsplit kernel's, with one buffer reused across
steps of different lengths as a replayed graph reuses it.
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.kernels.split_plan import MIN_CHUNK_TOKENS, NO_WORK, SplitPlan, plan_capacity, plan_rows, plan_splits
from kvcourse.kernels.testing import random_paged_case, tolerance
from kvcourse.kernels.triton_paged import (MIN_SPLIT_TOKENS, choose_num_splits, paged_decode, paged_decode_planned,
                                           planned_workspace)  # fmt: skip
from kvcourse.kernels.triton_runtime import fallbacks, interpreting, reset_fallbacks

DEVICE = "cpu" if interpreting() else "cuda"
H200_SMS = 132


@pytest.fixture(autouse=True)
def no_fallback():
    reset_fallbacks()
    yield
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"


# ---------------------------------------------------------------------------------------------
# The plan (host arithmetic)
# ---------------------------------------------------------------------------------------------
def test_the_plan_follows_the_real_lengths_not_the_capacity():
    """The issue's case: ~600-token contexts in buckets of 1, 16 and 64 on an H200 with 3 KV heads. The capacity
    (what a graph is recorded with) is the same for every step; the chunks come from the lengths."""
    assert MIN_CHUNK_TOKENS == MIN_SPLIT_TOKENS  # one rule for both: no chunk shorter than this is cut
    cap = plan_capacity(64, 3, H200_SMS)
    assert cap == 88  # 2 programs per SM over 3 KV heads
    # Batch 1: 600 tokens in chunks of 256 (3 items), where the captured 8,192 gave 32 splits.
    assert plan_splits([600], 3, H200_SMS, cap) == 256
    assert choose_num_splits(1, 3, 8192, H200_SMS) == 32
    # 16 sequences: 3 chunks each, 48 items <= 88. 64 sequences fill the GPU unsplit: one chunk each.
    assert plan_splits([600] * 16, 3, H200_SMS, cap) == 256
    assert plan_splits([600] * 64, 3, H200_SMS, cap) == 608
    # A long and many short sequences: the long one is cut, the short ones stay whole.
    chunk = plan_splits([8000] + [100] * 15, 3, H200_SMS, cap)
    rows = plan_rows([8000] + [100] * 15, chunk, cap)
    work = rows[:cap]
    items = int((work[:, 0] != NO_WORK).sum())
    assert items <= 88 and chunk % 16 == 0 and chunk >= MIN_CHUNK_TOKENS
    assert int((work[:items, 0] == 0).sum()) == -(-8000 // chunk) > 1
    assert int((work[:items, 0] > 0).sum()) == 15


def test_plan_rows_lay_out_work_and_lanes():
    rows = plan_rows([5, 0, 40], chunk=16, capacity=8, lanes=4)
    work, seqs = rows[:8].tolist(), rows[8:].tolist()
    assert work[:4] == [[0, 0, 5, 1], [2, 0, 16, 3], [2, 16, 32, 3], [2, 32, 40, 3]]
    assert all(r[0] == NO_WORK for r in work[4:])  # programs past the plan exit at once
    assert seqs == [[0, 1, 0, 0], [1, 0, 0, 0], [1, 3, 0, 0], [0, 0, 0, 0]]  # lanes without tokens: no chunk


def test_no_gpu_means_no_split_and_a_full_buffer_means_longer_chunks():
    assert plan_splits([600, 1000], 3, None, capacity=2) == 1008  # the interpreter: one chunk a sequence
    # A buffer smaller than the GPU would like: chunks grow until the items fit it.
    chunk = plan_splits([4096], 1, H200_SMS, capacity=4)
    assert chunk == 1024 and plan_splits([4096], 1, H200_SMS, capacity=4, min_chunk=16) == 1024
    assert plan_splits([0, 0], 3, H200_SMS, capacity=2) == 16  # padding only: nothing to do


def test_plan_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="seq_lens_host"):
        plan_splits(torch.tensor([3]), 3, 132, 8)  # a tensor would need a read-back
    with pytest.raises(ValueError, match="seq_lens_host"):
        plan_splits([3, -1], 3, 132, 8)
    with pytest.raises(ValueError, match="capacity=1 .*2 sequences"):
        plan_splits([3, 4], 3, 132, 1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        plan_splits([3], 0, 132, 8)
    with pytest.raises(ValueError, match="num_sms"):
        plan_capacity(4, 3, 0)
    with pytest.raises(ValueError, match="lanes"):
        SplitPlan(8, 2, "cpu").fill([1, 2, 3], 3, 132)
    with pytest.raises(ValueError, match="capacity=2"):
        plan_rows([100], chunk=16, capacity=2)


# ---------------------------------------------------------------------------------------------
# The kernel reading it
# ---------------------------------------------------------------------------------------------
def _padded(case, lanes: int):
    """The case's q and block tables with spare lanes (zeros), as a graph's bucket has them."""
    spare = lanes - case.q.shape[0]
    q = torch.cat([case.q, torch.zeros(spare, *case.q.shape[1:], dtype=case.q.dtype, device=case.q.device)])
    tables = torch.cat([case.block_tables, torch.zeros(spare, case.block_tables.shape[1], dtype=torch.int32,
                                                       device=case.block_tables.device)])  # fmt: skip
    return q, tables


def test_one_plan_buffer_serves_steps_of_different_lengths():
    """As a graph replays: one SplitPlan, one workspace, one output buffer, three steps of ragged lengths (a
    sequence in 17 chunks, more than the merge reads at once; one chunk; padding lanes). Each equals the unsplit
    kernel within fp32 tolerance; lanes without tokens are left untouched."""
    lanes, hq, hkv, d = 8, 9, 3, 64
    cap = plan_capacity(lanes, hkv, H200_SMS)
    plan = SplitPlan(cap, lanes, DEVICE)
    workspace = planned_workspace(cap, hq, d, DEVICE)
    out = torch.empty(lanes, hq, d, device=DEVICE)
    buffers = (plan.buffer.data_ptr(), workspace[0].data_ptr(), out.data_ptr())
    chunks = []
    for step, (lens, min_chunk) in enumerate([([1, 600, 17, 300, 1027], 64), ([40, 3], 16), ([700] * 7, 256)]):
        case = random_paged_case(
            40 + step, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16, device=DEVICE
        )
        q, tables = _padded(case, lanes)
        chunks.append(plan.fill(lens + [0] * (lanes - len(lens)), hkv, H200_SMS, min_chunk=min_chunk))
        out.fill_(7.0)
        got = paged_decode_planned(q, case.k_cache, case.v_cache, tables, plan, d**-0.5, out=out, workspace=workspace)
        assert got.data_ptr() == out.data_ptr()
        unsplit = paged_decode(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, d**-0.5, 1)
        torch.testing.assert_close(got[: len(lens)], unsplit, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[: len(lens)], case.expected(), **tolerance(torch.float32))
        assert bool((got[len(lens) :] == 7.0).all())  # padding lanes: no work, nothing written
    assert chunks == [64, 16, 256]  # the split followed each step's lengths
    assert plan.seqs[:2, 1].tolist() == [3, 3]  # the last step: 700 tokens in chunks of 256
    assert (plan.buffer.data_ptr(), workspace[0].data_ptr(), out.data_ptr()) == buffers  # nothing reallocated
    plan.clear()  # as before a recording: nothing to do, nothing written
    out.fill_(7.0)
    paged_decode_planned(q, case.k_cache, case.v_cache, tables, plan, d**-0.5, out=out, workspace=workspace)
    assert bool((out == 7.0).all()) and plan.chunk == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_planned_in_half_precision(dtype):
    lens = [300, 5, 129]
    case = random_paged_case(
        50, lens, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16, dtype=dtype, device=DEVICE
    )
    plan = SplitPlan(plan_capacity(3, 1, H200_SMS), 3, DEVICE)
    plan.fill(lens, 1, H200_SMS, min_chunk=32)
    got = paged_decode_planned(case.q, case.k_cache, case.v_cache, case.block_tables, plan, 128**-0.5)
    assert got.dtype == dtype and plan.seqs[0, 1].item() == 10
    torch.testing.assert_close(got, case.expected(), **tolerance(dtype))


def test_planned_on_an_int8_pool():
    from kvcourse.kernels.int8 import quantize_int8

    lens = [200, 33]
    case = random_paged_case(51, lens, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, device=DEVICE)
    (k8, ks), (v8, vs) = quantize_int8(case.k_cache.nan_to_num()), quantize_int8(case.v_cache.nan_to_num())
    plan = SplitPlan(plan_capacity(2, 3, H200_SMS), 2, DEVICE)
    plan.fill(lens, 3, H200_SMS, min_chunk=48)
    got = paged_decode_planned(case.q, k8, v8, case.block_tables, plan, 64**-0.5, ks, vs)
    want = paged_decode(case.q, k8, v8, case.block_tables, case.seq_lens, 64**-0.5, 1, ks, vs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_kv_tile_is_loaded_once_per_kv_head(monkeypatch):
    """GQA: one program per (work item or sequence, KV head), never per query head: the G query heads of a group
    share every K/V tile the program loads (the engine's 9/3 heads: 3 programs per item, not 9)."""
    import kvcourse.kernels.triton_paged as triton_paged

    grids = []
    real = triton_paged._paged_decode_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_paged, "_paged_decode_kernel", Recorder())
    case = random_paged_case(52, [20, 30], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, device=DEVICE)
    plan = SplitPlan(4, 2, DEVICE)
    plan.fill([20, 30], 3, None)
    paged_decode_planned(case.q, case.k_cache, case.v_cache, case.block_tables, plan, 0.125)
    paged_decode(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125, 2)
    assert grids == [(4, 3), (2, 3, 2)]


def test_planned_bad_input_names_the_argument():
    case = random_paged_case(53, [20, 30], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, device=DEVICE)
    with pytest.raises(TypeError, match="plan must be"):
        paged_decode_planned(case.q, case.k_cache, case.v_cache, case.block_tables, [0, 1], 0.125)
    with pytest.raises(ValueError, match="plan holds 1 lanes"):
        paged_decode_planned(case.q, case.k_cache, case.v_cache, case.block_tables, SplitPlan(4, 1, DEVICE), 0.125)
    with pytest.raises(ValueError, match="tiles must be"):
        paged_decode_planned(
            case.q, case.k_cache, case.v_cache, case.block_tables, SplitPlan(4, 2, DEVICE), 0.125, tiles=(48, 4, 2)
        )


def test_other_tiles_give_the_same_answer():
    """The benchmark's tile alternatives for the engine's shape compute the same attention."""
    lens = [70, 20]
    case = random_paged_case(55, lens, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, device=DEVICE)
    plan = SplitPlan(plan_capacity(2, 3, H200_SMS), 2, DEVICE)
    plan.fill(lens, 3, H200_SMS, min_chunk=32)
    want = paged_decode(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125, 1)
    for tiles in [(32, 4, 3), (128, 8, 2), (16, 4, 1)]:
        got = paged_decode_planned(case.q, case.k_cache, case.v_cache, case.block_tables, plan, 0.125, tiles=tiles)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_triton_backend_reads_a_plan_the_batch_carries(monkeypatch):
    """``batch.split_plan`` (what StepGraphs fills before each replay) routes the backend's decode through the planned
    kernel: the same outputs as without it, counted as the same kernel, the plan's buffer read in place."""
    import dataclasses

    import kvcourse.backends.triton as triton_backend
    from kvcourse.backends.triton import TritonBackend
    from kvcourse.batch import ForwardBatch, SeqSlice
    from kvcourse.paged import PagedKVStore

    g = torch.Generator().manual_seed(54)
    store = PagedKVStore(1, 40, 4, 2, 64, dtype=torch.float32, device=DEVICE)
    store.k_cache[0].copy_(torch.randn(store.k_cache[0].shape, generator=g))
    store.v_cache[0].copy_(torch.randn(store.v_cache[0].shape, generator=g))
    seqs = [SeqSlice([1], 9, [3, 7, 1]), SeqSlice([2], 60, list(range(10, 26))), SeqSlice([7], 12, [2, 4, 6, 8])]
    batch = ForwardBatch.build(seqs, block_size=4, device=DEVICE)
    q = torch.randn(3, 6, 64, generator=g).to(DEVICE)
    k, v = (torch.randn(3, 2, 64, generator=g).to(DEVICE) for _ in range(2))
    plan = SplitPlan(plan_capacity(4, 2, H200_SMS), 4, DEVICE)
    plan.fill(list(batch.seq_lens_host) + [0], 2, H200_SMS, min_chunk=16)
    assert plan.seqs[1, 1].item() == 4  # the 61-token sequence in 4 chunks: the plan really splits
    plans_read = []
    real = triton_backend.paged_decode_planned
    monkeypatch.setattr(
        triton_backend, "paged_decode_planned", lambda *a, **kw: plans_read.append(a[4]) or real(*a, **kw)
    )
    planned = TritonBackend(store, dataclasses.replace(batch, split_plan=plan))
    got = planned(0, q, k, v)
    assert plans_read == [plan]
    want = TritonBackend(store, batch)(0, q, k, v)  # the same K/V written again: same pool
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    how = "interpreter" if interpreting() else "compiled"
    assert dict(planned.runs) == {("reshape_and_cache", how): 1, ("paged_decode_attention", how): 1}
