"""The KVPool protocol: every pool satisfies it, admission is one call that changes nothing when it
refuses, and a waiting prompt's block hashes are computed once."""

from __future__ import annotations

import pytest

from kvcourse.fragmentation import PagedPool, ReservationPool
from kvcourse.paged import (Admission, BlockManager, KVPool, PagedKVPool, PrefixCachingBlockManager,
                            PrefixCachingPool, hash_block_tokens)  # fmt: skip
from kvcourse.sequence import SamplingParams, Sequence
from kvcourse.serving import Scheduler

from .test_scheduler import run_step


def seq(name, tokens, max_new=4):
    return Sequence(name, tokens, SamplingParams(max_new_tokens=max_new, stop_token_ids=()))


def state(bm):
    return bm.num_free_blocks, {s: bm.block_table(s) for s in bm.seq_ids}


def test_every_pool_satisfies_the_protocol_it_claims():
    plain, caching = BlockManager(8, 4), PrefixCachingBlockManager(8, 4)
    reservations, paged_sim = ReservationPool(16, True, {}), PagedPool(8, 4)
    for pool in (plain, caching, reservations, paged_sim):
        assert isinstance(pool, KVPool), pool
    assert isinstance(plain, PagedKVPool) and isinstance(paged_sim, PagedKVPool)
    assert not isinstance(reservations, PagedKVPool)  # no block tables: no forks, no swaps
    assert isinstance(caching, PrefixCachingPool) and not isinstance(plain, PrefixCachingPool)
    assert [p.enable_prefix_caching for p in (plain, caching, reservations)] == [False, True, False]
    assert BlockManager(8, 4, num_host_blocks=3).num_host_blocks == 3 and reservations.num_host_blocks == 0
    assert not isinstance(object(), KVPool)


def test_admit_answers_in_one_call_and_changes_nothing_when_it_refuses():
    bm = BlockManager(4, 4)
    a = seq("a", list(range(10)))
    before = state(bm)
    assert bm.admit(a, 8, chunked=False) is None  # all 10 or nothing: the budget is 8
    assert bm.admit(a, 16, keep_free=2) is None  # 3 blocks, leaving 2 of 4 free: no
    assert state(bm) == before
    assert bm.admit(a, 8) == Admission(0, 8)  # a chunk of 8: 2 blocks
    assert bm.block_table("a") == [0, 1] and bm.num_tokens("a") == 8


def test_admit_starts_with_the_cached_prefix_one_token_short():
    bm = PrefixCachingBlockManager(8, 4)
    first = seq("first", list(range(12)))
    assert bm.admit(first, 100) == Admission(0, 12)
    bm.cache_full_blocks("first", first.token_ids, 12)
    # The same 12 tokens: the lookup stops one token short, so the last block is recomputed.
    twin = seq("twin", list(range(12)))
    assert bm.admit(twin, 100) == Admission(8, 4)
    assert bm.block_table("twin")[:2] == bm.block_table("first")[:2]
    # A refusal leaves the hits where they were (shared with nobody new).
    third = seq("third", list(range(12)) + [99] * 8)
    before = state(bm)
    assert bm.admit(third, 100, keep_free=4) is None and state(bm) == before


def test_a_waiting_prompt_is_hashed_once_across_the_steps_it_waits():
    calls = []

    def counting_hash(parent, token_ids, extra_keys):
        calls.append(tuple(token_ids))
        return hash_block_tokens(parent, token_ids, extra_keys)

    sched = Scheduler(PrefixCachingBlockManager(4, 4, hash_fn=counting_hash), watermark=0)
    a = seq("A", list(range(1, 13)))  # 3 blocks, and a 4th for its decodes: the whole pool
    b = seq("B", list(range(1, 5)) + list(range(100, 109)))  # shares A's first block, then differs
    sched.add(a)
    sched.add(b)
    run_step(sched)  # A prefills; B's lookup finds nothing cached yet (1 hash)
    run_step(sched)  # B finds A's first block, misses its second (1 more hash)
    assert len(b.block_hashes) == 2 and b.block_hashes[0] == hash_block_tokens(None, (1, 2, 3, 4), ())
    seen = len(calls)
    for _ in range(2):
        run_step(sched)
        assert sched.waiting[0] is b  # still waiting, and looked up again ...
    assert len(calls) == seen  # ... without hashing anything again
    while sched.waiting:
        out, _ = run_step(sched)
    assert out.admitted == [b] and out.num_prefix_cache_hit_tokens == 4  # admitted with its hit


def test_a_fork_inherits_the_hashes_of_its_tokens():
    parent = seq("p", list(range(9)))
    parent.block_hashes.append(hash_block_tokens(None, (0, 1, 2, 3), ()))
    child = parent.fork("c")
    assert child.block_hashes == parent.block_hashes and child.block_hashes is not parent.block_hashes


def test_the_simulator_pools_reserve_the_slot_of_the_token_a_step_makes():
    paged = PagedPool(4, 4)
    assert paged.admit(seq(0, [0] * 4), 100) == Admission(0, 4)
    assert paged.num_tokens(0) == 5 and paged.allocated_slots(0) == 8 and paged.offset(0) == -1
    assert paged.admit(seq(1, [0] * 8), 100) is None  # 9 slots need 3 blocks, 2 are free
    reservations = ReservationPool(16, True, {0: 6, 1: 16})
    assert reservations.admit(seq(0, [0] * 3), 100) == Admission(0, 3)
    assert reservations.num_tokens(0) == 4 and reservations.allocated_slots(0) == 6
    assert reservations.admit(seq(1, [0] * 3), 100) is None  # no free range of 16 slots
    with pytest.raises(ValueError, match="reservation of 6 slots"):
        ReservationPool(16, True, {2: 6}).admit(seq(2, [0] * 6), 100)
