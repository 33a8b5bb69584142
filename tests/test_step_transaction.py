"""A refused input changes nothing (issue 31, items 1 and 2): an engine step is a transaction.

If a user's hook (the preemption policy, the prefix lookup) or the forward raises, the step's reservations,
copy-on-write copies and queue moves are rolled back: the pool, the block tables and the queues are what they
were before the step, and the run carried on afterwards gives the outputs of a run that never failed.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcourse import SamplingParams
from kvcourse.paged import NoFreeBlocksError
from kvcourse.serving import Engine
from kvcourse.serving.scheduler import preempt_newest

from .conftest import tiny_llama
from .test_prefix_lookup_hook import walk

# Sampled, two samples a prompt: copy-on-write happens, and a wrong block shows in the tokens.
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0, n=2, stop_token_ids=())


def _prompts(seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    shared = [rnd.randrange(4, 100) for _ in range(8)]
    return [shared + [rnd.randrange(4, 100) for _ in range(rnd.randint(0, 5))] for _ in range(3)]


def _state(engine: Engine) -> tuple:
    """Everything a failed step must leave as it was."""
    s, bm = engine.scheduler, engine.block_manager
    snap = bm.snapshot()
    snap["host"] = dict(snap["host"] or {})  # None: no host pool
    return (
        [q.seq_id for q in s.waiting],
        [q.seq_id for q in s.running],
        [q.seq_id for q in s.swapped],
        {q.seq_id: (q.status, q.num_computed_tokens, q.num_tokens) for q in s._seqs.values()},
        {k: (list(v) if hasattr(v, "__iter__") and not isinstance(v, dict) else v) for k, v in snap.items()},
    )


def _serve(engine: Engine, prompts, fail_at: set[int] | None = None, errors: tuple = ()) -> list:
    """Serve ``prompts`` step by step; a step that raises one of ``errors`` must leave no trace, and is retried."""
    for i, p in enumerate(prompts):
        engine.add_request(p, PARAMS, request_id=i)
    failures, step = 0, 0
    while engine.has_unfinished_requests():
        before = _state(engine)
        try:
            engine.step()
        except errors:
            failures += 1
            assert _state(engine) == before, "the failed step left a trace"
        step += 1
        assert step < 500
    return [engine.requests[i].outputs for i in range(len(prompts))], failures


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


def _engine(model, **kw) -> Engine:
    return Engine(model, **{"num_blocks": 8, "block_size": 4, "max_num_batched_tokens": 16, **kw})


def test_a_refused_preemption_policy_leaves_the_step_undone(model):
    # The repro: the policy answers "not a sequence" once; the scheduler had already reserved slots and
    # made copy-on-write copies for the running sequences before it.
    calls = {"n": 0}

    def flaky(candidates):
        calls["n"] += 1
        return "not a sequence" if calls["n"] == 1 else preempt_newest(candidates)

    prompts = _prompts(0)
    want, _ = _serve(_engine(model), prompts)
    got, failures = _serve(_engine(model, preemption_policy=flaky), prompts, errors=(ValueError,))
    assert failures == 1 and calls["n"] > 1  # the pool was short, the policy refused once, then served
    assert got == want


def test_a_refused_prefix_lookup_leaves_the_step_undone(model):
    from kvcourse.paged import PrefixCachingBlockManager

    state = {"calls": 0}

    def flaky_lookup(token_ids, block_size, cache_salt, hash_fn, get_cached_block):
        state["calls"] += 1
        if state["calls"] == 2:  # while requests run
            return "oops"
        return real(token_ids, block_size, cache_salt, hash_fn, get_cached_block)

    prompts = _prompts(1)
    base = _engine(model, num_blocks=12, enable_prefix_caching=True)
    base.block_manager.find_longest_cache_hit = real = walk
    want, _ = _serve(base, prompts)
    engine = _engine(model, num_blocks=12, enable_prefix_caching=True)
    engine.block_manager.find_longest_cache_hit = flaky_lookup
    got, failures = _serve(engine, prompts, errors=(TypeError,))
    assert failures == 1 and got == want
    assert isinstance(engine.block_manager, PrefixCachingBlockManager)


class _FailingRunner:
    """The engine's runner, raising in the forward at the steps named (as running out of memory would)."""

    def __init__(self, runner, fail_at: set[int]) -> None:
        self._runner, self.fail_at, self.calls = runner, fail_at, 0

    def launch(self, step):
        self.calls += 1
        if self.calls in self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self._runner.launch(step)

    def __getattr__(self, name):
        return getattr(self._runner, name)


@pytest.mark.parametrize("num_blocks", [32, 8], ids=["no preemption", "with preemption"])
def test_a_forward_that_fails_leaves_nothing_reserved(model, num_blocks):
    prompts = _prompts(2)
    want, _ = _serve(_engine(model, num_blocks=num_blocks), prompts)
    engine = _engine(model, num_blocks=num_blocks)
    engine.runner = _FailingRunner(engine.runner, {1, 3, 4, 9})
    if num_blocks == 32:
        got, failures = _serve(engine, prompts, errors=(torch.OutOfMemoryError,))
        assert failures == 4 and got == want
        return
    # With preemption in a failed step, the victims are recomputed (the forward may have written into the blocks
    # they gave up): the state after the failure is no longer the state before it, but the outputs still match.
    for i, p in enumerate(prompts):
        engine.add_request(p, PARAMS, request_id=i)
    failures = 0
    while engine.has_unfinished_requests():
        try:
            engine.step()
        except torch.OutOfMemoryError:
            failures += 1
        bm = engine.block_manager  # every block is free or held, once: nothing leaked or handed out twice
        assert bm.num_free_blocks + len({b for s in bm.seq_ids for b in bm.block_table(s)}) == bm.num_blocks
    assert failures == 4
    assert [engine.requests[i].outputs for i in range(len(prompts))] == want


def test_the_forward_and_admission_fail_at_several_steps_of_one_run(model):
    # The forward fails at three steps and admission at two (the preemption policy and the prefix lookup are
    # the tests above); every failed step leaves no trace (checked in _serve), and the outputs equal those of a
    # run that never failed.
    prompts = _prompts(3)
    want, _ = _serve(_engine(model, num_blocks=24, enable_prefix_caching=True), prompts)
    engine = _engine(model, num_blocks=24, enable_prefix_caching=True)
    engine.runner = _FailingRunner(engine.runner, {2, 5, 7})
    bm = engine.block_manager
    real_admit, admits = bm.admit, [0]

    def admit(*a, **k):  # the pool running short in the middle of admission
        admits[0] += 1
        if admits[0] in fail_admits:
            raise NoFreeBlocksError("simulated")
        return real_admit(*a, **k)

    fail_admits = {2, 3}  # three prompts: at least three admissions succeed, so both of these happen

    bm.admit = admit
    got, failures = _serve(engine, prompts, errors=(torch.OutOfMemoryError, NoFreeBlocksError))
    assert failures == 5 and engine.runner.calls > 7 and got == want
