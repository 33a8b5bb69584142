"""Regression tests for issue 17's bugs: bad input is refused with a clear error, before anything changes.

Each test names the bug it pins down. The tiny random-weight model of ``test_serving_engine`` keeps
them fast; the reference for "the engine still works" is ``kvcourse.generate``, one request alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kvcourse
from kvcourse import SamplingParams
from kvcourse.memory import kv_layout
from kvcourse.memory.__main__ import main as memory_main
from kvcourse.paged import PrefixCachingBlockManager
from kvcourse.serving import Engine, ModelRunner, Scheduler

from .test_serving_engine import VOCAB, assert_greedy_equal, tiny  # noqa: F401  (tiny is a fixture)

BIG_SEED = 2**64  # one past the largest seed torch.Generator.manual_seed takes


def run_alone(model, prompt, max_new_tokens=4):
    return kvcourse.generate(model, prompt, max_new_tokens, eos_token_ids=())


def assert_engine_still_serves(eng: Engine, model) -> None:
    """The engine holds nothing of a refused request and serves the next one as if it were alone."""
    assert not eng.scheduler.has_unfinished() and not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    prompt = [5, 6, 7, 8, 9]
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=4, stop_token_ids=()))
    while eng.has_unfinished_requests():
        eng.step()
    assert_greedy_equal(model, prompt, eng.output(rid), run_alone(model, prompt))


# ---- an out-of-range seed bricked the engine ----------------------------------------------------
@pytest.mark.parametrize("seed, n", [(BIG_SEED, 1), (2**64 - 1, 2), (-1, 1)])
def test_a_seed_torch_cannot_take_is_refused_before_the_engine_sees_it(tiny, seed, n):
    # It used to be accepted; add_request then queued the sequence before the sampler raised, and
    # every later step() failed with a KeyError (n=2: the fork raised mid-step and abort failed).
    eng = Engine(tiny, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="seed must be an int in"):
        eng.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=seed, n=n, max_new_tokens=2))
    assert not eng.requests
    assert_engine_still_serves(eng, tiny)


def test_generate_with_one_bad_request_queues_none_of_them(tiny):
    """It used to queue the prompts before the bad seed, then raise."""
    eng = Engine(tiny, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="seed"):
        eng.generate([[1, 2], [3, 4]], [SamplingParams(), SamplingParams(temperature=1.0, seed=BIG_SEED)])
    assert not eng.requests and not eng.scheduler.waiting
    assert_engine_still_serves(eng, tiny)


def test_a_refused_request_does_not_use_up_a_request_id(tiny):
    eng = Engine(tiny, num_blocks=16, block_size=4, max_num_seqs=4)
    with pytest.raises(ValueError, match="n=5 samples exceed max_num_seqs=4"):
        eng.add_request([1, 2], SamplingParams(n=5))
    with pytest.raises(ValueError, match="n=5 samples exceed max_num_seqs=4"):
        eng.generate([[1], [2]], SamplingParams(n=5))
    assert eng.add_request([1, 2]) == 0 and eng.generate([[3]], max_new_tokens=1) and list(eng.requests) == [0, 1]


def test_the_engine_checks_a_request_once(tiny, monkeypatch):
    """The engine and its scheduler used to check every request twice (Engine._new_sequence, then
    Scheduler.add)."""
    calls = []
    original = Scheduler.check
    monkeypatch.setattr(Scheduler, "check", lambda self, seq, **kw: calls.append(seq) or original(self, seq, **kw))
    eng = Engine(tiny, num_blocks=16, block_size=4)
    eng.add_request([1, 2, 3])
    eng.generate([[4, 5], [6]], max_new_tokens=2)
    assert len(calls) == 3


# ---- a failing step left state behind ---------------------------------------------------------------
def test_a_refused_runner_step_changes_nothing(tiny):
    runner = ModelRunner(tiny, num_blocks=8, block_size=4)
    bm = runner.block_manager
    runner.step([(0, [1, 2, 3])])
    before = (bm.seq_ids, bm.block_table(0), bm.num_tokens(0), bm.num_free_blocks)
    bad_steps = [
        [(0, [4]), (1, [5, VOCAB])],  # an out-of-vocabulary token: a new id and slots were reserved first
        [(0, [4]), (1, [5, -1])],
        [(0, [4]), (1, [5, 2.0])],
        [(0, [4]), (1, [1] * 1030)],  # past the context (1024 positions)
        [(0, [4]), ([1], [5])],  # an unhashable id
    ]
    for work in bad_steps:
        with pytest.raises((ValueError, TypeError)):
            runner.step(work)
        assert (bm.seq_ids, bm.block_table(0), bm.num_tokens(0), bm.num_free_blocks) == before
    # The next step is exactly the one that would have come: token 4 at position 3.
    fresh = ModelRunner(tiny, num_blocks=8, block_size=4)
    fresh.step([(0, [1, 2, 3])])
    torch.testing.assert_close(runner.step([(0, [4])]), fresh.step([(0, [4])]), rtol=0, atol=0)


def test_model_names_an_out_of_vocabulary_id(tiny):
    with pytest.raises(ValueError, match=r"input_ids has token ids outside the vocabulary \[0, 101\): \[101\]"):
        tiny(torch.tensor([[1, VOCAB]]))
    cache = kvcourse.KVCache.for_model(tiny.config)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny(torch.tensor([[-3]]), cache=cache)
    assert cache.seq_len == 0


# ---- after a swap-in, the prefix cache re-hashed the whole sequence ---------------------------------
def test_swap_in_keeps_the_prefix_cache_chain():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2, num_host_blocks=8)
    tokens = [10, 11, 12, 13, 14, 15]
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", tokens, 4)
    assert bm.num_cached_blocks == 2
    bm.swap_out("a")
    bm.swap_in("a")
    bm.take_transfers()
    bm.append_slots("a", 2)
    bm.cache_full_blocks("a", tokens, 6)
    # Before the fix: 5 cached blocks, the first two twice (the copies swapped in re-registered).
    assert bm.num_cached_blocks == 3
    assert all(len(blocks) == 1 for blocks in bm.cached_block_hash_to_block.values())
    # The third block is chained to the first two: a new request with the same tokens finds all three.
    hits = bm.find_cached_blocks(tokens)
    assert len(hits) == 3 and hits[2] == bm.block_table("a")[2]


def test_a_swapped_sequence_aborted_forgets_its_chain():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2, num_host_blocks=4)
    bm.allocate("a", 2)
    bm.cache_full_blocks("a", [1, 2], 2)
    bm.swap_out("a")
    bm.free_swapped("a")
    bm.allocate("a", 2)  # the id can be used again, and starts a fresh chain
    bm.cache_full_blocks("a", [3, 4], 2)
    assert len(bm.find_cached_blocks([3, 4])) == 1


# ---- a pool too big for memory; a clock that is not one ---------------------------------------------
def test_a_pool_larger_than_memory_is_refused_not_oom_killed(tiny):
    with pytest.raises(ValueError, match=r"num_blocks: a pool of 1,000,000,000 blocks of 16 tokens needs .* GiB"):
        Engine(tiny, num_blocks=10**9)
    with pytest.raises(ValueError, match="num_blocks: a pool of 1,000,000,000 blocks"):
        Engine(tiny, num_blocks=4, num_cpu_blocks=10**9)


def test_the_memory_check_uses_what_is_available(tiny, monkeypatch):
    block_bytes = 2 * 2 * 16 * 2 * 8 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 8, fp32
    monkeypatch.setattr(kvcourse.checks, "available_memory", lambda device: 10 * block_bytes)
    ModelRunner(tiny, num_blocks=10)
    with pytest.raises(ValueError, match="needs .* GiB but only .* GiB is available"):
        ModelRunner(tiny, num_blocks=11)


@pytest.mark.parametrize(
    "clock, exc, match",
    [
        ("x", TypeError, "clock must be a function returning seconds"),
        (lambda: "now", TypeError, r"clock\(\) must be a finite number, got str"),
    ],
)
def test_a_clock_that_is_not_one(tiny, clock, exc, match):
    with pytest.raises(exc, match=match):
        Engine(tiny, num_blocks=4, clock=clock)


# ---- silently accepted, or unclear ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(use_cache="no"), TypeError, r"use_cache must be a bool \(True or False\), got str 'no'"),
        (dict(temperature=float("inf")), ValueError, "temperature must be a finite number >= 0"),
        (dict(eos_token_ids=5), TypeError, r"eos_token_ids must be a list of token ids, e.g. \[5\]"),
        (dict(ids=[1, np.int64(VOCAB)]), ValueError, r"ids has token ids outside the vocabulary \[0, 101\): \[101\]"),
    ],
)
def test_generate_refuses_what_it_used_to_accept_or_garble(tiny, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvcourse.generate(tiny, **(dict(ids=[1, 2], max_new_tokens=2) | kwargs))


def test_numpy_token_ids_are_token_ids(tiny):
    prompt = [5, 6, 7]
    want = run_alone(tiny, prompt)
    assert run_alone(tiny, np.array(prompt)) == want
    assert run_alone(tiny, [np.int64(t) for t in prompt]) == want
    eng = Engine(tiny, num_blocks=16, block_size=4)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=[np.int64(3)])
    assert params.stop_token_ids == (3,) and type(params.stop_token_ids[0]) is int
    rid = eng.add_request(np.array(prompt, dtype=np.int64), SamplingParams(max_new_tokens=4, stop_token_ids=()))
    [out] = eng.generate([[np.int32(t) for t in prompt]], SamplingParams(max_new_tokens=4, stop_token_ids=()))
    assert_greedy_equal(tiny, prompt, out, want)
    assert_greedy_equal(tiny, prompt, eng.output(rid), want)
    runner = ModelRunner(tiny, num_blocks=4, block_size=4)
    torch.testing.assert_close(
        runner.step([(0, np.array(prompt))])[0], tiny(torch.tensor([prompt]))[0, -1], rtol=1e-5, atol=1e-5
    )


def test_unhashable_request_ids_get_a_clear_error(tiny):
    eng = Engine(tiny, num_blocks=16, block_size=4)
    for bad in ([1], (1, [2]), {"a": 1}):
        with pytest.raises(TypeError, match="request_id must be hashable"):
            eng.add_request([1, 2], request_id=bad)
        with pytest.raises(TypeError, match="request_id must be hashable"):
            eng.abort(bad)
        with pytest.raises(TypeError, match="request_id must be hashable"):
            eng.output(bad)
    assert not eng.requests


def test_kv_cache_update_refuses_a_bool_layer_and_a_cast():
    cache = kvcourse.KVCache(num_layers=2, batch_size=1, num_kv_heads=1, head_dim=4)
    k = torch.ones(1, 1, 1, 4)
    with pytest.raises(TypeError, match="layer_idx must be an int in"):
        cache.update(True, k, k)  # used to write layer 1
    with pytest.raises(TypeError, match=r"k and v must be torch.float32, the cache's dtype, got torch.float64"):
        cache.update(0, k.double(), k.double())  # used to be rounded to fp32 without a word
    assert cache.seq_len == 0 and cache.keys(1).shape[2] == 0


def test_quantizing_an_inf_is_refused_not_turned_into_nans():
    from kvcourse.compression.quantization import quantize
    from kvcourse.kernels.int8 import quantize_int8

    x = torch.ones(2, 64)
    x[1, 5] = float("inf")
    with pytest.raises(ValueError, match="x has 1 non-finite values"):
        quantize_int8(x)
    for fmt in ("int8", "int4", "fp8"):
        with pytest.raises(ValueError, match="non-finite"):
            quantize(x, fmt)
    q, scale = quantize_int8(torch.ones(2, 64))
    assert torch.isfinite(scale).all()


@pytest.mark.parametrize(
    "key, value",
    [
        ("use_sliding_window", "false"),  # was read as true: a windowed cache for a model without one
        ("multi_query", "no"),  # was read as MQA: 1 KV head
        ("new_decoder_architecture", 1),
    ],
)
def test_memory_config_flags_must_be_json_booleans(tmp_path, capsys, key, value):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "sliding_window": 16,
           "model_type": "qwen2", key: value}  # fmt: skip
    with pytest.raises(ValueError, match=rf"config\['{key}'\] must be true, false or null, got {value!r}"):
        kv_layout(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(SystemExit):
        memory_main(["--config", str(path)])
    assert f"config['{key}'] must be true, false or null" in capsys.readouterr().err
    assert kv_layout(cfg | {key: False}).num_kv_heads == 4


def test_a_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes('{"num_hidden_layers": 2, "name": "Größe"}'.encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8 text, as JSON must be"):
        kv_layout(path)


# ---- the runner's order: the step's block transfers, then its copy-on-write copies ------------------
def _cow_onto_an_evicted_block(model, reverse: bool):
    """A step whose copy-on-write copy writes a block that the same step moves to the host tier.

    R0's two blocks are cached and free when A (n=2) forks; A's first decode appends into the shared
    partial block, and the only free block left to copy it into is R0's cached block 1, which is
    evicted to the host tier in the same step. Returns the engine and the step's (transfers, copies).
    """
    eng = Engine(model, num_blocks=4, block_size=4, watermark=0.0, enable_prefix_caching=True, num_cpu_blocks=4)
    seen = []
    launch = eng.runner.launch

    def spy(step):
        out = step.out
        seen.append((list(out.transfers), list(out.copies)))
        if reverse:  # the wrong order: copies first, then the transfers
            for cow in out.copies:
                eng.runner.kv_store.copy_block(cow.src_block, cow.dst_block)
            out.copies = []
        return launch(step)

    eng.runner.launch = spy
    r0 = [11, 12, 13, 14, 15, 16, 17, 18]
    eng.generate([r0], SamplingParams(max_new_tokens=1, stop_token_ids=()))
    eng.generate([[21, 22, 23, 24, 25, 26]], SamplingParams(max_new_tokens=3, n=2, stop_token_ids=()))
    return eng, r0, seen


def test_transfers_run_before_copy_on_write_copies(tiny):
    eng, r0, seen = _cow_onto_an_evicted_block(tiny, reverse=False)
    # The scenario happened: one step evicts block b to the host and copies a shared block into b.
    transfers, copies = next((t, c) for t, c in seen if any(x.src == cow.dst_block for x in t for cow in c))
    moved = next(x for x in transfers if x.direction == "to_host" and x.src == copies[0].dst_block)
    # The invariant the order relies on: no transfer of a step writes a block its copies read or write.
    for t, c in seen:
        written = {x.dst for x in t if x.direction == "to_device"}
        assert not any(cow.src_block in written or cow.dst_block in written for cow in c)
    # The host tier holds R0's block 1 as R0 computed it, not A's copy.
    want = ModelRunner(tiny, num_blocks=4, block_size=4)
    want.step([(0, r0)])
    ref_block = want.block_manager.block_table(0)[1]
    for layer in range(tiny.config.num_hidden_layers):
        torch.testing.assert_close(
            eng.runner.host_kv_store.k_cache[layer][moved.dst], want.kv_store.k_cache[layer][ref_block], rtol=0, atol=0
        )
    # And a later request on R0's prompt, served through that host block, equals one alone.
    out = eng.generate([r0 + [19]], SamplingParams(max_new_tokens=3, stop_token_ids=()))[0]
    assert eng.stats["prefix_cache_host_hit_tokens"] > 0
    assert_greedy_equal(tiny, r0 + [19], out, run_alone(tiny, r0 + [19], 3))


def test_copies_before_transfers_would_corrupt_the_host_tier(tiny):
    """The order matters: with the copy first, the host tier gets A's K/V under R0's block hash."""
    eng, r0, seen = _cow_onto_an_evicted_block(tiny, reverse=True)
    transfers, copies = next((t, c) for t, c in seen if any(x.src == cow.dst_block for x in t for cow in c))
    moved = next(x for x in transfers if x.direction == "to_host" and x.src == copies[0].dst_block)
    want = ModelRunner(tiny, num_blocks=4, block_size=4)
    want.step([(0, r0)])
    ref = want.kv_store.k_cache[0][want.block_manager.block_table(0)[1]]
    assert not torch.equal(eng.runner.host_kv_store.k_cache[0][moved.dst], ref)
