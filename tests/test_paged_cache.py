"""Slot mapping, the paged K/V store, paged attention, and the real model running on a PagedKVCache."""

from __future__ import annotations

import math
import random

import pytest
import torch

import kvcourse
from kvcourse.attention import decode_attention_ref
from kvcourse.paged import (
    BlockManager,
    NoFreeBlocksError,
    PagedKVCache,
    PagedKVStore,
    generate_paged,
    paged_attention_ref,
    slot_mapping,
)

PROMPT = (
    "Once upon a time, in a small village by the sea, there lived an old clockmaker who "
    "repaired every clock in the town. One day a stranger"
)


# ---- slot mapping and the store ----------------------------------------------------------------
def test_slot_mapping_formula():
    slots = slot_mapping([7, 2, 5], [0, 3, 4, 9, 11], block_size=4)
    assert slots.tolist() == [28, 31, 8, 21, 23]  # block 7 off 0, 7/3, 2/0, 5/1, 5/3
    with pytest.raises(ValueError, match="positions must lie in"):
        slot_mapping([7, 2, 5], [12], block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        slot_mapping([0], [0], block_size=0)


def test_manager_slot_mapping_agrees_with_the_function():
    bm = BlockManager(num_blocks=10, block_size=3)
    bm.allocate("x", 2)
    bm.allocate("y", 4)
    bm.append_slots("x", 5)  # x's blocks are not adjacent: [0, 3, 4]
    assert bm.block_table("x") == [0, 3, 4]
    assert bm.slot_mapping("x") == slot_mapping(bm.block_table("x"), range(7), 3).tolist()


def test_store_write_gather_roundtrip_through_scattered_blocks():
    torch.manual_seed(0)
    store = PagedKVStore(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=8)
    table, s = [4, 0, 5], 10
    k, v = torch.randn(s, 3, 8), torch.randn(s, 3, 8)
    store.write(1, slot_mapping(table, range(s), 4), k, v)
    k_all, v_all = store.gather(1, table, s)
    assert torch.equal(k_all, k.transpose(0, 1)) and torch.equal(v_all, v.transpose(0, 1))
    assert torch.equal(store.k_cache[1][5, :2], k[8:])  # block 5 holds positions 8, 9
    assert not store.k_cache[0].any()  # layer 0 untouched
    store.copy_block(5, 1)
    assert torch.equal(store.k_cache[1][1], store.k_cache[1][5])
    assert store.nbytes == 2 * 2 * 6 * 4 * 3 * 8 * 4


def test_store_validates():
    store = PagedKVStore(num_layers=1, num_blocks=2, block_size=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="layer_idx"):
        store.write(1, [0], torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match=r"k must have shape \[T, H_kv, D\]"):
        store.write(0, [0, 1], torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="slots must lie in"):
        store.write(0, [4], torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="block_table entries"):
        store.gather(0, [2], 1)
    with pytest.raises(ValueError, match="src_block"):
        store.copy_block(-1, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVStore(1, 0, 2, 1, 4)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVStore(1, 1, 2, 1, 4, dtype=torch.int32)


# ---- paged attention against contiguous decode attention ----------------------------------------
def _random_paged_batch(rng: random.Random, dtype=torch.float64):
    """Random sequences scattered over a shuffled pool, plus the same K/V laid out contiguously."""
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 2, 3, 4])
    d = rng.choice([4, 16, 64])
    block_size = rng.choice([1, 2, 4, 5, 16])
    batch = rng.randint(1, 4)
    seq_lens = [rng.randint(1, 40) for _ in range(batch)]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + rng.randint(0, 2)  # extra padding columns
    num_blocks = sum(blocks_per_seq) + rng.randint(0, 3)  # spare blocks hold garbage
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype)
    tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)  # -1 padding must never be read
    s_max = max(seq_lens)
    k = torch.zeros(batch, hkv, s_max, d, dtype=dtype)
    v = torch.zeros(batch, hkv, s_max, d, dtype=dtype)
    for b, nb in enumerate(blocks_per_seq):
        own = [physical.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(own, dtype=torch.int32)
        slots = slot_mapping(own, range(seq_lens[b]), block_size)
        k[b, :, : seq_lens[b]] = k_cache.reshape(-1, hkv, d)[slots].transpose(0, 1)
        v[b, :, : seq_lens[b]] = v_cache.reshape(-1, hkv, d)[slots].transpose(0, 1)
    q = torch.randn(batch, hq, d, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), k, v


@pytest.mark.parametrize("seed", range(60))
def test_paged_attention_ref_equals_contiguous_decode_attention(seed):
    q, k_cache, v_cache, tables, seq_lens, k, v = _random_paged_batch(random.Random(seed))
    scale = None if seed % 2 else 0.3
    got = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale=scale)
    want = decode_attention_ref(q, k, v, seq_lens, scale=scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_paged_attention_ref_ignores_unused_blocks_and_slots():
    poisoned = 0
    for seed in range(10):
        q, k_cache, v_cache, tables, seq_lens, _, _ = _random_paged_batch(random.Random(1000 + seed))
        before = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens)
        used = {int(b) for b in tables.flatten() if b >= 0}
        spare = [b for b in range(k_cache.shape[0]) if b not in used]
        k_cache[spare] = v_cache[spare] = float("nan")  # garbage in blocks no sequence owns changes nothing
        poisoned += len(spare)
        # Slots past seq_len inside a sequence's last block are garbage too.
        bs = k_cache.shape[1]
        for b, n in enumerate(seq_lens.tolist()):
            if n % bs:
                k_cache[tables[b, n // bs], n % bs :] = v_cache[tables[b, n // bs], n % bs :] = float("nan")
                poisoned += 1
        torch.testing.assert_close(paged_attention_ref(q, k_cache, v_cache, tables, seq_lens), before)
    assert poisoned > 10  # the random batches really had spare blocks and partial last blocks


def test_paged_attention_ref_float32():
    q, k_cache, v_cache, tables, seq_lens, k, v = _random_paged_batch(random.Random(7), dtype=torch.float32)
    got = paged_attention_ref(q, k_cache, v_cache, tables, seq_lens)
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, seq_lens), rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32


def test_paged_attention_ref_validates_strictly():
    q = torch.randn(2, 4, 8)
    kc = torch.randn(5, 4, 2, 8)
    tables = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    ok = paged_attention_ref(q, kc, kc, tables, lens)
    assert ok.shape == (2, 4, 8)
    cases = [
        ((q, kc, kc, tables.long(), lens), TypeError, "block_tables must have dtype torch.int32"),
        ((q, kc, kc, tables, lens.long()), TypeError, "seq_lens must have dtype torch.int32"),
        ((q, kc, kc, tables, [6, 3]), TypeError, "seq_lens must be an int32 torch.Tensor"),
        ((q, kc, kc, tables[0], lens), ValueError, "block_tables must have rank 2"),
        ((q, kc, kc, tables[:1], lens), ValueError, "block_tables has 1 rows but q has batch size 2"),
        ((q, kc, kc, tables, torch.tensor([9, 3], dtype=torch.int32)), ValueError, "seq_lens must lie in"),
        ((q, kc, kc, tables, torch.tensor([0, 3], dtype=torch.int32)), ValueError, "seq_lens must lie in"),
        ((q, kc, kc, torch.tensor([[0, 5], [2, -1]], dtype=torch.int32), lens), ValueError, r"block_tables\[0\]"),
        ((q, kc, kc, tables, torch.tensor([6, 5], dtype=torch.int32)), ValueError, r"block_tables\[1\]"),
        ((torch.randn(2, 3, 8), kc, kc, tables, lens), ValueError, "multiple of the KV heads"),
        ((torch.randn(2, 4, 16), kc, kc, tables, lens), ValueError, "head_dim"),
        ((q, kc, kc.double(), tables, lens), TypeError, "v_cache is torch.float64"),
        ((q, kc[0], kc, tables, lens), ValueError, "k_cache must have rank 4"),
        ((q, kc, kc[:, :2], tables, lens), ValueError, "one shape"),
        ((q.long(), kc, kc, tables, lens), TypeError, "q must be a floating-point"),
        ((q, kc, kc, tables, lens, -1.0), ValueError, "scale must be a positive number"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            paged_attention_ref(*args)


# ---- the real model on a PagedKVCache ------------------------------------------------------------
@pytest.fixture(scope="module")
def prompt_ids(tok):
    ids = tok.encode(PROMPT)
    assert 30 <= len(ids) <= 48
    return ids


def test_model_generates_identically_through_paged_memory(model, prompt_ids):
    new = 32
    want = kvcourse.generate(model, prompt_ids, new, use_cache=True, eos_token_ids=())
    cache = PagedKVCache.for_model(model.config, num_blocks=8, block_size=16)
    got = generate_paged(model, prompt_ids, new, cache, eos_token_ids=())
    assert got == want
    # The last generated token is never fed back, so the cache holds prompt + new - 1 tokens.
    n = len(prompt_ids) + new - 1
    assert cache.seq_len == n and len(cache.block_table) == math.ceil(n / 16)
    assert cache.num_free_blocks == 8 - math.ceil(n / 16)
    assert cache.nbytes == 2 * 30 * n * 3 * 64 * 4
    # Logits: a prefill and a decode step through paged memory against the contiguous cache.
    contiguous = kvcourse.KVCache.for_model(model.config)
    paged = PagedKVCache.for_model(model.config, num_blocks=8, block_size=16)
    seq = prompt_ids + want
    for chunk in (seq[:-5], seq[-5:-4], seq[-4:-3]):
        ref = model(torch.tensor([chunk]), cache=contiguous)
        out = model(torch.tensor([chunk]), cache=paged)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_forked_caches_share_the_prompt_and_copy_on_write(model, prompt_ids):
    block_size = 16
    parent = PagedKVCache.for_model(model.config, num_blocks=6, block_size=block_size)
    model(torch.tensor([prompt_ids]), cache=parent)
    assert len(prompt_ids) % block_size  # the last prompt block is partial, so it is the one copied
    free_after_prompt = parent.num_free_blocks
    child = parent.fork()
    assert child.seq_id != parent.seq_id and child.block_table == parent.block_table
    assert parent.num_free_blocks == free_after_prompt  # forking copied nothing

    # The two sequences continue with different tokens; each must match a contiguous run.
    a, b = 100, 200
    out_child = model(torch.tensor([[a]]), cache=child)
    assert child.block_table[:-1] == parent.block_table[:-1]  # full blocks still shared
    assert child.block_table[-1] != parent.block_table[-1]  # the partial block was copied
    assert parent.num_free_blocks == free_after_prompt - 1
    out_parent = model(torch.tensor([[b]]), cache=parent)
    contiguous = kvcourse.KVCache.for_model(model.config)
    model(torch.tensor([prompt_ids]), cache=contiguous)
    for token, out in ((a, out_child), (b, out_parent)):
        contiguous.crop(len(prompt_ids))  # back to the shared prompt, then this branch's token
        ref = model(torch.tensor([[token]]), cache=contiguous)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)

    # Greedy continuations of each fork equal plain generation from the same text.
    t1 = int(out_child[0, -1].argmax())
    got = generate_paged(model, [t1], 4, child, eos_token_ids=())
    assert got == kvcourse.generate(model, prompt_ids + [a, t1], 4, eos_token_ids=())

    shared = set(parent.block_table) & set(child.block_table)
    child.free()
    assert all(parent.block_manager.ref_count(blk) == 1 for blk in shared)
    parent.free()
    assert parent.block_manager.num_free_blocks == 6


def test_paged_cache_runs_out_cleanly_and_validates(model, prompt_ids):
    cache = PagedKVCache.for_model(model.config, num_blocks=2, block_size=16)
    with pytest.raises(NoFreeBlocksError):
        model(torch.tensor([prompt_ids + prompt_ids]), cache=cache)  # > 32 tokens
    assert cache.seq_len == 0 and cache.num_free_blocks == 2  # nothing half-done
    model(torch.tensor([prompt_ids[:20]]), cache=cache)
    assert cache.seq_len == 20

    with pytest.raises(ValueError, match=r"\[1, H_kv, T, D\]"):
        cache.update(0, torch.zeros(2, 3, 1, 64), torch.zeros(2, 3, 1, 64))
    with pytest.raises(ValueError, match="expected layer 0, got 3"):
        cache.update(3, torch.zeros(1, 3, 1, 64), torch.zeros(1, 3, 1, 64))
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(30, torch.zeros(1, 3, 1, 64), torch.zeros(1, 3, 1, 64))
    with pytest.raises(ValueError, match="block_manager and kv_store must be given together"):
        PagedKVCache(30, 3, 64, block_manager=cache.block_manager)
    with pytest.raises(ValueError, match="seq_id=0 is already allocated"):
        PagedKVCache(30, 3, 64, block_manager=cache.block_manager, kv_store=cache.kv_store, seq_id=0)
    with pytest.raises(TypeError, match="cache must be a PagedKVCache"):
        generate_paged(model, prompt_ids, 1, cache=kvcourse.KVCache.for_model(model.config))
    cache.free()
    with pytest.raises(ValueError, match="already freed"):
        cache.free()


def test_generate_paged_makes_its_own_pool_and_stops_at_eos(model, prompt_ids):
    short = prompt_ids[:5]
    assert generate_paged(model, short, 3) == kvcourse.generate(model, short, 3)
    first = generate_paged(model, short, 1)[0]
    # Declaring the first token an end-of-sequence token stops generation right after it.
    assert generate_paged(model, short, 3, eos_token_ids=[first]) == [first]
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_paged(model, short, -1)


def test_two_caches_share_one_pool():
    store = PagedKVStore(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2)
    bm = BlockManager(4, 2)
    first = PagedKVCache(1, 1, 2, block_manager=bm, kv_store=store)
    second = PagedKVCache(1, 1, 2, block_manager=bm, kv_store=store)
    assert (first.seq_id, second.seq_id) == (0, 1)
    k1, k2 = torch.arange(6.0).view(1, 1, 3, 2), -torch.arange(4.0).view(1, 1, 2, 2)
    first.update(0, k1, k1)
    out2, _ = second.update(0, k2, k2)
    out1, _ = first.update(0, k1[:, :, :1], k1[:, :, :1])
    assert torch.equal(out2, k2)
    assert torch.equal(out1, torch.cat([k1, k1[:, :, :1]], dim=2))
    assert first.block_table == [0, 1] and second.block_table == [2]
