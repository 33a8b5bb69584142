"""Chapter 7's prefix-caching checks: the references agree with the package, right answers pass, mistakes get a hint."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvcourse.exercises import ExerciseError
from kvcourse.exercises import ch07_prefix as ch07
from kvcourse.paged import PrefixCachingBlockManager, hash_block_tokens


# ---- the references -----------------------------------------------------------------------------
def test_block_hashes_reference_equals_the_block_manager():
    rng = random.Random(2)
    for _ in range(100):
        bs = rng.choice([1, 2, 4, 16])
        tokens = [rng.randrange(500) for _ in range(rng.randint(0, 5 * bs))]
        salt = rng.choice([None, "alice"])
        bm = PrefixCachingBlockManager(8, bs)
        bm.allocate("s", len(tokens))
        bm.cache_full_blocks("s", tokens, len(tokens), salt)
        table = bm.block_table("s")[: len(tokens) // bs]
        assert ch07._block_hashes(tokens, bs, salt, hash_block_tokens) == [bm.cached_block(b).block_hash for b in table]


def test_block_hashes_reference_by_hand():
    h = ch07._readable_hash
    assert ch07._block_hashes([1, 2, 3, 4, 5], 2, "t", h) == [
        ("h", None, (1, 2), ("t",)),
        ("h", ("h", None, (1, 2), ("t",)), (3, 4), ()),
    ]


def test_lru_reference_equals_the_block_manager():
    """take: a sequence of one full block of fresh tokens; free: it ends; hit: a sequence finds that block cached."""
    rng = random.Random(4)
    for _ in range(100):
        n = rng.randint(1, 6)
        ops = ch07._lru_ops(rng, n, rng.randint(4, 30))
        bm, taken, owner, contents = PrefixCachingBlockManager(n, 1), [], {}, {}
        for i, op in enumerate(ops):
            if op[0] == "take":
                (b,) = bm.allocate(i, 1)
                bm.cache_full_blocks(i, [i], 1)
                taken.append(b)
                owner[b], contents[b] = i, [i]
            elif op[0] == "free":
                bm.free(owner.pop(op[1]))
            else:
                hit = bm.find_cached_blocks(contents[op[1]])
                assert hit == [op[1]]
                bm.allocate(i, 1, hit)
                owner[op[1]] = i
        assert taken == ch07._lru_takes(n, ops), (n, ops)


# ---- right answers pass --------------------------------------------------------------------------
def right_block_hashes(token_ids, block_size, cache_salt, hash_fn):
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        parent = hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


def right_lru_takes(num_blocks, ops):
    queue, out = list(range(num_blocks)), []
    for op in ops:
        if op[0] == "take":
            out.append(queue.pop(0))
        elif op[0] == "free":
            queue.append(op[1])
        else:
            queue.remove(op[1])
    return out


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_right_answers_pass(seed):
    assert ch07.check_block_hashes(right_block_hashes, seed=seed)
    assert ch07.check_lru_takes(right_lru_takes, seed=seed)


def test_handing_in_the_package_is_refused():
    def uses_it(token_ids, block_size, cache_salt, hash_fn):
        return hash_block_tokens(None, token_ids, ())

    with pytest.raises(ExerciseError, match="hash_block_tokens"):
        ch07.check_block_hashes(uses_it)


# ---- wrong answers get their hint ----------------------------------------------------------------
def hashes_with(chain=True, partial=False, salt_everywhere=False, none_key=False, no_salt=False):
    def block_hashes(token_ids, block_size, cache_salt, hash_fn):
        out, parent = [], None
        end = -(-len(token_ids) // block_size) if partial else len(token_ids) // block_size
        for i in range(end):
            salted = (i == 0 or salt_everywhere) and not no_salt and (cache_salt is not None or none_key)
            h = hash_fn(parent if chain else None, token_ids[i * block_size : (i + 1) * block_size],
                        (cache_salt,) if salted else ())  # fmt: skip
            out.append(h)
            parent = h
        return out

    return block_hashes


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (hashes_with(chain=False), "Chain the hashes"),
        (hashes_with(partial=True), "Only full blocks"),
        (hashes_with(salt_everywhere=True), "first block's extra keys only"),
        (hashes_with(none_key=True), r"not \(None,\)"),
        (hashes_with(no_salt=True), "two tenants share blocks"),
        (lambda t, bs, s, h: [h(None, t, ())], "For each full block"),
        (lambda t, bs, s, h: "abc", "should return a list"),
    ],
)
def test_block_hashes_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch07.check_block_hashes(wrong)


def lru_with(hit="remove", free="tail", take="head"):
    def lru_takes(num_blocks, ops):
        queue, out = OrderedDict.fromkeys(range(num_blocks)), []
        for op in ops:
            if op[0] == "take":
                if not queue:
                    break
                b = next(iter(queue)) if take == "head" else next(reversed(queue))
                del queue[b]
                out.append(b)
            elif op[0] == "free":
                queue[op[1]] = None
                queue.move_to_end(op[1], last=free == "tail")
            elif hit == "remove":
                queue.pop(op[1], None)
            elif hit == "touch" and op[1] in queue:
                queue.move_to_end(op[1])
        return out

    return lru_takes


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lru_with(hit="keep"), "A hit takes the block out of the free queue"),
        (lru_with(hit="touch"), "does not move the block to the recently used end"),
        (lru_with(free="head"), "Evict from the head"),
        (lru_with(take="tail"), "Evict from the head"),
        (lambda n, ops: list(range(sum(op[0] == "take" for op in ops))), "Keep the free blocks in order"),
        (lambda n, ops: None, "list of block ids"),
    ],
)
def test_lru_takes_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch07.check_lru_takes(wrong)
