"""Checks for chapter 7's prefix-caching exercises: the learner writes a block hash chain, an LRU eviction,
and the lookup the engine admits requests with.

1. :func:`check_block_hashes` -- the chained hashes of a sequence's full blocks, with a tenant's salt.
2. :func:`check_lru_takes` -- which blocks a free block queue hands out, least recently used first.
3. :func:`check_prefix_lookup` -- the longest cached prefix of a prompt, block by block, one token short;
   with the model, the real :class:`~kvcourse.serving.Engine` then admits requests with it.

Each check runs the learner's function on hidden cases seeded from the check's ``seed`` argument and
compares it with a private reference that ``tests/test_exercises_ch07_prefix.py`` tests against
:class:`kvcourse.paged.PrefixCachingBlockManager`. Wrong answers are compared with the typical
mistakes (:class:`~kvcourse.exercises._core.Diagnosis`) to say which one they look like.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable

from ..paged.prefix_cache import FreeBlockQueue, PrefixCachingBlockManager, hash_block_tokens
from ._core import CheckResult, ExerciseError, call_learner, case_rng, check, describe, diagnose, fail, hidden_rng
from ._core import learner_runs, lend, mistaken, passed

__all__ = ["check_block_hashes", "check_lru_takes", "check_prefix_lookup"]


# --- Exercise 1: a block hash chain --------------------------------------------------------------
def _readable_hash(parent, token_ids, extra_keys) -> tuple:
    """The hash the check hands the learner: a tuple that shows what went into it, so a wrong chain
    can be told apart from a right one (a real hash would only say "different")."""
    return ("h", parent, tuple(token_ids), tuple(extra_keys))


def _block_hashes(
    token_ids,
    block_size,
    cache_salt,
    hash_fn,
    *,
    chain=True,
    partial=False,
    salt_everywhere=False,
    salt_none_key=False,
    salt_forgotten=False,
) -> list:
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
    (
        "Chain the hashes: block i's hash takes block i-1's hash as its parent (None only for block 0), so it stands "
        "for the whole prefix; the same tokens after a different prefix have different K/V.",
        lambda *case: _block_hashes(*case, chain=False),
    ),
    *mistaken(
        _block_hashes,
        partial="Only full blocks get a hash: a partly filled last block is still being written, and cannot be shared.",
        salt_everywhere="The salt goes into the first block's extra keys only: every later hash inherits it through "
        "the chain.",
        salt_none_key="Without a salt the extra keys are empty, (), not (None,).",
        salt_forgotten="Put cache_salt into the first block's extra keys, (cache_salt,): without it two tenants share "
        "blocks.",
    ),
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
        cases.append(
            ([rng.randrange(50_000) for _ in range(rng.randint(0, 5 * bs))], bs, rng.choice([None, "alice", "bob"]))
        )
    return cases


def _a_list(what: str, ints: bool = False) -> Callable:
    """A ``returns`` for diagnose: the answer must be a list (``what``: of what), of ints if asked."""

    def returns(case: str, got, *_) -> list:
        if not isinstance(got, list) or (ints and not all(isinstance(b, int) and not isinstance(b, bool) for b in got)):
            raise ExerciseError(f"{case} should return a list {what}, got {describe(got)}", case=case)
        return got

    return returns


@check(
    "check_block_hashes",
    takes="block_hashes(token_ids, block_size, cache_salt, hash_fn)",
    references={"PrefixCachingBlockManager": PrefixCachingBlockManager, "hash_block_tokens": hash_block_tokens},
    task="chain the hashes yourself.",
)
def check_block_hashes(block_hashes: Callable, seed: int = 0) -> CheckResult:
    """``block_hashes(token_ids, block_size, cache_salt, hash_fn)`` -> one hash per full block, in order,
    each ``hash_fn(parent_block_hash, block_token_ids, extra_keys)``."""
    diagnose(
        block_hashes,
        [(*case, _readable_hash) for case in _hash_cases(hidden_rng())],
        label=lambda tokens, bs, salt, _: (
            f"block_hashes({describe(tokens, limit=6)}, block_size={bs}, cache_salt={salt!r})"
        ),
        reference=_block_hashes,
        mistakes=_HASH_MISTAKES,
        hint="For each full block i: hash_fn(hash of block i-1 or None, its block_size tokens, (cache_salt,) for block "
        "0 with a salt, else ()).",
        compare=operator.eq,
        returns=_a_list("(one hash per full block)"),
    )
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
    return _lru_queue(num_blocks, ops, hit=hit, free=free, take=take)[0]


def _lru_queue(num_blocks, ops, *, hit="remove", free="tail", take="head") -> tuple[list[int], OrderedDict]:
    """A typical wrong policy's takes, and the free queue it ends with."""
    queue, taken = OrderedDict.fromkeys(range(num_blocks)), []
    for op in ops:
        if op[0] == "take":
            if not queue:
                return taken, queue
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
    return taken, queue


# The same policies as _LRU_MISTAKES, by keyword: which of them leaves a hit block out of the queue (a crash).
_LRU_POLICIES = [dict(hit="keep"), dict(hit="touch"), dict(free="head"), dict(take="tail")]

_LRU_MISTAKES = [
    (
        "A hit takes the block out of the free queue: it is in use now, and a block in use must never be handed out "
        "(its owner's K/V would be overwritten).",
        lambda n, ops: _lru_wrong(n, ops, hit="keep"),
    ),
    (
        "A hit does not move the block to the recently used end: it leaves the queue until its owners free it, and "
        "only then goes to the tail.",
        lambda n, ops: _lru_wrong(n, ops, hit="touch"),
    ),
    (
        "Evict from the head (least recently used) and free to the tail: taking the most recently freed block throws "
        "away the prefix most likely to be asked for again.",
        lambda n, ops: _lru_wrong(n, ops, free="head"),
    ),
    (
        "Evict from the head (least recently used) and free to the tail: taking the most recently freed block throws "
        "away the prefix most likely to be asked for again.",
        lambda n, ops: _lru_wrong(n, ops, take="tail"),
    ),
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


def _lru_call(label: str, lru_takes: Callable, n: int, ops: list[tuple]) -> list:
    """The learner's takes; a crash at a hit on a block its queue lost gets the hint of the mistake that lost it."""
    try:
        return call_learner("lru_takes", lru_takes, n, ops)
    except ExerciseError as exc:
        if isinstance(exc.__cause__, (KeyError, ValueError, IndexError)):
            _explain_lru_crash(lru_takes, n, ops, label, exc)
        raise


@check(
    "check_lru_takes",
    takes="lru_takes(num_blocks, ops)",
    references={"FreeBlockQueue": FreeBlockQueue, "PrefixCachingBlockManager": PrefixCachingBlockManager},
    task="keep the queue yourself (an OrderedDict or a list will do).",
)
def check_lru_takes(lru_takes: Callable, seed: int = 0) -> CheckResult:
    """``lru_takes(num_blocks, ops)`` -> the block each ``("take",)`` op gets, in order.

    The queue starts as ``0, 1, ..., num_blocks - 1``; ops are ``("take",)``, ``("free", block)``,
    ``("hit", block)``.
    """
    diagnose(
        lru_takes,
        _lru_cases(hidden_rng()),
        label=lambda n, ops: f"lru_takes({n}, {describe(ops, limit=5)})",
        reference=_lru_takes,
        mistakes=_LRU_MISTAKES,
        hint="Keep the free blocks in order: take from the head, put a freed block at the tail, and remove a hit block "
        "from wherever it is.",
        compare=operator.eq,
        returns=_a_list("of block ids", ints=True),
        call=_lru_call,
    )
    return passed("cached blocks leave in the order they were last freed; a block in use is never evicted.")


def _explain_lru_crash(lru_takes: Callable, n: int, ops: list[tuple], label: str, crash: ExerciseError) -> None:
    """The learner's ``lru_takes`` crashed (``del queue[b]``, ``list.remove(b)``): when it did so at a hit on a block
    its own queue no longer held, raise the hint of the mistake that got the queue there; else return.

    Every hit in the cases names a block the rules keep in the free queue, so a learner whose queue lacks it went
    wrong before that op. The ops before it are replayed to find which typical mistake the learner's takes follow.
    """
    stop = None
    for k in range(1, len(ops) + 1):  # the first op the learner's code cannot get past
        try:
            lru_takes(n, [tuple(op) for op in ops[:k]])
        except Exception:  # noqa: BLE001 - the learner's code: any crash marks the op
            stop = k - 1
            break
    if stop is None or ops[stop][0] != "hit":
        return
    before, block = ops[:stop], ops[stop][1]
    try:
        got = lru_takes(n, [tuple(op) for op in before])
    except Exception:  # noqa: BLE001 - it crashed on this prefix a moment ago: no diagnosis, the crash stands
        return
    hint = next((text for (text, _), flags in zip(_LRU_MISTAKES, _LRU_POLICIES)
                 if _lru_queue(n, before, **flags)[0] == got and block not in _lru_queue(n, before, **flags)[1]),
                "Keep the free blocks in order: take from the head, put a freed block at the tail, and remove a hit "
                "block from wherever it is.")  # fmt: skip
    message = (
        f"{label}: your lru_takes raised {type(crash.__cause__).__name__} at op {stop}, {ops[stop]}: block "
        f"{block} was not in your free queue. Under the rules it is there: every hit in these ops names a "
        f"block in the free queue (freed, still holding its K/V, not taken since), so your queue went wrong "
        f"before that op.\nHint: {hint}"
    )
    raise ExerciseError(message, case=label, got=f"{type(crash.__cause__).__name__} at op {stop}", hint=hint) from crash


# --- Exercise 3: the lookup the engine admits with -----------------------------------------------
def _find_longest_cache_hit(
    token_ids,
    block_size,
    cache_salt,
    hash_fn,
    get_cached_block,
    *,
    short="token",
    chain=True,
    salt="first",
    at_miss="break",
    partial=False,
) -> list:
    """The reference (defaults), and the typical mistakes (one keyword changed).

    ``short``: how far short of the end the walk stops ("token": the reference, "none", "block": a whole block);
    ``salt``: where the salt goes ("first", "none": forgotten, "every": every block, "nonekey": (None,) unsalted);
    ``at_miss``: "break" (the reference) or "continue"; ``partial``: a partly filled last block is looked up too.
    """
    n = len(token_ids)
    usable = {"token": n - 1, "none": n, "block": n - block_size}[short]
    num_blocks = -(-usable // block_size) if partial else usable // block_size
    hits, parent = [], None
    for i in range(max(num_blocks, 0)):
        tokens = tuple(token_ids[i * block_size : min((i + 1) * block_size, usable)])
        first = i == 0 or salt == "every"
        if salt == "none" or not first:
            extra = ()
        elif cache_salt is None:
            extra = (None,) if salt == "nonekey" else ()
        else:
            extra = (cache_salt,)
        block_hash = hash_fn(parent if chain else None, tokens, extra)
        parent = block_hash
        block = get_cached_block(block_hash)
        if block is None:
            if at_miss == "break":
                break
            continue
        hits.append(block)
    return hits


class _PartialBlock(Exception):
    """The learner hashed a partly filled block (the check's hash function refuses it)."""


def _strict_hash(block_size: int):
    """The check's hash function: readable (see :func:`_readable_hash`), and only for full blocks."""

    def hash_fn(parent, token_ids, extra_keys=()):
        if len(token_ids) != block_size:
            raise _PartialBlock(len(token_ids))
        return _readable_hash(parent, token_ids, extra_keys)

    return hash_fn


_LOOKUP_MISTAKES = [
    (
        "Stop one token short: look up the full blocks of token_ids[:-1]. When the prompt is an exact number of cached "
        "blocks, the last token must still be computed, because its logits give the first output token.",
        lambda *case: _lookup_case(case, short="none"),
    ),
    (
        "Stop one *token* short, not one block: when the last block is partly filled, every full block can be a hit "
        "((len(token_ids) - 1) // block_size of them).",
        lambda *case: _lookup_case(case, short="block"),
    ),
    (
        "Put cache_salt in the first block's extra keys, (cache_salt,): the blocks were cached under the salted chain, "
        "and without it a tenant would read another tenant's blocks.",
        lambda *case: _lookup_case(case, salt="none"),
    ),
    (
        "The salt goes into the first block's extra keys only: later blocks inherit it through the chain, and were "
        "cached with extra keys ().",
        lambda *case: _lookup_case(case, salt="every"),
    ),
    (
        "Chain the hashes: block i is looked up by hash_fn(hash of block i-1, its tokens, extra keys), the hash the "
        "cache stored it under. A block's own tokens alone do not say what came before them.",
        lambda *case: _lookup_case(case, chain=False),
    ),
    ("Without a salt the extra keys are (), not (None,).", lambda *case: _lookup_case(case, salt="nonekey")),
    (
        "Stop at the first miss: a block after a missing one cannot be used (its K/V assume the missing block's), and "
        "the hits must be the prompt's first blocks, in order.",
        lambda *case: _lookup_case(case, at_miss="continue"),
    ),
]
_PARTIAL_HINT = (
    "Only full blocks are cached, so only full blocks have a hash: walk (len(token_ids) - 1) // "
    "block_size blocks, never a partly filled last one."
)


def _lookup_case(case, **mistake) -> list:
    tokens, bs, salt, cache = case
    return _find_longest_cache_hit(tokens, bs, salt, _readable_hash, cache.get, **mistake)


def _lookup_cases(rng) -> list[tuple[list[int], int, str | None, dict]]:
    """(token_ids, block_size, cache_salt, cache: block hash -> block id). Each cache holds the blocks of a few
    earlier sequences (tenants' salts included), sometimes with one block evicted from the middle of a chain."""
    cases = []
    for _ in range(40):
        bs = rng.choice([2, 4, 4, 16])
        stored_salt = rng.choice([None, None, "alice", "bob"])
        base = [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 6) * bs + rng.choice([0, 0, 1, bs - 1]))]
        cache: dict = {}
        for salt in {stored_salt, rng.choice([None, "alice"])}:
            for h in _block_hashes(base, bs, salt, _readable_hash):
                cache[h] = len(cache)
        if rng.random() < 0.3 and len(base) // bs >= 3:  # evict a block in the middle of the stored chain
            chain = _block_hashes(base, bs, stored_salt, _readable_hash)
            del cache[chain[rng.randrange(1, len(chain) - 1)]]
        kind = rng.choice(["same", "exact", "longer", "diverge", "diverge"])
        if kind == "same":
            tokens = list(base)
        elif kind == "exact":  # an exact number of blocks, all of them cached
            tokens = base[: max(len(base) // bs, 1) * bs]
        elif kind == "longer":
            tokens = base + [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 2 * bs))]
        else:  # the same first tokens, then different ones
            cut = rng.randrange(0, len(base) + 1)
            tokens = base[:cut] + [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 2 * bs))]
        salt = stored_salt if rng.random() < 0.7 else rng.choice([None, "alice", "bob"])
        cases.append((tokens, bs, salt, cache))
    return cases


def _fixed_lookup_cases() -> list[tuple[list[int], int, str | None, dict]]:
    """The cases every run starts with: each one tells a typical mistake apart."""
    h = _readable_hash
    ab = [h(None, (1, 2), ()), None]
    ab[1] = h(ab[0], (3, 4), ())
    salted = h(None, (1, 2), ("t",))
    return [
        ([1, 2, 3, 4], 2, None, {ab[0]: 7, ab[1]: 9}),  # exact: stop one token short, 1 block
        ([1, 2, 3, 4, 5], 2, None, {ab[0]: 7, ab[1]: 9}),  # both blocks
        ([1, 2, 3, 4, 5], 2, "t", {salted: 3, h(salted, (3, 4), ()): 5}),  # a tenant's chain
        ([1, 2, 3, 4, 5], 2, "t", {ab[0]: 7, ab[1]: 9}),  # another tenant's blocks: nothing
        ([1, 2, 3, 4, 5, 6, 7], 2, None, {ab[0]: 7, h(ab[1], (5, 6), ()): 2}),  # block 1 evicted: 1 hit
    ]


def _lookup_call(label: str, find_longest_cache_hit: Callable, tokens, bs, salt, cache) -> list:
    """The learner's lookup, handed a hash that refuses a partial block and the cache's getter."""
    try:
        return call_learner("find_longest_cache_hit", find_longest_cache_hit, tokens, bs, salt, _strict_hash(bs),
                            cache.get)  # fmt: skip
    except ExerciseError as exc:
        if isinstance(exc.__cause__, _PartialBlock):
            fail(
                label,
                expected="hashes of full blocks only",
                got=f"hash_fn called with a block of {exc.__cause__.args[0]} tokens",
                hint=_PARTIAL_HINT,
            )
        raise


@check(
    "check_prefix_lookup",
    takes="find_longest_cache_hit(token_ids, block_size, cache_salt, hash_fn, get_cached_block)",
    references={"PrefixCachingBlockManager": PrefixCachingBlockManager, "hash_block_tokens": hash_block_tokens},
    task="walk the blocks yourself.",
)
def check_prefix_lookup(find_longest_cache_hit: Callable, model=None, seed: int = 0) -> CheckResult:
    """``find_longest_cache_hit(token_ids, block_size, cache_salt, hash_fn, get_cached_block)`` -> the ids of the
    cached blocks a sequence of ``token_ids`` can start on, in order.

    ``hash_fn(parent_hash, block_token_ids, extra_keys)`` hashes one full block; ``get_cached_block(block_hash)``
    returns the block cached under that hash, or ``None``. With ``model``, the check also serves prompts that
    share prefixes (some an exact number of blocks, some with tenants' salts) through the real
    :class:`~kvcourse.serving.Engine`, which admits every request with your lookup.
    """
    diagnose(
        find_longest_cache_hit,
        _fixed_lookup_cases() + _lookup_cases(hidden_rng()),
        label=lambda tokens, bs, salt, cache: (
            f"find_longest_cache_hit({describe(tokens, limit=6)}, block_size={bs}, "
            f"cache_salt={salt!r}) with {len(cache)} blocks cached"
        ),
        reference=lambda *case: _lookup_case(case),
        mistakes=_LOOKUP_MISTAKES,
        hint="For each full block of token_ids[:-1]: chain its hash from the previous one (salt in the first block's "
        "extra keys), ask get_cached_block, and stop at the first None.",
        compare=operator.eq,
        returns=_a_list("of block ids"),
        call=_lookup_call,
    )
    if model is not None:
        _lookup_in_the_engine(find_longest_cache_hit, model, seed)
        return passed(
            "the engine admitted every request on the blocks your lookup found: the same hits as kvcourse's "
            "own lookup, and the same tokens as each prompt run alone."
        )
    return passed(
        "the longest run of cached full blocks, chained and salted, stopping at the first miss and one "
        "token short of the end."
    )


# Token ids (SmolLM2's tokenizer) of a library help desk's instruction and four questions: natural text, so no two
# logits of the next token are nearly tied, and a run with reused K/V gives the tokens of a run alone.
_SYSTEM_IDS = [2683, 359, 260, 724, 10917, 282, 253, 1360, 4971, 30, 19842, 281, 582, 1890, 6330, 30]
_QUESTION_IDS = [
    [15232, 42, 1550, 1072, 260, 4971, 1440, 335, 14986, 47, 19842, 42],
    [15232, 42, 1978, 339, 5357, 253, 1863, 2329, 47, 19842, 42],
    [15232, 42, 1073, 1083, 1072, 7510, 1708, 47, 19842, 42],
    [15232, 42, 3315, 346, 457, 253, 8354, 3589, 327, 4836, 47, 19842, 42],
]
_ENGINE_BLOCK_SIZE = 4


def _engine_rounds(seed: int) -> list[tuple[list[list[int]], str | None]]:
    """Rounds of ``Engine.generate`` calls, each (prompts, cache_salt), sharing the instruction's 4 blocks of 4."""
    rng = case_rng("check_prefix_lookup.engine", seed)  # check_prefix_lookup's key, and a stream of its own
    q = rng.sample(_QUESTION_IDS, 4)
    prompt = [_SYSTEM_IDS + x for x in q]
    exact = prompt[0][: len(prompt[0]) // _ENGINE_BLOCK_SIZE * _ENGINE_BLOCK_SIZE]  # an exact number of blocks
    tenant = rng.choice(["alice", "bob"])
    return [
        ([prompt[0]], None),  # warms the cache
        ([prompt[1], prompt[2]], None),  # the instruction's blocks hit
        ([exact], None),  # every block cached: all but the last are hits
        ([prompt[3]], tenant),  # a tenant: nothing of the unsalted cache
        ([prompt[1]], tenant),  # the tenant's own instruction blocks
        ([prompt[1]], "carol" if tenant == "bob" else "bob"),  # another tenant: nothing
    ]


def _serve(model, rounds, lookup) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Every round's outputs, and each admission's (tokens, hit tokens), on an engine admitting with ``lookup``."""
    from ..serving import Engine  # the engine imports torch and the model code: only when the model is given

    eng = Engine(model, num_blocks=64, block_size=_ENGINE_BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=64,
                 enable_prefix_caching=True)  # fmt: skip
    # The engine hands the lookup its own hash and block getter (a PrefixCachingBlockManager's, which the check
    # refuses as an answer): lent by the check, so the learner's calls of them are not refused.
    eng.block_manager.find_longest_cache_hit = (
        None
        if lookup is None
        else (
            lambda token_ids, block_size, cache_salt, hash_fn, get_cached_block: _lookup_watched(
                lookup, token_ids, block_size, cache_salt, lend(hash_fn), lend(get_cached_block)
            )
        )
    )
    outs = []
    for prompts, salt in rounds:
        outs += eng.generate(prompts, max_new_tokens=3, cache_salt=salt)
    return outs, [(a.num_tokens, a.num_hit_tokens) for a in eng.block_manager.admissions]


def _lookup_watched(lookup: Callable, *args):
    with learner_runs():
        return lookup(*args)


def _lookup_in_the_engine(find_longest_cache_hit: Callable, model, seed: int) -> None:
    from ..generation import generate

    rounds = _engine_rounds(seed)
    want_outs, want_hits = _serve(model, rounds, None)  # kvcourse's own lookup
    try:
        got_outs, got_hits = _serve(model, rounds, find_longest_cache_hit)
    except (ValueError, TypeError) as exc:
        raise ExerciseError(f"the engine could not admit a request with your lookup: {exc}") from exc
    prompts = [p for ps, _ in rounds for p in ps]
    label = f"the engine serving {len(prompts)} prompts in {len(rounds)} rounds with your lookup"
    if got_hits != want_hits:
        fail(label + ": (prompt tokens, tokens found in the cache) of each admission", expected=want_hits,
             got=got_hits, hint="Your lookup passed the small cases but finds other blocks in the engine: does it keep "
             "state between calls, or change token_ids?")  # fmt: skip
    for i, (p, got, want) in enumerate(zip(prompts, got_outs, want_outs)):
        # kvcourse's lookup gives each prompt's solo tokens (tests/test_exercises_ch07_prefix.py); a run alone is
        # made only for a difference, which a near-tie of two logits could explain.
        solo = want if got == want else generate(model, p, max_new_tokens=3)
        if got != solo:
            fail(f"{label}: prompt {i}'s tokens", expected=f"{solo} (the prompt run alone)", got=got,
                 hint="The engine computed on the blocks you returned: they must be the prompt's own first blocks, "
                      "in order.")  # fmt: skip
