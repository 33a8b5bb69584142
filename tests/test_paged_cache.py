"""The paged K/V store, PagedKVCache (allocate before the forward), and the real model generating through it."""

from __future__ import annotations

import math

import pytest
import torch

import kvcourse
from kvcourse.batch import ForwardBatch, slot_mapping
from kvcourse.paged import BlockManager, NoFreeBlocksError, PagedKVCache, PagedKVStore, allocate_slots

from .tolerances import assert_logits_close

PROMPT = (
    "Once upon a time, in a small village by the sea, there lived an old clockmaker who "
    "repaired every clock in the town. One day a stranger"
)


# ---- the store -------------------------------------------------------------------------------------
def test_store_write_through_scattered_blocks_and_copy_block(device):
    g = torch.Generator().manual_seed(0)
    store = PagedKVStore(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=8, device=device)
    table, s = [4, 0, 5], 10
    k, v = torch.randn(s, 3, 8, generator=g).to(device), torch.randn(s, 3, 8, generator=g).to(device)
    store.write(1, slot_mapping(table, range(s), 4), k, v)
    assert store.k_cache[1].device.type == device.type
    assert torch.equal(store.k_cache[1][4], k[:4]) and torch.equal(store.v_cache[1][0], v[4:8])
    assert torch.equal(store.k_cache[1][5, :2], k[8:])  # block 5 holds positions 8, 9
    assert not store.k_cache[0].any()  # layer 0 untouched
    store.copy_block(5, 1)
    assert torch.equal(store.k_cache[1][1], store.k_cache[1][5]) and torch.equal(
        store.v_cache[1][1], store.v_cache[1][5]
    )
    assert store.nbytes == 2 * 2 * 6 * 4 * 3 * 8 * 4 and store.block_nbytes == 2 * 2 * 4 * 3 * 8 * 4


def test_store_validates():
    store = PagedKVStore(num_layers=1, num_blocks=2, block_size=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="layer_idx"):
        store.write(1, [0], torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match=r"key must have shape \[N, Hkv, D\]"):
        store.write(0, [0], torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="agree on N"):
        store.write(0, [0, 1], torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match=r"slot_mapping entries must lie in \[0, 4\)"):
        store.write(0, [4], torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="src_block"):
        store.copy_block(-1, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVStore(1, 0, 2, 1, 4)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVStore(1, 1, 2, 1, 4, dtype=torch.int32)


def test_for_model_wants_the_config_not_the_model(model):
    for make in (
        lambda c: PagedKVStore.for_model(c, 4),
        lambda c: PagedKVCache.for_model(c, 4),
        lambda c: kvcourse.KVCache.for_model(c),
    ):
        with pytest.raises(TypeError, match=r"model's config \(model.config\), got the model itself"):
            make(model)
        with pytest.raises(TypeError, match="LlamaConfig"):
            make({"num_hidden_layers": 2})
    assert PagedKVStore.for_model(model.config, 4).k_cache[0].shape == (4, 16, 3, 64)


def test_allocate_slots_copies_a_shared_block_before_anything_writes(device):
    bm, store = BlockManager(4, 2), PagedKVStore(1, 4, 2, 1, 1, device=device)
    bm.allocate("p", 3)  # blocks 0, 1; block 1 half full
    store.k_cache[0][1, 0] = 7.0
    bm.fork("p", "c")
    assert allocate_slots(bm, store, "c", 2) == 3  # its next token is position 3
    table = bm.block_table("c")
    assert table[0] == 0 and table[1] != 1  # block 1 was copied for "c"
    assert store.k_cache[0][table[1], 0].item() == 7.0  # with the token already in it
    assert bm.num_tokens("c") == 5 and bm.num_tokens("p") == 3


# ---- the real model on a PagedKVCache ------------------------------------------------------------
@pytest.fixture(scope="module")
def prompt_ids(tok):
    ids = tok.encode(PROMPT)
    assert 30 <= len(ids) <= 48
    return ids


def _run(model, cache: PagedKVCache, ids) -> torch.Tensor:
    """Allocate, then run: the two steps of a paged forward. Logits at every fed position."""
    return model.forward_batch(cache.prepare(ids), cache.kv_store, all_logits=True)


def test_model_generates_identically_through_paged_memory(model_on, prompt_ids, device):
    model = model_on
    new = 32
    want = kvcourse.generate(model, prompt_ids, new, use_cache=True, eos_token_ids=())
    cache = PagedKVCache.for_model(model.config, num_blocks=8, block_size=16, device=device)
    got = kvcourse.generate_paged(model, prompt_ids, new, cache, eos_token_ids=())
    assert got == want
    # The last generated token is never fed back, so the cache holds prompt + new - 1 tokens.
    n = len(prompt_ids) + new - 1
    assert cache.seq_len == n and len(cache.block_table) == math.ceil(n / 16)
    assert cache.num_free_blocks == 8 - math.ceil(n / 16)
    assert cache.nbytes == 2 * 30 * n * 3 * 64 * 4
    # Logits: a prefill and two decode steps through paged memory against the contiguous cache.
    contiguous = kvcourse.KVCache.for_model(model.config, device=device)
    paged = PagedKVCache.for_model(model.config, num_blocks=8, block_size=16, device=device)
    seq = prompt_ids + want
    for chunk in (seq[:-5], seq[-5:-4], seq[-4:-3]):
        ref = model(torch.tensor([chunk], device=device), cache=contiguous)[0]
        assert_logits_close(_run(model, paged, chunk), ref)


def test_prepare_allocates_before_the_forward(model, prompt_ids):
    cache = PagedKVCache.for_model(model.config, num_blocks=4, block_size=16)
    batch = cache.prepare(prompt_ids)
    assert isinstance(batch, ForwardBatch)
    assert cache.seq_len == len(prompt_ids)  # the slots are reserved: one meaning, before and after the forward
    assert batch.positions.tolist() == list(range(len(prompt_ids)))
    assert batch.slot_mapping.tolist() == slot_mapping(cache.block_table, range(len(prompt_ids)), 16)
    before = [k.clone() for k in cache.kv_store.k_cache]
    assert all(not k.any() for k in before)  # preparing wrote nothing
    model.forward_batch(batch, cache.kv_store)
    assert all(k.any() for k in cache.kv_store.k_cache)  # every layer wrote its K
    assert cache.seq_len == len(prompt_ids)
    with pytest.raises(TypeError, match="paged cache runs through model.forward_batch"):
        model(torch.tensor([prompt_ids]), cache=cache)


def test_forked_caches_share_the_prompt_and_copy_on_write(model_on, prompt_ids, device):
    model = model_on
    block_size = 16
    parent = PagedKVCache.for_model(model.config, num_blocks=6, block_size=block_size, device=device)
    _run(model, parent, prompt_ids)
    assert len(prompt_ids) % block_size  # the last prompt block is partial, so it is the one copied
    free_after_prompt = parent.num_free_blocks
    child = parent.fork()
    assert child.seq_id != parent.seq_id and child.block_table == parent.block_table
    assert parent.num_free_blocks == free_after_prompt  # forking copied nothing

    # The two sequences continue with different tokens; each must match a contiguous run.
    a, b = 100, 200
    out_child = _run(model, child, [a])
    assert child.block_table[:-1] == parent.block_table[:-1]  # full blocks still shared
    assert child.block_table[-1] != parent.block_table[-1]  # the partial block was copied
    assert parent.num_free_blocks == free_after_prompt - 1
    out_parent = _run(model, parent, [b])
    for token, out in ((a, out_child), (b, out_parent)):
        ref = model(torch.tensor([prompt_ids + [token]], device=device))[0, -1:]
        assert_logits_close(out, ref)

    # Greedy continuations of each fork equal plain generation from the same text.
    t1 = int(out_child[-1].argmax())
    got = kvcourse.generate_paged(model, [t1], 4, child, eos_token_ids=())
    assert got == kvcourse.generate(model, prompt_ids + [a, t1], 4, eos_token_ids=())

    shared = set(parent.block_table) & set(child.block_table)
    child.free()
    assert all(parent.block_manager.ref_count(blk) == 1 for blk in shared)
    parent.free()
    assert parent.block_manager.num_free_blocks == 6


def test_paged_cache_runs_out_cleanly_and_validates(model, prompt_ids):
    cache = PagedKVCache.for_model(model.config, num_blocks=2, block_size=16)
    with pytest.raises(NoFreeBlocksError):
        cache.prepare(prompt_ids + prompt_ids)  # > 32 tokens
    assert cache.seq_len == 0 and cache.num_free_blocks == 2  # nothing half-done
    _run(model, cache, prompt_ids[:20])
    assert cache.seq_len == 20
    with pytest.raises(ValueError, match="token_ids must be a non-empty list"):
        cache.prepare([])
    with pytest.raises(ValueError, match="block_manager and kv_store must be given together"):
        PagedKVCache(30, 3, 64, block_manager=cache.block_manager)
    with pytest.raises(ValueError, match="seq_id=0 is already allocated"):
        PagedKVCache(30, 3, 64, block_manager=cache.block_manager, kv_store=cache.kv_store, seq_id=0)
    with pytest.raises(TypeError, match="cache must be a PagedKVCache"):
        kvcourse.generate_paged(model, prompt_ids, 1, cache=kvcourse.KVCache.for_model(model.config))
    cache.free()
    with pytest.raises(ValueError, match="already freed"):
        cache.free()


def test_generate_paged_makes_its_own_pool_and_stops_at_eos(model, prompt_ids):
    short = prompt_ids[:5]
    assert kvcourse.generate_paged(model, short, 3) == kvcourse.generate(model, short, 3)
    first = kvcourse.generate_paged(model, short, 1)[0]
    # Declaring the first token an end-of-sequence token stops generation right after it.
    assert kvcourse.generate_paged(model, short, 3, eos_token_ids=[first]) == [first]
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvcourse.generate_paged(model, short, -1)


def test_two_caches_share_one_pool(model, prompt_ids):
    store = PagedKVStore.for_model(model.config, num_blocks=4, block_size=16)
    bm = BlockManager(4, 16)
    first = PagedKVCache(30, 3, 64, block_manager=bm, kv_store=store)
    second = PagedKVCache(30, 3, 64, block_manager=bm, kv_store=store)
    assert (first.seq_id, second.seq_id) == (0, 1)
    _run(model, first, prompt_ids[:20])  # blocks 0, 1
    out2 = _run(model, second, prompt_ids[5:9])  # block 2
    out1 = _run(model, first, prompt_ids[20:21])
    assert first.block_table == [0, 1] and second.block_table == [2]
    assert_logits_close(out2, model(torch.tensor([prompt_ids[5:9]]))[0])
    assert_logits_close(out1, model(torch.tensor([prompt_ids[:21]]))[0, -1:])
