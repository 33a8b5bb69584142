"""The prefix cache's swappable lookup (``find_longest_cache_hit``): the engine admits with it, and checks its answer."""

from __future__ import annotations

import random

import pytest

import kvcourse
from kvcourse.paged import PrefixCachingBlockManager, hash_block_tokens
from kvcourse.sequence import Sequence
from kvcourse.serving import Engine

from .test_serving_engine import VOCAB, tiny  # noqa: F401  (tiny is a fixture)


def walk(token_ids, block_size, cache_salt, hash_fn, get_cached_block):
    """A right lookup, written here: chained hashes of token_ids[:-1]'s full blocks until the first miss."""
    out, parent = [], None
    usable = token_ids[:-1]
    for start in range(0, len(usable) - block_size + 1, block_size):
        parent = hash_fn(parent, usable[start : start + block_size], (cache_salt,) if start == 0 and cache_salt else ())
        block = get_cached_block(parent)
        if block is None:
            return out
        out.append(block)
    return out


def serve(model, rounds, lookup, **engine):
    eng = Engine(
        model, **{"num_blocks": 48, "block_size": 4, "max_num_batched_tokens": 32, **engine}, enable_prefix_caching=True
    )
    eng.block_manager.find_longest_cache_hit = lookup
    outs = [eng.generate(prompts, max_new_tokens=new, cache_salt=salt) for prompts, new, salt in rounds]
    return eng, outs


def chat_rounds(seed):
    rnd = random.Random(seed)
    shared = [rnd.randrange(4, VOCAB) for _ in range(rnd.choice([8, 11, 16]))]
    rounds = []
    for _ in range(5):
        prompts = [
            shared[: rnd.randint(1, len(shared))] + [rnd.randrange(4, VOCAB) for _ in range(rnd.randint(0, 9))]
            for _ in range(rnd.randint(1, 3))
        ]
        rounds.append((prompts, rnd.randint(1, 6), rnd.choice([None, None, "alice"])))
    rounds.append(([shared], 2, None))
    rounds.append(([shared[:8]], 2, None))  # an exact number of blocks, all cached
    return rounds


@pytest.mark.parametrize("seed", range(4))
def test_a_right_lookup_gives_the_packages_hits_and_every_output_as_if_alone(tiny, seed):  # noqa: F811
    rounds = chat_rounds(seed)
    mine, outs = serve(tiny, rounds, walk, num_blocks=24 if seed % 2 else 48)  # odd seeds: evictions too
    ref, ref_outs = serve(tiny, rounds, None, num_blocks=24 if seed % 2 else 48)
    assert mine.block_manager.admissions == ref.block_manager.admissions
    assert mine.stats["prefix_cache_hit_tokens"] == ref.stats["prefix_cache_hit_tokens"] > 0
    assert outs == ref_outs
    for (prompts, new, _), got in zip(rounds, outs):
        assert got == [kvcourse.generate(tiny, p, max_new_tokens=new) for p in prompts]


def test_a_lookup_that_finds_nothing_computes_everything(tiny):  # noqa: F811
    eng, _ = serve(tiny, chat_rounds(0), lambda *args: [])
    assert eng.stats["prefix_cache_hit_tokens"] == 0
    assert all(a.num_hit_tokens == 0 for a in eng.block_manager.admissions)


def test_a_lookup_that_does_not_stop_one_token_short_is_refused(tiny):  # noqa: F811
    def whole(token_ids, block_size, cache_salt, hash_fn, get_cached_block):
        return walk(token_ids + [0], block_size, cache_salt, hash_fn, get_cached_block)  # all of token_ids

    prompt = list(range(10, 18))  # two blocks of 4
    eng = Engine(tiny, num_blocks=16, block_size=4, enable_prefix_caching=True)
    eng.block_manager.find_longest_cache_hit = whole
    eng.generate([prompt], max_new_tokens=1)
    with pytest.raises(ValueError, match="stop one token short"):
        eng.generate([prompt], max_new_tokens=1)


def admit(bm, tokens, seq_id="s"):
    return bm.admit(Sequence(seq_id, tokens), 64)


def test_the_answer_is_checked_for_what_would_break_the_engine():
    bm = PrefixCachingBlockManager(8, 2)
    table = bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4)
    for answer, error, match in [
        ("01", TypeError, "list of block ids"),
        ([7], ValueError, "not a cached block"),
        ([True], ValueError, "not a cached block"),
        ([table[0], table[0]], ValueError, "twice"),
    ]:
        bm.find_longest_cache_hit = lambda *args, answer=answer: answer
        with pytest.raises(error, match=match):
            admit(bm, [1, 2, 3, 4, 5])
    assert "s" not in bm and bm.admissions == []  # nothing changed
    bm.find_longest_cache_hit = lambda *args: table
    assert admit(bm, [1, 2, 3, 4, 5]) == (4, 1)  # trusted, as vLLM trusts its hashes
    with pytest.raises(TypeError, match="find_longest_cache_hit"):
        PrefixCachingBlockManager(8, 2, find_longest_cache_hit=3)


def test_the_lookup_gets_the_pools_hashes_of_full_blocks_only():
    bm = PrefixCachingBlockManager(8, 2)
    table = bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4, "t")
    seen = {}

    def spy(token_ids, block_size, cache_salt, hash_fn, get_cached_block):
        seen.update(tokens=token_ids, bs=block_size, salt=cache_salt)
        h0 = hash_fn(None, (1, 2), ("t",))
        assert h0 == hash_block_tokens(None, (1, 2), ("t",)) and get_cached_block(h0) == table[0]
        assert get_cached_block(hash_fn(None, (1, 2), ())) is None  # unsalted: not cached
        with pytest.raises(ValueError, match="full block of 2 tokens"):
            hash_fn(h0, (3,), ())
        return [table[0]]

    bm.find_longest_cache_hit = spy
    assert bm.admit(Sequence("s", [1, 2, 3, 4, 5]), 64, cache_salt="t") == (2, 3)
    assert seen == {"tokens": [1, 2, 3, 4, 5], "bs": 2, "salt": "t"}
    assert bm.admissions[-1] == ("s", 5, 5, 2)


def test_the_admission_log_shows_a_preempted_request_coming_back_on_its_cached_blocks(tiny):  # noqa: F811
    rnd = random.Random(3)
    prompts = [[rnd.randrange(4, VOCAB) for _ in range(14)] for _ in range(3)]
    eng = Engine(
        tiny, num_blocks=12, block_size=4, max_num_batched_tokens=32, enable_prefix_caching=True, watermark=0.0
    )
    params = kvcourse.SamplingParams(max_new_tokens=14, stop_token_ids=())
    outs = eng.generate(prompts, params)
    assert outs == [kvcourse.generate(tiny, p, sampling_params=params) for p in prompts]
    back = [a for a in eng.block_manager.admissions if a.num_tokens > a.num_prompt_tokens]
    assert eng.stats["preemptions"] >= 1 and len(back) == eng.stats["preemptions"]
    assert all(a.num_hit_tokens <= a.num_tokens - 1 for a in back)
    assert sum(a.num_hit_tokens for a in back) > 0  # its freed blocks kept their hashes: a hit
