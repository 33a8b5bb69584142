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
            h = hash_fn(
                parent if chain else None,
                token_ids[i * block_size : (i + 1) * block_size],
                (cache_salt,) if salted else (),
            )
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


def lru_as_a_list(take_tail=False, free_head=False):
    """The natural wrong answers of issue 47: a list whose hit is ``list.remove``, which crashes when a wrong
    policy has already handed the block out."""

    def lru_takes(num_blocks, ops):
        queue, out = list(range(num_blocks)), []
        for op in ops:
            if op[0] == "take":
                out.append(queue.pop(-1 if take_tail else 0))
            elif op[0] == "free":
                queue.insert(0 if free_head else len(queue), op[1])
            else:
                queue.remove(op[1])
        return out

    return lru_takes


@pytest.mark.parametrize("wrong", [lru_as_a_list(take_tail=True), lru_as_a_list(free_head=True)])
def test_lru_takes_a_crash_at_a_hit_gets_the_mistakes_hint(wrong):
    with pytest.raises(ExerciseError) as exc:
        ch07.check_lru_takes(wrong)
    message = str(exc.value)
    assert "raised ValueError at op" in message and "was not in your free queue" in message, message
    assert "every hit in these ops names a block in the free queue" in message
    assert exc.value.hint.startswith("Evict from the head"), exc.value.hint
    assert ch07.check_lru_takes(lru_as_a_list())  # the same code with the rules right passes


def test_lru_takes_a_crash_elsewhere_is_reported_as_a_crash():
    def crashes(num_blocks, ops):
        raise KeyError("somewhere else")

    with pytest.raises(ExerciseError, match=r"raised KeyError: 'somewhere else'"):
        ch07.check_lru_takes(crashes)


# ---- the lookup the engine admits with -----------------------------------------------------------
def test_lookup_reference_equals_the_block_managers_own_lookup():
    """On caches filled by the real pool (salts, evictions), the reference finds find_cached_blocks(tokens[:-1]).

    (Two sequences that computed the same prefix side by side both stay cached; there the pool's own lookup, which
    checks each hit's parent entry, can stop where a lookup by hash alone goes on, on blocks of equal contents.)"""
    rng = random.Random(6)
    for _ in range(60):
        bs = rng.choice([1, 2, 4])
        bm = PrefixCachingBlockManager(rng.randint(4, 12), bs)
        base = [rng.randrange(5) for _ in range(rng.randint(1, 12))]
        for i in range(rng.randint(1, 5)):
            tokens = base[: rng.randint(1, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 4))]
            salt = rng.choice([None, "alice"])
            hits = bm.find_cached_blocks(tokens[:-1], salt)  # admitted as the engine does: on its hits
            if bm.blocks_to_allocate(len(tokens), hits) <= bm.num_free_blocks:
                bm.allocate(i, len(tokens), hits)
                bm.cache_full_blocks(i, tokens, len(tokens), salt)
                bm.free(i)
        query, salt = base[: rng.randint(1, len(base))], rng.choice([None, "alice"])
        want = bm.find_cached_blocks(query[:-1], salt)
        assert ch07._find_longest_cache_hit(query, bs, salt, bm._full_block_hash, bm.get_cached_block) == want


def right_lookup(token_ids, block_size, cache_salt, hash_fn, get_cached_block):
    """Written independently of the reference: slices first, then walks."""
    blocks = [tuple(token_ids[i : i + block_size]) for i in range(0, len(token_ids) - 1, block_size)]
    blocks = [b for b in blocks if len(b) == block_size and blocks.index(b) * block_size + block_size < len(token_ids)]
    found, parent = [], None
    for i, tokens in enumerate(blocks):
        parent = hash_fn(parent, tokens, () if i or cache_salt is None else (cache_salt,))
        hit = get_cached_block(parent)
        if hit is None:
            break
        found.append(hit)
    return found


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_right_lookup_passes(seed):
    assert ch07.check_prefix_lookup(right_lookup, seed=seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_right_lookup_passes_in_the_engine_and_the_reference_gives_the_solo_tokens(model_on, seed):
    import kvcourse

    model = model_on
    assert ch07.check_prefix_lookup(right_lookup, model, seed=seed)
    rounds = ch07._engine_rounds(seed)
    outs, hits = ch07._serve(model, rounds, None)
    prompts = [p for ps, _ in rounds for p in ps]
    assert outs == [kvcourse.generate(model, p, max_new_tokens=3) for p in prompts]  # what the check relies on
    assert [h for _, h in hits] == [0, 16, 16, 24, 0, 16, 0]  # the instruction's 4 blocks of 4; 6 of the exact one


def test_handing_in_the_package_to_the_lookup_is_refused():
    def uses_it(token_ids, block_size, cache_salt, hash_fn, get_cached_block):
        return PrefixCachingBlockManager(4, block_size).find_cached_blocks(token_ids[:-1])

    with pytest.raises(ExerciseError, match="PrefixCachingBlockManager"):
        ch07.check_prefix_lookup(uses_it)


def lookup_with(stop=1, chain=True, salt="first", at_miss="break", ceil=False):
    """Wrong lookups, each with one typical mistake (``stop``: tokens left out at the end, 0 or a block)."""

    def lookup(token_ids, block_size, cache_salt, hash_fn, get_cached_block):
        end = len(token_ids) - (block_size if stop == "block" else stop)
        n = -(-end // block_size) if ceil else end // block_size
        found, parent = [], None
        for i in range(max(n, 0)):
            if salt == "first":
                extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
            elif salt == "every":
                extra = (cache_salt,) if cache_salt is not None else ()
            elif salt == "none_key":
                extra = (cache_salt,) if i == 0 else ()
            else:
                extra = ()
            h = hash_fn(
                parent if chain else None, tuple(token_ids[i * block_size : min(end, (i + 1) * block_size)]), extra
            )
            parent = h
            block = get_cached_block(h)
            if block is None:
                if at_miss == "break":
                    break
                continue
            found.append(block)
        return found

    return lookup


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (lookup_with(stop=0), "Stop one token short: look up"),
        (lookup_with(stop="block"), r"Stop one \*token\* short, not one block"),
        (lookup_with(chain=False), "Chain the hashes"),
        (lookup_with(salt="forgotten"), r"Put cache_salt in the first block's extra keys"),
        (lookup_with(salt="every"), "first block's extra keys only"),
        (lookup_with(salt="none_key"), r"not \(None,\)"),
        (lookup_with(at_miss="continue"), "Stop at the first miss"),
        (lookup_with(ceil=True), "Only full blocks are cached"),
        (lambda t, bs, s, h, g: [g(h(None, tuple(t[:bs]), ()))], "For each full block"),
        (lambda t, bs, s, h, g: None, "should return a list"),
    ],
)
def test_lookup_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch07.check_prefix_lookup(wrong)


def test_a_lookup_right_on_the_cases_but_wrong_in_the_engine_fails_on_its_outputs(model):
    """After the 45 small cases, it swaps the last hit for the block another prompt cached at the same place: the
    same number of hits, other K/V. (Reordering the right blocks would not do: each key carries its position in its
    rotation, and every cached token is visible to the new ones, so attention does not see the order.)"""
    calls = []

    def swaps(token_ids, block_size, cache_salt, hash_fn, get_cached_block):
        calls.append(list(token_ids))
        found = right_lookup(token_ids, block_size, cache_salt, hash_fn, get_cached_block)
        n = len(found) * block_size
        if len(calls) <= 45 or not found:
            return found
        for other in calls[45:]:
            if other[:n] != token_ids[:n] and len(other) > n:
                parent = None
                for i in range(len(found)):
                    extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
                    parent = hash_fn(parent, tuple(other[i * block_size : (i + 1) * block_size]), extra)
                block = get_cached_block(parent)
                if block is not None and block not in found:
                    return found[:-1] + [block]
        return found

    with pytest.raises(ExerciseError, match="prompt .*'s tokens"):
        ch07.check_prefix_lookup(swaps, model)
