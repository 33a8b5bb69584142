"""Checks for chapter 4, *Paged KV cache*.

1. :func:`check_blocks_needed` -- blocks a sequence of ``num_tokens`` tokens occupies.
2. :func:`check_slot_for` -- the slot mapping: where position ``pos`` of a sequence lives in the pool.
3. :func:`check_parallel_sampling_blocks` -- blocks used by ``n`` samples of one prompt with fork and copy-on-write.
4. :func:`check_largest_block_size` -- read the block-size trade-off off the simulator.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from ..fragmentation import block_size_sweep, make_trace
from ..paged import BlockManager
from ._core import ExerciseError, expect_equal, passed, call_learner

__all__ = [
    "check_blocks_needed",
    "check_slot_for",
    "check_parallel_sampling_blocks",
    "check_largest_block_size",
    "parallel_sampling_blocks",
    "largest_block_size",
]


_call = call_learner


def _expect_int(name: str, got: object) -> None:
    if isinstance(got, bool) or not isinstance(got, int):
        raise ExerciseError(f"{name} should return an int, got {type(got).__name__}")


def check_blocks_needed(blocks_needed: Callable[[int, int], int]) -> bool:
    """``blocks_needed(num_tokens, block_size)``: blocks that hold ``num_tokens`` tokens."""
    cases = [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (35, 16), (300, 16), (1, 1), (7, 1), (255, 256), (257, 256)]
    for num_tokens, block_size in cases:
        got = _call("blocks_needed", blocks_needed, num_tokens, block_size)
        _expect_int(f"blocks_needed({num_tokens}, {block_size})", got)
        want = -(-num_tokens // block_size)
        if got == want - 1:
            hint = "A partly filled last block is still a whole block: round up, not down."
        elif got == want + 1:
            hint = "A sequence that exactly fills its blocks needs no extra one (and 0 tokens need 0 blocks)."
        else:
            hint = "Divide the tokens by the block size, rounding up."
        expect_equal(f"blocks_needed({num_tokens}, {block_size})", got, want, hint=hint)
    return passed("a 35-token sequence in blocks of 16 takes 3 blocks, 13 slots of the last one still empty.")


def check_slot_for(slot_for: Callable[[list[int], int, int], int]) -> bool:
    """``slot_for(block_table, pos, block_size)``: the pool slot holding position ``pos``."""
    rng = random.Random(4)
    cases = [([7, 2, 9], 0, 4), ([7, 2, 9], 3, 4), ([7, 2, 9], 4, 4), ([7, 2, 9], 11, 4), ([5], 0, 1), ([3, 0], 17, 16)]
    for _ in range(20):
        block_size = rng.choice([1, 2, 8, 16, 32])
        table = rng.sample(range(64), rng.randint(1, 6))
        cases.append((table, rng.randrange(len(table) * block_size), block_size))
    for table, pos, block_size in cases:
        got = _call("slot_for", slot_for, list(table), pos, block_size)
        _expect_int(f"slot_for({table}, {pos}, {block_size})", got)
        want = table[pos // block_size] * block_size + pos % block_size
        if got == (pos // block_size) * block_size + pos % block_size and got != want:
            hint = "That is the slot of a contiguous cache: look the logical block up in the block table first."
        elif got == table[pos // block_size] + pos % block_size and got != want:
            hint = "A block id counts blocks, not slots: multiply it by the block size."
        else:
            hint = "Logical block pos // block_size, offset pos % block_size inside it."
        expect_equal(f"slot_for({table}, {pos}, {block_size})", got, want, hint=hint)
    return passed("position pos lives at block_table[pos // block_size] * block_size + pos % block_size.")


def parallel_sampling_blocks(prompt_len: int, n: int, new_tokens: int, block_size: int) -> int:
    """Reference, measured on a real :class:`BlockManager`: blocks in use after ``n`` forked samples
    of a ``prompt_len``-token prompt have each appended ``new_tokens`` tokens (one step at a time)."""
    for name, value, lo in (("prompt_len", prompt_len, 1), ("n", n, 1), ("new_tokens", new_tokens, 0), ("block_size", block_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    blocks = -(-(prompt_len + new_tokens) // block_size)
    bm = BlockManager(n * blocks + 1, block_size)
    bm.allocate(0, prompt_len)
    for child in range(1, n):
        bm.fork(0, child)
    for _ in range(new_tokens):
        for seq in range(n):
            bm.append_slot(seq)
    return bm.num_used_blocks


def check_parallel_sampling_blocks(blocks_with_sharing: Callable[[int, int, int, int], int]) -> bool:
    """``blocks_with_sharing(prompt_len, n, new_tokens, block_size)`` (``new_tokens >= 1``)."""
    cases = [(300, 4, 64, 16), (32, 4, 10, 16), (33, 4, 10, 16), (300, 1, 64, 16), (5, 3, 1, 16), (100, 8, 200, 32), (17, 2, 15, 16)]
    for args in cases:
        got = _call("blocks_with_sharing", blocks_with_sharing, *args)
        _expect_int(f"blocks_with_sharing{args}", got)
        want = parallel_sampling_blocks(*args)
        prompt_len, n, new_tokens, block_size = args
        unshared = n * -(-(prompt_len + new_tokens) // block_size)
        if got == unshared and got != want:
            hint = "After fork the prompt's full blocks are stored once, whatever n is."
        elif got < want:
            hint = (
                "The prompt's last block is partly filled and shared: each sample writing into it gets a "
                "copy (copy-on-write), except the last owner, which writes in place."
            )
        else:
            hint = "Count the shared full prompt blocks once, then each sample's own blocks."
        expect_equal(f"blocks_with_sharing{args}", got, want, hint=hint)
    return passed("4 samples of a 300-token prompt, 64 new tokens each, blocks of 16: "
                  f"{parallel_sampling_blocks(300, 4, 64, 16)} blocks shared vs "
                  f"{4 * -(-364 // 16)} without sharing.")


@functools.lru_cache(maxsize=1)
def _sweep() -> tuple[tuple[int, float], ...]:
    trace = make_trace(300, seed=0)
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    return tuple((r.block_size, r.live_frac) for r in block_size_sweep(trace, 16384, sizes))


def largest_block_size(threshold: float = 0.9) -> int:
    """Reference: the largest block size (a power of two, 1..256) whose live fraction is at least
    ``threshold`` for ``make_trace(300, seed=0)`` in a pool of 16384 slots."""
    ok = [b for b, live in _sweep() if live >= threshold]
    if not ok:
        raise ValueError(f"no block size reaches a live fraction of {threshold}")
    return max(ok)


def check_largest_block_size(answer: int) -> bool:
    """``answer``: the largest power-of-two block size (1..256) keeping the live fraction >= 0.9."""
    _expect_int("answer", answer)
    want = largest_block_size(0.9)
    if answer not in {b for b, _ in _sweep()}:
        raise ExerciseError(f"answer = {answer!r} is not one of the swept block sizes 1, 2, 4, ..., 256.")
    live = dict(_sweep())[answer]
    if live < 0.9:
        hint = f"At block size {answer} only {live:.3f} of the pool holds live tokens: too big."
    elif answer < want:
        hint = f"Block size {answer} keeps {live:.3f} live, but a larger one still stays above 0.9."
    else:
        hint = ""
    expect_equal("answer", answer, want, hint=hint)
    return passed(f"block size {want} keeps {dict(_sweep())[want]:.3f} of the pool live; the next size falls below 0.9.")
