"""Offloading (chapter 7): swapped sequences and the host tier of the prefix cache.

The references: a preempted request's output must equal its solo run (``kvcourse.generate`` on the
contiguous cache, no blocks) in swap mode as in recompute mode; block data moved to the host and
back must equal the data before the move (checked against a copy taken before, not against the
mover); the bookkeeping must give every host block back.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcourse
from kvcourse import SamplingParams
from kvcourse.paged import (BlockManager, BlockTransfer, HostBlockPool, NoFreeBlocksError, OffloadedBlock,
                            PagedKVStore, PrefixCachingBlockManager, apply_transfers)  # fmt: skip
from kvcourse.paged.block_hash import CachedBlock
from kvcourse.serving import Engine

from .test_prefix_cache import shared_prefix_workload
from .conftest import on_device
from .test_serving_engine import VOCAB, assert_greedy_equal, check_events_match_stats, tiny, workload  # noqa: F401


def entry(i: int, parent: CachedBlock | None = None) -> CachedBlock:
    return CachedBlock(("h", i), (i,), (), parent)


def random_store(num_blocks: int, seed: int, device: torch.device | str = "cpu") -> PagedKVStore:
    store = PagedKVStore(num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=3, device=device)
    g = torch.Generator().manual_seed(seed)
    for t in store.k_cache + store.v_cache:
        t.copy_(torch.randn(t.shape, generator=g))  # drawn on the CPU: the same data on every device
    return store


def block_data(store: PagedKVStore, block: int) -> list[torch.Tensor]:
    return [t[block].clone() for t in store.k_cache + store.v_cache]


# ---- the host pool's bookkeeping ----------------------------------------------------------------
def test_host_pool_hands_out_free_blocks_before_evicting_the_least_recently_used_cold_one():
    host = HostBlockPool(3)
    a, b = entry(0), entry(1)
    assert host.put_cold(a) == 0 and host.put_cold(b) == 1
    assert host.take() == 2  # a free block first: no eviction
    assert host.num_evictions == 0 and host.num_available_blocks == 2
    assert host.take() == 0 and host.num_evictions == 1  # then the oldest cold block
    assert host.find_cold(("h", 0), (0,), (), None) is None and host.find_cold(("h", 1), (1,), (), None) == 1
    assert host.put_cold(entry(2)) == 1  # b is evicted for it: full of held blocks but one cold
    assert host.num_available_blocks == 1 and host.put_cold(entry(3)) == 1
    host.take()
    assert host.put_cold(entry(4)) is None  # every block held: nothing can be kept
    with pytest.raises(RuntimeError, match="full of swapped blocks"):
        host.take()


def test_a_cold_hit_is_verified_not_just_hashed():
    host = HostBlockPool(2)
    parent = entry(0)
    block = host.put_cold(CachedBlock("same", (5, 6), (), parent))
    assert host.find_cold("same", (5, 6), (), parent) == block
    assert host.find_cold("same", (5, 7), (), parent) is None  # colliding hash, other tokens
    assert host.find_cold("same", (5, 6), (), entry(0)) is None  # an equal-looking but different parent
    assert host.find_cold("same", (5, 6), ("salt",), parent) is None


def test_bad_host_pool_size():
    with pytest.raises(ValueError, match="num_blocks"):
        HostBlockPool(-1)
    with pytest.raises(TypeError, match="num_host_blocks"):
        BlockManager(4, 2, num_host_blocks=1.5)


# ---- swapping in the block manager --------------------------------------------------------------
def test_swap_out_and_in_keep_the_tokens_and_record_every_move():
    bm = BlockManager(6, 4, num_host_blocks=4)
    bm.allocate("a", 10)  # blocks 0, 1, 2
    bm.allocate("b", 4)  # block 3
    assert bm.can_swap_out("a")
    moves = bm.swap_out("a")
    assert moves == [BlockTransfer("to_host", 0, 0), BlockTransfer("to_host", 1, 1), BlockTransfer("to_host", 2, 2)]
    assert "a" not in bm and bm.is_swapped("a") and bm.num_free_blocks == 5
    assert bm.host.num_free_blocks == 1
    bm.append_slots("b", 8)  # b grows into a's old blocks
    assert bm.blocks_to_swap_in("a") == 3 and bm.blocks_to_swap_in("a", 3) == 4
    back = bm.swap_in("a")
    assert [m.direction for m in back] == ["to_device"] * 3 and [m.src for m in back] == [0, 1, 2]
    assert bm.block_table("a") == [m.dst for m in back] and bm.num_tokens("a") == 10
    assert bm.host.num_free_blocks == 4 and not bm.is_swapped("a")
    assert bm.take_transfers() == moves + back and bm.take_transfers() == []


def test_swap_out_refuses_without_host_room_and_changes_nothing():
    bm = BlockManager(6, 4, num_host_blocks=2)
    bm.allocate("a", 9)
    assert not bm.can_swap_out("a")
    with pytest.raises(NoFreeBlocksError, match="host blocks"):
        bm.swap_out("a")
    assert bm.block_table("a") == [0, 1, 2] and bm.host.num_free_blocks == 2 and bm.take_transfers() == []
    bm.allocate("b", 4)
    bm.swap_out("b")
    bm.free("a")
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("c", 24)
        bm.swap_in("b")
    with pytest.raises(ValueError, match="not swapped"):
        bm.swap_in("a")
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("b", 1)  # a swapped id is still taken
    bm.free_swapped("b")
    assert bm.host.num_free_blocks == 2


def test_swapping_out_a_forked_sequence_leaves_the_other_owner_its_blocks():
    bm = BlockManager(8, 4, num_host_blocks=8)
    bm.allocate("p", 6)
    bm.fork("p", "c")
    bm.swap_out("c")
    assert bm.block_table("p") == [0, 1] and all(bm.ref_count(b) == 1 for b in (0, 1))
    bm.swap_in("c")
    assert set(bm.block_table("c")).isdisjoint(bm.block_table("p"))  # private copies now


# ---- the copies ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_transfers_replayed_in_order_equal_one_copy_at_a_time(seed, device):
    """Random moves, blocks reused within the step: the batched mover equals copying one block at a
    time in the recorded order (a plain loop over clones). The device pool on ``device``, the host's on the CPU."""
    rnd = random.Random(seed)
    device_store, host = random_store(6, seed, device), random_store(5, seed + 100)
    moves = [BlockTransfer(rnd.choice(["to_host", "to_device"]), rnd.randrange(6), rnd.randrange(5)) for _ in range(12)]
    moves = [m if m.direction == "to_host" else BlockTransfer("to_device", m.dst, m.src) for m in moves]
    want_dev, want_host = random_store(6, seed), random_store(5, seed + 100)
    for m in moves:
        src, dst = (want_dev, want_host) if m.direction == "to_host" else (want_host, want_dev)
        for s, d in zip(src.k_cache + src.v_cache, dst.k_cache + dst.v_cache):
            d[m.dst] = s[m.src].clone()
    apply_transfers(device_store, host, moves)
    assert device_store.k_cache[0].device.type == device.type
    for got, want in zip(
        device_store.k_cache + device_store.v_cache + host.k_cache + host.v_cache,
        want_dev.k_cache + want_dev.v_cache + want_host.k_cache + want_host.v_cache,
    ):
        assert torch.equal(got.cpu(), want)


# ---- the prefix cache's host tier ---------------------------------------------------------------
def cold_tier_setup(num_host_blocks: int):
    """A 4-block pool whose two cached blocks (a 2-block prefix) get evicted by a new sequence."""
    bm = PrefixCachingBlockManager(4, 2, num_host_blocks=num_host_blocks)
    prefix = [11, 12, 13, 14]
    bm.allocate("a", 5)
    bm.cache_full_blocks("a", prefix + [15], 5)
    bm.free("a")  # blocks 0, 1 cached and idle; 2 free
    return bm, prefix


def test_an_evicted_block_moves_to_the_host_tier_and_a_hit_brings_it_back_with_its_data():
    bm, prefix = cold_tier_setup(num_host_blocks=4)
    device, host = random_store(4, 0), random_store(4, 1)
    before = {b: block_data(device, b) for b in (0, 1)}
    bm.allocate("b", 8)  # takes every block: the free one first, then both cached ones
    assert bm.num_evictions == 2 and bm.num_offloaded_blocks == 2 and bm.num_cached_blocks == 0
    moves = bm.take_transfers()
    assert sorted(m.src for m in moves) == [0, 1] and {m.direction for m in moves} == {"to_host"}
    apply_transfers(device, host, moves)
    for t in device.k_cache + device.v_cache:
        t.zero_()  # "b" writes over every device block
    bm.free("b")
    hits = bm.find_cached_blocks(prefix + [15])
    to_host = {m.src: m.dst for m in moves}  # the tail block went first: least recently used
    assert hits == [OffloadedBlock(to_host[0]), OffloadedBlock(to_host[1])]  # in chain order, from the host
    assert bm.blocks_to_allocate(5, hits) == 3
    table = bm.allocate("c", 5, hits)
    loads = bm.take_transfers()
    assert [m.direction for m in loads] == ["to_device"] * 2 and [m.dst for m in loads] == table[:2]
    apply_transfers(device, host, loads)
    for old, new in zip((0, 1), table[:2]):
        for want, got in zip(before[old], block_data(device, new)):
            assert torch.equal(got, want)
    assert bm.num_host_hit_blocks == 2 and bm.host.num_cold_blocks == 0 and bm.host.num_free_blocks == 4
    assert bm.find_cached_blocks(prefix + [15]) == table[:2]  # on the device again, the chain intact


def test_host_hits_are_not_overwritten_by_evictions_in_the_same_allocation():
    """Two cold hits and a host pool with no other room: the device blocks taken for them evict
    another cached block, which must not land on a hit before it is copied back."""
    bm = PrefixCachingBlockManager(3, 2, num_host_blocks=2)
    device, host = random_store(3, 2), random_store(2, 3)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4)
    bm.free("a")
    want = [block_data(device, b) for b in bm.find_cached_blocks([1, 2, 3, 4])]
    bm.allocate("x", 6)  # every block: a's two go to the host
    apply_transfers(device, host, bm.take_transfers())
    bm.cache_full_blocks("x", [7, 7, 8, 8, 9, 9], 6)
    bm.free("x")  # now 3 cached blocks on the device, 2 cold ones on a full host
    for t in device.k_cache + device.v_cache:
        t.add_(1.0)  # x's data differs from a's
    hits = bm.find_cached_blocks([1, 2, 3, 4, 5])
    assert all(isinstance(h, OffloadedBlock) for h in hits) and len(hits) == 2
    table = bm.allocate("c", 5, hits)  # 3 device blocks, each an eviction of x's
    apply_transfers(device, host, bm.take_transfers())
    for w, b in zip(want, table[:2]):
        for a, g in zip(w, block_data(device, b)):
            assert torch.equal(g, a)
    assert bm.host.num_cold_blocks + bm.host.num_free_blocks == 2


def test_reset_prefix_cache_empties_the_host_tier_too():
    bm, prefix = cold_tier_setup(num_host_blocks=4)
    bm.allocate("b", 8)
    bm.free("b")
    assert bm.host.num_cold_blocks == 2
    bm.reset_prefix_cache()
    assert bm.host.num_cold_blocks == 0 and bm.find_cached_blocks(prefix + [15]) == []


# ---- the engine ---------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 4, 16]), budget=st.sampled_from([16, 64]),
       slack=st.sampled_from([0, 2, 8]), host=st.sampled_from([1, 8, 1000]))  # fmt: skip
def test_swap_mode_outputs_equal_each_request_alone(tiny, seed, block_size, budget, slack, host):  # noqa: F811
    """A tight pool forces preemptions; swapped requests resume where they stopped. A host pool too
    small for a victim falls back to recompute. Nothing leaks on either pool."""
    rnd = random.Random(seed)
    prompts, params = workload(rnd, rnd.randint(2, 8), max_prompt=60)
    budget = max(budget, block_size)
    biggest = max(-(-(len(p) + sp.max_new_tokens - 1) // block_size) for p, sp in zip(prompts, params))
    eng = Engine(tiny, num_blocks=biggest + slack, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=budget,
                 num_cpu_blocks=host, preemption_mode="swap", watermark=0.0)  # fmt: skip
    outs = eng.generate(prompts, params)
    for p, sp, got in zip(prompts, params, outs):
        assert_greedy_equal(tiny, p, got, kvcourse.generate(tiny, p, sampling_params=sp))
    bm, stats = eng.block_manager, eng.stats
    assert bm.num_free_blocks == bm.num_blocks and bm.host.num_free_blocks == host
    assert stats["swapped_out"] == stats["swapped_in"] <= stats["preemptions"]
    assert stats["blocks_to_host"] == stats["blocks_to_device"]
    if host == 1000:  # room for everyone: nothing is ever recomputed
        assert stats["swapped_out"] == stats["preemptions"] and stats["recomputed_tokens"] == 0
    check_events_match_stats(eng)


def forced_preemption(tiny, **kwargs):  # noqa: F811
    """Three requests on a pool that holds two of them: the newest is preempted at least once."""
    rnd = random.Random(5)
    prompts = [[rnd.randrange(4, VOCAB) for _ in range(24)] for _ in range(3)]
    params = SamplingParams(max_new_tokens=20, stop_token_ids=[])
    eng = Engine(tiny, num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=96, watermark=0.0, **kwargs)
    return prompts, params, eng


def test_swap_moves_blocks_and_recompute_feeds_tokens_again_for_the_same_outputs(tiny, device):  # noqa: F811
    tiny = on_device(tiny, device)
    prompts, params, rec = forced_preemption(tiny)
    want = rec.generate(prompts, params)
    assert want == [kvcourse.generate(tiny, p, sampling_params=params) for p in prompts]
    assert rec.stats["preemptions"] >= 1 and rec.stats["recomputed_tokens"] > 0
    _, _, swp = forced_preemption(tiny, num_cpu_blocks=16, preemption_mode="swap")
    assert swp.generate(prompts, params) == want
    s = swp.stats
    assert s["swapped_out"] >= 1 and s["recomputed_tokens"] == 0 and s["blocks_to_host"] > 0
    assert s["batched_tokens"] < rec.stats["batched_tokens"]  # the swapped tokens were not fed again
    assert s["transfer_seconds"] > 0 and rec.stats["transfer_seconds"] == 0
    assert swp.runner.kv_store.device.type == device.type and swp.runner.host_kv_store.device.type == "cpu"


def test_aborting_a_swapped_request_gives_its_host_blocks_back(tiny):  # noqa: F811
    prompts, params, eng = forced_preemption(tiny, num_cpu_blocks=16, preemption_mode="swap")
    ids = [eng.add_request(p, params) for p in prompts]
    while not eng.scheduler.swapped:
        eng.step()
    victim = eng.scheduler.swapped[0].seq_id[0]
    assert eng.block_manager.host.num_free_blocks < 16
    eng.abort(victim)
    assert eng.block_manager.host.num_free_blocks == 16
    while eng.has_unfinished_requests():
        eng.step()
    for rid, p in zip(ids, prompts):
        if rid != victim:
            assert eng.output(rid) == kvcourse.generate(tiny, p, sampling_params=params)


def test_a_prefix_evicted_to_the_host_tier_is_copied_back_not_recomputed(tiny, device):  # noqa: F811
    tiny = on_device(tiny, device)
    rnd = random.Random(3)
    system = [rnd.randrange(4, VOCAB) for _ in range(32)]
    first, later = system + [5, 6, 7], system + [8, 9]
    others = [[rnd.randrange(4, VOCAB) for _ in range(40)] for _ in range(3)]
    results = {}
    for host in (0, 64):
        eng = Engine(tiny, num_blocks=14, block_size=4, enable_prefix_caching=True, num_cpu_blocks=host)
        eng.generate([first], max_new_tokens=4)
        eng.generate(others, max_new_tokens=4)  # floods the 14 blocks: the system prompt's are evicted
        out = eng.generate([later], max_new_tokens=4)
        assert out == [kvcourse.generate(tiny, later, max_new_tokens=4)]
        results[host] = eng.stats
    assert results[0]["prefix_cache_host_hit_tokens"] == 0 and results[0]["blocks_to_host"] == 0
    assert results[64]["prefix_cache_offloaded_blocks"] >= 8
    assert results[64]["prefix_cache_host_hit_tokens"] == 32  # all 8 blocks of the system prompt
    assert results[64]["batched_tokens"] == results[0]["batched_tokens"] - 32


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(preemption_mode="swap"), ValueError, "num_host_blocks > 0"),
        (dict(preemption_mode="bogus", num_cpu_blocks=4), ValueError, "preemption_mode"),
        (dict(num_cpu_blocks=-1), ValueError, "num_cpu_blocks"),
        (dict(num_cpu_blocks=2.0), TypeError, "num_cpu_blocks must be an int >= 0, got float"),
    ],
)
def test_bad_offload_arguments(tiny, kwargs, exc, match):  # noqa: F811
    with pytest.raises(exc, match=match):
        Engine(tiny, num_blocks=8, block_size=4, **kwargs)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 4]), host=st.sampled_from([2, 16, 200]),
       mode=st.sampled_from(["swap", "recompute"]))  # fmt: skip
def test_prefix_caching_with_a_host_tier_and_swapping_leaves_outputs_as_if_alone(tiny, seed, block_size, host, mode):  # noqa: F811
    """Swapped blocks and cold prefix blocks compete for one host pool, on a pool tight enough to
    evict and preempt: every output is still the solo run's, and both pools end empty of held blocks."""
    rnd = random.Random(seed)
    prompts, params = shared_prefix_workload(rnd, rnd.randint(3, 10), block_size)
    biggest = max(-(-(len(p) + sp.max_new_tokens - 1) // block_size) for p, sp in zip(prompts, params))
    eng = Engine(tiny, num_blocks=biggest + 2, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=32,
                 enable_prefix_caching=True, num_cpu_blocks=host, preemption_mode=mode, watermark=0.0)  # fmt: skip
    half = len(prompts) // 2
    outs = eng.generate(prompts[:half], params[:half]) + eng.generate(prompts[half:], params[half:])
    for p, sp, got in zip(prompts, params, outs):
        assert_greedy_equal(tiny, p, got, kvcourse.generate(tiny, p, sampling_params=sp))
    bm, stats = eng.block_manager, eng.stats
    assert bm.num_free_blocks == bm.num_blocks and all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert bm.host.num_free_blocks + bm.host.num_cold_blocks == host and not eng.scheduler.swapped
    # Every block swapped out came back: moves to the host less cold ones = moves back less cold hits.
    swapped_blocks = stats["blocks_to_host"] - stats["prefix_cache_offloaded_blocks"]
    assert swapped_blocks == stats["blocks_to_device"] - stats["prefix_cache_host_hit_tokens"] // block_size


def test_the_swap_benchmark_times_every_block_size_and_checks_the_round_trip(tiny):  # noqa: F811
    from kvcourse.bench.swap import time_swap_vs_recompute

    rows = time_swap_vs_recompute(tiny, 20, [1, 8], repeats=1)
    assert [r["block_size"] for r in rows] == [1, 8] and [r["num_blocks"] for r in rows] == [20, 3]
    per_token = 2 * tiny.config.num_hidden_layers * tiny.config.num_key_value_heads * tiny.config.head_dim * 4
    assert rows[0]["bytes"] == 20 * per_token and rows[1]["bytes"] == 24 * per_token
    keys = ("recompute_s", "swap_out_s", "swap_in_s", "swap_out_per_block_s", "swap_in_per_block_s")
    assert all(r[k] > 0 for r in rows for k in keys)
    for bad, name in (
        (dict(num_tokens=0, block_sizes=[4]), "num_tokens"),
        (dict(num_tokens=8, block_sizes=[]), "block_sizes"),
        (dict(num_tokens=8, block_sizes=[0]), "block_sizes"),
        (dict(num_tokens=8, block_sizes=[4], repeats=0), "repeats"),
    ):
        with pytest.raises(ValueError, match=name):
            time_swap_vs_recompute(tiny, **bad)
