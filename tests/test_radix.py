"""The radix tree of cached prefixes (SGLang's RadixAttention): matching to the token, splits, locks, LRU leaves."""

from __future__ import annotations

import random

import pytest

from kvcourse.paged.radix import RadixCache, longest_prefix_first


def paths(cache: RadixCache) -> set[tuple[int, ...]]:
    """Every cached sequence, spelled from the root to each leaf."""
    out, stack = set(), [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        spelled = prefix + node.key
        if node.is_leaf and node is not cache.root:
            out.add(spelled)
        stack.extend((c, spelled) for c in node.children.values())
    return out


def test_a_match_is_to_the_token_not_to_a_block():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4, 5]) == 0
    assert cache.match_prefix([1, 2, 3, 9])[0] == 3
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0] == 5
    assert cache.match_prefix([2, 3])[0] == 0
    assert cache.match_prefix([])[0] == 0


def test_insert_shares_the_common_path_and_counts_each_token_once():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    assert cache.insert([1, 2, 7, 8, 9]) == 2  # the hit: its first two tokens
    assert len(cache) == 4 + 3
    assert paths(cache) == {(1, 2, 3, 4), (1, 2, 7, 8, 9)}
    (mid,) = cache.root.children.values()
    assert mid.key == (1, 2) and sorted(c.key for c in mid.children.values()) == [(3, 4), (7, 8, 9)]


def test_a_match_inside_an_edge_splits_it_there():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    n, node = cache.match_prefix([1, 2, 9])
    assert n == 2 and node.key == (1, 2) and list(node.children.values())[0].key == (3, 4)
    assert paths(cache) == {(1, 2, 3, 4)} and len(cache) == 4  # a split adds no token


def test_eviction_takes_the_least_recently_used_leaf_first():
    cache = RadixCache()
    cache.insert([1, 2, 3])  # a
    cache.insert([1, 2, 4, 5])  # b
    cache.insert([7, 8])  # c
    cache.match_prefix([1, 2, 3])  # a used again: b, then c, are the least recently used
    assert cache.evict(1) == 2 and paths(cache) == {(1, 2, 3), (7, 8)}  # b's own suffix (4, 5): a whole leaf
    assert cache.evict(1) == 2 and paths(cache) == {(1, 2, 3)}  # then c
    assert cache.evict(10) == 3 and len(cache) == 0  # (3), then (1, 2) once it is a leaf
    assert cache.num_evicted_tokens == 7


def test_a_locked_prefix_is_never_evicted_and_unlock_releases_it():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    cache.insert([5, 6])
    n, node = cache.match_prefix([1, 2, 3, 9])
    cache.lock(node)  # a running request reads [1, 2, 3]
    assert cache.num_evictable_tokens == 1 + 2  # (4) and (5, 6)
    assert cache.evict(100) == 3
    assert paths(cache) == {(1, 2, 3)}
    cache.unlock(node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)  # twice
    assert cache.evict(100) == 3 and len(cache) == 0
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.lock(node)  # evicted


def test_only_the_node_that_was_locked_can_be_unlocked():
    # issue 31: unlocking an ancestor of a locked node (it holds the lock too) left lock_ref at -1 on the path
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    _, leaf = cache.match_prefix([1, 2, 3, 4])
    cache.lock(leaf)
    _, mid = cache.match_prefix([1, 2])  # splits the edge: (1, 2) then (3, 4), both locked through the leaf
    assert mid.lock_ref == 1
    with pytest.raises(ValueError, match="not locked by a request"):
        cache.unlock(mid)
    assert mid.lock_ref == 1 and leaf.lock_ref == 1  # the refusal changed nothing
    cache.unlock(leaf)
    assert mid.lock_ref == 0 and leaf.lock_ref == 0 and cache.evict(10) == 4
    other = RadixCache()
    other.insert([5])
    for bad, exc, word in (
        (None, TypeError, "RadixNode"),
        ("node", TypeError, "RadixNode"),
        (other.match_prefix([5])[1], ValueError, "another RadixCache"),
    ):
        with pytest.raises(exc, match=word):
            cache.lock(bad)
        with pytest.raises(exc, match=word):
            cache.unlock(bad)
    cache.lock(cache.root)  # an empty match locks the root: harmless, and it can be unlocked
    cache.unlock(cache.root)


@pytest.mark.parametrize(
    ("value", "exc"), [(float("nan"), TypeError), (-3, ValueError), (2.5, TypeError), ("1", TypeError)]
)
def test_evict_refuses_what_is_not_a_count_of_tokens(value, exc):
    cache = RadixCache()
    cache.insert([1, 2])
    with pytest.raises(exc, match="num_tokens"):
        cache.evict(value)
    assert len(cache) == 2


def test_capacity_evicts_to_make_room_and_keeps_the_path_being_extended():
    cache = RadixCache(capacity=6)
    cache.insert([1, 2, 3, 4])
    cache.insert([9, 9])
    assert cache.insert([1, 2, 3, 4, 5, 6]) == 4  # needs 2 more: the older leaf (9, 9) goes, not (1..4)
    assert paths(cache) == {(1, 2, 3, 4, 5, 6)} and len(cache) == 6
    n, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(node)
    cache.insert([7, 7, 7])  # nothing evictable: nothing added
    assert len(cache) == 6 and cache.match_prefix([7])[0] == 0


def test_the_tree_agrees_with_a_list_of_sequences():
    """Random inserts and lookups: the match is the longest common prefix with any cached sequence."""
    rng = random.Random(0)
    cache, seqs = RadixCache(), []
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randint(0, 8))]
        want = max(
            (next((i for i, (a, b) in enumerate(zip(s, seq)) if a != b), min(len(s), len(seq))) for s in seqs),
            default=0,
        )
        if rng.random() < 0.5:
            assert cache.match_prefix(seq)[0] == want
        else:
            assert cache.insert(seq) == want
            seqs.append(seq)
    distinct = {tuple(s[:i]) for s in seqs for i in range(1, len(s) + 1)}  # each cached prefix's last token, once
    assert len(cache) == len(distinct)


def test_longest_prefix_first_orders_by_cached_prefix_and_keeps_arrival_order_on_ties():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5, 6])
    waiting = [[9, 9], [1, 2, 8], [1, 2, 3, 4, 5, 7], [7], [1, 2, 3]]
    assert longest_prefix_first(cache, waiting) == [2, 4, 1, 0, 3]


def test_bad_input():
    with pytest.raises(ValueError, match="capacity"):
        RadixCache(capacity=-1)
    cache = RadixCache()
    with pytest.raises(TypeError, match="token_ids"):
        cache.insert("abc")
    with pytest.raises(TypeError, match="token_ids"):
        cache.match_prefix([1, 2.0])


def test_format_shows_each_edge_by_depth_with_its_locks():
    cache = RadixCache()
    cache.insert([1, 2, 3])
    cache.insert([1, 2, 4])
    cache.lock(cache.match_prefix([1, 2, 3])[1])
    assert cache.format() == "(1, 2)  (2 tokens, locked by 1)\n    (3,)  (1 tokens, locked by 1)\n    (4,)  (1 tokens)"
