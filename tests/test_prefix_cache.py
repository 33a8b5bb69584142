"""Prefix caching: the hash chain, verified hits, LRU eviction, tenant salts, and the engine on a tiny model.

The engine's outputs are compared with ``kvcourse.generate`` run alone on the contiguous cache (no
blocks, no cache reuse); the real model gets the same check in ``test_serving_real.py``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcourse
from kvcourse import SamplingParams
from kvcourse.paged import PrefixCachingBlockManager, hash_block_tokens
from kvcourse.sequence import Sequence
from kvcourse.serving import Engine, Scheduler

from .test_scheduler import plan, run_step
from .test_serving_engine import VOCAB, assert_greedy_equal, tiny  # noqa: F401  (tiny is a fixture)


def colliding_hash(parent, token_ids, extra_keys):
    """Every block gets the same hash: only the verification can tell blocks apart."""
    return 0


def register(bm, seq_id, tokens, salt=None):
    """A sequence that computed ``tokens`` (no lookup), its full blocks cached; its table."""
    table = bm.allocate(seq_id, len(tokens))
    bm.cache_full_blocks(seq_id, tokens, len(tokens), salt)
    return table


def hashes(bm, table):
    return [bm.cached_block(b).block_hash for b in table if bm.cached_block(b) is not None]


# ---- the block hash chain ----------------------------------------------------------------------
def test_a_changed_token_changes_the_hash_of_its_block_and_every_later_one_but_no_earlier_one():
    bm = PrefixCachingBlockManager(40, 4)
    rnd = random.Random(0)
    a = [rnd.randrange(1000) for _ in range(20)]  # 5 full blocks
    ha = hashes(bm, register(bm, "a", a))
    assert len(ha) == 5 and len(set(ha)) == 5
    for i in range(5):
        b = list(a)
        b[4 * i + 2] += 1  # one token of block i
        hb = hashes(bm, register(bm, ("b", i), b))
        assert hb[:i] == ha[:i] and all(x != y for x, y in zip(hb[i:], ha[i:]))
    # Each hash is the hash of (its parent's hash, its tokens, its extra keys): a chain, not a bag.
    assert ha[0] == hash_block_tokens(None, a[:4]) and ha[3] == hash_block_tokens(ha[2], a[12:16])
    # The same block of tokens after a different prefix is a different block.
    c = a[4:8] + a[4:8]
    hc = hashes(bm, register(bm, "c", c))
    assert hc[0] == hash_block_tokens(None, a[4:8]) != ha[1] and hc[1] != ha[1]


def test_a_hit_is_the_longest_cached_run_of_full_blocks():
    bm = PrefixCachingBlockManager(20, 4)
    table = register(bm, "a", list(range(1, 15)))  # 14 tokens: 3 full blocks cached, the 4th partial
    assert bm.num_cached_blocks == 3
    assert bm.find_cached_blocks(list(range(1, 15))) == table[:3]
    assert bm.find_cached_blocks(list(range(1, 11))) == table[:2]  # 10 tokens: 2 full blocks
    assert bm.find_cached_blocks([1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12]) == table[:1]
    assert bm.find_cached_blocks([0] + list(range(2, 15))) == []
    assert bm.find_cached_blocks([1, 2, 3]) == []  # no full block


def test_a_hash_collision_is_a_miss_never_a_wrong_hit():
    bm = PrefixCachingBlockManager(20, 2, hash_fn=colliding_hash)
    a = register(bm, "a", [1, 2, 3, 4])
    assert len(bm.cached_block_hash_to_block) == 1  # both blocks under the one hash
    assert bm.find_cached_blocks([1, 2, 3, 4]) == a
    assert bm.find_cached_blocks([5, 6, 7, 8]) == []  # same hash, other tokens
    assert bm.find_cached_blocks([1, 2, 9, 9]) == a[:1]
    # Block (3, 4) is cached, but after (1, 2): as a first block it holds the wrong K/V.
    assert bm.find_cached_blocks([3, 4, 1, 2]) == []
    b = register(bm, "b", [3, 4, 1, 2])
    assert bm.find_cached_blocks([3, 4, 1, 2]) == b and bm.find_cached_blocks([1, 2, 3, 4]) == a


# ---- tenants -----------------------------------------------------------------------------------
def test_different_salts_never_share_a_block():
    bm = PrefixCachingBlockManager(20, 4)
    tokens = list(range(1, 13))
    alice = register(bm, "alice", tokens, salt="alice")
    assert bm.find_cached_blocks(tokens, "alice") == alice
    assert bm.find_cached_blocks(tokens, "bob") == [] and bm.find_cached_blocks(tokens) == []
    # The salt is in the first block's hash, so every later hash differs too (the chain carries it).
    plain = register(bm, "plain", tokens)
    assert set(hashes(bm, alice)).isdisjoint(hashes(bm, plain))
    assert bm.find_cached_blocks(tokens) == plain


def test_tenants_share_only_within_their_salt_in_the_engine(tiny):  # noqa: F811
    rnd = random.Random(5)
    prompt = [rnd.randrange(4, VOCAB) for _ in range(40)]
    eng = Engine(tiny, num_blocks=64, block_size=8, enable_prefix_caching=True)
    want = kvcourse.generate(tiny, prompt, max_new_tokens=6)
    hits = []
    for salt in ("alice", "bob", "alice", None, None):
        before = eng.stats["prefix_cache_hit_tokens"]
        assert eng.generate([prompt], max_new_tokens=6, cache_salt=salt) == [want]
        hits.append(eng.stats["prefix_cache_hit_tokens"] - before)
    assert hits == [0, 0, 32, 0, 32]  # 39 tokens looked up: 4 full blocks of 8


# ---- LRU eviction ------------------------------------------------------------------------------
def test_idle_cached_blocks_are_evicted_least_recently_used_first_and_only_when_needed():
    bm = PrefixCachingBlockManager(6, 2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert register(bm, "A", a) == [0, 1]
    bm.free("A")
    assert register(bm, "B", b) == [2, 3]
    bm.free("B")
    # A hit on A makes it the most recently used: B is now the oldest.
    assert bm.allocate("A2", 4, bm.find_cached_blocks(a)) == [0, 1]
    bm.free("A2")
    assert list(bm._free) == [4, 5, 3, 2, 1, 0] and bm.num_evictions == 0
    bm.allocate("X", 6)  # 3 fresh blocks: the 2 empty ones, then B's tail block
    assert bm.num_evictions == 1
    assert bm.find_cached_blocks(b) == [2] and bm.find_cached_blocks(a) == [0, 1]
    bm.allocate("Y", 4)  # B's head block, then A's tail
    assert bm.num_evictions == 3 and bm.find_cached_blocks(b) == [] and bm.find_cached_blocks(a) == [0]
    assert bm.num_free_blocks == 1


def test_a_block_without_a_cached_prefix_is_handed_out_before_any_cached_one():
    bm = PrefixCachingBlockManager(4, 2)
    register(bm, "A", [1, 2, 3])  # block 0 full (cached), block 1 partial (not)
    bm.free("A")
    bm.allocate("X", 6)  # takes 1 (holds nothing), 2, 3: block 0 keeps its prefix
    assert bm.num_evictions == 0 and bm.find_cached_blocks([1, 2]) == [0]


def test_reset_prefix_cache_forgets_idle_blocks_only():
    bm = PrefixCachingBlockManager(8, 2)
    register(bm, "A", [1, 2, 3, 4])
    register(bm, "B", [5, 6])
    bm.free("A")
    assert bm.reset_prefix_cache() == 2 and bm.find_cached_blocks([1, 2]) == []
    assert bm.find_cached_blocks([5, 6]) == bm.block_table("B") and bm.num_free_blocks == 7


# ---- the scheduler -----------------------------------------------------------------------------
def seq(name, tokens, max_new=2):
    return Sequence(name, tokens, SamplingParams(max_new_tokens=max_new, stop_token_ids=()))


def test_only_uncached_tokens_are_fed_and_a_fully_cached_prompt_recomputes_its_last_block():
    bm = PrefixCachingBlockManager(20, 4)
    sched = Scheduler(bm, watermark=0)
    prompt = list(range(1, 9))  # 8 tokens: 2 full blocks
    sched.add(seq("A", prompt))
    while sched.has_unfinished():
        run_step(sched)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 20
    # The same prompt again: the lookup stops one token short (7 tokens: 1 full block), so its last
    # block is fed again and its last token's logits give the first output token.
    sched.add(seq("B", prompt, max_new=4))
    out, _ = run_step(sched)
    assert plan(out) == [("B", 4, 4, "prefill")] and out.num_prefix_cache_hit_tokens == 4
    assert out.num_prefix_cache_queried_tokens == 8
    # One more token than A's prompt: both blocks hit, 1 token fed.
    sched.add(seq("C", prompt + [9]))
    out, _ = run_step(sched)
    assert plan(out) == [("B", 8, 1, "decode"), ("C", 8, 1, "prefill")] and out.num_prefix_cache_hit_tokens == 8
    # A's blocks 0 and 1 (B recomputed its own copy of block 1); block 0 is shared by B and C.
    assert bm.block_table("C")[:2] == [0, 1] and bm.block_table("B")[0] == 0 and bm.ref_count(0) == 2


def test_a_preempted_request_that_hits_the_cache_counts_its_tokens_right():
    # The preemption of test_scheduler's hand-derived case, with prefix caching. Blocks of 2, a pool of 4.
    # X and Y: prompt [1, 2]; every output is 7. Step 3: X needs a block, Y (newest) is preempted: its
    # blocks go to the free queue with their K/V, X takes Y's tail block (an eviction) and finishes.
    # Step 4: Y (tokens 1 2 7 7 7) looks up 1 2 7 7: both blocks hit (X's), so it feeds 1 token, not 5,
    # and none counts as recomputed.
    bm = PrefixCachingBlockManager(4, 2)
    sched = Scheduler(bm, watermark=0)
    x = seq("X", [1, 2], max_new=4)
    y = seq("Y", [1, 2], max_new=5)
    sched.add(x)
    sched.add(y)
    for _ in range(3):
        out, _ = run_step(sched)
        assert not out.preempted
    out, finished = run_step(sched)
    assert out.preempted == [y] and finished == [x] and bm.num_evictions == 1
    out, _ = run_step(sched)
    assert out.admitted == [y] and plan(out) == [("Y", 4, 1, "decode")]
    assert out.num_prefix_cache_hit_tokens == 4 and out.scheduled[0].num_recomputed_tokens == 0
    assert y.num_computed_tokens == 5 and bm.num_tokens("Y") == 5
    run_step(sched)
    assert y.output_token_ids == [7] * 5 and bm.num_free_blocks == 4


def test_a_preempted_request_whose_blocks_were_evicted_recomputes_the_rest():
    # Same pool, but Y's prompt differs from X's: X's decode evicts Y's tail block, so Y re-admitted
    # finds only its first block and recomputes positions 2-3, fed for the first time at position 4.
    bm = PrefixCachingBlockManager(4, 2)
    sched = Scheduler(bm, watermark=0)
    x, y = seq("X", [1, 2], max_new=4), seq("Y", [3, 4], max_new=5)
    sched.add(x)
    sched.add(y)
    for _ in range(4):
        out, _ = run_step(sched)
    assert out.preempted == [y]
    out, _ = run_step(sched)
    assert plan(out) == [("Y", 2, 3, "recompute")] and out.num_prefix_cache_hit_tokens == 2
    assert out.scheduled[0].num_recomputed_tokens == 2


# ---- arguments ---------------------------------------------------------------------------------
def test_bad_arguments(tiny):  # noqa: F811
    with pytest.raises(TypeError, match="hash_fn must be callable"):
        PrefixCachingBlockManager(4, 4, hash_fn=3)
    with pytest.raises(TypeError, match="enable_prefix_caching must be a bool"):
        Engine(tiny, num_blocks=8, enable_prefix_caching="yes")
    eng = Engine(tiny, num_blocks=8, block_size=4, enable_prefix_caching=True)
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty str or None"):
            eng.add_request([5, 6], cache_salt=bad)
        with pytest.raises(ValueError, match="cache_salt must be a non-empty str or None"):
            eng.generate([[5, 6]], cache_salt=bad)
    assert not eng.requests  # nothing was queued
    bm = PrefixCachingBlockManager(8, 2)
    with pytest.raises(ValueError, match=r"cached_blocks \[3\] are not in the prefix cache"):
        bm.allocate("a", 4, [3])
    register(bm, "b", [1, 2])
    with pytest.raises(ValueError, match="cached_blocks: 1 blocks hold more than num_tokens=0"):
        bm.allocate("a", 0, bm.find_cached_blocks([1, 2]))
    with pytest.raises(ValueError, match=r"num_computed_tokens must be in \[0, 2\]"):
        bm.cache_full_blocks("b", [1, 2], 3)


# ---- the engine: outputs unchanged -------------------------------------------------------------
def shared_prefix_workload(rnd, num, block_size):
    """Prompts that share a random number of leading tokens with a few common prefixes."""
    roots = [[rnd.randrange(4, VOCAB) for _ in range(rnd.randint(1, 60))] for _ in range(rnd.randint(1, 3))]
    prompts = []
    for _ in range(num):
        root = rnd.choice(roots)
        cut = rnd.randint(0, len(root))
        prompts.append(root[:cut] + [rnd.randrange(4, VOCAB) for _ in range(rnd.randint(0 if cut else 1, 30))])
    return prompts, [SamplingParams(max_new_tokens=rnd.randint(1, 16)) for _ in range(num)]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 4, 16]), budget=st.sampled_from([16, 64]),
       slack=st.sampled_from([0, 4, 200]), collide=st.booleans())  # fmt: skip
def test_prefix_caching_leaves_every_output_as_if_alone(tiny, seed, block_size, budget, slack, collide):  # noqa: F811
    rnd = random.Random(seed)
    prompts, params = shared_prefix_workload(rnd, rnd.randint(2, 10), block_size)
    budget = max(budget, block_size)
    biggest = max(-(-(len(p) + sp.max_new_tokens - 1) // block_size) for p, sp in zip(prompts, params))
    eng = Engine(tiny, num_blocks=biggest + slack, block_size=block_size, max_num_seqs=4,
                 max_num_batched_tokens=budget, enable_prefix_caching=True, watermark=0.0)  # fmt: skip
    if collide:
        eng.block_manager.hash_fn = colliding_hash
    # Two waves, so the second finds the first's blocks (a request admitted in the same step as its
    # twin finds nothing: neither is computed yet).
    half = len(prompts) // 2
    outs = eng.generate(prompts[:half], params[:half]) if half else []
    outs += eng.generate(prompts[half:], params[half:])
    for p, sp, got in zip(prompts, params, outs):
        assert_greedy_equal(tiny, p, got, kvcourse.generate(tiny, p, sampling_params=sp))
    bm, stats = eng.block_manager, eng.stats
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked: every block idle, cached or not
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    once = sum(r.metrics.num_prompt_tokens + r.metrics.num_output_tokens - 1 for r in eng.requests.values())
    hits = stats["prefix_cache_hit_tokens"]
    assert once + stats["recomputed_tokens"] - hits <= stats["batched_tokens"] <= once + stats["recomputed_tokens"]
    assert 0 <= hits <= stats["prefix_cache_queried_tokens"]


def test_engine_hit_rate_and_a_fully_cached_prompt(tiny):  # noqa: F811
    rnd = random.Random(11)
    prompt = [rnd.randrange(4, VOCAB) for _ in range(32)]
    want = kvcourse.generate(tiny, prompt, max_new_tokens=5)
    eng = Engine(tiny, num_blocks=32, block_size=8, enable_prefix_caching=True)
    assert eng.generate([prompt], max_new_tokens=5) == [want]
    assert eng.stats["prefix_cache_hit_tokens"] == 0 and eng.stats["prefix_cache_hit_rate"] == 0
    assert eng.generate([prompt], max_new_tokens=5) == [want]  # 31 looked up: 3 of 4 blocks hit
    stats = eng.stats
    assert stats["prefix_cache_hit_tokens"] == 24 and stats["prefix_cache_queried_tokens"] == 64
    assert stats["prefix_cache_hit_rate"] == pytest.approx(24 / 64)
    off = Engine(tiny, num_blocks=32, block_size=8)
    assert off.generate([prompt], max_new_tokens=5) == [want]
    assert off.stats["prefix_cache_hit_tokens"] == 0 and off.stats["prefix_cache_evictions"] == 0
