"""Chapter 5's checks accept right kernels and reject the typical wrong ones, each with its own hint.

The kernels here are written independently of the notebook's solutions; the wrong ones are the
mistakes the hints name. They run where this process runs kernels: in Triton's interpreter on a CPU,
compiled on a GPU (the tests taking ``device`` run on the kernels' device, and skip the other).
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.exercises import ExerciseError, ch05
from kvcourse.exercises._core import Unfinished
from kvcourse.kernels.triton_runtime import tl, triton


class Spy:
    """A kernel that notes the device of every tensor it is launched with, then launches ``kernel``."""

    def __init__(self, kernel) -> None:
        self.kernel, self.fn, self.devices = kernel, kernel.fn, set()

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.devices.update(a.device.type for a in args if isinstance(a, torch.Tensor))
            return launch(*args, **kwargs)

        return run


# ---------------------------------------------------------------------------------------------
# 1. The missing mask: one program per sequence, the whole context in one tile
# ---------------------------------------------------------------------------------------------
@triton.jit
def mask_right(Q, K, V, Seq_lens, Out, scale, BLOCK_S: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    n = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ok = n < tl.load(Seq_lens + b)
    q = tl.load(Q + b * D + d)
    k = tl.load(K + b * BLOCK_S * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    v = tl.load(V + b * BLOCK_S * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    s = tl.where(ok, tl.sum(q[None, :] * k, 1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    tl.store(Out + b * D + d, tl.sum(p[:, None] * v, 0) / tl.sum(p, 0))


@triton.jit
def mask_none(Q, K, V, Seq_lens, Out, scale, BLOCK_S: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    n = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    q = tl.load(Q + b * D + d)
    k = tl.load(K + b * BLOCK_S * D + n[:, None] * D + d[None, :])
    v = tl.load(V + b * BLOCK_S * D + n[:, None] * D + d[None, :])
    s = tl.sum(q[None, :] * k, 1) * scale
    p = tl.exp(s - tl.max(s, 0))
    tl.store(Out + b * D + d, tl.sum(p[:, None] * v, 0) / tl.sum(p, 0))


@triton.jit
def mask_loads_only(Q, K, V, Seq_lens, Out, scale, BLOCK_S: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    n = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ok = n < tl.load(Seq_lens + b)
    q = tl.load(Q + b * D + d)
    k = tl.load(K + b * BLOCK_S * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    v = tl.load(V + b * BLOCK_S * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    s = tl.sum(q[None, :] * k, 1) * scale
    p = tl.exp(s - tl.max(s, 0))
    tl.store(Out + b * D + d, tl.sum(p[:, None] * v, 0) / tl.sum(p, 0))


@triton.jit
def mask_scores_only(Q, K, V, Seq_lens, Out, scale, BLOCK_S: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    n = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ok = n < tl.load(Seq_lens + b)
    q = tl.load(Q + b * D + d)
    k = tl.load(K + b * BLOCK_S * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    v = tl.load(V + b * BLOCK_S * D + n[:, None] * D + d[None, :])  # V padding loaded
    s = tl.where(ok, tl.sum(q[None, :] * k, 1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    tl.store(Out + b * D + d, tl.sum(p[:, None] * v, 0) / tl.sum(p, 0))


@triton.jit
def mask_off_by_one(Q, K, V, Seq_lens, Out, scale, BLOCK_S: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    n = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ok = n <= tl.load(Seq_lens + b)
    q = tl.load(Q + b * D + d)
    k = tl.load(K + b * BLOCK_S * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    v = tl.load(V + b * BLOCK_S * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    s = tl.where(ok, tl.sum(q[None, :] * k, 1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    tl.store(Out + b * D + d, tl.sum(p[:, None] * v, 0) / tl.sum(p, 0))


def test_masked_decode_accepts_right_kernel(kernels_on):
    spy = Spy(mask_right)
    assert ch05.check_masked_decode(spy)
    assert spy.devices == {kernels_on.type}  # every tensor where the kernels run


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (mask_none, "attends to all BLOCK_S slots"),
        (mask_loads_only, "set the scores of masked positions to -inf"),
        (mask_scores_only, "Mask the loads of K and V"),
        (mask_off_by_one, "One slot too many"),
        (lambda *a: None, "@triton.jit kernel masked_decode_kernel itself"),
    ],
    ids=["no-mask", "loads-only", "scores-only", "off-by-one", "not-a-kernel"],
)
def test_masked_decode_rejects_wrong_kernels(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_masked_decode(wrong)


# ---------------------------------------------------------------------------------------------
# 2. The online softmax: tiles of BLOCK_N, running max / sum / output
# ---------------------------------------------------------------------------------------------
class Bound:
    """A kernel with some constexpr arguments fixed: launched as ``bound[grid](*args, **constexprs)``."""

    def __init__(self, kernel, **fixed) -> None:
        self.kernel, self.fixed, self.fn = kernel, fixed, kernel.fn

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, **self.fixed)


@triton.jit
def online_kernel(
    Q, K, V, Seq_lens, Out, scale, S_MAX: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, MISTAKE: tl.constexpr
):
    b = tl.program_id(0)
    seq_len = tl.load(Seq_lens + b)
    d = tl.arange(0, D)
    q = tl.load(Q + b * D + d)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.full([1], 0.0, tl.float32)
    acc = tl.full([D], 0.0, tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        ok = n < seq_len
        k = tl.load(K + b * S_MAX * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + b * S_MAX * D + n[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.where(ok, tl.sum(q[None, :] * k, 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        if MISTAKE == "inverted":
            alpha = tl.exp(m_new - m)
        else:
            alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        if MISTAKE == "l":
            l = l + tl.sum(p, 0)
        else:
            l = l * alpha + tl.sum(p, 0)
        if MISTAKE == "acc":
            acc = acc + tl.sum(p[:, None] * v, 0)
        else:
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    if MISTAKE != "divide":
        acc = acc / l
    tl.store(Out + b * D + d, acc)


def _online(mistake: str) -> Bound:
    return Bound(online_kernel, MISTAKE=mistake)


def test_online_softmax_accepts_right_kernel(kernels_on):
    spy = Spy(_online("none"))
    assert ch05.check_online_softmax(spy) and spy.devices == {kernels_on.type}


@pytest.mark.parametrize(
    "mistake, hint",
    [("acc", "multiply it by alpha"), ("l", "l is not"), ("divide", "divide it by l"), ("inverted", "inf or NaN")],
)
def test_online_softmax_rejects_wrong_kernels(mistake, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_online_softmax(_online(mistake))


# ---------------------------------------------------------------------------------------------
# 3. The block-table offset
# ---------------------------------------------------------------------------------------------
@triton.jit
def paged_kernel(Q, K_cache, V_cache, Block_tables, Seq_lens, Out, scale, stride_qb, stride_qh, stride_kb, stride_kt,
                 stride_kh, stride_bt, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 D: tl.constexpr, MISTAKE: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    seq_len = tl.load(Seq_lens + b)
    d = tl.arange(0, D)
    if MISTAKE == "q_heads_by_d":  # Q and Out read as packed [B, Hq, D]
        q_row = b * stride_qb + h * D + d
    else:
        q_row = b * stride_qb + h * stride_qh + d
    if MISTAKE == "head_by_d":  # each token's KV heads read as packed
        head_offset = kv_head * D
    else:
        head_offset = kv_head * stride_kh
    q = tl.load(Q + q_row)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.full([1], 0.0, tl.float32)
    acc = tl.full([D], 0.0, tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        ok = n < seq_len
        if MISTAKE == "row0":
            block = tl.load(Block_tables + n // BLOCK_SIZE, mask=ok, other=0)
        else:
            block = tl.load(Block_tables + b * stride_bt + n // BLOCK_SIZE, mask=ok, other=0)
        if MISTAKE == "contiguous":
            row = n * stride_kt
        elif MISTAKE == "no_offset":
            row = block * stride_kb
        elif MISTAKE == "unscaled":
            row = block * stride_kt + (n % BLOCK_SIZE) * stride_kt
        elif MISTAKE == "packed_blocks":  # right only for one packed [num_blocks, BLOCK_SIZE, Hkv, D] pool
            row = block * BLOCK_SIZE * stride_kt + (n % BLOCK_SIZE) * stride_kt
        else:
            row = block * stride_kb + (n % BLOCK_SIZE) * stride_kt
        ptr = row[:, None] + head_offset + d[None, :]
        k = tl.load(K_cache + ptr, mask=ok[:, None], other=0.0)
        v = tl.load(V_cache + ptr, mask=ok[:, None], other=0.0)
        s = tl.where(ok, tl.sum(q[None, :] * k, 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l = l * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    tl.store(Out + q_row, acc / l)


def _paged(mistake: str) -> Bound:
    return Bound(paged_kernel, MISTAKE=mistake)


def test_paged_offsets_accepts_right_kernel(kernels_on):
    spy = Spy(_paged("none"))
    assert ch05.check_paged_offsets(spy) and spy.devices == {kernels_on.type}


@pytest.mark.parametrize(
    "mistake, hint",
    [
        ("contiguous", "look up the physical block"),
        ("no_offset", "add the offset"),
        ("unscaled", "multiply it by the block stride"),
        ("row0", "sequence 0's table"),
        ("packed_blocks", "a block starts at block \\* stride_kb"),
        ("head_by_d", "not h \\* D \\(a head-major pool"),
        ("q_heads_by_d", "Step the heads of Q and Out by stride_qh"),
    ],
)
def test_paged_offsets_rejects_wrong_kernels(mistake, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_paged_offsets(_paged(mistake))


# ---------------------------------------------------------------------------------------------
# 4. Split-KV's merge, written whole: rows of NUM_SPLITS partial results
# ---------------------------------------------------------------------------------------------
@triton.jit
def merge_kernel(
    Partial, Lse, Out, Out_lse, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, MISTAKE: tl.constexpr
):
    row = tl.program_id(0)
    split = tl.arange(0, BLOCK_S)
    col = tl.arange(0, D)
    if MISTAKE == "row_stride":  # rows taken to be BLOCK_S splits long
        first = row * BLOCK_S
    else:
        first = row * NUM_SPLITS
    if MISTAKE == "split_mask":
        lse = tl.load(Lse + first + split)
    else:
        lse = tl.load(Lse + first + split, mask=split < NUM_SPLITS, other=float("-inf"))
    ptrs = Partial + first * D + split[:, None] * D + col[None, :]
    if MISTAKE == "empty":
        parts = tl.load(ptrs, mask=(split < NUM_SPLITS)[:, None], other=0.0)
    elif MISTAKE == "split_mask":
        parts = tl.load(ptrs)
        parts = tl.where((lse == float("-inf"))[:, None], 0.0, parts)
    else:
        parts = tl.load(ptrs, mask=(split < NUM_SPLITS)[:, None] & (lse != float("-inf"))[:, None], other=0.0)
    top = tl.max(lse, 0)
    if MISTAKE == "no_max":
        weight = tl.exp(lse)
    elif MISTAKE == "mean":
        weight = tl.where(lse != float("-inf"), 1.0, 0.0)
    elif MISTAKE == "exp2":
        weight = tl.exp2(lse - top)
    else:
        weight = tl.exp2((lse - top) * 1.4426950408889634)  # e^x = 2^(x log2 e)
    denominator = tl.sum(weight, 0)
    merged = tl.sum(parts * weight[:, None], 0)
    if MISTAKE != "unnormalised":
        merged = merged / denominator
    tl.store(Out + row * D + col, merged)
    if MISTAKE == "lse_max":
        tl.store(Out_lse + row, top)
    elif MISTAKE == "lse_sum":
        tl.store(Out_lse + row, tl.sum(tl.where(lse != float("-inf"), lse, 0.0), 0))
    elif MISTAKE == "no_max":
        tl.store(Out_lse + row, tl.log(denominator))
    else:
        tl.store(Out_lse + row, top + tl.log(denominator))


def _merge(mistake: str) -> Bound:
    return Bound(merge_kernel, MISTAKE=mistake)


def test_merge_splits_accepts_right_kernel(kernels_on):
    spy = Spy(_merge("none"))
    assert ch05.check_merge_splits(spy) and spy.devices == {kernels_on.type}
    assert ch05.check_merge_splits(_merge("none"), seed=5)


@pytest.mark.parametrize(
    "mistake, hint",
    [
        ("empty", "0 x NaN is NaN"),
        ("split_mask", "read the next row's splits"),
        ("no_max", "exp\\(lse\\) overflows"),
        ("mean", "the same weight"),
        ("exp2", "natural logarithms"),
        ("unnormalised", "without the division"),
        ("lse_max", "the maximum M alone"),
        ("lse_sum", "logs of sums do not add"),
        ("row_stride", "BLOCK_S is the width of the tile you load"),
    ],
)
def test_merge_splits_rejects_wrong_kernels(mistake, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_merge_splits(_merge(mistake))


def test_merge_splits_wants_the_kernel_and_reports_a_stub():
    with pytest.raises(ExerciseError, match="@triton.jit kernel merge_splits_kernel itself"):
        ch05.check_merge_splits(lambda *a: None)

    @triton.jit
    def stub(Partial, Lse, Out, Out_lse, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr):
        raise NotImplementedError("write the merge")

    assert not ch05.check_merge_splits(stub)


def test_a_stub_that_cannot_compile_is_reported_as_not_written():
    """Compiled on a GPU, a stub's ``raise NotImplementedError`` is a compile error (Triton has no raise):
    the learner must still read "not written yet", as in the interpreter."""

    class CompiledStub:  # what Triton's JIT does with the stub on a GPU
        src = 'def stub(Partial, Lse, Out, Out_lse):\n    raise NotImplementedError("write the merge")\n'

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("at 2:4:\n    raise NotImplementedError\n    ^\nunsupported AST node type: Raise")

            return launch

    with pytest.raises(Unfinished, match="not written yet"):
        ch05._launch("merge_splits_kernel", CompiledStub(), (1,))

    class BrokenKernel(CompiledStub):  # the same error from a kernel that is not a stub is the learner's bug
        src = "def k(X):\n    pass\n"

    with pytest.raises(ExerciseError, match="unsupported AST node type: Raise") as err:
        ch05._launch("merge_splits_kernel", BrokenKernel(), (1,))
    assert not isinstance(err.value, Unfinished)


# ---------------------------------------------------------------------------------------------
# 5. A GQA decode kernel, tiled: one program per (sequence, KV head)
# ---------------------------------------------------------------------------------------------
@triton.jit
def tiled_kernel(Q, K, V, Seq_lens, Out, scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, MISTAKE: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    kv = tl.program_id(1)
    length = tl.load(Seq_lens + b)
    rows = tl.arange(0, GROUP)
    cols = tl.arange(0, D)
    if MISTAKE == "interleaved":
        heads = kv + rows * tl.num_programs(1)
    else:
        heads = kv * GROUP + rows
    if MISTAKE == "heads_by_d":  # Q and Out read as packed [B, Hq, D]
        head_step = D
    else:
        head_step = stride_qh
    if MISTAKE == "keys_by_d":  # K and V read as packed [..., S_MAX, D]
        key_step = D
    else:
        key_step = stride_ks
    q_ptrs = Q + b * stride_qb + heads[:, None] * head_step + cols[None, :]
    q = tl.load(q_ptrs) * scale  # fold the scale into the query once
    run_max = tl.zeros([GROUP], tl.float32) - float("inf")
    run_sum = tl.zeros([GROUP], tl.float32)
    run_out = tl.zeros([GROUP, D], tl.float32)
    if MISTAKE == "tail":
        stop = length // BLOCK_N * BLOCK_N
    else:
        stop = length
    for first in range(0, stop, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        inside = pos < length
        base = K + b * stride_kb + kv * stride_kh + pos[:, None] * key_step + cols[None, :]
        vbase = V + b * stride_kb + kv * stride_kh + pos[:, None] * key_step + cols[None, :]
        if MISTAKE == "no_mask":
            keys = tl.load(base)
            vals = tl.load(vbase)
        elif MISTAKE == "scores_only":
            keys = tl.load(base, mask=inside[:, None], other=0.0)
            vals = tl.load(vbase)
        else:
            keys = tl.load(base, mask=inside[:, None], other=0.0)
            vals = tl.load(vbase, mask=inside[:, None], other=0.0)
        scores = tl.sum(q[:, None, :] * keys[None, :, :], 2)
        if MISTAKE != "no_mask" and MISTAKE != "loads_only":
            scores = tl.where(inside[None, :], scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, 1))
        shrink = tl.exp(run_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        if MISTAKE == "l":
            run_sum = run_sum + tl.sum(probs, 1)
        else:
            run_sum = run_sum * shrink + tl.sum(probs, 1)
        contrib = tl.sum(probs[:, :, None] * vals[None, :, :], 1)
        if MISTAKE == "acc":
            run_out = run_out + contrib
        else:
            run_out = run_out * shrink[:, None] + contrib
        run_max = new_max
    if MISTAKE != "divide":
        run_out = run_out / run_sum[:, None]
    tl.store(Out + b * stride_qb + heads[:, None] * head_step + cols[None, :], run_out)


def _tiled(mistake: str) -> Bound:
    return Bound(tiled_kernel, MISTAKE=mistake)


def test_tiled_decode_accepts_right_kernel(kernels_on):
    spy = Spy(_tiled("none"))
    assert ch05.check_tiled_decode(spy) and spy.devices == {kernels_on.type}
    assert ch05.check_tiled_decode(_tiled("none"), seed=11)


@pytest.mark.parametrize(
    "mistake, hint",
    [
        ("tail", "reads whole tiles only"),
        ("no_mask", "reads past seq_len"),
        ("scores_only", "NaN padding leaks"),
        ("loads_only", "a score of 0 still gets weight"),
        ("acc", "multiply it by alpha"),
        ("l", "l is not"),
        ("divide", "divide it by l"),
        ("interleaved", "consecutive heads"),
        ("keys_by_d", "step the keys and values by stride_ks"),
        ("heads_by_d", "Step the heads of Q and Out by stride_qh"),
    ],
)
def test_tiled_decode_rejects_wrong_kernels(mistake, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_tiled_decode(_tiled(mistake))


# ---------------------------------------------------------------------------------------------
# 6. Bytes of K and V
# ---------------------------------------------------------------------------------------------
def test_kv_bytes_accepts_right_answer():
    assert ch05.check_kv_bytes(lambda lens, hkv, d, nb: 2 * sum(lens) * hkv * d * nb)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda lens, hkv, d, nb: sum(lens) * hkv * d * nb, "Both K and V"),
        (lambda lens, hkv, d, nb: 2 * len(lens) * max(lens) * hkv * d * nb, "sum the lengths"),
        (lambda lens, hkv, d, nb: 16 * sum(lens) * hkv * d * nb, "multiply by 8 bits"),
        (lambda lens, hkv, d, nb: "many", "a number of bytes"),
        (lambda lens, hkv, d, nb: 2 * sum(lens) * d * nb, "multiply by num_kv_heads"),
        (lambda lens, hkv, d, nb: 2 * sum(lens) * hkv * d, "tokens x KV heads x head_dim x bytes"),
    ],
    ids=["k-only", "max-len", "bits", "not-a-number", "no-heads", "no-bytes"],
)
def test_kv_bytes_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_kv_bytes(wrong)


def test_other_seeds_draw_other_cases_and_still_accept_right_answers():
    assert ch05.check_kv_bytes(lambda lens, hkv, d, nb: 2 * sum(lens) * hkv * d * nb, seed=7)
    assert ch05.check_masked_decode(mask_right, seed=3)
    with pytest.raises(ExerciseError, match="One slot too many"):
        ch05.check_masked_decode(mask_off_by_one, seed=3)


# ---------------------------------------------------------------------------------------------
# Inputs are the learner's to read, not to write (issue 36)
# ---------------------------------------------------------------------------------------------
class Vandal:
    """The right kernel, launched, then argument ``index`` (an input) zeroed: the output is right, but
    the caller's data is gone. A check must refuse it, naming the input."""

    def __init__(self, kernel, index: int) -> None:
        self.kernel, self.index = kernel, index
        self.fn = getattr(kernel, "fn", None)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            out = launch(*args, **kwargs)
            args[self.index].zero_()
            return out

        return run


@pytest.mark.parametrize(
    "check, kernel, index, name",
    [
        (ch05.check_masked_decode, mask_right, 2, "V"),
        (ch05.check_online_softmax, _online("none"), 1, "K"),
        (ch05.check_paged_offsets, _paged("none"), 2, "V_cache"),
        (ch05.check_merge_splits, _merge("none"), 0, "Partial"),
        (ch05.check_tiled_decode, _tiled("none"), 0, "Q"),
    ],
    ids=["mask", "online", "paged", "merge", "tiled"],
)
def test_a_kernel_that_writes_into_its_inputs_is_refused(check, kernel, index, name):
    with pytest.raises(ExerciseError, match=rf"(?s)input {name}\b.*changed at \d+ positions"):
        check(Vandal(kernel, index))


@triton.jit
def mask_zeroes(Q, K, V, Seq_lens, Out, scale, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """The cheat of issue 36: write zeros to V and to Out, compute nothing."""
    b = tl.program_id(0)
    n = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    tl.store(V + b * BLOCK_S * D + n[:, None] * D + d[None, :], tl.zeros([BLOCK_S, D], tl.float32))
    tl.store(Out + b * D + d, tl.zeros([D], tl.float32))


def test_a_kernel_that_zeroes_its_value_input_and_output_gets_no_credit():
    with pytest.raises(ExerciseError):
        ch05.check_masked_decode(mask_zeroes)


# ---------------------------------------------------------------------------------------------
# Layouts a packed kernel gets wrong (issue 47): every seed draws them
# ---------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("error::RuntimeWarning")  # the packed kernel reduces tiles of NaN: no NumPy noise shown
def test_other_seeds_still_lay_kv_out_so_that_a_packed_layout_is_caught():
    assert ch05.check_paged_offsets(_paged("none"), seed=3)
    with pytest.raises(ExerciseError, match=r"a block starts at block \* stride_kb"):
        ch05.check_paged_offsets(_paged("packed_blocks"), seed=3)
    assert ch05.check_tiled_decode(_tiled("none"), seed=3)
    with pytest.raises(ExerciseError, match="step the keys and values by stride_ks"):
        ch05.check_tiled_decode(_tiled("keys_by_d"), seed=3)


# ---------------------------------------------------------------------------------------------
# The int8 speed-up the bytes promise (issue 45: predict, then measure)
# ---------------------------------------------------------------------------------------------
def _int8_nbytes(lens, hq, hkv, d, bs, kv, scale, q=2, tables=True):
    return (
        2 * sum(lens) * hkv * (d * kv + scale)
        + 2 * len(lens) * hq * d * q
        + (4 * sum(-(-n // bs) for n in lens) if tables else 0)
    )


def int8_speedup_right(lens, hq, hkv, d, bs):
    return _int8_nbytes(lens, hq, hkv, d, bs, 2, 0) / _int8_nbytes(lens, hq, hkv, d, bs, 1, 4)


def test_int8_speedup_accepts_right_answer():
    assert ch05.check_int8_speedup(int8_speedup_right)
    assert ch05.check_int8_speedup(int8_speedup_right, seed=5)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lambda *c: _int8_nbytes(*c, 2, 0) / _int8_nbytes(*c, 1, 0), "The scales are bytes too"),
        (lambda *c: _int8_nbytes(*c, 2, 0) / _int8_nbytes(*c, 1, 2), "Both K and V carry a scale"),
        (lambda *c: _int8_nbytes(*c, 1, 4) / _int8_nbytes(*c, 2, 0), "fp16's time over int8's"),
        (lambda *c: _int8_nbytes(*c, 2, 0) / _int8_nbytes(*c, 1, 4, q=1), "Only the cache is int8"),
        (lambda *c: _int8_nbytes(*c, 2, 0, q=0) / _int8_nbytes(*c, 1, 4, q=0), "query and write the fp16 output"),
        (lambda *c: _int8_nbytes(*c, 2, 0, tables=False) / _int8_nbytes(*c, 1, 4, tables=False), "block table"),
        (lambda *c: 2.0, "Count each kernel's bytes"),
        (lambda *c: "twice", "a speed-up"),
    ],
    ids=["no-scales", "k-scale-only", "inverted", "int8-query", "no-query", "no-tables", "two", "not-a-number"],
)
def test_int8_speedup_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch05.check_int8_speedup(wrong)


def test_int8_speedup_refuses_the_packages_model():
    from kvcourse.kernels.roofline import int8_speedup_bound

    with pytest.raises(ExerciseError, match="int8_speedup_bound"):
        ch05.check_int8_speedup(lambda *c: int8_speedup_bound(*c))
