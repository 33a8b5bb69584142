"""The scheduler without a model: hand-derived steps, the bugs other engines shipped, and a fuzz of its invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.paged import BlockManager, PrefixCachingBlockManager
from kvcourse.sequence import SamplingParams, Sequence, SequenceStatus
from kvcourse.serving import Scheduler


def seq(name, prompt_len, max_new=4, n=1):
    params = SamplingParams(max_new_tokens=max_new, n=n, stop_token_ids=())
    return Sequence(name, list(range(1, prompt_len + 1)), params)


def run_step(sched, token=7):
    """One step as the engine runs it, with a placeholder token for every sequence that samples."""
    out = sched.schedule()
    sched.advance(out)
    finished = sched.append_tokens({s.seq.seq_id: token for s in out.scheduled if s.samples})
    return out, finished


def plan(out):
    return [(s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens, s.kind) for s in out.scheduled]


# ---- hand-derived steps ------------------------------------------------------------------------
def test_token_budget_is_shared_running_first_then_waiting_in_chunks():
    # Budget 10. Step 0: A takes its 3 prompt tokens, B (12) gets the 7 left as a chunk, C waits.
    # Step 1: A decodes (1), B finishes its prompt (5), C is admitted with its 2 tokens: 8 of 10.
    sched = Scheduler(BlockManager(100, 4), max_num_batched_tokens=10, watermark=0)
    for s in (seq("A", 3), seq("B", 12), seq("C", 2)):
        sched.add(s)
    out, _ = run_step(sched)
    assert plan(out) == [("A", 0, 3, "prefill"), ("B", 0, 7, "chunk")]
    assert [s.samples for s in out.scheduled] == [True, False]
    assert [s.seq_id for s in sched.waiting] == ["C"]
    out, _ = run_step(sched)
    assert plan(out) == [("A", 3, 1, "decode"), ("B", 7, 5, "chunk"), ("C", 0, 2, "prefill")]
    assert [s.samples for s in out.scheduled] == [True, True, True] and out.num_batched_tokens == 8
    # The chunked prompt now decodes from position 12: after its prompt, never off by one.
    out, _ = run_step(sched)
    assert plan(out) == [("A", 4, 1, "decode"), ("B", 12, 1, "decode"), ("C", 2, 1, "decode")]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it():
    sched = Scheduler(BlockManager(100, 4), max_num_batched_tokens=16, enable_chunked_prefill=False, watermark=0)
    for s in (seq("A", 3), seq("B", 12), seq("C", 2)):
        sched.add(s)
    out, _ = run_step(sched)
    assert plan(out) == [("A", 0, 3, "prefill"), ("B", 0, 12, "prefill")]  # C (2) > the 1 token left
    out, _ = run_step(sched)
    assert plan(out) == [("A", 3, 1, "decode"), ("B", 12, 1, "decode"), ("C", 0, 2, "prefill")]
    with pytest.raises(ValueError, match="without chunked prefill .* max_num_batched_tokens=16"):
        sched.add(seq("D", 14, max_new=4))  # 14 + 3 tokens to recompute after a preemption > 16


def test_the_newest_request_is_preempted_and_recomputed_with_its_outputs():
    # Blocks of 2, a pool of 4, no watermark. X and Y: prompt 2; X makes 4 new tokens, Y 5.
    # Steps 0-2: both hold 2 blocks by step 1 (3 tokens each), the pool is full.
    # Step 3: X feeds position 4 and needs a third block: Y, the newest, is preempted (its 2 blocks
    #         freed, its K/V forgotten); X samples its 4th token and finishes.
    # Step 4: Y is re-admitted and recomputes its prompt and its 3 outputs: 5 tokens from position 0.
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, watermark=0)
    x, y = seq("X", 2), seq("Y", 2, max_new=5)
    sched.add(x)
    sched.add(y)
    for _ in range(3):
        out, _ = run_step(sched)
        assert not out.preempted
    assert bm.num_free_blocks == 0 and y.num_computed_tokens == 4
    out, finished = run_step(sched)
    assert out.preempted == [y] and plan(out) == [("X", 4, 1, "decode")]
    assert y.status is SequenceStatus.PREEMPTED and y.num_computed_tokens == 0 and list(sched.waiting) == [y]
    assert finished == [x] and bm.num_free_blocks == 4
    out, finished = run_step(sched)
    assert plan(out) == [("Y", 0, 5, "recompute")] and out.admitted == [y]
    assert out.scheduled[0].num_recomputed_tokens == 4  # 4 had K/V before; its 3rd output never had
    assert y.num_computed_tokens == 5 and bm.num_tokens("Y") == 5  # counts its recomputed tokens right
    out, finished = run_step(sched)
    assert plan(out) == [("Y", 5, 1, "decode")]  # and decodes on from position 5
    assert finished == [y] and y.output_token_ids == [7] * 5 and bm.num_free_blocks == 4


def test_a_request_that_is_itself_the_newest_preempts_itself_and_resumes_later():
    # Blocks of 2, a pool of 2: X (prompt 1, 4 new) and Y (prompt 2, 3 new) take one block each.
    # Step 1: Y needs a second block, none is free and Y is the newest: Y goes, X keeps running.
    bm = BlockManager(2, 2)
    sched = Scheduler(bm, watermark=0)
    x, y = seq("X", 1, max_new=4), seq("Y", 2, max_new=3)
    sched.add(x)
    sched.add(y)
    run_step(sched)
    out, _ = run_step(sched)
    assert out.preempted == [y] and plan(out) == [("X", 1, 1, "decode")]
    steps = 2
    while sched.has_unfinished():
        run_step(sched)
        steps += 1
        assert steps < 20
    assert x.output_token_ids == [7] * 4 and y.output_token_ids == [7] * 3 and bm.num_free_blocks == 2


def test_a_preemption_policy_picks_the_victim_among_the_sequence_in_need_and_those_after_it():
    # Blocks of 2, a pool of 6: X, Y, Z (prompt 2 each, 4 new) fill it at step 1; at step 3 X needs a block.
    def run(policy):
        bm = BlockManager(6, 2)
        sched = Scheduler(bm, watermark=0, preemption_policy=policy)
        for s in (seq("X", 2, 4), seq("Y", 2, 4), seq("Z", 2, 4)):
            sched.add(s)
        for _ in range(3):
            run_step(sched)
        out, _ = run_step(sched)
        return out, sched

    seen = []
    out, sched = run(lambda c: seen.append([s.seq_id for s in c]) or c[1])  # Y: not the newest
    assert seen[0] == ["X", "Y", "Z"]  # candidates: X, who needs the block, then the others, oldest first
    assert [s.seq_id for s in out.preempted] == ["Y"] and plan(out)[0] == ("X", 4, 1, "decode")
    assert [p[0] for p in plan(out)] == ["X", "Z"] and [s.seq_id for s in sched.waiting] == ["Y"]
    out, _ = run(None)  # vLLM's default: the newest
    assert [s.seq_id for s in out.preempted] == ["Z"]
    # X preempts itself although newer sequences run: they still run this step
    out, sched = run(lambda c: c[0])
    assert [s.seq_id for s in out.preempted] == ["X"] and [p[0] for p in plan(out)] == ["Y", "Z"]
    while sched.has_unfinished():
        run_step(sched)
    assert sched.block_manager.num_free_blocks == 6


@pytest.mark.parametrize(
    "policy, match",
    [
        (lambda c: "Z", "returned 'Z', which is not one of its candidates"),
        (lambda c: seq("W", 2), "not one of its candidates"),
    ],
)
def test_a_policy_that_returns_no_candidate_is_refused_before_anything_changes(policy, match):
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, watermark=0, preemption_policy=policy)
    for s in (seq("X", 2, 4), seq("Y", 2, 4)):
        sched.add(s)
    for _ in range(3):
        run_step(sched)
    with pytest.raises(ValueError, match=match):
        sched.schedule()
    assert [s.seq_id for s in sched.running] == ["X", "Y"] and bm.num_free_blocks == 0  # nobody was preempted


def test_a_preemption_policy_must_be_callable():
    with pytest.raises(TypeError, match="preemption_policy must be a function"):
        Scheduler(BlockManager(4, 2), preemption_policy="newest")


def test_admission_keeps_the_watermark_free_unless_nothing_runs():
    bm = BlockManager(20, 4)
    sched = Scheduler(bm, watermark=0.25)  # keeps 5 blocks free for growth
    sched.add(seq("A", 50, max_new=2))  # 13 blocks: admitted although it leaves 7 < 5 + 13... alone, no watermark
    sched.add(seq("B", 8))  # 2 blocks: 7 free - 5 kept = 2 -> fits
    sched.add(seq("C", 1))  # 1 block: 5 free - 5 kept = 0 -> waits
    out, _ = run_step(sched)
    assert [s.seq_id for s in out.admitted] == ["A", "B"] and [s.seq_id for s in sched.waiting] == ["C"]


def test_nobody_is_admitted_in_a_step_that_preempted():
    bm = BlockManager(3, 2)
    sched = Scheduler(bm, watermark=0)
    sched.add(seq("X", 2, max_new=4))
    sched.add(seq("Y", 2, max_new=2))
    run_step(sched)  # X, Y: 1 block each, 1 free
    sched.add(seq("Z", 1, max_new=1))
    out, _ = run_step(sched)  # X and Y both need a block; Y is preempted; Z would fit in Y's freed block
    assert [s.seq_id for s in out.preempted] == ["Y"] and not out.admitted


def test_parallel_samples_take_their_seats_from_admission():
    sched = Scheduler(BlockManager(50, 4), max_num_seqs=4)
    a = seq("A", 5, n=3)
    sched.add(a)
    sched.add(seq("B", 5, n=2))
    out, _ = run_step(sched)
    assert [s.seq_id for s in out.admitted] == ["A"]  # 3 seats + 2 > 4
    child = a.fork("A1")
    sched.fork(a, child)
    assert sched.block_manager.block_table("A1") == sched.block_manager.block_table("A")
    with pytest.raises(ValueError, match="n=5 samples exceed max_num_seqs=4"):
        sched.add(seq("C", 5, n=5))


def test_abort_frees_blocks_and_leaves_the_queues():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_batched_tokens=8)
    for s in (seq("A", 9), seq("B", 3)):
        sched.add(s)
    run_step(sched)  # A: a chunk of 8 in 2 blocks; B waits
    assert bm.num_free_blocks == 8
    assert sched.abort("A").status is SequenceStatus.CANCELLED
    assert sched.abort("B").status is SequenceStatus.CANCELLED
    assert bm.num_free_blocks == 10 and not sched.has_unfinished()
    with pytest.raises(ValueError, match="seq_id='A' is not waiting or running"):
        sched.abort("A")


def test_a_request_bigger_than_the_pool_is_refused_at_add():
    sched = Scheduler(BlockManager(4, 16))
    with pytest.raises(ValueError, match="alone needs 5 blocks .* num_blocks=4: it could never run"):
        sched.add(seq("big", 60, max_new=10))  # 60 + 9 tokens = 5 blocks of 16
    sched.add(seq("fits", 60, max_new=5))  # 64 tokens = 4 blocks
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(seq("fits", 1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_seqs=0), "max_num_seqs must be an int >= 1"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an int >= 1"),
        (dict(watermark=1.0), "watermark"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(BlockManager(4, 4), **kwargs)


def test_fork_needs_a_pool_that_shares_blocks():
    from kvcourse.fragmentation import ReservationPool

    sched = Scheduler(ReservationPool(16, True, {"A": 8}), watermark=0)
    a = seq("A", 3)
    sched.add(a)
    run_step(sched)
    with pytest.raises(TypeError, match="PagedKVPool"):
        sched.fork(a, a.fork("A1"))


# ---- fuzz: random arrivals, lengths, aborts, pools, budgets --------------------------------------
def check_pool(bm: BlockManager, seqs) -> None:
    """Every block is free xor owned, and its reference count is the number of tables holding it."""
    owners = [0] * bm.num_blocks
    for s in seqs:
        for block in bm.block_table(s.seq_id):
            owners[block] += 1
    assert all(bm.ref_count(b) == owners[b] for b in range(bm.num_blocks))
    assert bm.num_free_blocks == sum(1 for o in owners if o == 0)
    assert set(bm.seq_ids) == {s.seq_id for s in seqs}
    if isinstance(bm, PrefixCachingBlockManager):  # the hash index and the blocks agree
        indexed = {b: e for bucket in bm.cached_block_hash_to_block.values() for b, e in bucket.items()}
        assert indexed == {b: bm.cached_block(b) for b in range(bm.num_blocks) if bm.cached_block(b)}
        assert all(e.block_hash == h for h, bucket in bm.cached_block_hash_to_block.items() for e in bucket.values())


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.sampled_from([None, 16, 40, 256]), chunked=st.booleans(),
       max_num_seqs=st.sampled_from([None, 1, 3, 8]),
       watermark=st.sampled_from([0.0, 0.05, 0.3]), slack=st.sampled_from([0, 1, 3, 8, 30]),
       prefix_caching=st.booleans())  # fmt: skip
def test_fuzz_every_request_ends_exactly_once_within_budget_and_cap(
    seed, block_size, budget, chunked, max_num_seqs, watermark, slack, prefix_caching
):
    # Every prompt is 1, 2, 3, ...: with prefix caching on, they share prefixes (and salts split them).
    rnd = random.Random(seed)
    max_n = 1 if max_num_seqs is None else min(3, max_num_seqs)
    reqs = []
    for i in range(rnd.randint(1, 12)):
        prompt = rnd.randint(1, 80)
        params = SamplingParams(max_new_tokens=rnd.randint(1, 20), n=rnd.randint(1, max_n), stop_token_ids=(0,))
        reqs.append((rnd.randint(0, 15), Sequence((i, 0), list(range(1, prompt + 1)), params)))
    if not chunked and budget is not None:
        reqs = [(t, s) for t, s in reqs if s.num_prompt_tokens + s.params.max_new_tokens - 1 <= budget] or reqs[:0]
    if not reqs:
        return
    biggest = max(-(-(s.num_prompt_tokens + s.params.max_new_tokens - 1) // block_size) for _, s in reqs)
    bm = (PrefixCachingBlockManager if prefix_caching else BlockManager)(biggest + slack, block_size)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      enable_chunked_prefill=chunked, watermark=watermark)  # fmt: skip
    pending = sorted(reqs, key=lambda r: r[0])
    live, ended = {}, {}  # seq_id -> Sequence
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            s = pending.pop(0)[1]
            sched.add(s, cache_salt=rnd.choice([None, None, "tenant"]))
            live[s.seq_id] = s
        if live and rnd.random() < 0.03:  # abort a random unfinished sequence
            victim = rnd.choice(sorted(live, key=repr))
            ended[victim] = sched.abort(victim)
            del live[victim]
        out = sched.schedule()
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        if budget is not None:
            assert out.num_batched_tokens <= budget
        if max_num_seqs is not None:
            assert len(sched.running) <= max_num_seqs
        assert all(s.num_new_tokens >= 1 and s.seq.status is SequenceStatus.RUNNING for s in out.scheduled)
        assert all(v.status is SequenceStatus.PREEMPTED and v.seq_id not in bm for v in out.preempted)
        for s in out.scheduled:  # hits are whole blocks, and the last token is always fed
            assert s.num_cached_tokens % block_size == 0 and s.num_cached_tokens < s.seq.num_tokens
            assert s.num_cached_tokens == 0 or (prefix_caching and s.seq in out.admitted)
        check_pool(bm, sched.running)
        sched.advance(out)
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                if s.seq.params.n > 1 and s.seq.num_tokens == s.seq.num_prompt_tokens:  # fork, as the engine does
                    for j in range(1, s.seq.params.n):
                        child = s.seq.fork((s.seq.seq_id[0], j))
                        sched.fork(s.seq, child)
                        live[child.seq_id] = child
                        sampled[child.seq_id] = rnd.randrange(0, 8)
                sampled[s.seq.seq_id] = rnd.randrange(0, 8)  # token 0 stops a sequence early
        for s in sched.append_tokens(sampled):
            assert s.seq_id not in ended and s.status is SequenceStatus.FINISHED
            ended[s.seq_id] = live.pop(s.seq_id)
        if max_num_seqs is not None:
            assert len(sched.running) <= max_num_seqs
        # a running sequence holds exactly the slots of its computed tokens; a waiting one holds none
        assert all(bm.num_tokens(s.seq_id) == s.num_computed_tokens for s in sched.running)
        assert all(s.num_computed_tokens == 0 and s.seq_id not in bm for s in sched.waiting)
        check_pool(bm, sched.running)
        step += 1
        assert step < 5000, "no progress"
    assert not live and bm.num_free_blocks == bm.num_blocks
    for s in ended.values():
        assert s.is_finished
        if s.status is SequenceStatus.FINISHED:
            out = s.output_token_ids
            assert len(out) == s.params.max_new_tokens or out[-1] == 0


def test_a_step_without_a_model_advances_and_appends_a_placeholder_token():
    # What simulations and exercise checks do instead of a forward pass: the same as advance + append_tokens with 0.
    ours, theirs = (Scheduler(BlockManager(20, 4), max_num_batched_tokens=8, watermark=0) for _ in range(2))
    for sched in (ours, theirs):
        for s in (seq("A", 3, max_new=2), seq("B", 9, max_new=2)):
            sched.add(s)
    while theirs.has_unfinished():
        out_ours, out_theirs = ours.schedule(), theirs.schedule()
        assert plan(out_ours) == plan(out_theirs)
        finished = ours.advance_without_model(out_ours)
        theirs.advance(out_theirs)
        expected = theirs.append_tokens({s.seq.seq_id: 0 for s in out_theirs.scheduled if s.samples})
        assert [s.seq_id for s in finished] == [s.seq_id for s in expected]
        assert [s.token_ids for s in ours.running] == [s.token_ids for s in theirs.running]
    assert not ours.has_unfinished()
