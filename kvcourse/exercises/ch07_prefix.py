"""Checks for chapter 7's prefix-caching exercises: the learner writes a block hash chain and an LRU eviction.

1. :func:`check_block_hashes` -- the chained hashes of a sequence's full blocks, with a tenant's salt.
2. :func:`check_lru_takes` -- which blocks a free block queue hands out, least recently used first.

Each check runs the learner's function on hidden cases seeded from the check's ``seed`` argument and
compares it with a private reference that ``tests/test_exercises_ch07_prefix.py`` tests against
:class:`kvcourse.paged.PrefixCachingBlockManager`. Wrong answers are compared with the typical
mistakes (:class:`~kvcourse.exercises._core.Diagnosis`) to say which one they look like.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ..paged.prefix_cache import FreeBlockQueue, PrefixCachingBlockManager, hash_block_tokens
from ._core import (
    call_learner,
    case_rng,
    CheckResult,
    describe,
    Diagnosis,
    ExerciseError,
    passed,
    refuse_references,
    wrap_checks,
)

__all__ = ["check_block_hashes", "check_lru_takes"]


def _same(a, b) -> bool:
    return a == b


# --- Exercise 1: a block hash chain --------------------------------------------------------------
def _readable_hash(parent, token_ids, extra_keys) -> tuple:
    """The hash the check hands the learner: a tuple that shows what went into it, so a wrong chain
    can be told apart from a right one (a real hash would only say "different")."""
    return ("h", parent, tuple(token_ids), tuple(extra_keys))


def _block_hashes(token_ids, block_size, cache_salt, hash_fn, *, chain=True, partial=False, salt_everywhere=False,
                  salt_none_key=False, salt_forgotten=False) -> list:
    """The reference (every flag off), and the typical mistakes (one flag on)."""
    hashes, parent = [], None
    end = -(-len(token_ids) // block_size) if partial else len(token_ids) // block_size
    for i in range(end):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        first = i == 0 or salt_everywhere
        if salt_forgotten or not first or (cache_salt is None and not salt_none_key):
            extra = ()
        else:
            extra = (cache_salt,)
        h = hash_fn(parent if chain else None, tokens, extra)
        hashes.append(h)
        parent = h
    return hashes


_HASH_MISTAKES = [
    ("Chain the hashes: block i's hash takes block i-1's hash as its parent (None only for block 0), so it stands "
     "for the whole prefix; the same tokens after a different prefix have different K/V.",
     lambda *case: _block_hashes(*case, chain=False)),
    ("Only full blocks get a hash: a partly filled last block is still being written, and cannot be shared.",
     lambda *case: _block_hashes(*case, partial=True)),
    ("The salt goes into the first block's extra keys only: every later hash inherits it through the chain.",
     lambda *case: _block_hashes(*case, salt_everywhere=True)),
    ("Without a salt the extra keys are empty, (), not (None,).",
     lambda *case: _block_hashes(*case, salt_none_key=True)),
    ("Put cache_salt into the first block's extra keys, (cache_salt,): without it two tenants share blocks.",
     lambda *case: _block_hashes(*case, salt_forgotten=True)),
]


def _hash_cases(rng) -> list[tuple[list[int], int, str | None]]:
    cases = [
        ([1, 2, 3, 4, 5, 6, 7, 8], 4, None),  # two full blocks
        ([1, 2, 3, 4, 1, 2, 3, 4], 4, None),  # the same tokens twice: different hashes
        ([1, 2, 3, 4, 5, 6], 4, None),  # a partial block: no hash
        ([1, 2, 3], 4, None),  # no full block at all
        ([5, 6, 7, 8, 9, 10], 2, "tenant-a"),
    ]
    for _ in range(25):
        bs = rng.choice([1, 2, 4, 16])
        cases.append(([rng.randrange(50_000) for _ in range(rng.randint(0, 5 * bs))], bs,
                      rng.choice([None, "alice", "bob"])))  # fmt: skip
    return cases


def check_block_hashes(block_hashes: Callable, seed: int = 0) -> CheckResult:
    """``block_hashes(token_ids, block_size, cache_salt, hash_fn)`` -> one hash per full block, in order,
    each ``hash_fn(parent_block_hash, block_token_ids, extra_keys)``."""
    refuse_references(block_hashes, {"PrefixCachingBlockManager": PrefixCachingBlockManager,
                                     "hash_block_tokens": hash_block_tokens}, "chain the hashes yourself.")  # fmt: skip
    diagnosis = Diagnosis(_HASH_MISTAKES, same=_same, default=(
        "For each full block i: hash_fn(hash of block i-1 or None, its block_size tokens, (cache_salt,) for block 0 "
        "with a salt, else ())."))  # fmt: skip
    for tokens, bs, salt in _hash_cases(case_rng("check_block_hashes", seed)):
        label = f"block_hashes({describe(tokens, limit=6)}, block_size={bs}, cache_salt={salt!r})"
        got = call_learner("block_hashes", block_hashes, list(tokens), bs, salt, _readable_hash)
        if not isinstance(got, list):
            raise ExerciseError(f"{label} should return a list (one hash per full block), got {describe(got)}",
                                case=label)  # fmt: skip
        want = _block_hashes(tokens, bs, salt, _readable_hash)
        if got != want:
            diagnosis.record(label, (tokens, bs, salt, _readable_hash), got, want)
    diagnosis.raise_if_wrong()
    return passed("each full block's hash chains from its parent's, and a tenant's salt reaches every block.")


# --- Exercise 2: an LRU eviction -----------------------------------------------------------------
def _lru_takes(num_blocks: int, ops: list[tuple]) -> list[int]:
    """The blocks the ``("take",)`` ops get from a free block queue that starts as 0, 1, ..., hands out
    its head, puts a ``("free", b)`` block at its tail (it keeps its K/V: a cached block), and lets a
    ``("hit", b)`` take a free block out of the middle (reused, so not evictable while in use)."""
    queue, taken = FreeBlockQueue(range(num_blocks)), []
    for op in ops:
        if op[0] == "take":
            taken.append(queue.popleft())
        elif op[0] == "free":
            queue.append(op[1])
        else:
            queue.remove(op[1])
    return taken


def _lru_wrong(num_blocks, ops, *, hit="remove", free="tail", take="head") -> list[int]:
    queue, taken = OrderedDict.fromkeys(range(num_blocks)), []
    for op in ops:
        if op[0] == "take":
            if not queue:
                return taken
            b = next(iter(queue)) if take == "head" else next(reversed(queue))
            del queue[b]
            taken.append(b)
        elif op[0] == "free":
            if free == "tail":
                queue[op[1]] = None
                queue.move_to_end(op[1])
            elif free == "head":
                queue[op[1]] = None
                queue.move_to_end(op[1], last=False)
            else:  # "keep": an ordered set that leaves a block freed before at its old place
                queue.setdefault(op[1], None)
        elif hit == "remove":
            queue.pop(op[1], None)  # a wrong policy may have handed this block out already
        elif hit == "touch" and op[1] in queue:  # a classic LRU cache's "move to most recent": but it is in use
            queue.move_to_end(op[1])
    return taken


_LRU_MISTAKES = [
    ("A hit takes the block out of the free queue: it is in use now, and a block in use must never be handed out "
     "(its owner's K/V would be overwritten).", lambda n, ops: _lru_wrong(n, ops, hit="keep")),
    ("A hit does not move the block to the recently used end: it leaves the queue until its owners free it, and "
     "only then goes to the tail.", lambda n, ops: _lru_wrong(n, ops, hit="touch")),
    ("Evict from the head (least recently used) and free to the tail: taking the most recently freed block throws "
     "away the prefix most likely to be asked for again.", lambda n, ops: _lru_wrong(n, ops, free="head")),
    ("Evict from the head (least recently used) and free to the tail: taking the most recently freed block throws "
     "away the prefix most likely to be asked for again.", lambda n, ops: _lru_wrong(n, ops, take="tail")),
]


def _lru_ops(rng, num_blocks: int, length: int) -> list[tuple]:
    """A valid history: takes only when a block is free, frees only blocks in use, hits only free blocks
    that hold something (taken once before)."""
    free, in_use, ops = list(range(num_blocks)), [], []
    filled: set[int] = set()
    for _ in range(length):
        cached_free = [b for b in free if b in filled]
        choice = rng.choice(["take", "take", "free", "free", "hit"])
        if choice == "free" and in_use:
            b = in_use.pop(rng.randrange(len(in_use)))
            free.append(b)
            ops.append(("free", b))
        elif choice == "hit" and cached_free:
            b = rng.choice(cached_free)
            free.remove(b)
            in_use.append(b)
            ops.append(("hit", b))
        elif free:
            b = free.pop(0)
            filled.add(b)
            in_use.append(b)
            ops.append(("take",))
    return ops


def _lru_cases(rng) -> list[tuple[int, list[tuple]]]:
    cases = [
        (3, [("take",), ("take",), ("free", 0), ("free", 1), ("take",), ("take",)]),  # 2 (empty), then 0
        (2, [("take",), ("take",), ("free", 1), ("free", 0), ("hit", 1), ("take",)]),  # 1 is in use: 0
        (3, [("take",), ("take",), ("free", 0), ("free", 1), ("hit", 0), ("free", 0), ("take",), ("take",)]),
    ]
    for _ in range(25):
        n = rng.randint(1, 6)
        cases.append((n, _lru_ops(rng, n, rng.randint(4, 30))))
    return cases


def check_lru_takes(lru_takes: Callable, seed: int = 0) -> CheckResult:
    """``lru_takes(num_blocks, ops)`` -> the block each ``("take",)`` op gets, in order.

    The queue starts as ``0, 1, ..., num_blocks - 1``; ops are ``("take",)``, ``("free", block)``,
    ``("hit", block)``.
    """
    refuse_references(lru_takes, {"FreeBlockQueue": FreeBlockQueue,
                                  "PrefixCachingBlockManager": PrefixCachingBlockManager},
                      "keep the queue yourself (an OrderedDict or a list will do).")  # fmt: skip
    diagnosis = Diagnosis(_LRU_MISTAKES, same=_same, default=(
        "Keep the free blocks in order: take from the head, put a freed block at the tail, and remove a hit block "
        "from wherever it is."))  # fmt: skip
    for n, ops in _lru_cases(case_rng("check_lru_takes", seed)):
        label = f"lru_takes({n}, {describe(ops, limit=5)})"
        got = call_learner("lru_takes", lru_takes, n, [tuple(op) for op in ops])
        if not isinstance(got, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in got):
            raise ExerciseError(f"{label} should return a list of block ids, got {describe(got)}", case=label)
        want = _lru_takes(n, ops)
        if got != want:
            diagnosis.record(label, (n, ops), got, want)
    diagnosis.raise_if_wrong()
    return passed("cached blocks leave in the order they were last freed; a block in use is never evicted.")


wrap_checks(globals())  # an unwritten answer is reported ("Not done yet"), not raised: see _core.reports_unfinished
