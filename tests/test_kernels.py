"""Chapter 5's attention kernels against the torch references: contiguous, paged, split-KV, int8 reads.

Without a GPU the kernels run in Triton's interpreter, where time grows with programs x loop iterations.
CI runs a pruned grid in which every value of every axis appears (seq_lens {1, 17, 255, 1027} in every
case; heads (9,3), (4,4), (8,1), (32,8); head dims 64, 128; block sizes 1, 16, 32; fp32, fp16, bf16).
``KVCOURSE_FULL_KERNEL_GRID=1`` runs the full product (for a GPU session, or a patient laptop).

Every test checks that no kernel fell back to torch: a kernel that failed to run cannot pass as the
reference it falls back to.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kvcourse.kernels import (
    decode_attention,
    paged_decode_attention,
    paged_decode_attention_fp8,
    paged_decode_attention_int8,
)
from kvcourse.kernels.fp8 import dequantize_fp8, paged_decode_attention_fp8_ref, quantize_fp8
from kvcourse.kernels.int8 import dequantize_int8, paged_decode_attention_int8_ref, quantize_int8
from kvcourse.kernels.reference import decode_attention_ref, paged_decode_attention_ref
from kvcourse.kernels.testing import random_paged_case, repage, tolerance
from kvcourse.kernels.triton_decode import group_rows, tile_config
from kvcourse.kernels.triton_paged import (
    INT8_CONVERSIONS,
    MAX_SPLITS,
    choose_num_splits,
    decode_workspace,
    int8_to_float,
    paged_decode,
)
from kvcourse.kernels.triton_runtime import fallbacks, interpreting, reset_fallbacks, tl, triton

FULL_GRID = os.environ.get("KVCOURSE_FULL_KERNEL_GRID") == "1"
# Where the kernels run in this process: the CPU (Triton's interpreter), or the GPU when Triton compiles
# (``python -m kvcourse.gpu_check`` runs these tests there).
DEVICE = "cpu" if interpreting() else "cuda"
SEQ_LENS = [1, 17, 255, 1027]
HEADS = [(9, 3), (4, 4), (8, 1), (32, 8)]
HEAD_DIMS = [64, 128]
BLOCK_SIZES = [1, 16, 32]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Pruned for CI: each heads pair twice, each head dim, block size and dtype at least twice.
CI_PAGED = [
    ((9, 3), 64, 16, torch.float32),
    ((9, 3), 128, 1, torch.float16),
    ((4, 4), 64, 32, torch.float16),
    ((4, 4), 128, 16, torch.bfloat16),
    ((8, 1), 64, 1, torch.bfloat16),
    ((8, 1), 128, 32, torch.float32),
    ((32, 8), 64, 1, torch.float32),
    ((32, 8), 128, 16, torch.float16),
]
PAGED_GRID = list(itertools.product(HEADS, HEAD_DIMS, BLOCK_SIZES, DTYPES)) if FULL_GRID else CI_PAGED
CONTIGUOUS_GRID = (
    list(itertools.product(HEADS, HEAD_DIMS, DTYPES))
    if FULL_GRID
    else [
        ((9, 3), 64, torch.float32),
        ((4, 4), 128, torch.float16),
        ((8, 1), 64, torch.bfloat16),
        ((32, 8), 128, torch.float32),
    ]
)


def _id(params) -> str:
    return "-".join(str(p).replace("torch.", "").replace(" ", "") for p in params)


@pytest.fixture(autouse=True)
def no_fallback():
    reset_fallbacks()
    yield
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"


def _seed(*params) -> int:
    return sum(ord(c) for c in _id(params))  # from the test's own parameters, not the test order


# ---------------------------------------------------------------------------------------------
# Contiguous decode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads, head_dim, dtype", CONTIGUOUS_GRID, ids=[_id(p) for p in CONTIGUOUS_GRID])
def test_decode_attention_equals_reference(heads, head_dim, dtype):
    case = random_paged_case(_seed(heads, head_dim, dtype), SEQ_LENS, num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=head_dim, block_size=16, dtype=dtype, device=DEVICE)  # fmt: skip
    k, v = case.k.clone(), case.v.clone()
    for b, n in enumerate(SEQ_LENS):  # padding past each seq_len must never be read
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    got = decode_attention(case.q, k, v, case.seq_lens)
    assert got.dtype == dtype and got.shape == case.q.shape
    torch.testing.assert_close(got, case.expected(), **tolerance(dtype))
    torch.testing.assert_close(got, decode_attention_ref(case.q, case.k, case.v, case.seq_lens), **tolerance(dtype))


def test_decode_attention_defaults_and_scale():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE) for shape in ((2, 6, 64), (2, 2, 40, 64), (2, 2, 40, 64)))
    torch.testing.assert_close(decode_attention(q, k, v), decode_attention_ref(q, k, v), **tolerance(torch.float32))
    torch.testing.assert_close(
        decode_attention(q, k, v, [3, 40], scale=0.3),
        decode_attention_ref(q, k, v, [3, 40], scale=0.3),
        rtol=1e-5,
        atol=1e-5,
    )


# ---------------------------------------------------------------------------------------------
# Paged decode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads, head_dim, block_size, dtype", PAGED_GRID, ids=[_id(p) for p in PAGED_GRID])
def test_paged_decode_attention_equals_reference(heads, head_dim, block_size, dtype):
    case = random_paged_case(_seed(heads, head_dim, block_size, dtype), SEQ_LENS, num_q_heads=heads[0],
                             num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size, dtype=dtype, device=DEVICE)  # fmt: skip
    got = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert got.dtype == dtype and got.shape == case.q.shape
    torch.testing.assert_close(got, case.expected(), **tolerance(dtype))


def test_paged_decode_with_shared_blocks_and_a_custom_scale():
    case = random_paged_case(11, [70, 33, 64, 40], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                             shared_blocks=2, scale=0.05, device=DEVICE)  # fmt: skip
    assert case.block_tables[1, :2].tolist() == case.block_tables[0, :2].tolist()  # blocks really shared
    got = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale=0.05)
    torch.testing.assert_close(got, case.expected(), **tolerance(torch.float32))


def test_block_size_16_equals_block_size_1_exactly():
    case16 = random_paged_case(3, SEQ_LENS, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, device=DEVICE)
    case1 = repage(case16, block_size=1, seed=4)
    assert case1.k_cache.shape[1] == 1 and case1.block_tables.shape[1] == max(SEQ_LENS) + 1
    out16 = paged_decode_attention(case16.q, case16.k_cache, case16.v_cache, case16.block_tables, case16.seq_lens)
    out1 = paged_decode_attention(case1.q, case1.k_cache, case1.v_cache, case1.block_tables, case1.seq_lens)
    assert torch.equal(out1, out16)  # same values, same order of operations: only the addresses differ


# ---------------------------------------------------------------------------------------------
# Split-KV
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_split_kv_equals_unsplit(num_splits):
    case = random_paged_case(
        20 + num_splits, SEQ_LENS, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, device=DEVICE
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    unsplit = paged_decode_attention(*args, num_splits=1)
    split = paged_decode_attention(*args, num_splits=num_splits)  # seq_len 1: num_splits - 1 empty splits
    torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, case.expected(), **tolerance(torch.float32))


@pytest.mark.parametrize("seq_lens, num_splits", [([3, 17, 40], 8), ([40], MAX_SPLITS)], ids=["8", "max"])
def test_more_splits_than_blocks_and_tokens(seq_lens, num_splits):
    case = random_paged_case(8, seq_lens, num_q_heads=8, num_kv_heads=1, head_dim=64, block_size=32, device=DEVICE)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    got = paged_decode_attention(*args, num_splits=num_splits)  # 2 blocks and 40 tokens at most
    torch.testing.assert_close(got, paged_decode_attention(*args, num_splits=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, case.expected(), **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_split_kv_in_half_precision(dtype):
    case = random_paged_case(
        30, SEQ_LENS, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16, dtype=dtype, device=DEVICE
    )
    got = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, num_splits=4)
    assert got.dtype == dtype
    torch.testing.assert_close(got, case.expected(), **tolerance(dtype))


@pytest.mark.parametrize("capability", [75, 80, 90])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kv_int8", [False, True], ids=["kv-float", "kv-int8"])
def test_gpu_tiles_are_legal_and_fit_a_t4(head_dim, dtype, capability, kv_int8):
    cfg = tile_config(head_dim, dtype, capability, torch.int8 if kv_int8 else dtype)  # no GPU needed
    n, d = cfg["BLOCK_N"], cfg["BLOCK_D"]
    assert n >= 16 and d >= 16 and n & (n - 1) == 0 and d & (d - 1) == 0  # tl.dot's minimum, powers of two
    smem = cfg["num_stages"] * 2 * n * d * torch.finfo(dtype).bits // 8  # K and V tiles in the dots' dtype
    assert smem <= 32 * 1024 or (n == 16 and head_dim == 256 and dtype == torch.float32)
    assert group_rows(3) == 16 and group_rows(32) == 32  # GQA groups padded to tl.dot's 16 rows
    if capability < 80:  # a T4: FMA dots, no cp.async (tests/test_kernels_native.py compiles these)
        assert cfg["num_stages"] == 1 and cfg["num_warps"] == 8 and n <= 32
    if kv_int8:
        assert cfg["num_warps"] == 8 and (cfg["num_stages"] == 1 or dtype != torch.float32)
    assert tile_config(head_dim, dtype, None)["BLOCK_N"] == 128  # the interpreter: wide tiles


def test_choose_num_splits():
    # H100 (132 SMs): batch 1 x 8 KV heads = 8 programs; up to 32 x 132 / 8 = 528 splits: capped at MAX_SPLITS.
    assert choose_num_splits(1, 8, 65536, 132) == MAX_SPLITS
    # No split shorter than 256 tokens: 8,192 tokens -> 32 splits (a power of two).
    assert choose_num_splits(1, 8, 8192, 132) == 32 and choose_num_splits(1, 8, 5000, 132) == 16
    # A context under 4,096 tokens is not split at all: the merge's launch would cost more.
    assert choose_num_splits(1, 8, 4095, 132) == 1 and choose_num_splits(1, 8, 600, 132) == 1
    # A big batch fills the GPU by itself: 64 x 8 = 512 programs, 32 x 132 / 512 = 8.25 -> 8 splits.
    assert choose_num_splits(64, 8, 65536, 132) == 8 and choose_num_splits(1024, 8, 65536, 132) == 1
    assert choose_num_splits(1, 8, 65536, None) == 1  # the interpreter: programs run one by one
    with pytest.raises(ValueError, match="max_seq_len"):
        choose_num_splits(1, 8, 0, 132)


# ---------------------------------------------------------------------------------------------
# int8 K/V reads
# ---------------------------------------------------------------------------------------------
def _int8_case(seed, dtype, heads=(9, 3), head_dim=64, block_size=16):
    case = random_paged_case(seed, SEQ_LENS, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE)  # fmt: skip
    k8, ks = quantize_int8(case.k_cache.nan_to_num(0.0))  # unused slots: zeros (int8 has no NaN)
    v8, vs = quantize_int8(case.v_cache.nan_to_num(0.0))
    return case, (k8, v8, ks, vs)


@pytest.mark.parametrize(
    "dtype, num_splits, heads, head_dim",
    [
        (torch.float32, 1, (9, 3), 64),
        (torch.float16, 1, (32, 8), 128),
        (torch.bfloat16, 3, (8, 1), 64),
        (torch.float32, 4, (4, 4), 128),
    ],
    ids=["fp32", "fp16", "bf16-split3", "fp32-split4"],
)
def test_paged_decode_int8_equals_dequantized_reference(dtype, num_splits, heads, head_dim):
    case, (k8, v8, ks, vs) = _int8_case(40 + num_splits, dtype, heads, head_dim)
    args = (case.q, k8, v8, ks, vs, case.block_tables, case.seq_lens)
    got = paged_decode_attention_int8(*args, num_splits=num_splits)
    want = paged_decode_attention_int8_ref(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tolerance(dtype))
    # The reference really is the float reference on the dequantized pool.
    deq = paged_decode_attention_ref(
        case.q.float(), dequantize_int8(k8, ks), dequantize_int8(v8, vs), case.block_tables, case.seq_lens
    )
    torch.testing.assert_close(want, deq.to(dtype), rtol=0, atol=0)


@triton.jit
def _int8_to_float_kernel(X, Y, DTYPE: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(Y + i, int8_to_float(tl.load(X + i), DTYPE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_int8_to_float_is_exact_for_every_byte(dtype):
    """The kernel's bit-level conversion (no conversion unit) gives exactly what a plain conversion gives."""
    x = torch.arange(-128, 128, dtype=torch.int8, device=DEVICE)
    y = torch.empty(256, dtype=dtype, device=DEVICE)
    _int8_to_float_kernel[(1,)](
        x, y, DTYPE={torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    )
    assert torch.equal(y, x.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_both_int8_conversions_give_one_answer(dtype):
    """``int8_conversion="cvt"`` (the first version, kept for the GPU benchmark to time) and the default agree."""
    case, (k8, v8, ks, vs) = _int8_case(61, dtype, (32, 8), 128)
    outs = [
        paged_decode(case.q, k8, v8, case.block_tables, case.seq_lens, 128**-0.5, 2, ks, vs, int8_conversion=c)
        for c in INT8_CONVERSIONS
    ]
    torch.testing.assert_close(outs[0], outs[1], **tolerance(dtype))
    with pytest.raises(ValueError, match="int8_conversion must be one of"):
        paged_decode(case.q, k8, v8, case.block_tables, case.seq_lens, 1.0, 1, ks, vs, int8_conversion="i2f")


def test_kept_buffers_give_the_same_answer_and_nothing_is_allocated(monkeypatch):
    """``out`` and ``workspace`` (bigger than this step needs, as an engine keeps them): the same result, written into
    them, with no ``torch.empty`` in the wrapper."""
    case = random_paged_case(62, SEQ_LENS, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device=DEVICE)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125, 3)
    want = paged_decode(*args)
    out = torch.empty_like(case.q)
    workspace = decode_workspace(len(SEQ_LENS) + 2, 8, 64, 5, DEVICE)
    import kvcourse.kernels.triton_paged as triton_paged

    made = []
    real_empty = torch.empty
    monkeypatch.setattr(triton_paged.torch, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    got = paged_decode(*args, out=out, workspace=workspace)
    monkeypatch.undo()
    assert got is out and not made
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _fp8_case(seed, dtype, heads=(9, 3), head_dim=64, block_size=16):
    case = random_paged_case(seed, SEQ_LENS, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=DEVICE)  # fmt: skip
    kf, ks = quantize_fp8(case.k_cache.nan_to_num(0.0))
    vf, vs = quantize_fp8(case.v_cache.nan_to_num(0.0))
    return case, (kf, vf, ks, vs)


@pytest.mark.parametrize(
    "dtype, num_splits, heads, head_dim",
    [(torch.float32, 1, (9, 3), 64), (torch.float16, 1, (32, 8), 128), (torch.bfloat16, 3, (8, 1), 64)],
    ids=["fp32", "fp16", "bf16-split3"],
)
def test_paged_decode_fp8_equals_dequantized_reference(dtype, num_splits, heads, head_dim):
    case, (kf, vf, ks, vs) = _fp8_case(70 + num_splits, dtype, heads, head_dim)
    args = (case.q, kf, vf, ks, vs, case.block_tables, case.seq_lens)
    got = paged_decode_attention_fp8(*args, num_splits=num_splits)
    assert got.dtype == dtype
    torch.testing.assert_close(got, paged_decode_attention_fp8_ref(*args), **tolerance(dtype))
    # and fp8 is close to the full-precision answer (e4m3 keeps about 2 significant digits per value)
    full = paged_decode_attention_ref(
        case.q.float(), case.k_cache.float(), case.v_cache.float(), case.block_tables, case.seq_lens
    )
    assert (got.float() - full).abs().max() <= 0.1 * full.abs().max()  # each value within 1/16: the output near too


def test_fp8_quantization_keeps_every_value_within_a_sixteenth():
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, 128)
    q, s = quantize_fp8(x)
    back = dequantize_fp8(q, s)
    err = (back - x).abs()
    assert q.dtype == torch.float8_e4m3fn and bool((err <= x.abs() / 16 + 2**-10 * s[..., None] + 1e-12).all())
    assert torch.equal(quantize_fp8(torch.zeros(2, 8))[1], torch.zeros(2))  # zeros: scale 0, values 0
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8(torch.tensor([[1.0, float("inf")]]))


def test_the_fp8_wrapper_names_a_wrong_pool():
    case, (kf, vf, ks, vs) = _fp8_case(80, torch.float32)
    k8 = torch.zeros_like(kf, dtype=torch.int8)
    with pytest.raises(TypeError, match=r"k_cache must have dtype torch.float8_e4m3fn"):
        paged_decode_attention_fp8(case.q, k8, vf, ks, vs, case.block_tables, case.seq_lens)
    with pytest.raises(TypeError, match=r"k_cache must have dtype torch.int8"):
        paged_decode_attention_int8(case.q, kf, vf, ks, vs, case.block_tables, case.seq_lens)


def test_int8_attention_error_against_full_precision_is_small():
    case, (k8, v8, ks, vs) = _int8_case(50, torch.float32)
    got = paged_decode_attention_int8(case.q, k8, v8, ks, vs, case.block_tables, case.seq_lens)
    err = (got - case.expected()).abs().max().item()
    # Each K/V value is off by at most scale / 2 = max|x| / 254: random unit-normal data gives ~1e-2.
    assert 1e-4 < err < 5e-2


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors naming the argument
# ---------------------------------------------------------------------------------------------
def _small_case():
    return random_paged_case(0, [5, 20], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device=DEVICE)


def test_paged_bad_input_names_the_argument():
    c = _small_case()
    args = dict(q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, block_tables=c.block_tables, seq_lens=c.seq_lens)

    def call(**change):
        return paged_decode_attention(**{**args, **change})

    with pytest.raises(TypeError, match="block_tables must have dtype torch.int32"):
        call(block_tables=c.block_tables.long())
    with pytest.raises(TypeError, match="seq_lens must have dtype torch.int32"):
        call(seq_lens=c.seq_lens.long())
    with pytest.raises(ValueError, match=r"query heads in q \(3\) must be a multiple"):
        call(q=c.q[:, :3])
    with pytest.raises(ValueError, match=r"block_tables\[1\] has 1 entries, too short for seq_lens\[1\]=20"):
        call(block_tables=c.block_tables[:, :1])
    with pytest.raises(TypeError, match="v_cache has dtype torch.float16"):
        call(v_cache=c.v_cache.half())
    with pytest.raises(ValueError, match="q must have rank 3"):
        call(q=c.q[None])
    with pytest.raises(ValueError, match="k_cache has head_dim 32 but q has 64"):
        call(k_cache=c.k_cache[..., :32].contiguous(), v_cache=c.v_cache[..., :32].contiguous())
    with pytest.raises(ValueError, match="q is on meta"):
        call(q=c.q.to("meta"), k_cache=c.k_cache.to("meta"), v_cache=c.v_cache.to("meta"))
    with pytest.raises(ValueError, match="num_splits must be an int"):
        call(num_splits=0)
    with pytest.raises(ValueError, match="num_splits must be an int"):
        paged_decode_attention(**args, num_splits=MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="scale must be a positive number"):
        call(scale=-1.0)
    with pytest.raises(TypeError, match="k_cache must be a floating-point tensor"):
        call(k_cache=c.k_cache.nan_to_num(0).to(torch.int8), v_cache=c.v_cache.nan_to_num(0).to(torch.int8))


def test_decode_and_int8_bad_input_names_the_argument():
    c = _small_case()
    with pytest.raises(ValueError, match="seq_lens must lie in"):
        decode_attention(c.q, c.k, c.v, [0, 20])
    with pytest.raises(ValueError, match=r"query heads in q \(4\) must be a multiple"):
        decode_attention(c.q, c.k[:, :1].expand(2, 3, 20, 64), c.v[:, :1].expand(2, 3, 20, 64))
    _, (k8, v8, ks, vs) = _int8_case(1, torch.float32)
    c8 = random_paged_case(1, SEQ_LENS, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match="k_scale must have shape"):
        paged_decode_attention_int8(c8.q, k8, v8, ks[..., :1], vs, c8.block_tables, c8.seq_lens)
    with pytest.raises(TypeError, match="v_scale must be float32"):
        paged_decode_attention_int8(c8.q, k8, v8, ks, vs.half(), c8.block_tables, c8.seq_lens)
    with pytest.raises(TypeError, match="k_cache must have dtype torch.int8"):
        paged_decode_attention_int8(c8.q, k8.float(), v8, ks, vs, c8.block_tables, c8.seq_lens)


def test_a_loaded_scalar_bounds_a_loop_in_the_interpreter():
    """Triton's interpreter up to 3.6 could not use a loaded scalar as a range bound under NumPy 2; kvcourse
    patches it (triton_runtime), so our kernels and chapter 5's exercises run on Colab's Triton too."""
    from kvcourse.kernels.triton_runtime import _index_loaded_scalars_in_the_interpreter, tl, triton

    if not interpreting():
        pytest.skip("compiled code: the loop bound is a register, nothing to patch")
    assert _index_loaded_scalars_in_the_interpreter() and _index_loaded_scalars_in_the_interpreter()  # idempotent

    @triton.jit
    def count_tiles(Seq_lens, Out, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        tiles = tl.full([1], 0, tl.int32)
        for start in range(0, tl.load(Seq_lens + b), BLOCK_N):
            tiles += 1
        tl.store(Out + b + tl.arange(0, 1), tiles)

    out = torch.zeros(3, dtype=torch.int32)
    count_tiles[(3,)](torch.tensor([1, 16, 33], dtype=torch.int32), out, BLOCK_N=16)
    assert out.tolist() == [1, 1, 3]


def test_tiles_pad_the_head_dim_to_tl_dots_minimum():
    """Triton 3.6 refuses, compiling for a GPU, a tl.dot with a dimension under 16 ("K >= 16"; found on
    an H100 with the tests' tiny model, head_dim 8). Padded columns load as zeros and add nothing."""
    for capability in (None, 75, 80, 90):
        for head_dim in (8, 16, 64, 96, 128):
            block_d = tile_config(head_dim, torch.float16, capability)["BLOCK_D"]
            assert block_d >= max(16, head_dim) and block_d & (block_d - 1) == 0, (capability, head_dim)
