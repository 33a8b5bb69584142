"""Paged references (decode, ragged prefill, the cache write) against the contiguous references."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcourse.batch import slot_mapping
from kvcourse.kernels import reference
from kvcourse.kernels.reference import (
    decode_attention_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
)
from kvcourse.kernels.testing import random_paged_case, tolerance

HEADS = [(9, 3), (4, 4), (8, 1), (6, 2)]
BLOCK_SIZES = [1, 5, 16]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(12))
def test_paged_decode_equals_contiguous_decode(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    hq, hkv = HEADS[seed % len(HEADS)]
    block_size = BLOCK_SIZES[seed % len(BLOCK_SIZES)]
    lens = torch.randint(1, 60, (1 + seed % 4,), generator=g).tolist()
    case = random_paged_case(seed, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=16, block_size=block_size,
                             dtype=dtype, scale=None if seed % 2 else 0.3)  # fmt: skip
    got = paged_decode_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    assert got.shape == case.q.shape and got.dtype == dtype
    assert not got.isnan().any()  # the NaN in unused slots and padding never leaked in
    want = decode_attention_ref(case.q, case.k, case.v, case.seq_lens, case.scale)
    torch.testing.assert_close(got, want, **tolerance(dtype))


def test_paged_decode_over_several_tiles_and_shared_blocks():
    # 1027 tokens in blocks of 16 is 65 blocks: more than one KV tile of KV_TILE_TOKENS.
    assert 1027 > reference.KV_TILE_TOKENS
    case = random_paged_case(5, [1027, 255, 300, 17], num_q_heads=32, num_kv_heads=8, head_dim=64, block_size=16)
    got = paged_decode_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    torch.testing.assert_close(got, case.expected(), **tolerance(torch.float32))
    shared = random_paged_case(
        6, [100, 70, 65], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=16, shared_blocks=4
    )
    assert shared.block_tables[1, :4].tolist() == shared.block_tables[0, :4].tolist()
    got = paged_decode_attention_ref(shared.q, shared.k_cache, shared.v_cache, shared.block_tables, shared.seq_lens)
    torch.testing.assert_close(got, shared.expected(), **tolerance(torch.float32))


def test_block_size_does_not_change_the_answer():
    case = random_paged_case(
        7, [40, 3, 77], num_q_heads=9, num_kv_heads=3, head_dim=32, block_size=16, dtype=torch.float64
    )
    # The same memory seen as a pool of blocks of 1: block id = slot id, the table = the slot mapping.
    k1, v1 = (c.view(-1, 1, 3, 32) for c in (case.k_cache, case.v_cache))
    lens = case.seq_lens.tolist()
    tables = [slot_mapping(case.block_tables[b].tolist()[: -(-n // 16)], range(n), 16) for b, n in enumerate(lens)]
    tables1 = torch.tensor([t + [-1] * (max(lens) - len(t)) for t in tables], dtype=torch.int32)
    out16 = paged_decode_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out1 = paged_decode_attention_ref(case.q, k1, v1, tables1, case.seq_lens)
    torch.testing.assert_close(out1, out16, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_paged_prefill_equals_contiguous_causal(seed):
    g = torch.Generator().manual_seed(100 + seed)
    hq, hkv = HEADS[seed % len(HEADS)]
    n = 1 + seed % 4
    lens = torch.randint(1, 90, (n,), generator=g).tolist()
    query_lens = [int(torch.randint(1, s + 1, (1,), generator=g)) for s in lens]  # whole prompts, chunks, decodes
    case = random_paged_case(seed, lens, query_lens=query_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=16,
                             block_size=BLOCK_SIZES[seed % 3], dtype=torch.float64)  # fmt: skip
    got = paged_prefill_attention_ref(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.positions
    )
    torch.testing.assert_close(got, case.expected(), **tolerance(torch.float64))


def test_prefill_mask_comes_from_positions():
    # Queries that are not the last keys: each must see exactly the keys up to its own position.
    case = random_paged_case(
        3, [12], query_lens=[12], num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float64
    )
    some = torch.tensor([0, 5, 6], dtype=torch.int64)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    got = paged_prefill_attention_ref(
        case.q[some], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, qsl, some
    )
    torch.testing.assert_close(got, case.expected()[some], **tolerance(torch.float64))


def test_paged_decode_validates_strictly():
    q = torch.randn(2, 4, 8)
    kc = torch.randn(5, 4, 2, 8)
    tables = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    assert paged_decode_attention_ref(q, kc, kc, tables, lens).shape == (2, 4, 8)
    cases = [
        ((q, kc, kc, tables.long(), lens), TypeError, "block_tables must have dtype torch.int32"),
        ((q, kc, kc, tables, lens.long()), TypeError, "seq_lens must have dtype torch.int32"),
        ((q, kc, kc, tables, [6, 3]), TypeError, "seq_lens must be an integer torch.Tensor"),
        ((q, kc, kc, tables[0], lens), ValueError, "block_tables must have rank 2"),
        ((q, kc, kc, tables[:1], lens[:1]), ValueError, "q has batch size 2"),
        ((q, kc, kc, tables, torch.tensor([9, 3], dtype=torch.int32)), ValueError, r"block_tables\[0\] has 2 entries"),
        ((q, kc, kc, tables, torch.tensor([0, 3], dtype=torch.int32)), ValueError, r"seq_lens\[0\] must be >= 1"),
        ((q, kc, kc, torch.tensor([[0, 5], [2, -1]], dtype=torch.int32), lens), ValueError, r"block_tables\[0\]"),
        ((q, kc, kc, tables, torch.tensor([6, 5], dtype=torch.int32)), ValueError, r"block_tables\[1\]"),
        ((torch.randn(2, 3, 8), kc, kc, tables, lens), ValueError, "multiple of the KV heads"),
        ((torch.randn(2, 4, 16), kc, kc, tables, lens), ValueError, "head_dim"),
        ((q, kc, kc.double(), tables, lens), TypeError, "v_cache has dtype torch.float64"),
        ((q, kc[0], kc, tables, lens), ValueError, "k_cache must have rank 4"),
        ((q, kc, kc[:, :2], tables, lens), ValueError, "one shape"),
        ((q.long(), kc, kc, tables, lens), TypeError, "q must be a floating-point"),
        ((q, kc, kc, tables, lens, -1.0), ValueError, "scale must be a positive number"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            paged_decode_attention_ref(*args)


def test_paged_prefill_validates_positions_and_starts():
    case = random_paged_case(0, [8, 5], query_lens=[3, 2], num_q_heads=2, num_kv_heads=1, head_dim=4, block_size=4)
    args = [case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.positions]
    paged_prefill_attention_ref(*args)
    bad_pos = case.positions.clone()
    bad_pos[0] = 8
    overlap = torch.tensor([0, 3, 3], dtype=torch.int32)
    for i, value, match in [
        (6, bad_pos, r"positions of sequence 0 must lie in \[0, seq_lens\[0\]=8\)"),
        (5, torch.tensor([0, 5, 5], dtype=torch.int32), "strictly increasing"),
        (5, overlap, "from 0 to N = 5"),
        (5, torch.tensor([0, 5], dtype=torch.int32), "B \\+ 1 = 3 entries"),
        (6, case.positions[:4], "positions has 4 entries"),
    ]:
        bad = list(args)
        bad[i] = value
        with pytest.raises(ValueError, match=match):
            paged_prefill_attention_ref(*bad)


def test_reshape_and_cache_is_bit_exact_and_skips_padding():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.full((4, 4, 2, 8), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([13, -1, 0, 7, 15])
    reshape_and_cache_ref(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], key[i]) and torch.equal(flat_v[s], value[i])
    written = {13, 0, 7, 15}
    assert all(flat_k[s].isnan().all() for s in range(16) if s not in written)  # token 1 (-1) wrote nothing


def test_reshape_and_cache_validates():
    kc = torch.zeros(2, 2, 1, 4)
    key = torch.zeros(2, 1, 4)
    ok = torch.tensor([0, 3])
    cases = [
        ((key, key, kc, kc, torch.tensor([0, 4])), ValueError, r"slot_mapping entries must lie in \[0, 4\)"),
        ((key, key, kc, kc, torch.tensor([1, 1])), ValueError, "one slot twice"),
        ((key, key, kc, kc, ok.float()), TypeError, "slot_mapping must have dtype"),
        ((key, key, kc, kc, ok[:1]), ValueError, "agree on N"),
        ((torch.zeros(2, 2, 4), key, kc, kc, ok), ValueError, "key must have shape"),
        ((key.double(), key, kc, kc, ok), TypeError, "key has dtype torch.float64"),
        ((key, key, kc, kc[:, :1], ok), ValueError, "one shape"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            reshape_and_cache_ref(*args)


def test_harness_case_is_the_same_on_every_call_and_scatters_blocks():
    kwargs = dict(num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    a, b = random_paged_case(11, [30, 9], **kwargs), random_paged_case(11, [30, 9], **kwargs)
    assert all(
        torch.equal(x, y)
        for x, y in zip(
            (a.q, a.block_tables, a.k_cache.nan_to_num(), a.k), (b.q, b.block_tables, b.k_cache.nan_to_num(), b.k)
        )
    )
    table = a.block_tables[0, :8].tolist()
    assert table != sorted(table) or table != list(range(table[0], table[0] + 8))  # not one contiguous run
    assert a.block_tables[0, -1] == -1  # padding column
    # Every slot no sequence owns is NaN; every owned slot holds that sequence's K.
    owned = set(itertools.chain(slot_mapping(a.block_tables[0, :8].tolist(), range(30), 4),
                                slot_mapping(a.block_tables[1, :3].tolist(), range(9), 4)))  # fmt: skip
    flat = a.k_cache.view(-1, 2, 8)
    assert all(flat[s].isnan().all() == (s not in owned) for s in range(flat.shape[0]))
